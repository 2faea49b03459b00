"""Activation bytes one transformer block stores for one micro-batch (pure).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Section 4 and Table 2
(activation bytes per layer), tensor by tensor. Symbols follow the paper: s sequence length, b micro-batch,
h hidden, a heads, t tensor size.
"""
from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")


def activation_terms_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               kv_heads: int | None = None, ffn_hidden: int | None = None,
                               mlp: str = "gelu", bytes_per_value: float = 2,
                               fused_attention: bool = False, dropout: bool = True,
                               fused_swiglu: bool = True, mask_bytes: float = 1) -> list[tuple[str, float]]:
    """The stored activations of one transformer block for one micro-batch, each tensor named, in bytes.

    Korthikanti et al. 2022, Section 4.1, tensor by tensor (16-bit values, 1-byte dropout masks). With
    kv_heads = heads, ffn_hidden = 4h and a GELU MLP the sums are the paper's Table 2; ``kv_heads``,
    ``ffn_hidden`` and ``mlp="swiglu"`` generalise the same count. SwiGLU, silu(x W_gate) * (x W_up), stores
    the gate and up outputs (4sbf) and the down projection's input (2sbf), 6sbf in all: a fused kernel
    (Megatron's ``bias_swiglu_impl``, which recomputes silu in backward). Eager PyTorch (``F.silu(gate) * up``,
    as in transformers' ``LlamaMLP``) also keeps silu(gate) for the multiplication's backward, 2sbf more
    (8sbf): ``fused_swiglu=False`` counts it (``bench/activations_vs_torch.py`` measures both).
    Tensor parallelism divides the tensors inside the attention and MLP regions by t; sequence
    parallelism divides the rest (norm inputs, the QKV and fc1 inputs, dropout masks) by t as well.
    Selective recompute drops the attention core (softmax, its dropout, the 5as^2b terms); full recompute
    keeps only the block's input, 2sbh (sequence-sharded, so 2sbh/t, under sequence parallelism).
    Dropout is on, as in the paper; ``dropout=False`` (probability 0) drops the three masks and the
    separate post-dropout attention probabilities. ``fused_attention`` (FlashAttention, or torch's
    ``scaled_dot_product_attention`` on its fused kernels) never stores the softmax: the 5as^2b terms go,
    as under selective recompute, at no recompute cost of its own. ``mask_bytes``: bytes of one dropout-mask
    value, 1 (CUDA's fused dropout, the paper); the CPU's dropout keeps its mask in the input's dtype
    (``input * noise``), so ``bench/activations_recompute.py`` passes ``bytes_per_value`` there.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    g = kv_heads if kv_heads is not None else heads
    f = ffn_hidden if ffn_hidden is not None else 4 * hidden
    w = bytes_per_value / 2  # the paper's 2-byte terms scale with the value size; masks stay 1 byte
    rep = t if sequence_parallel else 1  # the regions tensor parallelism leaves whole
    sbh = s * b * h
    if recompute == "full":
        return [("layer_input", 2 * w * sbh / rep)]
    terms = [
        ("attn_norm_input", 2 * w * sbh / rep),
        ("qkv_input", 2 * w * sbh / rep),
        ("q_and_k", 2 * w * sbh * (1 + g / a) / t),
    ]
    if recompute == "none" and not fused_attention:
        terms.append(("softmax_output", 2 * w * a * s * s * b / t))
        if dropout:
            terms += [
                ("softmax_dropout_mask", mask_bytes * a * s * s * b / t),
                ("attention_probs_after_dropout", 2 * w * a * s * s * b / t),
            ]
    terms += [
        ("v", 2 * w * sbh * (g / a) / t),
        ("attn_proj_input", 2 * w * sbh / t),
        ("attn_dropout_mask", mask_bytes * sbh / rep if dropout else 0.0),
        ("mlp_norm_input", 2 * w * sbh / rep),
        ("fc1_input", 2 * w * sbh / rep),
    ]
    if mlp == "swiglu":
        terms.append(("gate_and_up_outputs", 4 * w * s * b * f / t))
        if not fused_swiglu:
            terms.append(("silu_output", 2 * w * s * b * f / t))
    else:
        terms.append(("gelu_input", 2 * w * s * b * f / t))
    terms += [
        ("fc2_input", 2 * w * s * b * f / t),
        ("mlp_dropout_mask", mask_bytes * sbh / rep if dropout else 0.0),
    ]
    return [(k, v) for k, v in terms if v or dropout]


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               kv_heads: int | None = None, ffn_hidden: int | None = None,
                               mlp: str = "gelu", bytes_per_value: float = 2,
                               fused_attention: bool = False, dropout: bool = True,
                               fused_swiglu: bool = True, mask_bytes: float = 1) -> float:
    """Activation bytes of one transformer block for one micro-batch: Korthikanti et al. 2022, Table 2.

    ==========================================  =========================
    no parallelism                              sbh(34 + 5as/h)
    tensor parallel                             sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel                  sbh/t (34 + 5as/h)
    tensor parallel + selective recompute       sbh(10 + 24/t)
    tensor + sequence + selective recompute     sbh(34/t)
    full recompute                              2sbh  (2sbh/t under sequence parallelism)
    ==========================================  =========================

    The extra keywords (GQA ``kv_heads``, ``ffn_hidden``, ``mlp="swiglu"``, ``bytes_per_value=4`` for fp32)
    generalise the count; left at their defaults the result is the table's formula exactly.
    ``fused_attention=True`` drops the 5as/h terms (FlashAttention stores no softmax); ``dropout=False``
    the dropout masks (and 3as/h of the 5as/h); ``fused_swiglu=False`` counts eager SwiGLU (8sbf, not 6sbf);
    ``mask_bytes`` the bytes of a mask value (1; the CPU's dropout keeps the input's dtype).
    See :func:`activation_terms_per_layer` for the tensors.
    """
    return sum(v for _, v in activation_terms_per_layer(
        seq_len, micro_batch, hidden, heads, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
        kv_heads=kv_heads, ffn_hidden=ffn_hidden, mlp=mlp, bytes_per_value=bytes_per_value,
        fused_attention=fused_attention, dropout=dropout, fused_swiglu=fused_swiglu, mask_bytes=mask_bytes))
