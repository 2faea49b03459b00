"""``python -m plugin estimate RECIPE [--gpu-memory 80GB] [--json]``: will it fit, per rank, term by term.

Prints the most loaded rank's memory (model states, activations, embedding and output terms), the
bytes it sends per step, the pipeline bubble, a roofline step time, and a verdict with the margin.

Exit codes: 0 it fits, 3 it does not fit, 2 the recipe is invalid (or has no model block), 1 usage error.
"""
from __future__ import annotations

from ..errors import RecipeError
from ..planning.dims import params_text
from ..planning.units import fmt_bytes, fmt_gb, fmt_seconds
from .common import load_or_report, print_json, print_problems, print_table, size

DOES_NOT_FIT = 3


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="per-rank memory, traffic and step time of a recipe, and whether it fits",
        description="The most loaded rank's memory term by term (model states, activations, embedding and "
                    "output layer), the bytes it sends per step, a roofline step time, and a verdict: does it "
                    "fit, with what margin.",
        epilog="Exit codes: 0 fits, 3 does not fit, 2 invalid recipe, 1 usage error. GB = 10^9 bytes.")
    p.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a shipped recipe's name (tp2_dp4)")
    p.add_argument("--gpu-memory", type=size, metavar="SIZE",
                   help="memory of one accelerator: 80GB, 80GiB or 80 (GB); default: the recipe's cluster, else 80GB")
    p.add_argument("--json", action="store_true", help="print JSON for machines instead of tables")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..planning.for_recipe import estimate_recipe

    recipe = load_or_report(args.recipe, None)  # validated as show and export do: no verdict on an invalid recipe
    if recipe is None:
        return 2
    try:
        est = estimate_recipe(recipe, gpu_memory=args.gpu_memory)
    except RecipeError as e:
        print_problems(e.errors or e.problems)
        return 2
    if args.json:
        print_json(est.to_json())
    else:
        _print(est)
    return 0 if est.fits else DOES_NOT_FIT


def _print(est) -> None:
    s, spec = est.setup, est.spec
    print(f"{est.name}: {s.world_size} ranks = tensor {s.tp} x pipeline {s.pp} x data {s.dp}"
          + (f" x context {s.cp} ({s.cp_method})" if s.cp > 1 else "")
          + (f" (expert {s.ep} of data x context)" if s.ep > 1 else "") + f", ZeRO-{s.zero_stage}, "
          f"{s.precision}, micro-batch {s.micro_batch} x {s.micro_batches} accumulated "
          f"(global {s.global_batch}), recompute {s.recompute}"
          + (f" (spans of {s.checkpoint_interval})" if s.recompute == "full" else "")
          + (", sequence parallel" if s.sequence_parallel else ""))
    print(f"model: reference GPT, {spec.layers} layers, hidden {spec.hidden}, heads {spec.heads}, ffn {spec.ffn}, "
          f"vocab {spec.vocab}, seq {spec.seq_len}"
          + (f", {spec.moe_experts} experts (top-{spec.moe_top_k}) every {spec.moe_every} block(s)"
             if spec.moe_experts else "") + f": {params_text(spec.total_params())} parameters "
          f"(GELU MLP, LayerNorm, learned positions, untied output layer; fused attention; "
          f"dropout {'on' if s.dropout else 'off'})")
    total = est.memory.total
    rows = [(name, fmt_bytes(v), f"{v / total:.0%}" if total else "-") for name, v in est.memory.terms]
    rows.append(("total", fmt_bytes(total), "100%"))
    where = f"pipeline stage {est.memory.stage} of {s.pp}" if s.pp > 1 else "every rank"
    print_table(f"Memory per rank ({where}, the most loaded)", ["term", "bytes", "share"], rows,
                right=["bytes", "share"])
    if est.host.total:
        print(f"offloaded to CPU memory per rank: {fmt_bytes(est.host.total)} (parameters "
              f"{fmt_bytes(est.host.parameters)}, optimizer states {fmt_bytes(est.host.optimizer_states)})")
    if est.communication:
        rows = [(c.name, c.group, fmt_bytes(c.bytes), str(c.calls)) for c in est.communication]
        print_table("Bytes sent per rank per optimizer step", ["term", "group", "bytes", "operations"], rows,
                    right=["bytes", "operations"])
    rows = [(name, fmt_seconds(v)) for name, v in est.time.terms if v > 0]
    rows.append(("total", fmt_seconds(est.time.total)))
    print_table("Step time (roofline)", ["term", "time"], rows, right=["time"])
    print(f"roofline: {est.hardware.describe()}; data-parallel traffic as DeepSpeed runs it (overlap_comm off "
          f"at ZeRO 0-2, on at ZeRO-3); pipeline bubble {est.bubble:.1%}; "
          f"{est.time.tokens_per_second_per_gpu:,.0f} tokens/s per GPU; MFU {est.time.mfu:.0%}")
    head = (f"{fmt_bytes(total)} of {fmt_gb(est.usable)} usable ({fmt_gb(est.gpu_memory, 0)} per GPU less a "
            f"{fmt_gb(est.reserve)} reserve for the CUDA context, NCCL buffers and fragmentation)")
    if est.fits:
        print(f"FITS: {head}: {fmt_gb(est.margin)} to spare")
    else:
        print(f"DOES NOT FIT: {head}: {fmt_gb(-est.margin)} too much. Try " + "; or ".join(_suggestions(s)) + ".")


def _suggestions(s) -> list[str]:
    """What could still shrink this rank, given what the recipe already uses."""
    out = []
    if s.zero_stage < 3 and s.dp > 1 and s.pp == 1:
        out.append(f"ZeRO stage {s.zero_stage + 1} (zero.stage)")
    elif s.zero_stage < 1 and s.dp > 1:
        out.append("ZeRO stage 1 (zero.stage)")
    if s.micro_batch > 1:
        out.append("a smaller batch.micro")
    if s.recompute != "full":
        out.append('full recompute (activation_checkpointing: {"mode": "full"})'
                   + ("" if s.fused_attention or s.recompute == "selective"
                      else ', or selective (activation_checkpointing: {"mode": "selective"})'))
    elif s.checkpoint_interval > 1:
        out.append(f"a shorter span (activation_checkpointing.every < {s.checkpoint_interval})")
    if s.tp > 1 and not s.sequence_parallel:
        out.append("sequence parallelism (tensor_parallel.sequence_parallel: true)")
    if not s.offload_optimizer and s.zero_stage >= 1:
        out.append("zero.offload_optimizer: cpu")
    out.append("more tensor or pipeline ranks")
    out.append("`python -m plugin plan` to search every layout")
    return out
