"""A transformers model under context parallelism, through transformers' own attention interface.

:func:`configure_hf` registers :func:`attention_forward` with ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``) as
``"plugin_context_parallel"`` and switches the model to it (``set_attn_implementation``), and gives each attention
module the rank's :class:`~.attention.ContextParallelContext` as ``.cp``. The model's own code then computes its
queries, keys and values of this rank's chunks, with rotary tables from the ``position_ids`` the batch carries (the
chunks' global positions, :mod:`.batch`), and calls the function in place of SDPA. With no mask function registered
for that name, transformers builds no mask (``masking_utils``: "custom attention without equivalent mask
creation"); the causal mask is the context attention's own, and a padding mask arrives whole as the keyword
``context_key_mask``. Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``) is refused.
"""
from __future__ import annotations

from .attention import ContextParallelContext, context_attention
from .batch import KEY_MASK
from .errors import ContextParallelError

NAME = "plugin_context_parallel"
# The families whose decoder layers mix the sequence only in an attention call of this contract, with no argument
# the context attention would drop (a soft-cap, attention sinks, a latent or linear attention of their own): the
# others would train on their local chunks without an error, so they are refused by name
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: ``[b, heads, s, d]`` in, ``([b, s, heads, d], None)`` out."""
    cp = getattr(module, "cp", None)
    if cp is None:
        raise ContextParallelError(f"{type(module).__name__} runs {NAME!r} attention without a context group -> "
                                   "build the model through plugin.initialize with a context axis")
    if kwargs.get("sliding_window") is not None:
        raise ContextParallelError(f"{type(module).__name__}: sliding-window attention under context parallelism is "
                                   "not supported -> set the config's sliding_window (or use_sliding_window) off, or "
                                   '"context": 1')
    y = context_attention(query, key, value, cp, causal=True, key_mask=kwargs.get(KEY_MASK), dropout_p=dropout,
                          scale=scaling)
    return y.transpose(1, 2).contiguous(), None


def attention_modules(model) -> list:
    """The model's attention modules: those its decoder layers call the attention interface from."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def configure_hf(model, cp: ContextParallelContext) -> None:
    from transformers import AttentionInterface

    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise ContextParallelError(f"{type(model).__name__} ({family}) under context parallelism is not supported: "
                                   f"context parallelism runs the reference GPT and the transformers families "
                                   f"{', '.join(FAMILIES)} -> \"context\": 1 for this model")
    modules = attention_modules(model)
    if not modules:
        raise ContextParallelError(f"{type(model).__name__} has no attention module with a layer_idx that calls "
                                   "transformers' attention interface -> context parallelism runs the reference GPT "
                                   "and transformers models of Llama's shape (Llama, Qwen2, Mistral, GPT-2)")
    window = getattr(model.config, "sliding_window", None) if getattr(model.config, "use_sliding_window", True) \
        else None
    if window:
        raise ContextParallelError(f"{type(model).__name__}: sliding_window {window} under context parallelism is not "
                                   "supported -> turn sliding-window attention off in the config, or \"context\": 1")
    AttentionInterface.register(NAME, attention_forward)
    model.set_attn_implementation(NAME)
    for m in modules:
        m.cp = cp
