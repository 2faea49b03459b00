"""The options of ``python -m plugin dryrun`` (pure: the CLI door registers them, ``python -m plugin.dryrun``
parses them)."""
from __future__ import annotations

HELP = "build and step every rank of a job in one process, on the meta device: what each holds and says"


def add_arguments(p) -> None:
    p.add_argument("recipe", metavar="RECIPE", help="a recipe file, or a shipped recipe's name (tp2_dp4)")
    p.add_argument("--model", default="gpt", help="gpt (default), a transformers model_type (llama, qwen3, ...) or a "
                   "config.json / directory, sized by the recipe's model block, as train.py's --model")
    p.add_argument("--world-size", type=int, metavar="N", help="the job's ranks (default: the recipe's)")
    p.add_argument("--ranks", metavar="LIST", help="ranks to simulate: 0,5,7-9 or all (default: data replica 0 at "
                   "context 0, and the last rank)")
    p.add_argument("--verify", action="store_true", help="also simulate one whole group of each axis, so that "
                   "their members' collectives are compared call by call")
    p.add_argument("--json", action="store_true", help="print JSON for machines instead of the table")


def to_argv(args) -> list[str]:
    """The parsed options as a command line again (for the child process the CLI door starts)."""
    out = [args.recipe, "--model", args.model]
    if args.world_size:
        out += ["--world-size", str(args.world_size)]
    if args.ranks:
        out += ["--ranks", args.ranks]
    return out + (["--verify"] if args.verify else []) + (["--json"] if args.json else [])
