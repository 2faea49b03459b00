"""``validate RECIPE... [--world-size N] [--json]``: exit 0 when all are valid (warnings on stderr), 2 if not."""
from __future__ import annotations

from .common import EXIT_INVALID, EXIT_OK, add_world_size, print_json, print_problems


def register(sub) -> None:
    p = sub.add_parser("validate", help="check recipes against the schema and the cross-field rules",
                       description="Check recipes: schema, then every cross-field rule; all problems at once.")
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help="a path, or a shipped recipe's name (tp2_dp4)")
    add_world_size(p)
    p.add_argument("--json", action="store_true", help="one JSON report on stdout instead of text")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..recipe.checks import validate

    reports, ok = [], True
    for ref in args.recipes:
        recipe, problems = validate(ref, args.world_size)
        ok = ok and recipe is not None
        if args.json:
            reports.append({"recipe": ref, "valid": recipe is not None,
                            "errors": [p.to_json() for p in problems if p.is_error],
                            "warnings": [p.to_json() for p in problems if not p.is_error]})
            continue
        print_problems(problems)
        if recipe is not None:
            print(f"ok: {ref}: {_summary(recipe, args.world_size)}")
    if args.json:
        print_json(reports)
    return EXIT_OK if ok else EXIT_INVALID


def _summary(recipe, world_size) -> str:
    from ..recipe.layout import layout_words, processes

    par = recipe.parallelism
    if par.data == "auto" and world_size is None:
        return f'{layout_words("auto", par.tensor, par.pipeline, par.context)} (world size set by the launcher)'
    lay = recipe.layout(world_size)
    return (f"{lay.words} = {processes(lay.world_size)}; "
            f"batch {lay.global_batch} = micro {lay.micro_batch} x grad_accum {lay.grad_accum} x data {lay.data}; "
            f"ZeRO-{recipe.zero.stage}, {recipe.precision}")
