"""``python -m plugin.dryrun RECIPE ...``: what ``python -m plugin dryrun`` runs in its child process."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import PluginError, RecipeError
from .args import HELP, add_arguments
from .ranks import parse_ranks
from .report import table, to_json


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugin dryrun", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from ..recipe.checks import validate

    recipe, problems = validate(args.recipe, args.world_size)
    for p in problems:
        print(p.format(), file=sys.stderr)
    if recipe is None:
        return 2
    from .run import dry_run

    try:
        world = recipe.layout(args.world_size).world_size
        ranks = parse_ranks(args.ranks, world) if args.ranks else None
        progress = None if args.json or not sys.stderr.isatty() else \
            lambda i, n, r: print(f"\rsimulated rank {r} ({i}/{n})", end="", file=sys.stderr, flush=True)
        result = dry_run(recipe, model=args.model, world_size=args.world_size, ranks=ranks, verify=args.verify,
                         progress=progress)
    except RecipeError as e:
        print("\n".join(p.with_file(recipe.source).format() for p in (e.errors or e.problems)), file=sys.stderr)
        return 2
    except PluginError as e:
        print(f"{recipe.source or recipe.name}: dry run: {e}", file=sys.stderr)
        return 2
    if progress:
        print(file=sys.stderr)
    if args.json:
        json.dump(to_json(result), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(table(result))
    failed = [c for c in result["checks"] if c["ok"] is False]
    for c in failed:
        print(f"{recipe.source or recipe.name}: dry run: check {c['name']} failed for ranks {c['ranks']}: "
              f"{c['detail']}", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
