"""Activation bytes the reference GPT keeps for backward under each recompute mode, against the estimate.

    python bench/activations_recompute.py

For each shape and dropout (0: SDPA's flash kernel on the CPU, which stores no softmax; 0.1: its math kernel,
which stores the softmax and its dropout), L blocks of :class:`plugin.models.gpt.GPT` run forward in fp32 under
the recipe's ``activation_checkpointing`` modes, through the code the engines run:

- ``none``: the blocks as they are;
- ``selective``: ``GPT.configure_selective_recompute(True)`` (each attention core under the plugin's checkpoint);
- ``full`` every 1 and every 2: :func:`plugin.engines.recompute.run_layers`, spans of 1 and 2 blocks.

Measured: the bytes allocated and not freed over the forward (``torch.profiler`` with ``profile_memory``: every
CPU allocation and free in the region, summed), i.e. what the autograd graph and the checkpoints keep until
backward, plus the blocks' output and less their input (the same count: one ``[s, b, h]`` tensor). Estimated:
what ``estimate`` counts for L blocks (:func:`plugin.planning.activations.activation_bytes_per_layer`, and for
full recompute ``ceil(L / every)`` kept span inputs, as :func:`plugin.planning.memory.stage_memory` counts them),
with fp32 values, attention fused for dropout 0 and unfused for 0.1, and the CPU's dropout masks in the
input's dtype (``mask_bytes=4``: ``input * noise``; the GPU estimate's 1-byte masks in the last column).
The goal: measured / estimate within 10 % on every row. Not measured here: the peak while backward recomputes
a span (``recompute_working_set`` in the estimate).

A benchmark, not plugin code: it imports torch.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from plugin.engines.recompute import run_layers  # noqa: E402
from plugin.models.gpt import GPT, GPTConfig  # noqa: E402
from plugin.planning.activations import activation_bytes_per_layer  # noqa: E402

SHAPES = [(256, 2, 256, 4), (128, 4, 512, 8), (512, 1, 256, 8)]  # s, b, h, a
LAYERS = 4
MODES = [("none", 0), ("selective", 0), ("full", 1), ("full", 2)]  # (mode, every)
GOAL = 0.10


def retained_bytes(fn, x: torch.Tensor) -> int:
    """Bytes allocated and not freed while ``fn(x)`` runs (the output included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = fn(x)
    net = sum(e.self_cpu_memory_usage for e in prof.events())
    y.sum().backward()  # the graph is real: backward runs (and frees it)
    return net


def measure(s: int, b: int, h: int, a: int, dropout: float, mode: str, every: int) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=LAYERS, hidden=h, heads=a, vocab=64, seq_len=s, dropout=dropout)).train()
    model.configure_selective_recompute(mode == "selective")
    blocks = list(model.blocks)
    x = torch.randn(s, b, h, requires_grad=True)
    return retained_bytes(lambda t: run_layers(blocks, t, every if mode == "full" else 0), x)


def estimate(s: int, b: int, h: int, a: int, dropout: float, mode: str, every: int, mask_bytes: float) -> float:
    per_layer = activation_bytes_per_layer(s, b, h, a, recompute=mode, bytes_per_value=4, ffn_hidden=4 * h,
                                           fused_attention=dropout == 0, dropout=dropout > 0, mask_bytes=mask_bytes)
    return (math.ceil(LAYERS / every) if mode == "full" else LAYERS) * per_layer


def main() -> int:
    print(f"{LAYERS} blocks of the reference GPT, fp32, CPU (torch {torch.__version__}); MB = 10^6 bytes")
    header = (f"{'s':>4} {'b':>2} {'h':>4} {'a':>2} {'drop':>4}  {'mode':<11} {'measured MB':>11} "
              f"{'estimate MB':>11} {'ratio':>6}  {'GPU-mask est MB':>15}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for s, b, h, a in SHAPES:
        for dropout in (0.0, 0.1):
            for mode, every in MODES:
                got = measure(s, b, h, a, dropout, mode, every)
                est = estimate(s, b, h, a, dropout, mode, every, mask_bytes=4)
                gpu = estimate(s, b, h, a, dropout, mode, every, mask_bytes=1)
                worst = max(worst, abs(got / est - 1))
                label = f"full/{every}" if mode == "full" else mode
                print(f"{s:>4} {b:>2} {h:>4} {a:>2} {dropout:>4}  {label:<11} {got / 1e6:>11.2f} {est / 1e6:>11.2f} "
                      f"{got / est:>6.3f}  {gpu / 1e6:>15.2f}")
    ok = worst <= GOAL
    print(f"\nworst |measured / estimate - 1| = {worst:.3f}: goal <= {GOAL:.2f} {'met' if ok else 'NOT met'}")
    print("With dropout 0 SDPA runs its flash kernel on the CPU (no softmax stored), so selective keeps what none"
          "\nkeeps, as the estimate says for fused attention; with dropout 0.1 it runs the math kernel and selective"
          "\ndrops the softmax, its mask and the dropped probabilities.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
