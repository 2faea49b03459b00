"""Time per simulated rank of the dry run against the world size: it should not grow with the world.

    python bench/dryrun.py [--worlds 64,256,1024] [--ranks replica|stage]

The Llama-3-70B-sized reference GPT of ``bench/dryrun_llama70b.json`` (tensor 8 x pipeline 8, 16 micro-batches per
step) at data 1, 4 and 16 (64, 256 and 1,024 ranks; the global batch grows with the data degree, so each rank's step
is the same), simulating the same ranks at every world: the 64 ranks of data replica 0 (``--ranks stage``: the 8 of
its first stage). A warm-up run of those ranks first (imports and torch's own caches, not counted); each world then
starts from the dry run's empty caches.
One line per world: ranks simulated, seconds, seconds per rank, and its ratio to the smallest world's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plugin.dryrun.run import dry_run  # noqa: E402
from plugin.recipe.checks import load_recipe  # noqa: E402

RECIPE = ROOT / "bench" / "dryrun_llama70b.json"


def recipe_at(world: int, directory: Path):
    text = json.loads(RECIPE.read_text())
    text.pop("$schema", None)
    data = world // (text["parallelism"]["tensor"] * text["parallelism"]["pipeline"])
    text["parallelism"]["data"] = data
    text["batch"]["global"] = 16 * data  # micro 1 x 16 micro-batches per data rank, whatever the world
    text["cluster"]["nodes"] = max(1, world // 8)
    path = directory / f"dryrun_{world}.json"
    path.write_text(json.dumps(text))
    return load_recipe(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024")
    p.add_argument("--ranks", choices=("replica", "stage"), default="replica")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    ranks = list(range(64)) if args.ranks == "replica" else list(range(8))
    with tempfile.TemporaryDirectory() as tmp:
        dry_run(recipe_at(worlds[0], Path(tmp)), ranks=ranks)  # warm-up: imports, torch's own caches
        first = None
        print(f"{'world':>6} {'ranks':>6} {'seconds':>8} {'s/rank':>7} {'ratio':>6}")
        for world in worlds:
            recipe = recipe_at(world, Path(tmp))
            start = time.perf_counter()
            result = dry_run(recipe, ranks=ranks)
            seconds = time.perf_counter() - start
            per = seconds / len(result["ranks"])
            first = first or per
            failed = [c["name"] for c in result["checks"] if c["ok"] is False]
            print(f"{world:>6} {len(result['ranks']):>6} {seconds:>8.1f} {per:>7.2f} {per / first:>6.2f}"
                  + (f"  checks failed: {failed}" if failed else ""), flush=True)


if __name__ == "__main__":
    main()
