"""transformers GPT-2, Llama and MiniCPM5-MoE (tiny configs, random weights, no downloads) sharded by the "auto"
plan: the same loss (the models' own ``labels=`` loss), gathered gradients and global gradient norm (counted as the
engines' clipping counts it) as unsharded, over 3 steps.

One launch of 4 gloo processes: at tp=2 the two pairs share the work (GPT-2 and untied Llama on ranks 0-1,
tied Llama and MiniCPM5-MoE with one key/value head on ranks 2-3), then GPT-2 (n_head 4) and MiniCPM5-MoE (2
key/value heads) at tp=4 on all of them. Llama's 2 key/value heads cannot be split over 4 ranks, so it stays at
tp=2; MiniCPM5-MoE's plan splits them by whole heads (unit_colwise), so at tp=2 with one head and at tp=4 with two
each head is held by 2 ranks and its gradient summed over them.

The optimizer is SGD with momentum: Adam divides each gradient by its own magnitude, so float noise in
a near-zero gradient element (1e-9 against 1e-9) becomes a visible weight difference after one step,
which says nothing about tensor parallelism.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from .needs import need
from .spawn import run

need("transformers")
pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-5, atol=1e-6)


def build(kind, seed=0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "minicpm5_moe":
        from tests.hf_families import TINY, tiny_config

        config = tiny_config(kind, dataclasses.replace(TINY, kv_heads=overrides.get("kv_heads", 2)))
        return tf.AutoModelForCausalLM.from_config(config)
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **overrides)
        return tf.GPT2LMHeadModel(config)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            bos_token_id=0, eos_token_id=0, **overrides)
    return tf.LlamaForCausalLM(config)


def train_and_compare(group, kind, steps=3, **overrides):
    from plugin.distributed.clipping import global_grad_norm
    from plugin.tensor_parallel import apply_tensor_parallel, full_state_dict, padding_report
    from plugin.tensor_parallel.heads import HeadParallelLinear
    from plugin.tensor_parallel.layers import ColumnParallelLinear
    from plugin.tensor_parallel.sharding import padded_size

    ref = build(kind, **overrides)
    tp = apply_tensor_parallel(build(kind, **overrides), "auto", group)
    split = [n for n, m in tp.named_modules() if isinstance(m, ColumnParallelLinear)]
    assert split, f"{kind}: the auto plan split nothing"
    p = dist.get_world_size(group)
    if kind == "minicpm5_moe":  # each key/value head held by 2 ranks (1 head over 2, 2 heads over 4)
        by_head = [m for m in tp.modules() if isinstance(m, HeadParallelLinear)]
        assert len(by_head) == 4 and all(m.replicas == 2 for m in by_head), by_head
        assert tp.model.layers[0].self_attn.num_key_value_groups == ref.config.num_attention_heads // p
    if kind == "gpt2":
        padding = padded_size(ref.config.vocab_size, p) - ref.config.vocab_size  # 101 -> 1 at tp=2, 3 at tp=4
        assert padding_report(tp) == {"transformer.wte": padding, "lm_head": padding}, padding_report(tp)
        assert tp.lm_head.weight is tp.transformer.wte.weight, "the tied head must stay tied"
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(5)
    what = f"{kind} tp={p} {overrides}"
    # GPT-2's Conv1D stores [in, out]; the parallel layers store [out, in] like nn.Linear
    still_conv1d = {f"{n}.weight" for n, m in tp.named_modules() if type(m).__name__ == "Conv1D"}
    transposed = {f"{n}.weight" for n, m in ref.named_modules() if type(m).__name__ == "Conv1D"} - still_conv1d
    for step in range(steps):
        ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=data)
        loss_ref = ref(input_ids=ids, labels=ids).loss
        loss_ref.backward()
        out = tp(input_ids=ids, labels=ids)
        out.loss.backward()
        assert out.logits.shape[-1] == ref.config.vocab_size, "whole logits, padding dropped"
        torch.testing.assert_close(out.loss, loss_ref, **TOL, msg=lambda m, step=step: f"{what} step {step} loss: {m}")
        grads = full_state_dict(tp, group, grads=True)
        for name, p in ref.named_parameters(remove_duplicate=False):
            got = grads[name].t() if name in transposed else grads[name]
            torch.testing.assert_close(got, p.grad, **TOL,
                                       msg=lambda m, step=step, name=name: f"{what} step {step} grad {name}: {m}")
        # the global norm as the native engine's clipping counts it: tensor_model_parallel on every tensor rank (a
        # replicated key/value head on its first holder only), the rest on tensor rank 0
        sharded = {id(q) for q in tp.parameters() if getattr(q, "tensor_model_parallel", False)}
        norm = global_grad_norm(list(tp.parameters()), tensor_sharded=sharded, tp_rank=dist.get_rank(group),
                                model_group=group, model_size=dist.get_world_size(group))
        ref_norm = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters() if q.grad is not None])
        torch.testing.assert_close(norm, ref_norm, **TOL,
                                   msg=lambda m, step=step: f"{what} step {step} gradient norm: {m}")
        opt_ref.step()
        opt_ref.zero_grad()
        opt_tp.step()
        opt_tp.zero_grad()


def hf_worker(rank, world_size):
    import logging

    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology

    logging.getLogger("transformers").setLevel(logging.ERROR)
    pairs = build_groups(Topology(dp_size=2, tp_size=2))
    whole = build_groups(Topology(tp_size=4))
    if pairs.dp_rank == 0:
        train_and_compare(pairs.tensor_group, "gpt2")
        train_and_compare(pairs.tensor_group, "llama", tie_word_embeddings=False)
    else:
        train_and_compare(pairs.tensor_group, "llama", tie_word_embeddings=True)
        train_and_compare(pairs.tensor_group, "minicpm5_moe", kv_heads=1)
    train_and_compare(whole.tensor_group, "gpt2")
    train_and_compare(whole.tensor_group, "minicpm5_moe", kv_heads=2)
    return "ok"


def test_transformers_gpt2_and_llama_auto_plans_match_unsharded():
    assert run(hf_worker, 4) == ["ok"] * 4
