"""``import CONFIG [--world-size N] [--name NAME] [-o FILE]``: a recipe from a DeepSpeed config (JSON) or an
Accelerate config (YAML, or JSON with Accelerate's keys).

The recipe's launcher is the one the config was written for (``deepspeed``, ``accelerate``), or ``"auto"`` where
that one refuses the recipe (a context axis on DeepSpeed), so that ``validate`` accepts what import writes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import WARNING, Problem
from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, add_world_size, cannot_read, print_problems

EXPECTED = "a DeepSpeed config (JSON) or an Accelerate config (YAML)"
ACCELERATE_KEYS = frozenset({"distributed_type", "compute_environment"})  # what every Accelerate config has


def register(sub) -> None:
    p = sub.add_parser("import", help="turn a DeepSpeed config or an Accelerate config into a recipe",
                       description="Make a recipe from a ds_config JSON (keys with no recipe meaning go under "
                                   '"deepspeed", so exporting the recipe gives back an equivalent config) or from an '
                                   "Accelerate config YAML (what `export --to accelerate` writes, read back).")
    p.add_argument("config", metavar="CONFIG", help="a DeepSpeed config (JSON) or an Accelerate config (YAML)")
    add_world_size(p)
    p.add_argument("--name", help="the recipe's name (default: the output file's stem, or 'imported')")
    p.add_argument("-o", "--output", metavar="FILE", help="write the recipe there instead of stdout")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..recipe.foreign import ACCELERATE_YAML
    from ..recipe.jsontext import INVALID, json_type, parse_json

    path = args.config
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(cannot_read(path, e, EXPECTED) if isinstance(e, OSError) else f"{path}: not text ({e}) -> give "
              f"{EXPECTED}", file=sys.stderr)
        return EXIT_USAGE
    if not text.strip():
        print_problems([Problem("$", "the file is empty", f"give {EXPECTED}", file=path)])
        return EXIT_INVALID
    cfg, problems = parse_json(text, path)
    if cfg is INVALID and (Path(path).suffix.lower() in (".yaml", ".yml") or ACCELERATE_YAML.search(text)):
        from ..interop.accelerate_import import parse_yaml

        cfg, problems = parse_yaml(text, path)
        if problems:
            print_problems(problems)
            return EXIT_INVALID
        if not isinstance(cfg, dict) or not ACCELERATE_KEYS & cfg.keys():
            print_problems([Problem("$", "YAML, but not an Accelerate config (no distributed_type)",
                                    f"give {EXPECTED}", file=path)])
            return EXIT_INVALID
    if cfg is INVALID or not isinstance(cfg, dict):
        if cfg is not INVALID:
            problems.append(Problem("$", f"the top level must be a JSON object (a DeepSpeed config), not "
                                    f"{json_type(cfg)}", 'write an object such as {"train_batch_size": 32}',
                                    file=path))
        print_problems(problems)
        return EXIT_INVALID
    if "parallelism" in cfg:
        print_problems([Problem("$", "this is a recipe already (it has parallelism)",
                                f"check it with: python -m plugin validate {path}", file=path)])
        return EXIT_INVALID
    name = args.name or (Path(args.output).stem if args.output else "imported")
    if ACCELERATE_KEYS & cfg.keys():
        from ..interop.accelerate_import import from_accelerate_config

        data, found = from_accelerate_config(cfg, text, args.world_size, name=name)
        problems += [p.with_file(path) for p in found]
    else:
        from ..interop.deepspeed_config import from_ds_config

        data = from_ds_config(cfg, args.world_size, name=name)
        problems += _optimizer_warnings(cfg, path) + _precision_warnings(cfg, path)
    data, recipe, own = _runnable(data, args.world_size, args.output or "")
    # The recipe's own problems name the output file, or else the config it came from.
    problems += _scheduler_warnings(data, recipe, path) + [p if p.file else p.with_file(path) for p in own]
    print_problems(problems)
    text = json.dumps(data, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK if recipe is not None and not any(p.is_error for p in problems) else EXIT_INVALID


def _checked(data: dict, world_size, file: str):
    """(recipe or None, its schema and cross-field problems)."""
    from ..recipe.checks import check_recipe
    from ..recipe.load import recipe_from_data

    recipe, problems = recipe_from_data(data, file)
    if recipe is not None:
        problems += check_recipe(recipe, world_size)
    return recipe, problems


def _runnable(data: dict, world_size, file: str):
    """(data, recipe, problems) with the config's own launcher, or with ``"auto"`` (said in a warning) where that
    launcher refuses what ``"auto"`` accepts: DeepSpeed and a context axis, Accelerate (the native back end) and nvme
    offload."""
    recipe, problems = _checked(data, world_size, file)
    errors = {(p.path, p.message) for p in problems if p.is_error}
    if not errors or data.get("launcher", "auto") == "auto":
        return data, recipe, problems
    auto = {**data, "launcher": "auto"}
    other, other_problems = _checked(auto, world_size, file)
    left = {(p.path, p.message) for p in other_problems if p.is_error}
    if other is None or len(left) >= len(errors):
        return data, recipe, problems
    refused = "; ".join(message for path, message in sorted(errors - left))
    note = Problem("$.launcher", f'"auto" written, not "{data["launcher"]}", which refuses this recipe ({refused})',
                   'keep "auto" (the plugin picks a back end that trains it), or change the recipe', WARNING)
    return auto, other, other_problems + [note]


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
