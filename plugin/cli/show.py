"""``show RECIPE [--world-size N]``: the resolved sizes and the rank map (rich tables)."""
from __future__ import annotations

import os
import sys

from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, add_world_size, load_or_report, needs_world_size, print_json


def register(sub) -> None:
    p = sub.add_parser("show", help="resolved sizes and every rank's coordinates and peers",
                       description="Show what a recipe resolves to: data size, batch triple, world size, and "
                                   "each rank's (pipeline, data, context, tensor) coordinates and peers, by node.")
    p.add_argument("recipe", metavar="RECIPE")
    add_world_size(p)
    p.add_argument("--json", action="store_true", help="the same as JSON")
    p.add_argument("--svg", metavar="FILE", help="also draw the rank map (nodes, GPUs, tensor groups, pipeline "
                   "stages, data replicas, coloured by axis) as an SVG picture there")
    p.set_defaults(run=run)


def rank_rows(topology, gpus_per_node=None) -> list[dict]:
    """One row per rank: node, coordinates and peers; with a context axis also its context coordinate, its context
    group (the ring its keys and values go around) and its gradient group (data x context)."""
    context = topology.cp_size > 1
    expert = topology.ep_size > 1
    rows = []
    for rank in range(topology.world_size):
        c = topology.coord(rank)
        row = {
            "rank": rank,
            "node": topology.node_of(rank, gpus_per_node) if gpus_per_node else None,
            "local_rank": rank % gpus_per_node if gpus_per_node else None,
            "pipeline": c.pp, "data": c.dp, **({"context": c.cp} if context else {}), "tensor": c.tp,
            "tensor_peers": topology.group_of(rank, "tensor"),
            **({"context_peers": topology.group_of(rank, "context")} if context else {}),
            "data_peers": topology.group_of(rank, "data"),
            **({"gradient_peers": topology.group_of(rank, "data_context")} if context else {}),
            "pipeline_peers": topology.group_of(rank, "pipeline"),
            **({"expert": topology.expert_coord(rank)[1], "expert_peers": topology.group_of(rank, "expert"),
                "expert_data_peers": topology.group_of(rank, "expert_data")} if expert else {}),
        }
        rows.append(row)
    return rows


def run(args) -> int:
    from ..distributed.topology import Topology
    from ..recipe.lr_schedule import describe as describe_schedule

    recipe = load_or_report(args.recipe, args.world_size)
    if recipe is None:
        return EXIT_INVALID
    if needs_world_size(recipe, args.world_size, "the rank map depends on it"):
        return EXIT_INVALID
    layout = recipe.layout(args.world_size)
    topology = Topology.from_layout(layout)
    gpn = recipe.cluster.gpus_per_node if recipe.cluster else None
    rows = rank_rows(topology, gpn)
    resolved = {
        "name": recipe.name, "file": recipe.source, "description": recipe.description,
        "layout": layout.words,
        "data": layout.data, "tensor": layout.tensor, "pipeline": layout.pipeline, "context": layout.context,
        "expert": layout.expert if layout.expert > 1 else None,
        "expert_tensor": layout.expert_tensor_resolved if layout.expert > 1 else None,
        "world_size": layout.world_size,
        "global_batch": layout.global_batch, "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
        "zero_stage": recipe.zero.stage, "offload_optimizer": recipe.zero.offload_optimizer,
        "offload_param": recipe.zero.offload_param, "precision": recipe.precision,
        "sequence_parallel": recipe.tensor_parallel.sequence_parallel,
        "context_parallel": recipe.context_parallel.method if layout.context > 1 else None,
        "schedule": recipe.pipeline_parallel.schedule if layout.pipeline > 1 else None,
        "activation_checkpointing": _recompute_words(recipe.activation_checkpointing),
        "lr_schedule": describe_schedule(recipe.lr_schedule, recipe.optimizer.lr),
        "watchdog": _watchdog_words(recipe.watchdog),
        "launcher": recipe.launcher,
    }
    if args.svg:
        from ..monitor.rank_map import rank_map_svg

        svg = rank_map_svg(Topology.from_recipe(recipe, args.world_size), gpus_per_node=gpn,
                           title=f"rank map of {recipe.name}")
        try:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(svg)
        except OSError as e:
            print(f"show: --svg {args.svg}: cannot write: {e}", file=sys.stderr)
            return EXIT_USAGE
        print(f"wrote {args.svg}", file=sys.stderr)
    if args.json:
        print_json({"resolved": resolved, "ranks": rows})
        return EXIT_OK
    _render(resolved, rows, gpn)
    return EXIT_OK


def _recompute_words(ac) -> str:
    """``none``, ``selective (attention core)`` or ``full, spans of 2 blocks``."""
    if ac.mode == "full":
        return f"full, spans of {ac.every} block{'s' if ac.every != 1 else ''}"
    return "selective (attention core)" if ac.mode == "selective" else "none"


def _watchdog_words(w) -> str:
    """``timeout 600 s, pre-flight 60 s per group``: the hang guard's limits (:mod:`plugin.watchdog`)."""
    return f"timeout {w.timeout_s:g} s, pre-flight {w.preflight_s:g} s per group"


def _peers(ranks) -> str:
    return ",".join(str(r) for r in ranks)


def _render(resolved: dict, rows: list[dict], gpus_per_node) -> None:
    from rich.table import Table

    from .common import console

    out = console(max(100, int(os.environ.get("COLUMNS", 0) or 0)))
    summary = Table(title=f"recipe {resolved['name']}", show_header=False, title_justify="left")
    summary.add_column("field", style="bold")
    summary.add_column("value")
    for key, value in resolved.items():
        if value is not None and value != "":
            summary.add_row(key, str(value))
    out.print(summary)
    context = "context" in rows[0]
    title = ("rank map: rank = ((pp x data_size + dp) x context_size + cp) x tensor_size + tp (tensor fastest, then "
             "context, then data, then pipeline; gradients reduced over data x context)" if context else
             "rank map: rank = (pp x data_size + dp) x tensor_size + tp (tensor fastest, then data, then pipeline)")
    expert = "expert" in rows[0]
    if expert:
        title += "; experts over the expert peers (all-to-all), their gradients over the expert-data peers"
    table = Table(title=title, title_justify="left")
    coords = ["pipeline", "data", *(["context"] if context else []), "tensor", *(["expert"] if expert else [])]
    peers = ["tensor", *(["context"] if context else []), "data", *(["gradient"] if context else []), "pipeline",
             *(["expert", "expert_data"] if expert else [])]
    columns = (["node", "local"] if gpus_per_node else []) + ["rank", *coords, *(f"{p} peers" for p in peers)]
    for c in columns:
        table.add_column(c, justify="left" if c.endswith(" peers") else "right")
    for i, r in enumerate(rows):
        cells = ([str(r["node"]), str(r["local_rank"])] if gpus_per_node else []) + [
            str(r["rank"]), *(str(r[c]) for c in coords), *(_peers(r[f"{p}_peers"]) for p in peers)]
        last_of_node = gpus_per_node and (i + 1 == len(rows) or rows[i + 1]["node"] != r["node"])
        table.add_row(*cells, end_section=bool(last_of_node))
    out.print(table)
