"""``import DS_CONFIG.json [--world-size N] [--name NAME] [-o FILE]``: a recipe from a DeepSpeed config."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, add_world_size, print_problems


def register(sub) -> None:
    p = sub.add_parser("import", help="turn an existing DeepSpeed config into a recipe",
                       description="Make a recipe from a ds_config JSON; keys with no recipe meaning go under "
                                   '"deepspeed", so exporting the recipe gives back an equivalent config.')
    p.add_argument("ds_config", metavar="DS_CONFIG.json")
    add_world_size(p)
    p.add_argument("--name", help="the recipe's name (default: the output file's stem, or 'imported')")
    p.add_argument("-o", "--output", metavar="FILE", help="write the recipe there instead of stdout")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..checks import check_recipe
    from ..ds_config import from_ds_config
    from ..recipe import parse_json, recipe_from_data

    try:
        text = Path(args.ds_config).read_text(encoding="utf-8")
    except OSError as e:
        print(f"{args.ds_config}: cannot read: {e}", file=sys.stderr)
        return EXIT_USAGE
    cfg, problems = parse_json(text, args.ds_config)
    if cfg is None or not isinstance(cfg, dict):
        print_problems(problems or [])
        if cfg is not None:
            print(f"{args.ds_config}: $: a DeepSpeed config is a JSON object", file=sys.stderr)
        return EXIT_INVALID
    name = args.name or (Path(args.output).stem if args.output else "imported")
    data = from_ds_config(cfg, args.world_size, name=name)
    recipe, problems = recipe_from_data(data, args.output or "")
    if recipe is not None:
        problems += check_recipe(recipe, args.world_size)
    if "optimizer" not in cfg:
        from ..errors import WARNING, Problem

        problems.insert(0, Problem("$.optimizer", "the DeepSpeed config names no optimizer (its script passed one): "
                                   "the recipe takes its default, adamw with lr 0.001",
                                   "set $.optimizer to what the script used", WARNING, args.ds_config))
    print_problems(problems)
    text = json.dumps(data, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK if recipe is not None and not any(p.is_error for p in problems) else EXIT_INVALID
