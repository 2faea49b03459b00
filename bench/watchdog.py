"""What the hang guard's heartbeat costs a ``cpu_tp2_dp2`` step (the goal: at most 0.5 %), and with ``--hangs``
how soon it ends a job that hangs (the goal: every process gone within ``watchdog.timeout_s`` + 30 s).

Under torchrun with 4 CPU processes (gloo), ``cpu_tp2_dp2`` trains with ``watchdog.timeout_s`` 20 (a beat every
second: the most frequent the guard beats; the default 600 beats every 5 s). Two figures per back end:

* **paired**: blocks of steps with the guard on (phase hooks and heartbeat thread) and off (hooks detached, thread
  stopped), in the order on, off, off, on, ... so that a drift of the machine's load falls on both; the ratio of the
  median steps, on / off - 1. On a shared machine its noise is well above 0.5 %: read it with its spread.
* **direct**: what the guard does, timed alone on rank 0 and put per step: the main thread's phase marks (the
  ``Ledger.enter`` calls one step makes, counted, times the cost of one), plus the heartbeat thread's publication of
  each new step (the ledger with torch's sequence numbers, one store call) and its beats (a publication and three
  store calls), times the beats that fall in one step.
  The heartbeat waits on the store's socket without the GIL, so its wall time per beat is an upper bound of what
  it takes from the main thread.

``--hangs`` runs the end-to-end cases of tests/dist/test_watchdog.py (the same launches, imported from there) and
prints, per case, the seconds from the fault until the triage report was out, until the last live rank was gone,
and until the launcher itself exited: a stopped rank under torchrun and (rank 0) under the deepspeed launcher, by
hand a killed rank 0, a stopped store host and a wrong master address, a pre-flight group that never completes.

Usage: python bench/watchdog.py [--blocks 8] [--steps 5] [--backend native]   (relaunches itself under torchrun)
       python bench/watchdog.py --hangs [--cases sigstop,deepspeed,...]

A benchmark, not plugin code: it imports torch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 3
TIMEOUT_S = 20


def _guard_off(guard) -> None:
    guard._stop.set()
    guard._thread.join()
    guard.hooks.detach()


def _guard_on(guard) -> None:
    guard.hooks.attach()
    guard._stop.clear()
    guard._thread = threading.Thread(target=guard._beat, daemon=True, name="watchdog-heartbeat")
    guard._thread.start()


def _direct(guard, step_s: float, marks_per_step: float) -> dict:
    """Rank 0: the cost of one phase mark and of one beat's work, and their sum per step as a share of it."""
    ledger, n = guard.ledger, 20000
    t = time.perf_counter()
    for _ in range(n):
        ledger.enter("forward", "micro-batch 1")
    mark_s = (time.perf_counter() - t) / n
    publishes, beats = [], []
    for _ in range(30):
        t = time.perf_counter()
        guard._publish()
        publishes.append(time.perf_counter() - t)
        guard.store.add(f"beat/{guard.rank}", 0)
        guard.store.add("declared", 0)
        guard.store.add(f"beat/{(guard.rank + 1) % guard.world}", 0)
        beats.append(time.perf_counter() - t)
    publish_s, beat_s = statistics.median(publishes), statistics.median(beats)
    per_step = marks_per_step * mark_s + publish_s + beat_s * step_s / guard.beat_s
    return {"mark_us": mark_s * 1e6, "marks_per_step": marks_per_step, "publish_ms": publish_s * 1e3,
            "beat_ms": beat_s * 1e3, "beat_every_s": guard.beat_s, "direct_share": per_step / step_s}


def worker(backend: str | None, blocks: int, steps: int) -> None:
    import torch.distributed as dist

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.spec import Recipe

    data_ = plugin.load_recipe("cpu_tp2_dp2").to_dict()
    data_["watchdog"] = {"timeout_s": TIMEOUT_S}
    recipe = Recipe.from_dict(data_)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend, seed=0)
    guard, data = engine.guard, TextBatches(recipe.model.vocab, recipe.model.seq_len)
    counted = [0]
    enter = guard.ledger.enter

    def counting(*args, **kwargs):
        counted[0] += 1
        enter(*args, **kwargs)

    times = {"on": [], "off": []}
    step = 0
    for _ in range(WARMUP):
        engine.train_step(data.global_batch(step, engine.layout.global_batch))
        step += 1
    order = [("on", "off", "off", "on")[i % 4] for i in range(blocks)]
    state = "on"
    for mode in order:
        if mode != state:
            (_guard_on if mode == "on" else _guard_off)(guard)
            state = mode
        guard.ledger.enter = counting if mode == "on" else enter
        block = []
        for _ in range(steps):
            batch = data.global_batch(step, engine.layout.global_batch)
            dist.barrier()
            t = time.perf_counter()
            engine.train_step(batch)
            block.append(time.perf_counter() - t)
            step += 1
        times[mode].append(statistics.median(block))
    guard.ledger.enter = enter
    if state == "off":
        _guard_on(guard)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    row = {"on_ms": on * 1e3,
           "off_ms": off * 1e3, "paired": on / off - 1,
           "spread": (max(times["off"]) - min(times["off"])) / off, "blocks": blocks, "steps": steps}
    if int(os.environ["RANK"]) == 0:
        row.update(_direct(guard, off, counted[0] / (len(times["on"]) * steps)))
        print("RESULT " + json.dumps(row), flush=True)
    engine.close()


