"""Benchmark the plugin's tensor parallelism against Megatron's collective count, DTensor and megatron-core.

    python bench/tensor_parallel.py                 # tp=2, 2 gloo processes on the CPU
    python bench/tensor_parallel.py --repeats 100 --preset medium

Prints, for one transformer block of the reference GPT (plugin.models.gpt.Block) at tp=2:

1. Collectives per block, forward | backward, counted by wrapping the ``torch.distributed`` functions
   (DTensor issues functional collectives that bypass them: its row is counted with ``CommDebugMode``).
   Targets: the issue's (Megatron's f/g: 2 all-reduces each way; with sequence parallelism 2 all-gathers
   + 2 reduce-scatters each way) and what Megatron-LM itself does under sequence parallelism: it
   re-gathers each column layer's input in backward instead of keeping it (2 more all-gathers, less
   memory). The plugin keeps the gathered input (the issue's target). Under sequence parallelism it also
   sums the block's replicated gradients (norms, output biases: ``6 * hidden`` floats) in one all-reduce
   per block inside backward, where Megatron-LM sums them once per step after backward
   (``finalize_model_grads``): a deliberate deviation, so that engines reducing gradients from hooks
   during backward (DeepSpeed ZeRO-2/3) see whole gradients; its bytes are printed.
   Then the embedding layer (outside the block): plain, all-reduce; sequence parallel, one reduce-scatter.
   The script exits non-zero if the plugin's counts differ from these targets.
2. Step time (forward + backward) of the block at tp=2 on gloo: the plugin, torch's DTensor
   (ColwiseParallel/RowwiseParallel) and megatron-core's ColumnParallelLinear/RowParallelLinear
   (``use_cpu_initialization=True``, no sequence parallelism), all on the same weights, their outputs and
   input gradients checked equal first. Each round times every variant once, in an order rotated per round;
   the slowest rank's time counts. Ratios are the median over rounds of plugin / other within a round
   (the variants of a round share the machine's noise). Goals: <= 0.9 against DTensor, <= 1.0 against
   megatron-core.

megatron-core is a benchmark-only dependency (``pip install "torch==<your torch>" megatron-core``: pin torch,
or pip pulls another build). Not installed: its rows say so. Any other failure of it (megatron-core on a CPU
is not a setup it promises to support) is reported in its rows with the reason, and the run goes on.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import socket
import statistics
import sys
import threading
import time
import warnings
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
MCORE = "megatron-core"


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


def count(module, x, dy):
    """``({kind: n} forward, {kind: n} backward)`` for one forward and backward of ``module``."""
    from plugin.tensor_parallel import comm

    original = comm._AllReduceGradsInBackward.backward
    with Counting() as fwd:
        y = module(x)
    with Counting() as bwd:
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


# ---------------------------------------------------------------- megatron-core, guarded


def import_mcore():
    """``None`` when megatron-core imports, else why not: "not installed" only when megatron itself is
    missing; any other import failure (a missing dependency, an incompatible torch) with its reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", per module
            import megatron.core.tensor_parallel  # noqa: F401
    except ImportError as e:
        if (e.name or "").split(".")[0] == "megatron":
            return "not installed (pip install \"torch==<your torch>\" megatron-core)"
        return f"failed at import: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - importable but broken: say why, keep benchmarking the others
        return f"failed at import: {type(e).__name__}: {e}"
    return None


def guarded(phase: str, fn, agree):
    """``(fn(), None)``, or ``(None, reason)`` if ``fn`` raised here or on any other rank (``agree(ok)`` is
    the ranks' AND, a collective every rank reaches, so a symmetric failure never leaves one hanging)."""
    try:
        result, reason = fn(), None
    except Exception as e:  # noqa: BLE001 - megatron-core on CPU: report the failure in its column
        first = str(e).splitlines()[0][:160] if str(e) else ""
        result, reason = None, f"failed in {phase}: {type(e).__name__}: {first}"
    if not agree(reason is None):
        return None, reason or f"failed in {phase} on another rank"
    return result, None


def agree_over(group):
    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())
    return agree


# ---------------------------------------------------------------- the three implementations of one block


def plugin_gpt(whole_gpt, group, sequence_parallel):
    from plugin.tensor_parallel import apply_tensor_parallel

    return apply_tensor_parallel(copy.deepcopy(whole_gpt), "auto", group, sequence_parallel=sequence_parallel)


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


