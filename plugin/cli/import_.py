"""``import DS_CONFIG.json [--world-size N] [--name NAME] [-o FILE]``: a recipe from a DeepSpeed config."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import WARNING, Problem
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
    from ..interop.deepspeed_config import from_ds_config
    from ..recipe.checks import check_recipe
    from ..recipe.jsontext import INVALID, json_type, parse_json
    from ..recipe.load import recipe_from_data

    try:
        text = Path(args.ds_config).read_text(encoding="utf-8")
    except OSError as e:
        print(f"{args.ds_config}: cannot read: {e}", file=sys.stderr)
        return EXIT_USAGE
    cfg, parse_problems = parse_json(text, args.ds_config)
    if cfg is INVALID or not isinstance(cfg, dict):
        if cfg is not INVALID:
            parse_problems.append(Problem("$", f"the top level must be a JSON object (a DeepSpeed config), not "
                                          f"{json_type(cfg)}", 'write an object such as {"train_batch_size": 32}',
                                          file=args.ds_config))
        print_problems(parse_problems)
        return EXIT_INVALID
    name = args.name or (Path(args.output).stem if args.output else "imported")
    data = from_ds_config(cfg, args.world_size, name=name)
    # The recipe's own problems name the output file, or else the DeepSpeed config it came from.
    recipe, problems = recipe_from_data(data, args.output or "")
    if recipe is not None:
        problems += check_recipe(recipe, args.world_size)
    problems = parse_problems + _optimizer_warnings(cfg, args.ds_config) + _precision_warnings(cfg, args.ds_config) + \
        _scheduler_warnings(data, recipe, args.ds_config) + \
        [p if p.file else p.with_file(args.ds_config) for p in problems]
    print_problems(problems)
    text = json.dumps(data, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK if recipe is not None and not any(p.is_error for p in problems) else EXIT_INVALID


def _precision_warnings(cfg: dict, file: str) -> list[Problem]:
    """bf16/fp16 ``"enabled": "auto"`` (the Hugging Face Trainer decides at run time): the recipe cannot know."""
    return [Problem(f"$.{k}.enabled", '"auto" (the Hugging Face Trainer fills it in): the recipe takes fp32',
                    f'set $.precision in the recipe to what you train with ("{k}" or "fp32")', WARNING, file)
            for k in ("bf16", "fp16") if isinstance(cfg.get(k), dict) and cfg[k].get("enabled") == "auto"]


def _optimizer_warnings(cfg: dict, file: str) -> list[Problem]:
    """What the recipe had to assume about the optimizer: none named, or "auto" values (Hugging Face's)."""
    section = cfg.get("optimizer")
    if section is None:
        return [Problem("$.optimizer", "the DeepSpeed config names no optimizer (its script passed one): the recipe "
                        "takes its default, adamw with lr 0.001", "set $.optimizer to what the script used",
                        WARNING, file)]
    params = section.get("params") if isinstance(section, dict) else None
    if not isinstance(params, dict):
        return []
    return [Problem(f"$.optimizer.params.{k}", '"auto" (the Hugging Face Trainer fills it in): the recipe takes '
                    "DeepSpeed's default instead", f"set $.optimizer.{k} in the recipe to the value you train with",
                    WARNING, file) for k, v in params.items() if v == "auto"]


def _scheduler_warnings(data: dict, recipe, file: str) -> list[Problem]:
    """A DeepSpeed scheduler read as the recipe's lr_schedule: the plugin's engines run the recipe's formula, which
    differs from DeepSpeed's class by a step or two (plugin.interop.deepspeed_scheduler)."""
    if recipe is None or "lr_schedule" not in data:
        return []
    from ..interop.deepspeed_scheduler import scheduler_differences

    return [Problem("$.scheduler", "read as the recipe's lr_schedule, which the plugin's engines apply as the recipe "
                    "defines it, not as DeepSpeed's class runs it: " + "; ".join(p.message for p in
                                                                            scheduler_differences(recipe)),
                    "check $.lr_schedule in the recipe (or keep the block raw under $.deepspeed.scheduler, for the "
                    "DeepSpeed back end only)", WARNING, file)]