HANGS = {  # name -> (what, launcher, timeout_s of its recipe, the case's function in tests/dist/test_watchdog.py)
    "sigstop": ("rank 3 of tp2 x pp2 native stopped (SIGSTOP)", "torchrun", "TIMEOUT_S", "sigstop_native"),
    "deepspeed": ("rank 0 of tp2 x pp2 DeepSpeed stopped (SIGSTOP)", "deepspeed", "TIMEOUT_S", "sigstop_deepspeed"),
    "killed": ("rank 0 of dp2 killed (SIGKILL)", "by hand", "HAND_TIMEOUT_S", "killed_case"),
    "store": ("rank 0 of dp2 and its store child stopped", "by hand", "HAND_TIMEOUT_S", "store_stopped_case"),
    "master": ("rank 1 of dp2 with a wrong master address", "by hand", "HAND_TIMEOUT_S", "wrong_master_case"),
    "preflight": ("rank 3 of tp2 x dp2 stalls in a group's pre-flight", "torchrun", "TIMEOUT_S",
                  "preflight_group_case"),
}


def _guard_lines(stderr: str) -> str:
    """The guard's lines and its report (indented lines after its header), as a run printed them."""
    out, in_report = [], False
    for line in stderr.splitlines():
        if line.startswith("watchdog: "):
            out.append(line)
            in_report = line.startswith("watchdog: the job stopped")
        elif in_report and line.startswith("  "):
            out.append(line)
        else:
            in_report = False
    return "\n".join(out)


def hangs(names: list[str], show: bool) -> None:
    """Each case once, then the table (seconds from the fault; the wrong master address: from the launch);
    ``show``: each case's lines from the guard too."""
    import tempfile

    from tests.dist import test_watchdog as cases
    from tests.dist.runs import release_deepspeed_shm

    runs = {
        "sigstop_native": lambda tmp, paths: cases.sigstop_case(tmp, paths, "tp2_pp2", "torchrun", 3, 3),
        "sigstop_deepspeed": lambda tmp, paths: cases.sigstop_case(tmp, paths, "tp2_pp2_ds", "deepspeed", 0, 3),
    }
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        paths = cases.make_recipes(tmp)
        for name in names:
            what, launcher, timeout, fn = HANGS[name]
            timeout_s = getattr(cases, timeout)
            run = (runs.get(fn) or getattr(cases, fn))(tmp, paths)
            if "--master_port" in run.cmd:
                release_deepspeed_shm(run.cmd[run.cmd.index("--master_port") + 1])
            live = [t for r, t in run.gone.items() if r != run.hung or name == "preflight"]
            rows.append((what, launcher, timeout_s, run.reported, max(live, default=None), run.ended))
            print(f"{name}: gone {run.gone}, report {run.reported}, launcher {run.ended}, exit {run.proc.returncode}",
                  file=sys.stderr, flush=True)
            if show:
                print(_guard_lines(run.stderr), file=sys.stderr, flush=True)

    def s(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    print(f"{'case':<50} {'launcher':<10} {'timeout_s':>9} {'report s':>9} {'live gone s':>12} {'launcher out s':>15} "
          f"{'goal s':>7}")
    for what, launcher, timeout_s, reported, gone, ended in rows:
        print(f"{what:<50} {launcher:<10} {timeout_s:>9} {s(reported):>9} {s(gone):>12} {s(ended):>15} "
              f"{timeout_s + 30:>7}")
    print("seconds from the fault (the wrong master address: from the launch); launcher out '-': it never ends by "
          "itself (a stopped rank 0 the silent store's peers cannot see: the bench kills it)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8, help="blocks of steps, on and off in turn (default 8)")
    p.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    p.add_argument("--backend", choices=["deepspeed", "native"], help="default: the plugin's choice")
    p.add_argument("--hangs", action="store_true", help="time the end-to-end hang cases instead of the cost")
    p.add_argument("--cases", default=",".join(HANGS), help=f"with --hangs: which, of {', '.join(HANGS)}")
    p.add_argument("--show", action="store_true", help="with --hangs: print each case's lines from the guard")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hangs:
        hangs(args.cases.split(","), args.show)
        return
    if args.worker:
        worker(args.backend, args.blocks, args.steps)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    rows = []
    for backend in [args.backend] if args.backend else ["native", "deepspeed"]:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                              __file__, "--worker", "--blocks", str(args.blocks), "--steps", str(args.steps),
                              "--backend", backend], capture_output=True, text=True, env=env, timeout=1800)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode or line is None:
            sys.exit(f"the {backend} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows.append(dict(json.loads(line[7:]), backend=backend))
    print(f"cpu_tp2_dp2, 4 gloo processes, watchdog.timeout_s {TIMEOUT_S} (a beat every "
          f"{rows[0]['beat_every_s']:g} s); {args.blocks} blocks of {args.steps} steps, on/off in turn")
    print(f"{'back end':<10} {'step on ms':>11} {'step off ms':>12} {'paired':>8} {'off spread':>11} "
          f"{'mark us':>8} {'marks/step':>11} {'publish ms':>11} {'beat ms':>8} {'direct':>8}")
    for r in rows:
        print(f"{r['backend']:<10} {r['on_ms']:>11.1f} {r['off_ms']:>12.1f} {r['paired']:>8.2%} {r['spread']:>11.1%} "
              f"{r['mark_us']:>8.2f} {r['marks_per_step']:>11.1f} {r['publish_ms']:>11.3f} {r['beat_ms']:>8.3f} "
              f"{r['direct_share']:>8.3%}")
    print("goal: at most 0.50 % (paired: on / off - 1 of the median steps; direct: the guard's own work per step)")


if __name__ == "__main__":
    main()
