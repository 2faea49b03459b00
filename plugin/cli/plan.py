"""``python -m plugin plan --model NAME|PATH.json --gpus N --gpu-memory 80GB ...``: the fastest layouts that fit.

Searches every tensor x context x pipeline x data layout (context by ring or all-to-all attention; for a mixture of
experts, every expert degree too), ZeRO stage,
micro-batch, recompute (none, selective, full: the recipe's ``activation_checkpointing``) and sequence-parallel
choice (:mod:`plugin.planning.search`), keeps those whose most loaded rank fits, ranks them by a roofline step
time and prints the top K with the reason for each place and the assumptions behind the ranking. ``--write``
ranks the model the written recipe describes (the reference GPT of the model's dimensions,
:mod:`plugin.planning.to_recipe`), saves the winner (a context degree as ``"context"`` with its
``context_parallel.method``), and refuses to write it unless it validates and ``estimate`` of the recipe agrees
with the plan and says it fits.

Exit codes: 0 a layout fits, 3 none fits (the output says how far off the closest is and what to change),
2 an invalid model file or a written recipe that does not validate or agree with ``estimate``, 1 usage
error (bad size, unknown preset, GPUs that do not fill whole nodes).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import Problem, RecipeError
from ..planning.units import fmt_gb, fmt_seconds
from .common import load_or_report, positive_int, print_json, print_problems, print_table, size

NOTHING_FITS = 3
MODEL_OR_RECIPE = frozenset({"model", "parallelism", "batch"})  # keys a recipe has and a model block has not


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="find the fastest layout that fits a model on a cluster",
        description="Search every tensor x context x pipeline x data layout (context by ring or all-to-all "
                    "attention), ZeRO stage, micro-batch, recompute (none, selective, full; selective ranks as none "
                    "under fused attention without a context axis, which stores no softmax) and sequence-parallel "
                    "choice; keep those that fit; rank them by a roofline step time; print "
                    "the top K with the reason for each place; --write ranks the model the written recipe "
                    "describes (the reference GPT of these dimensions) and saves the best as a recipe.",
        epilog="Exit codes: 0 a layout fits, 3 none fits, 2 an invalid model file or a written recipe that does not "
               "validate or agree with estimate, 1 usage error. GB = 10^9 bytes.")
    p.add_argument("--model", required=True, metavar="NAME|PATH.json",
                   help="a preset (llama2-7b, llama3-8b, gpt3-175b, megatron-1t, ...) or a JSON model block "
                        "(the recipe's model fields) or a recipe with one")
    p.add_argument("--gpus", required=True, type=positive_int, metavar="N",
                   help="accelerators in all: up to one node, or whole nodes (a multiple of --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="G",
                   help="accelerators per node (default 8); tensor groups stay inside a node")
    p.add_argument("--gpu-memory", required=True, type=size, metavar="SIZE",
                   help="memory of one accelerator: 80GB, 80GiB or 80")
    p.add_argument("--global-batch", type=positive_int, metavar="B",
                   help="sequences per optimizer step (default: about 4M tokens, a multiple of --gpus)")
    p.add_argument("--seq-len", type=positive_int, metavar="S", help="sequence length (default: the model's)")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="how many layouts to show (default 5)")
    p.add_argument("--write", metavar="RECIPE.json",
                   help="write the best layout as a recipe to this file (ranking the model the recipe describes)")
    p.add_argument("--attention", choices=("fused", "eager"), default="fused",
                   help="fused (FlashAttention / SDPA's fused kernels: no stored softmax; the default) or eager "
                        "(the softmax and its dropout stored, as SDPA's math kernel on a CPU with dropout): only "
                        "eager attention gives selective recompute something to drop")
    p.add_argument("--json", action="store_true", help="print JSON for machines instead of tables")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..planning.presets import resolve_model
    from ..planning.search import plan

    code = _check_model_file(args.model)
    if code:
        return code
    try:
        spec = resolve_model(args.model)
    except RecipeError as e:
        print_problems(e.problems)
        file_problem = any(p.file for p in e.problems)
        return 2 if file_problem else 1
    if args.seq_len:
        spec = spec.with_seq_len(args.seq_len)
    if args.write and args.attention != "fused":
        print("plan: --write ranks what `estimate` of the written recipe counts, which takes attention as fused "
              "-> drop --attention eager, or --write", file=sys.stderr)
        return 1
    try:
        result = plan(spec, args.gpus, args.gpu_memory, gpus_per_node=args.gpus_per_node,
                      global_batch=args.global_batch, top=args.top, as_recipe=bool(args.write),
                      fused_attention=args.attention == "fused")
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 1
    written = None
    if args.write and result.plans:
        written, code = _write(result, Path(args.write))
        if code:
            return code
    if args.json:
        data = result.to_json()
        data["written"] = str(written) if written else None
        print_json(data)
    else:
        _print(result, written)
    if not result.plans:
        if args.write:
            print(f"nothing written to {args.write}: no layout fits", file=sys.stderr)
        return NOTHING_FITS
    return 0


def _check_model_file(ref: str) -> int:
    """``--model`` given as a recipe (or as a file that is no model block: empty, a DeepSpeed config, an Accelerate
    YAML) is validated as ``validate`` does it, its problems printed: 2 when it is invalid or has no model block; a
    directory is a usage error (1). 0 for a preset name, a missing file or a model block: :func:`resolve_model` reads
    those."""
    from ..recipe.jsontext import parse_json

    path = Path(ref)
    if path.is_dir():
        print_problems([Problem("--model", f"{ref!r} is a directory", "give a preset name, a model block (JSON) or a "
                                "recipe with one (a file)")])
        return 1
    if not path.is_file():
        return 0
    try:
        data, _ = parse_json(path.read_text(encoding="utf-8"), ref)
    except (OSError, UnicodeDecodeError):
        data = None  # load_or_report says why
    if isinstance(data, dict) and {"layers", "hidden"} & data.keys() and not MODEL_OR_RECIPE & data.keys():
        return 0  # a model block
    recipe = load_or_report(ref, None)
    if recipe is None:
        return 2
    if recipe.model is None:
        print_problems([Problem("$.model", "the recipe has no model block: plan needs the model's dimensions",
                                "add a model block (layers, hidden, heads, vocab, seq_len), or give --model a preset",
                                file=ref)])
        return 2
    return 0


def _write(result, path: Path):
    """Write the winner as a recipe after checking that it validates, passes the cross-field checks and that
    ``estimate`` of it agrees with the plan and fits; (path, exit code)."""
    from ..planning.to_recipe import check_written_recipe, to_recipe_data
    from ..recipe.checks import check_recipe
    from ..recipe.load import recipe_from_data

    data = to_recipe_data(result.plans[0], result, name=path.stem)
    text = json.dumps(data, indent=2) + "\n"
    recipe, problems = recipe_from_data(json.loads(text), str(path))  # exactly what the file will hold
    errors = [p for p in problems if p.is_error]
    if recipe is not None and not errors:
        errors = [p for p in check_recipe(recipe, recipe.layout().world_size) if p.is_error]
    if errors:  # a planner bug: say so rather than write a recipe that will not load
        print("the planned recipe does not validate (a bug in the planner; please report it):", file=sys.stderr)
        print_problems(errors)
        return None, 2
    disagreements = check_written_recipe(recipe, result.plans[0], result)
    if disagreements:  # also a planner bug: the recipe would not be what was ranked
        print(f"not writing {path}: `estimate` of the planned recipe disagrees with the plan (a bug in the "
              "planner; please report it):", file=sys.stderr)
        for line in disagreements:
            print(f"  {line}", file=sys.stderr)
        return None, 2
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        print(f"--write: cannot write {path}: {e}", file=sys.stderr)
        return None, 1
    return path, 0


def _print(result, written) -> None:
    from ..planning.search import describe_result

    print(describe_result(result))
    print(f"searched {result.considered} layouts, {result.fitting} fit")
    for note in result.notes:
        print(f"note: {note}")
    for line in result.assumptions:
        print(f"assumes: {line}")
    if not result.plans:
        print(result.advice)
        return
    rows = []
    moe = bool(result.spec.moe_experts)  # an expert column for a mixture of experts only
    for p in result.plans:
        s = p.setup
        context = f"{s.cp} {s.cp_method}" if s.cp > 1 else "1"
        rows.append((str(p.rank), str(s.tp), context, str(s.pp), str(s.dp), *([str(s.ep)] if moe else []),
                     str(s.zero_stage), f"{s.micro_batch} x {s.micro_batches}", "yes" if s.sequence_parallel else "no",
                     s.recompute, fmt_gb(p.memory.total), fmt_seconds(p.time.total),
                     f"{p.time.tokens_per_second_per_gpu:,.0f}", f"{p.time.mfu:.0%}"))
    print_table(f"Top {len(result.plans)} layouts (fastest first)",
                ["#", "tensor", "context", "pipeline", "data", *(["expert"] if moe else []), "ZeRO", "micro x acc",
                 "seq par", "recompute", "mem/GPU", "step", "tok/s/GPU", "MFU"], rows,
                right=["#", "tensor", "pipeline", "data", "expert", "ZeRO", "mem/GPU", "step", "tok/s/GPU", "MFU"])
    for p in result.plans:
        print(f"{p.rank}. {p.setup.label()}: {p.reason}")
    if written:
        print(f"wrote the best layout to {written}; `python -m plugin estimate {written}` gives the same "
              f"memory and step time (checked)")