def same_function(block, x, dy, expected_y, expected_dx):
    """The block computes the whole block's output and input gradient (the same work, checked)."""
    xs = x.detach().clone().requires_grad_(True)
    y = block(xs)
    y.backward(dy)
    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xs.grad, expected_dx, rtol=1e-4, atol=1e-5)


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
    group, agree = dist.group.WORLD, agree_over(dist.group.WORLD)
    from plugin.models import GPT, GPTConfig

    size = PRESETS[args.preset]
    config = GPTConfig(vocab=128, hidden=size["hidden"], layers=1, heads=size["heads"], seq_len=size["seq"])
    torch.manual_seed(0)
    whole_gpt = GPT(config)
    whole = whole_gpt.blocks[0]
    x = torch.randn(size["seq"], size["batch"], size["hidden"], requires_grad=True)  # a block's input needs dx
    dy = torch.randn_like(x)
    plain, sp = plugin_gpt(whole_gpt, group, False), plugin_gpt(whole_gpt, group, True)
    variants = {"plugin": plain.blocks[0], "DTensor": dtensor_block(whole, world)}
    failures = {}
    reason = import_mcore()
    if reason is None:
        block, reason = guarded("build", lambda: mcore_block(whole, group, rank, world), agree)
        if block is not None:
            variants[MCORE] = block
    if reason is not None:
        failures[MCORE] = reason

    xs = x.detach().clone().requires_grad_(True)
    expected_y = whole(xs)
    expected_y.backward(dy)
    expected_dx = xs.grad
    for name in list(variants):
        check = lambda b=variants[name]: same_function(b, x, dy, expected_y.detach(), expected_dx)  # noqa: E731
        if name == MCORE:
            _, reason = guarded("the check against the whole block", check, agree)
            if reason is not None:
                failures[MCORE] = reason
                del variants[MCORE]
        else:
            check()
    sp_block = sp.blocks[0]
    x_sp = x.detach().chunk(world, 0)[rank].contiguous().requires_grad_(True)
    dy_sp = dy.chunk(world, 0)[rank].contiguous()
    torch.testing.assert_close(sp_block(x_sp), expected_y.detach().chunk(world, 0)[rank], rtol=1e-4, atol=1e-5)

    counts = {"plugin": count(variants["plugin"], x, dy), "plugin, sequence parallel": count(sp_block, x_sp, dy_sp),
              "DTensor": count_dtensor(variants["DTensor"], x, dy)}
    if MCORE in variants:
        got, reason = guarded("counting", lambda: count(variants[MCORE], x, dy), agree)
        if reason is None:
            counts[MCORE] = got
        else:
            failures[MCORE] = reason
            del variants[MCORE]
    tokens = torch.randint(0, config.vocab, (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))
    embedding = {"plugin": count(plain.to_layers()[0], tokens, dy),
                 "plugin, sequence parallel": count(sp.to_layers()[0], tokens, dy_sp)}

    runs = {**variants, "plugin, sequence parallel": sp_block}
    timings = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.warmup + args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotated: no variant always goes first
        times = {}
        for name in order:
            if name not in runs:
                continue
            xs, dys = (x_sp, dy_sp) if name == "plugin, sequence parallel" else (x, dy)
            if name == MCORE:
                t, reason = guarded("timing", functools.partial(timed, runs[MCORE], xs, dys, group), agree)
                if reason is not None:
                    failures[MCORE] = reason
                    del runs[MCORE], timings[MCORE]
                    continue
            else:
                t = timed(runs[name], xs, dys, group)
            times[name] = t
        if rep >= args.warmup:
            for name, t in times.items():
                timings[name].append(t)
    if rank == 0:
        results.put((counts, embedding, timings, failures, torch.get_num_threads()))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- printing


def pair(f: dict, b, kind: str) -> str:
    return f"{f.get(kind, 0)} | {b.get(kind, 0) if isinstance(b, dict) else b}"


