"""``export RECIPE --to deepspeed|accelerate [--world-size N] [--cpu] [--no-deepspeed] [-o FILE]``."""
from __future__ import annotations

import json
import sys

from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, add_world_size, load_or_report, needs_world_size, print_problems


def register(sub) -> None:
    p = sub.add_parser("export", help="write the DeepSpeed config (JSON) or Accelerate config (YAML) of a recipe",
                       description="Export a recipe as a ds_config DeepSpeed accepts verbatim, or as an "
                                   "`accelerate launch --config_file` YAML.")
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument("--to", required=True, choices=["deepspeed", "accelerate"])
    add_world_size(p)
    p.add_argument("--cpu", action="store_true", help="accelerate only: a CPU (MULTI_CPU, gloo) config")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false",
                   help="accelerate only: for a machine without deepspeed (ZeRO >= 1 is then not Accelerate's "
                        "DeepSpeed plugin but its FSDP2 plugin on CUDA, or the plugin's native back end)")
    p.add_argument("-o", "--output", metavar="FILE", help="write there instead of stdout")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..interop.accelerate_config import to_accelerate_config
    from ..interop.deepspeed_config import to_ds_config

    if args.to == "deepspeed" and (args.cpu or not args.deepspeed):
        flag = "--cpu" if args.cpu else "--no-deepspeed"
        print(f"export: {flag} shapes an Accelerate config only -> drop it, or use --to accelerate", file=sys.stderr)
        return EXIT_USAGE
    recipe = load_or_report(args.recipe, args.world_size)
    if recipe is None:
        return EXIT_INVALID
    what = "a DeepSpeed config's batch triple" if args.to == "deepspeed" else "an Accelerate config's num_processes"
    if needs_world_size(recipe, args.world_size, f"{what} depends on it"):
        return EXIT_INVALID
    if recipe.parallelism.expert > 1 and args.to != "deepspeed":  # no key carries it: refused rather than lost
        from ..errors import Problem

        print_problems([Problem("$.parallelism.expert", f"expert {recipe.parallelism.expert}: Accelerate's config "
                                "has no key that carries an expert axis, so the export would train without it",
                                "train it with the plugin (launch.sh, train.py), export it --to deepspeed (AutoEP's "
                                'expert_parallel section), or export with "expert": 1', file=recipe.source)])
        return EXIT_INVALID
    if recipe.parallelism.expert > 1:
        print(f"{recipe.source or recipe.name}: note: the expert axis is written as DeepSpeed 0.19's AutoEP section "
              "(expert_parallel), which places the experts of the transformers families its presets cover; the "
              "plugin trains an expert axis on its native back end", file=sys.stderr)
    if args.to == "deepspeed":
        from ..interop.deepspeed_scheduler import scheduler_differences

        text = json.dumps(to_ds_config(recipe, args.world_size), indent=2) + "\n"
        print_problems(p.with_file(recipe.source) for p in scheduler_differences(recipe))
    else:
        text = to_accelerate_config(recipe, args.world_size, cpu=args.cpu, deepspeed=args.deepspeed)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
