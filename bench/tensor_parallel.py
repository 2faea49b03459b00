"""Benchmark the plugin's tensor parallelism against Megatron's collective count, DTensor and megatron-core.

    python bench/tensor_parallel.py                 # tp=2, 2 gloo processes on the CPU
    python bench/tensor_parallel.py --repeats 30 --preset medium

Prints two tables for one transformer block of the reference GPT (plugin.models.gpt.Block):

1. Collectives per block, forward and backward, counted by wrapping the ``torch.distributed`` functions
   (DTensor issues functional collectives that bypass them, so its column is counted with torch's
   ``CommDebugMode``). Megatron's numbers are 2 all-reduces forward and 2 backward; with sequence
   parallelism 2 all-gathers + 2 reduce-scatters each way. The plugin's sequence-parallel backward adds
   one small all-reduce of the block's replicated parameter gradients (norms and output biases, summed
   inside autograd), shown apart: Megatron does the same sum once per step outside the block.
   The script exits non-zero if the plugin's activation collectives differ from Megatron's.
2. Step time (forward + backward) of the block at tp=2 on gloo: the plugin, torch's DTensor
   (ColwiseParallel/RowwiseParallel) and megatron-core's ColumnParallelLinear/RowParallelLinear, all on the
   same weights (their outputs are checked equal first). Median over repeats after warm-up, the
   variants interleaved so that machine noise hits all alike; the slowest rank's time counts.

megatron-core is a benchmark-only dependency: ``pip install "torch==$(python -c 'import torch;
print(torch.__version__.split("+")[0])')" megatron-core`` (pin torch, or pip pulls a CUDA build). Without
it that column says "not installed".
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PRESETS = {"small": dict(hidden=256, heads=8, seq=128, batch=2),
           "medium": dict(hidden=512, heads=8, seq=256, batch=4)}
KINDS = {"all_reduce": "AR", "all_gather": "AG", "all_gather_into_tensor": "AG", "all_gather_single": "AG",
         "_all_gather_base": "AG", "reduce_scatter": "RS", "reduce_scatter_tensor": "RS",
         "reduce_scatter_single": "RS", "_reduce_scatter_base": "RS", "broadcast": "BC"}


class Counting:
    """Counts calls of the torch.distributed collectives (outermost only) while active."""

    def __init__(self):
        self.counts, self.depth, self.param_sync = Counter(), threading.local(), False
        self.saved = {}

    def __enter__(self):
        for name, kind in KINDS.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, _kind=kind, **kwargs):
                outer = getattr(self.depth, "n", 0) == 0
                self.depth.n = getattr(self.depth, "n", 0) + 1
                try:
                    if outer:
                        self.counts["grad-AR" if self.param_sync and _kind == "AR" else _kind] += 1
                    return _fn(*args, **kwargs)
                finally:
                    self.depth.n -= 1

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def count(block, x, dy, counting_cls=Counting):
    """``({kind: n} forward, {kind: n} backward)`` for one forward and backward of ``block``."""
    from plugin.tensor_parallel import comm

    original = comm._AllReduceGradsInBackward.backward
    with counting_cls() as fwd:
        y = block(x)
    with counting_cls() as bwd:
        def marked(ctx, *grads):
            bwd.param_sync = True
            try:
                return original(ctx, *grads)
            finally:
                bwd.param_sync = False
        comm._AllReduceGradsInBackward.backward = staticmethod(marked)
        try:
            y.backward(dy)
        finally:
            comm._AllReduceGradsInBackward.backward = staticmethod(original)
    return dict(fwd.counts), dict(bwd.counts)


def count_dtensor(block, x, dy):
    from torch.distributed.tensor.debug import CommDebugMode

    names = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}
    out = []
    with CommDebugMode() as mode:
        y = block(x)
    out.append(mode.get_comm_counts())
    with CommDebugMode() as mode:
        y.backward(dy)
    out.append(mode.get_comm_counts())
    return tuple({names.get(str(op).split(".")[-1], str(op)): n for op, n in c.items()} for c in out)


# ---------------------------------------------------------------- the three implementations of one block


def plugin_block(whole_gpt, group, sequence_parallel):
    from plugin.tensor_parallel import apply_tensor_parallel

    return apply_tensor_parallel(copy.deepcopy(whole_gpt), "auto", group,
                                 sequence_parallel=sequence_parallel).blocks[0]


def dtensor_block(whole_block, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return parallelize_module(copy.deepcopy(whole_block), mesh, plan)


class _First(torch.nn.Module):
    """megatron-core layers return (output, bias): keep the output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[0]


def mcore_block(whole_block, group, rank, world):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                 perform_initialization=False)
    block = copy.deepcopy(whole_block)

    def swap(owner, name, column):
        old = getattr(owner, name)
        kw = dict(config=config, init_method=lambda t: None, bias=True, tp_group=group)
        if column:
            new = ColumnParallelLinear(old.in_features, old.out_features, gather_output=False, **kw)
            w, b = old.weight.chunk(world, 0)[rank], old.bias.chunk(world, 0)[rank]
        else:
            new = RowParallelLinear(old.in_features, old.out_features, input_is_parallel=True,
                                    skip_bias_add=False, **kw)
            w, b = old.weight.chunk(world, 1)[rank], old.bias
        with torch.no_grad():
            new.weight.copy_(w)
            new.bias.copy_(b)
        setattr(owner, name, _First(new))

    swap(block.attn, "qkv", True)
    swap(block.attn, "proj", False)
    swap(block.mlp, "fc", True)
    swap(block.mlp, "proj", False)
    return block


