"""Our per-layer activation estimate next to the bytes PyTorch really saves for backward.

    python bench/activations_vs_torch.py

Builds one pre-norm GPT block (LayerNorm, fused QKV, attention, projection, GELU MLP, dropout after
attention and MLP) in bf16 on the CPU, runs its forward under ``torch.autograd.graph.saved_tensors_hooks``
and adds up the storage of every tensor autograd keeps (each storage once, parameters left out). That
total is compared with :func:`plugin.planning.activations.activation_bytes_per_layer` for the same shapes:

- eager attention (softmax materialised) against Korthikanti et al. 2022 Table 2, sbh(34 + 5as/h);
- ``F.scaled_dot_product_attention`` against ``fused_attention=True`` (no softmax stored). On the CPU
  SDPA uses its flash kernel only without dropout; with dropout it falls back to the math kernel, which
  stores the attention matrix, so that row is expected to exceed the fused estimate.

Then a Llama-style SwiGLU MLP in eager PyTorch, ``down(silu(gate(x)) * up(x))``, against the estimate's
MLP terms: eager keeps silu(gate) as well (``fused_swiglu=False``, 2sbh + 8sbf), where a fused kernel
keeps 2sbh + 6sbf (the default, ``fused_swiglu=True``).

A benchmark, not plugin code: it imports torch.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from plugin.planning.activations import activation_bytes_per_layer, activation_terms_per_layer  # noqa: E402

SHAPES = [(256, 2, 512, 8), (512, 1, 256, 4), (128, 4, 1024, 16), (1024, 1, 512, 8)]


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, fused: bool):
        super().__init__()
        self.heads, self.p, self.fused = heads, dropout, fused
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):  # x: [s, b, h]
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, a, d).permute(2, 1, 3, 0, 4)
        if self.fused:
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        else:
            probs = F.dropout(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1), self.p)
            o = probs @ v
        x = x + F.dropout(self.proj(o.permute(2, 0, 1, 3).reshape(s, b, h)), self.p)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p)


def saved_bytes(block: nn.Module, x: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(storages.values())


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


MLP_TERMS = ("fc1_input", "gate_and_up_outputs", "silu_output", "fc2_input")


def mlp_estimate(s: int, b: int, h: int, a: int, f: int, *, fused: bool) -> float:
    """The estimate's bytes of a SwiGLU MLP's stored tensors (eager or fused)."""
    terms = activation_terms_per_layer(s, b, h, a, ffn_hidden=f, mlp="swiglu", dropout=False, fused_swiglu=fused)
    return sum(v for k, v in terms if k in MLP_TERMS)


def swiglu_rows() -> None:
    print(f"\n{'s':>5} {'b':>2} {'h':>5} {'f':>5}  {'torch MB':>9} {'eager est MB':>12} {'fused est MB':>12} "
          f"{'torch/eager':>11}")
    for s, b, h, a in SHAPES:
        f = 8 * h // 3 // 64 * 64  # Llama's ffn of about 8h/3
        x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
        got = saved_bytes(SwiGLU(h, f).to(torch.bfloat16), x)

        eager, fused = (mlp_estimate(s, b, h, a, f, fused=k) for k in (False, True))
        print(f"{s:>5} {b:>2} {h:>5} {f:>5}  {got / 1e6:>9.2f} {eager / 1e6:>12.2f} {fused / 1e6:>12.2f} "
              f"{got / eager:>11.3f}")


def main() -> None:
    torch.manual_seed(0)
    print(f"{'s':>5} {'b':>2} {'h':>5} {'a':>3}  {'attention':<8} {'dropout':>7}  {'torch MB':>9} "
          f"{'estimate MB':>11} {'torch/est':>9}")
    for s, b, h, a in SHAPES:
        x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
        for fused in (False, True):
            for p in (0.1, 0.0):
                block = Block(h, a, p, fused).to(torch.bfloat16)
                got = saved_bytes(block, x)
                est = activation_bytes_per_layer(s, b, h, a, fused_attention=fused, dropout=p > 0)
                kind = "sdpa" if fused else "eager"
                print(f"{s:>5} {b:>2} {h:>5} {a:>3}  {kind:<8} {p:>7}  {got / 1e6:>9.2f} {est / 1e6:>11.2f} "
                      f"{got / est:>9.3f}")
    print("\nWithout dropout both agree to a fraction of a percent. With dropout, the CPU's dropout keeps its"
          "\nmask in the input's dtype (2 bytes, input * noise) where CUDA's fused dropout and the paper keep"
          "\n1 byte, hence +as^2b + 2sbh for eager attention; SDPA with dropout falls back to the math kernel"
          "\non the CPU and stores the attention matrix, which a fused GPU kernel would not.")
    swiglu_rows()


if __name__ == "__main__":
    main()
