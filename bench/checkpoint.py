"""Checkpoint save/load/export against raw DCP and DeepSpeed's own, on the same state (issue 13's bench).

One DeepSpeed ZeRO engine (default ZeRO-3, 2 CPU processes, gloo) of the reference GPT (default 1.14 GiB of fp32
weights: the export goal is for a model of at least 1 GB), one optimizer step so Adam's moments exist; then on that
state, --repeat rounds of the three saves, then the three loads of what they wrote (the order turned by one each
round, so drift in the machine's load falls on all three alike; medians, barriers around each):

* plugin: ``engine.save`` / ``engine.load`` (pieces, a checksum of every item taken while it is written and checked
  while it is read, manifest, rename after every rank finished; DCP with sync_files: every file fsynced, written
  behind: ``plugin/checkpoint/writeback.py``);
* raw DCP: ``dcp.save`` / ``dcp.load`` of the same local tensors (each piece's view under its own key) with the
  default planners and writer (the same bytes, also fsynced; no pieces, checksums, manifest or rename);
* DeepSpeed: ``save_checkpoint`` / ``load_checkpoint`` (torch.save, no fsync).

Every save writes a new directory (DeepSpeed: a new tag), as a training job does (``global_step{N}``): a save
that overwrote the same files would reuse the pages their truncation just freed, which a job's saves, minutes
apart, do not (on this VM freed memory goes back to the host within seconds and its first touch is slow, 0.35
GB/s). Before each operation, untimed: ``os.sync()`` (nothing pays for another's unsynced files), every file
written so far dropped from the page cache (``posix_fadvise``: every load reads from the disk, as a resume after a
restart does, and no load finds its files cached while another's were written behind), and --settle seconds.
``--overwrite``: every round saves over the previous round's files instead (the setup that favours the baselines
here).

Then, in fresh processes: ``python -m plugin checkpoint export`` of the plugin's checkpoint against DeepSpeed's
``zero_to_fp32`` (``convert_zero_checkpoint_to_fp32_state_dict``, safetensors) of DeepSpeed's; time and peak RSS
(``ru_maxrss`` of the child) minus the peak of a child that only imports torch (the baseline).

Usage: python bench/checkpoint.py [--hidden 1536] [--layers 9] [--vocab 16384] [--zero 3] [--repeat 3] [--settle 6]
[--overwrite]
(about 8 minutes here at the defaults and 5.5 GB of memory per rank, 11 GB in all: on a shared 23 GB machine
another job can get it OOM-killed; --hidden 1024 --layers 8 --vocab 8192: 0.44 GiB, about 2 GB per rank)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _recipe(args, tmp: Path) -> Path:
    data = json.loads((ROOT / "recipes" / "cpu_dp4.json").read_text())
    data.pop("$schema", None)
    data.update(name="bench_checkpoint", parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                zero={"stage": args.zero}, batch={"global": 4, "micro": 2})
    data["model"] = {"layers": args.layers, "hidden": args.hidden, "heads": 16, "vocab": args.vocab,
                     "seq_len": 128, "ffn_hidden": 4 * args.hidden, "dropout": 0.0}
    path = tmp / "bench_checkpoint.json"
    path.write_text(json.dumps(data))
    return path


def drop_cache(root: Path) -> None:
    """Every file under ``root`` out of the page cache (clean pages: call after ``os.sync()``)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed_rounds(saves: dict, loads: dict, repeat: int, tmp: Path, settle: float) -> dict:
    """``{name: median seconds}`` of ``repeat`` rounds: every save of round ``i`` (``fn(i)``), then every load of
    what round ``i`` wrote, each in an order turned by ``i``."""
    import torch.distributed as dist

    times = {name: [] for name in [*saves, *loads]}
    for i in range(repeat):
        for ops in (saves, loads):
            names = list(ops)
            for name in names[i % len(names):] + names[: i % len(names)]:
                dist.barrier()
                os.sync()
                if dist.get_rank() == 0:
                    drop_cache(tmp)
                time.sleep(settle)
                dist.barrier()
                t = time.perf_counter()
                ops[name](i)
                dist.barrier()
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _rank(rank, world, port, recipe_path, tmp, repeat, settle, overwrite, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed.checkpoint as dcp

    import plugin
    from plugin.checkpoint.adapt import local_state
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe

    torch.set_num_threads(1)
    recipe = load_recipe(recipe_path)
    torch.manual_seed(0)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="deepspeed")
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    engine.train_step(data.global_batch(0, engine.layout.global_batch))
    state = local_state(engine, for_load=False)
    raw = {f"{n}@{','.join(map(str, p.offsets))}@{rank}": p.view.detach().contiguous()
           for n, e in state.entries.items() for p in e.pieces}
    nbytes = sum(t.numel() * t.element_size() for t in raw.values())
    res = {"bytes": nbytes}
    def r(i):  # --overwrite: every round writes over the previous round's files
        return "r0" if overwrite else f"r{i}"

    res.update(_timed_rounds({
        "plugin_save": lambda i: engine.save(f"{tmp}/plugin/{r(i)}"),
        "dcp_save": lambda i: dcp.save(raw, checkpoint_id=f"{tmp}/dcp/{r(i)}"),
        "ds_save": lambda i: engine.ds.save_checkpoint(f"{tmp}/ds", tag=r(i))}, {
        "plugin_load": lambda i: engine.load(f"{tmp}/plugin/{r(i)}"),
        "dcp_load": lambda i: dcp.load(raw, checkpoint_id=f"{tmp}/dcp/{r(i)}"),
        "ds_load": lambda i: engine.ds.load_checkpoint(f"{tmp}/ds", tag=r(i))}, repeat, Path(tmp), settle))
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    engine.close()


