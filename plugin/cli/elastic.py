"""``python -m plugin elastic RECIPE --nodes MIN:MAX --gpus-per-node G``: the world sizes of an elastic range at
which the recipe trains the same global batch, the layout and grad accumulation there, and the planner's memory per
GPU and step time. Pure: no torch.

Exit codes: 0 every node count trains (some perhaps with processes sitting out), 2 the recipe is invalid or cannot
be elastic (it needs ``"data": "auto"`` and ``batch.global``), 3 some node count of the range cannot train at all.
"""
from __future__ import annotations

import argparse

from .common import EXIT_INVALID, EXIT_OK, load_or_report, positive_int, print_json, print_problems, print_table, size

NOT_ALL = 3


def node_range(text: str) -> range:
    """``"1:4"`` -> nodes 1 to 4; ``"2"`` -> just 2."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX node counts, e.g. 1:4, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return range(lo, hi + 1)


def register(sub) -> None:
    p = sub.add_parser("elastic", help="the world sizes of an elastic range at which a recipe keeps its global batch",
                       description="For each node count of MIN:MAX: the processes, how many of them train (the "
                                   "largest number the layout can use: the rest sit out), the data size and grad "
                                   "accumulation that keep batch.global, and the planner's memory per GPU and step "
                                   "time there.",
                       epilog="Exit codes: 0 every node count trains, 3 some cannot, 2 invalid or not elastic, "
                              "1 usage error.")
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument("--nodes", type=node_range, required=True, metavar="MIN:MAX", help="the elastic range of nodes")
    p.add_argument("--gpus-per-node", type=positive_int, required=True, metavar="G", help="processes per node")
    p.add_argument("--gpu-memory", type=size, metavar="SIZE", help="memory of one accelerator (default 80GB)")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..planning.elastic import elastic_table
    from ..planning.units import fmt_bytes, fmt_seconds
    from ..recipe.elastic import elastic_problems

    recipe = load_or_report(args.recipe, None)
    if recipe is None:
        return EXIT_INVALID
    problems = elastic_problems(recipe)
    if problems:
        print_problems(problems)
        return EXIT_INVALID
    rows = elastic_table(recipe, args.nodes, args.gpus_per_node, args.gpu_memory)
    if args.json:
        print_json([{**r.to_json(), "idle_nodes": idle_nodes(r, args.gpus_per_node)} for r in rows])
    else:
        out = []
        for r in rows:
            lay = r.layout
            if lay is None:
                out.append((str(r.nodes), str(r.world_size), "-", "cannot train", "-", "-", "-", "-"))
                continue
            out.append((str(r.nodes), str(r.world_size), training(r, args.gpus_per_node), lay.words,
                        f"{lay.micro_batch} x {lay.grad_accum}",
                        "-" if r.memory_per_gpu is None else fmt_bytes(r.memory_per_gpu),
                        "-" if r.step_time_s is None else fmt_seconds(r.step_time_s),
                        "-" if r.fits is None else ("yes" if r.fits else "NO")))
        g = recipe.batch.global_
        print_table(f"{recipe.name}: global batch {g} at every size (micro x grad_accum x data)",
                    ["nodes", "processes", "training", "layout", "micro x accum", "memory/GPU", "step time", "fits"],
                    out, right=["nodes", "processes", "memory/GPU", "step time"], caption=CAPTION)
    return EXIT_OK if all(r.layout is not None for r in rows) else NOT_ALL


CAPTION = ("memory and step time: the planner's estimate for the recipe's model block (roofline, H100). Idle processes "
           "exit at each start and are back at the next, except the first of an idle node (none of its processes "
           "trains): it stands by, so that torch's agent keeps the node in the job (docs/elastic.md)")


def idle_nodes(row, per_node: int) -> int:
    """The nodes of ``row`` none of whose processes train (the launcher numbers ranks node by node)."""
    return 0 if row.usable is None else row.nodes - -(-row.usable // per_node)


def training(row, per_node: int) -> str:
    """``4``, ``4 (2 idle)``, ``4 (1 node idle)``, or ``5 (3 idle, 1 node)`` where whole nodes train none."""
    idle, nodes = row.world_size - row.usable, idle_nodes(row, per_node)
    whole = f"{nodes} node{'s' if nodes > 1 else ''}"
    if not idle:
        return str(row.usable)
    if not nodes:
        return f"{row.usable} ({idle} idle)"
    return f"{row.usable} ({whole} idle)" if idle == nodes * per_node else f"{row.usable} ({idle} idle, {whole})"
