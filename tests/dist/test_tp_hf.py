"""transformers GPT-2 and Llama (tiny configs, random weights, no downloads) sharded by the "auto" plan: the
same loss (the models' own ``labels=`` loss) and gathered gradients as unsharded, over 3 steps.

One launch of 4 gloo processes: at tp=2 the two pairs share the work (GPT-2 and untied Llama on ranks 0-1,
tied Llama on ranks 2-3), then GPT-2 (n_head 4) at tp=4 on all of them. Llama's 2 key/value heads cannot
be split over 4 ranks, so it stays at tp=2.

The optimizer is SGD with momentum: Adam divides each gradient by its own magnitude, so float noise in
a near-zero gradient element (1e-9 against 1e-9) becomes a visible weight difference after one step,
which says nothing about tensor parallelism.
"""
from __future__ import annotations

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
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **overrides)
        return tf.GPT2LMHeadModel(config)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            bos_token_id=0, eos_token_id=0, **overrides)
    return tf.LlamaForCausalLM(config)


def train_and_compare(group, kind, steps=3, **overrides):
    from plugin.tensor_parallel import apply_tensor_parallel, full_state_dict, padding_report
    from plugin.tensor_parallel.layers import ColumnParallelLinear
    from plugin.tensor_parallel.sharding import padded_size

    ref = build(kind, **overrides)
    tp = apply_tensor_parallel(build(kind, **overrides), "auto", group)
    split = [n for n, m in tp.named_modules() if isinstance(m, ColumnParallelLinear)]
    assert split, f"{kind}: the auto plan split nothing"
    p = dist.get_world_size(group)
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
        torch.testing.assert_close(out.loss, loss_ref, **TOL, msg=lambda m: f"{what} step {step} loss: {m}")
        grads = full_state_dict(tp, group, grads=True)
        for name, p in ref.named_parameters(remove_duplicate=False):
            got = grads[name].t() if name in transposed else grads[name]
            torch.testing.assert_close(got, p.grad, **TOL, msg=lambda m: f"{what} step {step} grad {name}: {m}")
        opt_ref.step(); opt_ref.zero_grad()
        opt_tp.step(); opt_tp.zero_grad()


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
    train_and_compare(whole.tensor_group, "gpt2")
    return "ok"


def test_transformers_gpt2_and_llama_auto_plans_match_unsharded():
    assert run(hf_worker, 4) == ["ok"] * 4