# ---------------------------------------------------------------- measuring


def timed(block, x, dy, group) -> float:
    for p in [x, *block.parameters()]:
        p.grad = None
    dist.barrier(group)
    start = time.perf_counter()
    block(x).backward(dy)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the step ends when the slowest rank does
    return elapsed.item()


def worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    from plugin.models import GPT, GPTConfig

    size = PRESETS[args.preset]
    config = GPTConfig(vocab=128, hidden=size["hidden"], layers=1, heads=size["heads"], seq_len=size["seq"])
    torch.manual_seed(0)
    whole_gpt = GPT(config)
    whole = whole_gpt.blocks[0]
    x = torch.randn(size["seq"], size["batch"], size["hidden"], requires_grad=True)  # a block's input needs dx
    dy = torch.randn_like(x)
    variants = {"plugin": plugin_block(whole_gpt, group, False), "DTensor": dtensor_block(whole, world)}
    try:
        variants["megatron-core"] = mcore_block(whole, group, rank, world)
    except ImportError:
        pass
    sp_block = plugin_block(whole_gpt, group, True)
    x_sp = x.detach().chunk(world, 0)[rank].contiguous().requires_grad_(True)
    dy_sp = dy.chunk(world, 0)[rank].contiguous()

    expected = whole(x)
    for name, block in variants.items():  # same weights, same function
        torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(sp_block(x_sp), expected.chunk(world, 0)[rank], rtol=1e-4, atol=1e-5)

    counts = {"plugin": count(variants["plugin"], x, dy), "plugin, sequence parallel": count(sp_block, x_sp, dy_sp),
              "DTensor": count_dtensor(variants["DTensor"], x, dy)}
    if "megatron-core" in variants:
        counts["megatron-core"] = count(variants["megatron-core"], x, dy)

    timings = {name: [] for name in variants}
    timings["plugin, sequence parallel"] = []
    runs = {**variants, "plugin, sequence parallel": sp_block}
    for rep in range(args.warmup + args.repeats):
        for name, block in runs.items():  # interleaved: noise falls on every variant alike
            xs, dys = (x_sp, dy_sp) if block is sp_block else (x, dy)
            t = timed(block, xs, dys, group)
            if rep >= args.warmup:
                timings[name].append(t)
    if rank == 0:
        results.put((counts, {n: statistics.median(v) for n, v in timings.items()},
                     {n: (min(v), max(v)) for n, v in timings.items()}, torch.get_num_threads()))
    dist.barrier()
    dist.destroy_process_group()


def fmt(c: dict, kind: str) -> str:
    return str(c.get(kind, 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    world = 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # silences megatron-core's GPU-only advice
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, args, results), nprocs=world, join=True)
    counts, medians, spread, threads = results.get()
    size = PRESETS[args.preset]

    print(f"\nCollectives per transformer block, tp={world} (forward | backward)")
    print(f"{'implementation':<28}{'all-reduce':>12}{'all-gather':>12}{'reduce-scatter':>16}{'grad all-reduce':>17}")
    print(f"{'Megatron (expected)':<28}{'2 | 2':>12}{'0 | 0':>12}{'0 | 0':>16}{'-':>17}")
    print(f"{'Megatron, sequence parallel':<28}{'0 | 0':>12}{'2 | 2':>12}{'2 | 2':>16}{'1 per step':>17}")
    for name, (f, b) in counts.items():
        print(f"{name:<28}{fmt(f, 'AR') + ' | ' + fmt(b, 'AR'):>12}{fmt(f, 'AG') + ' | ' + fmt(b, 'AG'):>12}"
              f"{fmt(f, 'RS') + ' | ' + fmt(b, 'RS'):>16}{fmt(b, 'grad-AR') + ' per block':>17}")
    if "megatron-core" not in medians:
        print(f"{'megatron-core':<28}not installed (pip install \"torch==<your torch>\" megatron-core)")

    print(f"\nStep time (forward + backward) of one GPT block, tp={world}, gloo, {threads} thread "
          f"per rank; hidden={size['hidden']} heads={size['heads']} seq={size['seq']} batch={size['batch']}; "
          f"median of {args.repeats} after {args.warmup} warm-up")
    print(f"{'implementation':<28}{'median ms':>11}{'min..max ms':>17}{'plugin / it':>13}")
    base = medians["plugin"]
    for name, t in medians.items():
        lo, hi = spread[name]
        ratio = "" if name.startswith("plugin,") else f"{base / t:.2f}"
        print(f"{name:<28}{t * 1e3:>11.2f}{f'{lo * 1e3:.1f}..{hi * 1e3:.1f}':>17}{ratio:>13}")

    f, b = counts["plugin"]
    fs, bs = counts["plugin, sequence parallel"]
    ok = (f, b) == ({"AR": 2}, {"AR": 2}) and fs == {"AG": 2, "RS": 2} and \
        {k: v for k, v in bs.items() if k != "grad-AR"} == {"AG": 2, "RS": 2}
    print("\nplugin's activation collectives " + ("equal Megatron's" if ok else "DIFFER from Megatron's"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