def _child_peak(code_or_argv) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of a fresh python child."""
    argv = [sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str) else [sys.executable] + code_or_argv
    t = time.perf_counter()
    pid = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
                           stdout=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    assert status == 0, argv
    return time.perf_counter() - t, usage.ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--settle", type=float, default=6.0, help="seconds of rest before each timed operation")
    p.add_argument("--overwrite", action="store_true",
                   help="every round saves over the previous round's files (DeepSpeed's tag, DCP's directory, the "
                        "plugin's step): the baselines reuse the pages their truncation frees")
    args = p.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out:
        tmp = Path(tmp)
        recipe = _recipe(args, tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, str(recipe), str(tmp), args.repeat, args.settle, args.overwrite, out),
                 nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
        last = "r0" if args.overwrite else f"r{args.repeat - 1}"
        base_t, base = _child_peak("import torch, safetensors")
        os.sync()
        drop_cache(tmp)
        ours_t, ours = _child_peak(["-m", "plugin.checkpoint.export", str(tmp / "plugin" / last),
                                    "-o", str(tmp / "exp")])
        os.sync()
        drop_cache(tmp)
        theirs_t, theirs = _child_peak(
            "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
            f"c({str(tmp / 'ds')!r}, {str(tmp / 'z2f')!r}, tag={last!r}, safe_serialization=True)")
        model_bytes = sum(f.stat().st_size for f in (tmp / "exp").glob("*.safetensors"))
    r = {k: max(x[k] for x in ranks) for k in ranks[0]}
    print(f"model {model_bytes / 2**20:.0f} MiB ({model_bytes / 1e9:.2f} GB) fp32, ZeRO-{args.zero} on 2 CPU "
          "processes; state per rank "
          f"{r['bytes'] / 2**20:.0f} MiB (params + Adam moments); medians of {args.repeat}, slower rank")
    rows = [("save vs raw DCP", r["plugin_save"], r["dcp_save"], "<= 1.2"),
            ("load vs raw DCP", r["plugin_load"], r["dcp_load"], "<= 1.2"),
            ("save vs DeepSpeed", r["plugin_save"], r["ds_save"], "<= 1.0"),
            ("load vs DeepSpeed", r["plugin_load"], r["ds_load"], "<= 1.0"),
            ("export time vs zero_to_fp32", ours_t, theirs_t, "-"),
            ("export peak RSS over baseline (MiB) vs zero_to_fp32", ours - base, theirs - base, "<= 0.3")]
    print(f"{'operation':<52} {'plugin':>9} {'baseline':>9} {'ratio':>7} {'goal':>7}")
    for name, a, b, goal in rows:
        print(f"{name:<52} {a:9.2f} {b:9.2f} {a / b if b else float('nan'):7.2f} {goal:>7}")
    print(f"(import-only baseline child: {base:.0f} MiB peak RSS; the plugin's and raw DCP's saves fsync every file, "
          "DeepSpeed's does not; the plugin's also checksums every item and writes the manifest)")


if __name__ == "__main__":
    main()
