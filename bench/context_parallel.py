"""Activation bytes per rank and step time of the reference GPT's blocks at context 1, 2 and 4, against the estimate.

    python bench/context_parallel.py [--seq 2048]

For C = 1, 2, 4, C gloo processes (one thread each) form one context group; each builds the same GPT
(:class:`plugin.models.gpt.GPT`, fp32, dropout 0), tells it its sequence is split
(:func:`plugin.context_parallel.apply.apply_context_parallel`, ring and all-to-all) and runs its blocks forward on its
two chunks of one long sequence, ``[s/C, b, h]``, then backward. Measured on every rank: the bytes allocated and not
freed over the forward (``torch.profiler`` with ``profile_memory``, as ``bench/activations_recompute.py``), i.e. what
autograd keeps for backward plus the output less the input, the largest over the ranks; and the median wall time
of forward + backward over a few repeats, the slowest rank's. Estimated: the ``activations`` and
``context_attention_outputs`` terms of :func:`plugin.planning.memory.stage_memory` at ``seq_len / C`` tokens (fp32,
no dropout; the ring stores no score matrix, Ulysses runs SDPA's flash kernel with dropout 0). Goal: measured /
estimate within 10 % on every row.
Times come from 2 shared CPU cores: a ratio to C = 1 here says how much the split costs on one machine (C processes
share the cores), not what C accelerators would gain.

A benchmark, not plugin code: it imports torch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

LAYERS, BATCH, HIDDEN, HEADS, REPEATS, GOAL = 2, 1, 128, 4, 3, 0.10


def _rank(rank: int, size: int, port: int, seq: int, method: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=300))
    from plugin.context_parallel.apply import apply_context_parallel
    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=64, seq_len=seq, dropout=0.0)).train()
    if size > 1:
        apply_context_parallel(model, build_groups(Topology(cp_size=size)), method)
    blocks = list(model.blocks)

    def forward(x):
        for block in blocks:
            x = block(x)
        return x

    x = torch.randn(seq // size, BATCH, HIDDEN, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = forward(x)
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    y.sum().backward()
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        forward(x).sum().backward()
        times.append(time.perf_counter() - start)
    result = torch.tensor([float(kept), statistics.median(times)])
    gathered = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(gathered, result)
    if rank == 0:
        torch.save(torch.stack(gathered), out)
    dist.destroy_process_group()


def measure(size: int, seq: int, method: str) -> tuple[float, float]:
    """(the largest rank's kept bytes, the slowest rank's forward + backward seconds)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pt")
        mp.spawn(_rank, args=(size, port, seq, method, out), nprocs=size, join=True)
        table = torch.load(out)
    return float(table[:, 0].max()), float(table[:, 1].max())


def estimate(size: int, seq: int, method: str) -> float:
    from plugin.planning.dims import ModelSpec
    from plugin.planning.memory import stage_memory
    from plugin.planning.setup import Setup

    spec = ModelSpec(name="bench", layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=64, seq_len=seq)
    setup = Setup(cp=size, cp_method=method, precision="fp32", dropout=False, micro_batch=BATCH)
    memory = stage_memory(spec, setup, 0)
    return memory.get("activations") + memory.get("context_attention_outputs")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print(f"{LAYERS} blocks of the reference GPT, hidden {HIDDEN}, heads {HEADS}, seq {args.seq}, batch {BATCH}, fp32, "
          f"gloo on CPU (torch {torch.__version__}); MB = 10^6 bytes")
    header = (f"{'C':>2} {'method':<10} {'measured MB':>11} {'estimate MB':>11} {'ratio':>6} {'fwd+bwd s':>9} "
              f"{'vs C=1':>6}")
    print(header)
    print("-" * len(header))
    worst, base = 0.0, None
    for size in (1, 2, 4):
        for method in (("ring",) if size == 1 else ("ring", "all_to_all")):
            got, seconds = measure(size, args.seq, method)
            est = estimate(size, args.seq, method)
            base = seconds if size == 1 else base
            worst = max(worst, abs(got / est - 1))
            label = method if size > 1 else "-"
            print(f"{size:>2} {label:<10} {got / 1e6:>11.2f} {est / 1e6:>11.2f} {got / est:>6.3f} {seconds:>9.3f} "
                  f"{seconds / base:>6.2f}")
    ok = worst <= GOAL
    print(f"\nworst |measured / estimate - 1| = {worst:.3f}: goal <= {GOAL:.2f} {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
