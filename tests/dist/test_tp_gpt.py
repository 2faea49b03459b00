"""The reference GPT sharded at tp=2 and tp=4, with and without sequence parallelism, against tp=1.

Same loss and the same (gathered) gradients at each of 3 optimizer steps (SGD with momentum, see below), for
untied and tied embeddings; replicated parameters' gradients
identical on every tensor rank; the pipeline layer list composes to the model. One launch of 4 gloo
processes: tp=4 is the whole world, tp=2 runs on two pairs.

The optimizer is SGD with momentum: Adam divides each gradient by its own magnitude, so float noise in
a near-zero gradient element (1e-9 against 1e-9) becomes a visible weight difference after one step,
which says nothing about tensor parallelism.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from .spawn import run

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-5, atol=1e-6)


def make(config, seed=0):
    from plugin.models import GPT

    torch.manual_seed(seed)
    return GPT(config)


def train_and_compare(group, config, sequence_parallel, steps=3):
    from plugin.models import gpt_loss
    from plugin.tensor_parallel import apply_tensor_parallel, full_state_dict
    from plugin.tensor_parallel.sharding import is_sharded

    ref = make(config)
    tp = make(config)
    layers = tp.to_layers()  # a pipeline engine may cut stages before sharding, with its grid's group
    apply_tensor_parallel(tp, "auto", group, sequence_parallel=sequence_parallel)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(7)
    what = f"tp={dist.get_world_size(group)} sp={sequence_parallel} tie={config.tie_embeddings}"
    for step in range(steps):
        tokens = torch.randint(0, config.vocab, (2, config.seq_len), generator=data)
        targets = torch.randint(0, config.vocab, (2, config.seq_len), generator=data)
        loss_ref = gpt_loss(ref(tokens), targets)
        loss_ref.backward()
        logits = tp(tokens)
        loss = gpt_loss(logits, targets, group)
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, **TOL, msg=lambda m, step=step: f"{what} step {step} loss: {m}")
        grads = full_state_dict(tp, group, grads=True)
        for name, p in ref.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(grads[name], p.grad, **TOL,
                                       msg=lambda m, step=step, name=name: f"{what} step {step} grad {name}: {m}")
        for name, p in tp.named_parameters():
            if is_sharded(p):
                continue
            copies = [torch.empty_like(p.grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, p.grad, group=group)
            assert all(torch.equal(copies[0], c) for c in copies[1:]), \
                f"{what}: replicated {name} has different gradients on different tensor ranks"
        opt_ref.step()
        opt_ref.zero_grad()
        opt_tp.step()
        opt_tp.zero_grad()
    # the layer list (what a pipeline cuts into stages) composes to the model
    x = tokens
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, tp(tokens), rtol=0, atol=0)


def check_dropout_regions(group, config):
    """With dropout on and no sequence parallelism, the residual stream stays identical on all tensor
    ranks (replicated region: torch's default stream, seeded alike), while the attention dropout inside
    the split heads draws different masks on different ranks (each rank's own stream).

    To see the masks, every rank gets the same heads (the qkv rows of every rank's shard copied from rank
    0's before sharding): without dropout the ranks' attention outputs are then equal (checked), so with
    dropout they can differ only by their masks."""
    from plugin.tensor_parallel import apply_tensor_parallel

    p = dist.get_world_size(group)
    whole = make(config)
    with torch.no_grad():
        for block in whole.blocks:
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                shards = t.view(p, t.shape[0] // p, *t.shape[1:])
                shards[1:] = shards[0].clone()
    model = apply_tensor_parallel(whole, "auto", group)
    seen = []
    hook = model.blocks[0].attn.proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    tokens = torch.randint(0, config.vocab, (2, config.seq_len), generator=torch.Generator().manual_seed(3))
    model.eval()(tokens)
    model.train()
    layers = model.to_layers()
    x = tokens
    for layer in layers[:-1]:
        x = layer(x)
    hook.remove()

    def gathered(t):
        copies = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(copies, t.contiguous(), group=group)
        return copies

    plain, dropped = gathered(seen[0]), gathered(seen[1])
    assert all(torch.equal(plain[0], c) for c in plain[1:]), "same heads without dropout must agree (the control)"
    assert all(not torch.equal(dropped[i], dropped[j]) for i in range(p) for j in range(i)), \
        "attention dropout masks inside the split heads must differ across tensor ranks"
    copies = gathered(x.detach())
    assert all(torch.equal(copies[0], c) for c in copies[1:]), "residual stream differs across tensor ranks"


def gpt_worker(rank, world_size):
    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology
    from plugin.models import GPTConfig

    base = dict(vocab=37, hidden=32, layers=2, heads=8, kv_heads=4, seq_len=8, ffn_hidden=64)
    whole = build_groups(Topology(tp_size=4))
    pairs = build_groups(Topology(dp_size=2, tp_size=2))
    for groups, sp, tie in itertools.product((whole, pairs), (False, True), (False, True)):
        train_and_compare(groups.tensor_group, GPTConfig(**base, tie_embeddings=tie), sp)
    check_dropout_regions(pairs.tensor_group, GPTConfig(**base, dropout=0.2))
    return "ok"


def test_gpt_tp2_tp4_with_and_without_sequence_parallel_matches_tp1():
    assert run(gpt_worker, 4) == ["ok"] * 4