def counts_table(counts, failures, hidden, world) -> None:
    print(f"\nCollectives per transformer block, tp={world} (forward | backward)")
    print(f"{'implementation':<48}{'all-reduce':>12}{'all-gather':>12}{'reduce-scatter':>16}{'grad all-reduce':>18}")
    targets = [("target: Megatron f/g (issue)", "2 | 2", "0 | 0", "0 | 0", "-"),
               ("target: sequence parallel (issue)", "0 | 0", "2 | 2", "2 | 2", "-"),
               ("Megatron-LM, sequence parallel [1]", "0 | 0", "2 | 4", "2 | 2", "1 per step")]
    for row in targets:
        print(f"{row[0]:<48}{row[1]:>12}{row[2]:>12}{row[3]:>16}{row[4]:>18}")
    for name, (f, b) in counts.items():
        grad = f"{b.get('grad-AR', 0)} per block" + (" [2]" if b.get("grad-AR") else "")
        print(f"{name:<48}{pair(f, b, 'AR'):>12}{pair(f, b, 'AG'):>12}{pair(f, b, 'RS'):>16}{grad:>18}")
    if MCORE not in counts:
        print(f"{MCORE:<48}{failures[MCORE]}")
    print("[1] Megatron-LM re-gathers each column layer's input in backward to compute its weight gradient;\n"
          "    the plugin keeps the gathered input from forward (the issue's target: 2 all-gathers backward).")
    print(f"[2] a deviation from Megatron-LM, kept on purpose: the block's replicated norm and bias gradients\n"
          f"    (6 x hidden = {6 * hidden} floats, {6 * hidden * 4 / 1024:.1f} KiB in fp32) are summed per block and "
          f"micro-batch inside\n    autograd, where Megatron-LM sums them once per step after backward; "
          f"ZeRO-2/3 reduce gradients from\n    hooks during backward, so they need the sum before that.")


def embedding_table(embedding, world) -> None:
    print(f"\nCollectives of the embedding layer (outside the block), tp={world} (forward | backward)")
    print(f"{'implementation':<48}{'all-reduce':>12}{'all-gather':>12}{'reduce-scatter':>16}")
    for label, ar, ag, rs in (("Megatron-LM, learned positions", "1 | 0", "0 | 0", "0 | 0"),
                              ("Megatron-LM, learned positions, sequence par.", "1 | 0", "0 | 1", "0 | 0"),
                              ("Megatron-LM, no positions, sequence par.", "0 | 0", "0 | 1", "1 | 0")):
        print(f"{label:<48}{ar:>12}{ag:>12}{rs:>16}")
    for name, (f, b) in embedding.items():
        print(f"{name:<48}{pair(f, b, 'AR'):>12}{pair(f, b, 'AG'):>12}{pair(f, b, 'RS'):>16}")
    print("    (the plugin adds the positions inside the reduce-scatter, so it needs no all-reduce with them)")


def paired_ratio(mine: list, theirs: list) -> float:
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def time_table(timings, failures, args, threads, world) -> None:
    size = PRESETS[args.preset]
    print(f"\nStep time (forward + backward) of one GPT block, tp={world}, gloo, {threads} thread per rank; "
          f"hidden={size['hidden']} heads={size['heads']} seq={size['seq']} batch={size['batch']}; "
          f"{args.repeats} rounds after {args.warmup} warm-up")
    print(f"{'implementation':<28}{'median ms':>11}{'min..max ms':>17}{'plugin / it':>13}{'goal':>11}"
          f"{'min / min':>11}")
    goals = {"DTensor": 0.9, MCORE: 1.0}
    base = timings["plugin"]
    for name, ts in timings.items():
        ratio, goal, floor = "", "", ""
        if name in goals:
            r = paired_ratio(base, ts)
            ratio, goal = f"{r:.2f}", f"<= {goals[name]}" + (" ok" if r <= goals[name] else " MISS")
            floor = f"{min(base) / min(ts):.2f}"
        print(f"{name:<28}{statistics.median(ts) * 1e3:>11.2f}{f'{min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f}':>17}"
              f"{ratio:>13}{goal:>11}{floor:>11}")
    if MCORE not in timings:
        print(f"{MCORE:<28}{failures[MCORE]}")
    print("    plugin / it: median over rounds of the plugin's time over the other's in the same round (the goal);\n"
          "    min / min: the fastest round of each, the least disturbed by other load on the machine")


def counts_match(counts, embedding) -> bool:
    f, b = counts["plugin"]
    fs, bs = counts["plugin, sequence parallel"]
    block = (f, b) == ({"AR": 2}, {"AR": 2}) and fs == {"AG": 2, "RS": 2} and bs == {"AG": 2, "RS": 2, "grad-AR": 1}
    ef, eb = embedding["plugin"]
    sf, sb = embedding["plugin, sequence parallel"]
    return block and (ef, eb) == ({"AR": 1}, {}) and (sf, sb) == ({"RS": 1}, {"AG": 1})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    world = 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # silences megatron-core's GPU-only advice
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, args, results), nprocs=world, join=True)
    counts, embedding, timings, failures, threads = results.get()
    counts_table(counts, failures, PRESETS[args.preset]["hidden"], world)
    embedding_table(embedding, world)
    time_table(timings, failures, args, threads, world)
    ok = counts_match(counts, embedding)
    print("\nplugin's collectives " + ("equal the targets" if ok else "DIFFER from the targets"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
