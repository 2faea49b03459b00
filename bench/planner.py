"""How long `plan` takes to search every layout for 512 GPUs, preset by preset, against its goals.

    python bench/planner.py [--gpus 512] [--repeats 5]

One table: per model preset the layouts the search considered and kept (fitting 80 GB), the median wall
time of ``plugin.planning.search.plan`` (in this process, imports done) and its ratio to the goal (1 s); then the
CLI end to end (``python -m plugin plan --model llama2-70b ... --json``, interpreter start included) next
to a bare ``python -c pass``, against its goal (3 s). Pure code: no torch is imported.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plugin.planning.presets import get_preset, preset_names  # noqa: E402
from plugin.planning.search import plan  # noqa: E402

SEARCH_GOAL_S = 1.0  # one plan() call, any preset, 512 GPUs
CLI_GOAL_S = 3.0  # `python -m plugin plan` end to end, interpreter start included


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run_seconds(cmd: list[str], repeats: int) -> float:
    def once():
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-2000:]}")

    return median_seconds(once, repeats)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=512)
    parser.add_argument("--gpu-memory", type=float, default=80e9, help="bytes per GPU (default 80e9)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(f"\nplan() for {args.gpus} GPUs of {args.gpu_memory / 1e9:.0f} GB, median of {args.repeats} "
          f"(goal {SEARCH_GOAL_S:.0f} s per call)\n")
    print(f"{'preset':<16}{'considered':>12}{'fitting':>10}{'seconds':>10}{'vs goal':>10}")
    print("-" * 58)
    worst = 0.0
    for name in preset_names():
        spec = get_preset(name)
        seconds, result = median_seconds(functools.partial(plan, spec, args.gpus, args.gpu_memory, top=5), args.repeats)
        worst = max(worst, seconds)
        print(f"{name:<16}{result.considered:>12,}{result.fitting:>10,}{seconds:>10.3f}"
              f"{seconds / SEARCH_GOAL_S:>10.3f}")

    py = sys.executable
    cli = run_seconds([py, "-m", "plugin", "plan", "--model", "llama2-70b", "--gpus", str(args.gpus),
                       "--gpu-memory", "80GB", "--json"], args.repeats)
    bare = run_seconds([py, "-c", "pass"], args.repeats)
    print(f"\n{'end to end (median of ' + str(args.repeats) + ')':<44}{'seconds':>10}{'vs goal':>10}{'vs python':>11}")
    print("-" * 75)
    label = f"python -m plugin plan llama2-70b, {args.gpus} GPUs"
    print(f"{label:<44}{cli:>10.3f}{cli / CLI_GOAL_S:>10.3f}{cli / bare:>11.1f}")
    print(f"{'python -c pass':<44}{bare:>10.3f}{bare / CLI_GOAL_S:>10.3f}{1:>11.1f}")
    print()
    goals = ((f"every preset's search <= {SEARCH_GOAL_S:.0f} s (slowest {worst:.3f} s)", worst <= SEARCH_GOAL_S),
             (f"the CLI end to end <= {CLI_GOAL_S:.0f} s", cli <= CLI_GOAL_S))
    for goal, met in goals:
        print(f"  [{'met' if met else 'MISSED'}] {goal}")


if __name__ == "__main__":
    main()
