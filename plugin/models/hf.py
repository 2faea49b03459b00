"""transformers GPT-2 and Llama built from a recipe's ``model`` block, with random weights (no download).

The engines call ``model(input_ids)`` and give the loss the output's ``.logits``; the tensor-parallel
``"auto"`` plan shards these models with whole (gathered) logits, so their loss is the ordinary cross
entropy (see :mod:`plugin.tensor_parallel.hooks`). transformers is an optional dependency (the ``test`` extra).
"""
from __future__ import annotations

from ..errors import PluginError


def build_hf_model(name: str, dims):
    """``name`` "gpt2" or "llama"; ``dims`` a recipe's :class:`plugin.recipe.spec.Model`."""
    try:
        import transformers as tf
    except ImportError as e:
        raise PluginError(f"--model {name} needs transformers -> pip install transformers (with torch pinned)") from e
    tf.logging.set_verbosity_error()
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=dims.vocab, n_embd=dims.hidden, n_layer=dims.layers, n_head=dims.heads,
                               n_inner=dims.ffn_hidden_resolved, n_positions=dims.seq_len,
                               resid_pdrop=dims.dropout, embd_pdrop=dims.dropout, attn_pdrop=dims.dropout,
                               bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(config)
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=dims.vocab, hidden_size=dims.hidden, num_hidden_layers=dims.layers,
                                num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads_resolved,
                                intermediate_size=dims.ffn_hidden_resolved, max_position_embeddings=dims.seq_len,
                                attention_dropout=dims.dropout, tie_word_embeddings=False,
                                bos_token_id=0, eos_token_id=0)
        return tf.LlamaForCausalLM(config)
    raise PluginError(f"unknown model {name!r} -> use gpt, gpt2 or llama")
