"""The dry run's answer, pure: the JSON (``{"ranks": [{"rank", "coordinates", "groups", "parameters", "bytes",
"estimate", "collectives": [{"op", "group", "bytes", "count"}]}], ...}``) and the console table, one line per
simulated rank and the distinct roles summarised.
"""
from __future__ import annotations

from .ranks import compress

PUBLIC = ("rank", "stepped", "coordinates", "groups", "parameters", "bytes", "estimate", "ratio", "collectives",
          "setup_collectives", "seconds")


def roles(reports: list[dict]) -> list[dict]:
    """Ranks that hold and say the same (stage, parameters, bytes, collectives without peers), with their ranks."""
    found: dict = {}
    for r in reports:
        calls = tuple((c["op"], c["group"], c["bytes"], c["count"]) for c in r["collectives"])
        key = (r["coordinates"]["pipeline"], r["parameters"], r["bytes"]["total"], calls)
        found.setdefault(key, []).append(r)
    out = []
    for (stage, params, total, calls), members in found.items():
        out.append({"ranks": compress([m["rank"] for m in members]), "pipeline": stage, "parameters": params,
                    "bytes": total, "collectives": sum(c[3] for c in calls),
                    "bytes_said": sum(c[2] * c[3] for c in calls if c[0] != "recv")})
    return out


def to_json(result: dict) -> dict:
    out = {k: v for k, v in result.items() if k != "ranks"}
    out["ranks"] = [{k: r[k] for k in PUBLIC if k in r} for r in result["ranks"]]
    out["roles"] = roles(result["ranks"])
    return out


def _gb(n: float) -> str:
    """Bytes in a few characters: ``12.34G``, ``1.50M``, ``3.2k`` (powers of 10)."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def table(result: dict) -> str:
    lay = result["layout"]
    lines = [f"{result['recipe']}: {result['world_size']} ranks = tensor {lay['tensor']} x pipeline "
             f"{lay['pipeline']} x data {lay['data']} x context {lay['context']}, ZeRO-{result['zero']}, "
             f"{len(result['ranks'])} ranks simulated in {result['seconds']:.1f} s "
             f"({result['seconds_per_rank']:.2f} s per rank), model {result['model_parameters']:,} parameters",
             "bytes: G = 10^9, M = 10^6; estimate: the planner's parameters + gradients + optimizer states",
             f"{'rank':>6} {'pp':>3} {'dp':>4} {'cp':>3} {'tp':>3} {'params held':>14} {'params':>8} {'grads':>8} "
             f"{'optim':>8} {'total':>8} {'estimate':>8} {'ratio':>6} {'calls':>6} {'sent':>8}"]
    for r in result["ranks"]:
        c, b = r["coordinates"], r["bytes"]
        calls = sum(x["count"] for x in r["collectives"])
        sent = sum(x["bytes"] * x["count"] for x in r["collectives"] if x["op"] != "recv")
        lines.append(f"{r['rank']:>6} {c['pipeline']:>3} {c['data']:>4} {c['context']:>3} {c['tensor']:>3} "
                     f"{r['parameters']:>14,} {_gb(b['parameters']):>8} {_gb(b['gradients']):>8} "
                     f"{_gb(b['optimizer_states']):>8} {_gb(b['total']):>8} {_gb(r['estimate']['total']):>8} "
                     f"{r['ratio'] if r['ratio'] is not None else '-':>6} {calls:>6} {_gb(sent):>8}")
    if not all(r["stepped"] for r in result["ranks"]):
        lines.append("not stepped (FSDP2 refuses parameters on meta at its first forward): ranks "
                     + compress([r["rank"] for r in result["ranks"] if not r["stepped"]]) + ": built only, no "
                     "gradients, optimizer states or collectives")
    lines.append("roles (ranks that hold and say the same):")
    for role in roles(result["ranks"]):
        lines.append(f"  stage {role['pipeline']}: ranks {role['ranks']}: {role['parameters']:,} parameters, "
                     f"{_gb(role['bytes'])}B held, {role['collectives']} calls, {_gb(role['bytes_said'])}B sent")
    lines.append("checks:")
    for check in result["checks"]:
        mark = {True: "ok", False: "FAILED", None: "skipped"}[check["ok"]]
        named = f" (ranks {compress(check['ranks'])})" if check["ok"] is False else ""
        lines.append(f"  {check['name']}: {mark}{named}: {check['detail']}")
    return "\n".join(lines)
