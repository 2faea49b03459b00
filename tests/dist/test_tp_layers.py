"""Each tensor-parallel layer against its unsharded torch counterpart: outputs, input and weight gradients.

One launch of 4 gloo processes checks everything at tp=4 (the whole world) and at tp=2 (two pairs).
fp32, rtol 1e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .spawn import run

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-5, atol=1e-6)


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def seeded(seed=0):
    torch.manual_seed(seed)


def chunk(t, dim, group):
    import torch.distributed as dist
    return t.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def check_collectives(group):
    """Forward and backward math of every autograd collective, against explicit formulas."""
    import torch.distributed as dist

    from plugin.tensor_parallel import comm

    p, r = dist.get_world_size(group), dist.get_rank(group)
    seeded(1)
    per_rank = [torch.randn(4, 3, 2 * p) for _ in range(p)]  # x_q on rank q
    grads = [torch.randn(4, 3, 2 * p) for _ in range(p)]     # dy_q on rank q
    total_x, total_dy = sum(per_rank), sum(grads)

    def grad_of(fn, x, dy):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad

    y, dx = grad_of(lambda x: comm.copy_to_tensor_region(x, group), per_rank[r], grads[r])
    close(y, per_rank[r], "f forward")
    close(dx, total_dy, "f backward")
    # g: the input is an intermediate (x * 1) so the in-place path is the one exercised
    y, dx = grad_of(lambda x: comm.reduce_from_tensor_region(x * 1, group), per_rank[r], grads[r])
    close(y, total_x, "g forward")
    close(dx, grads[r], "g backward")
    y, dx = grad_of(lambda x: comm.scatter_to_tensor_region(x, group), per_rank[0], chunk(grads[0], -1, group))
    close(y, chunk(per_rank[0], -1, group), "scatter forward")
    close(dx, grads[0], "scatter backward")
    shard = chunk(per_rank[0], -1, group)
    y, dx = grad_of(lambda x: comm.gather_from_tensor_region(x, group), shard, grads[0])
    close(y, per_rank[0], "gather forward")
    close(dx, chunk(grads[0], -1, group), "gather backward")
    y, dx = grad_of(lambda x: comm.scatter_to_sequence_region(x, group), per_rank[0], chunk(grads[0], 0, group))
    close(y, chunk(per_rank[0], 0, group), "seq scatter forward")
    close(dx, grads[0], "seq scatter backward")
    y, dx = grad_of(lambda x: comm.gather_from_sequence_region(x, group), chunk(per_rank[0], 0, group), grads[r])
    close(y, per_rank[0], "seq gather forward")
    close(dx, chunk(total_dy, 0, group), "seq gather backward (RS)")
    y, dx = grad_of(lambda x: comm.gather_from_sequence_region(x, group, False), chunk(per_rank[0], 0, group),
                    grads[0])
    close(dx, chunk(grads[0], 0, group), "seq gather backward (split)")
    y, dx = grad_of(lambda x: comm.reduce_scatter_to_sequence_region(x * 1, group), per_rank[r],
                    chunk(grads[0], 0, group))
    close(y, chunk(total_x, 0, group), "reduce-scatter forward")
    close(dx, grads[0], "reduce-scatter backward")
    a, b = per_rank[r][0].clone().requires_grad_(True), per_rank[r][1, 0].clone().requires_grad_(True)
    ya, yb = comm.allreduce_grads_in_backward([a, b], group)
    (ya * grads[r][0]).sum().add((yb * grads[r][1, 0]).sum()).backward()
    close(a.grad, total_dy[0], "grad all-reduce a")
    close(b.grad, total_dy[1, 0], "grad all-reduce b")


class Collectives:
    """Records ``(name, numel)`` of every torch.distributed collective called while active (outermost only)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
             "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all_single")

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self.saved, self.depth = [], {}, 0
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                if self.depth == 0:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    self.calls.append((_name, tensors[0].numel() if tensors else 0))
                self.depth += 1
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.depth -= 1

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def check_linears(group):
    from plugin.tensor_parallel import ColumnParallelLinear, RowParallelLinear, full_tensor

    seeded(2)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(5, 3, 8)
    dy = torch.randn(5, 3, 8)
    # reference
    xr = x.clone().requires_grad_(True)
    fc2(F.gelu(fc1(xr))).backward(dy)
    # column -> row
    col, row = ColumnParallelLinear.from_linear(fc1, group), RowParallelLinear.from_linear(fc2, group)
    xs = x.clone().requires_grad_(True)
    out = row(F.gelu(col(xs)))
    out.backward(dy)
    close(out, fc2(F.gelu(fc1(x))), "column->row output")
    close(xs.grad, xr.grad, "column->row input grad")
    for layer, ref in ((col, fc1), (row, fc2)):
        close(full_tensor(layer.weight.grad, layer.weight, group), ref.weight.grad, f"{type(layer).__name__} dW")
        close(full_tensor(layer.bias.grad, layer.bias, group), ref.bias.grad, f"{type(layer).__name__} db")
    # under autocast the fused column backward sees bf16 gradients and fp32 saved tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row(F.gelu(col(xs)))
    y.float().sum().backward()
    assert col.weight.grad.dtype == xs.grad.dtype == torch.float32
    # column with gathered output; row with a whole (not yet split) input
    fc1.zero_grad()
    fc2.zero_grad()
    for layer, ref in ((ColumnParallelLinear.from_linear(fc1, group, gather_output=True), fc1),
                       (RowParallelLinear.from_linear(fc2, group, input_is_parallel=False), fc2)):
        ref.zero_grad()
        inp = torch.randn(5, 3, ref.in_features)
        g = torch.randn(5, 3, ref.out_features)
        xr, xs = inp.clone().requires_grad_(True), inp.clone().requires_grad_(True)
        ref(xr).backward(g)
        y = layer(xs)
        y.backward(g)
        close(y, ref(inp), f"{type(layer).__name__} whole output")
        close(xs.grad, xr.grad, f"{type(layer).__name__} whole input grad")
        close(full_tensor(layer.weight.grad, layer.weight, group), ref.weight.grad, "dW (whole in/out)")
        close(full_tensor(layer.bias.grad, layer.bias, group), ref.bias.grad, "db (whole in/out)")


def check_sequence_parallel_linears(group):
    from plugin.tensor_parallel import ColumnParallelLinear, RowParallelLinear, full_tensor

    seeded(3)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    x, dy = torch.randn(8, 2, 8), torch.randn(8, 2, 8)  # [seq, batch, hidden]
    xr = x.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(xr)))
    ref.backward(dy)
    col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=True)
    row = RowParallelLinear.from_linear(fc2, group, sequence_parallel=True)
    xs = chunk(x, 0, group).clone().requires_grad_(True)
    out = row(F.gelu(col(xs)))
    out.backward(chunk(dy, 0, group))
    close(out, chunk(ref.detach(), 0, group), "SP output (this rank's sequence slice)")
    close(xs.grad, chunk(xr.grad, 0, group), "SP input grad")
    close(full_tensor(col.weight.grad, col.weight, group), fc1.weight.grad, "SP column dW")
    close(full_tensor(row.weight.grad, row.weight, group), fc2.weight.grad, "SP row dW")
    close(full_tensor(col.bias.grad, col.bias, group), fc1.bias.grad, "SP column bias grad (split, whole sequence)")
    close(row.bias.grad, fc2.bias.grad, "SP row bias grad (replicated, summed over the sequence slices)")


def check_vocab(group):
    import torch.distributed as dist

    from plugin.tensor_parallel import (
        VocabParallelEmbedding,
        VocabParallelLinear,
        full_tensor,
        vocab_parallel_cross_entropy,
    )

    p = dist.get_world_size(group)
    seeded(4)
    vocab = 4 * p - 1  # never a multiple of p: padding is exercised at every size
    emb, head = nn.Embedding(vocab, 6, padding_idx=2), nn.Linear(6, vocab, bias=True)
    ids = torch.randint(0, vocab, (3, 7))
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :2] = -100
    # reference
    loss_ref = F.cross_entropy(head(emb(ids)).reshape(-1, vocab), targets.reshape(-1))
    loss_ref.backward()
    pe, ph = VocabParallelEmbedding.from_embedding(emb, group), VocabParallelLinear.from_linear(head, group)
    assert pe.padding == ph.padding == 1 and pe.padded_num_embeddings == 4 * p
    h = pe(ids)
    close(h, emb(ids), "vocab embedding output")
    logits = ph(h)
    assert logits.shape[-1] == 4, logits.shape
    loss = vocab_parallel_cross_entropy(logits, targets, group)
    loss.backward()
    close(loss, loss_ref, "vocab-parallel cross-entropy")
    # its documented cost: an all-reduce of the max and one of [sum exp | target logit], [tokens] floats each;
    # nothing in backward, and never a gather of the [tokens, vocab] logits
    alone = logits.detach().requires_grad_(True)
    with Collectives() as forward:
        again = vocab_parallel_cross_entropy(alone, targets, group)
    with Collectives() as backward:
        again.backward()
    tokens = targets.numel()
    assert forward.calls == [("all_reduce", tokens), ("all_reduce", 2 * tokens)], forward.calls
    assert backward.calls == [], backward.calls
    close(full_tensor(pe.weight.grad, pe.weight, group), emb.weight.grad, "embedding dW (padding dropped)")
    close(full_tensor(ph.weight.grad, ph.weight, group), head.weight.grad, "head dW")
    close(full_tensor(ph.bias.grad, ph.bias, group), head.bias.grad, "head db")
    # gathered logits drop the padding and equal nn.Linear
    gathered = VocabParallelLinear.from_linear(head, group, gather_output=True)(h.detach())
    close(gathered, head(emb(ids)), "gathered vocab logits")
    # raw split logits with padding rows that are not -inf: masked by vocab_size
    raw = torch.randn(3, 7, 4 * p)
    lr = raw[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(lr.reshape(-1, vocab), targets.reshape(-1), reduction="sum")
    ref.backward()
    ls = chunk(raw, -1, group).clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(ls, targets, group, vocab_size=vocab, reduction="sum")
    got.backward()
    close(got, ref, "cross-entropy with vocab_size mask")
    full_grad = torch.cat([lr.grad, torch.zeros(3, 7, 1)], dim=-1)
    close(ls.grad, chunk(full_grad, -1, group), "cross-entropy logits grad")


def check_sequence_parallel_embedding(group):
    """The reduce-scatter form of the vocabulary-split embedding, with and without positions, against
    nn.Embedding: this rank's [seq/p, batch, hidden] slice, the table's and the positions' gradients."""
    import torch.distributed as dist

    from plugin.tensor_parallel import VocabParallelEmbedding, full_tensor

    p = dist.get_world_size(group)
    seeded(8)
    vocab, seq = 4 * p - 1, 8
    emb, pos = nn.Embedding(vocab, 6, padding_idx=1), nn.Embedding(seq, 6)
    ids = torch.randint(0, vocab, (3, seq))
    dy = torch.randn(seq, 3, 6)  # [seq, batch, hidden], the same on every rank
    split = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=True)
    for with_positions in (False, True):
        emb.zero_grad()
        pos.zero_grad()
        split.zero_grad()
        positions = pos(torch.arange(seq))
        ref = emb(ids).transpose(0, 1) + (positions.unsqueeze(1) if with_positions else 0)
        ref.backward(dy)
        local_positions = pos(torch.arange(seq))  # a fresh graph for the split model's own backward
        y = split(ids, position_embeddings=local_positions if with_positions else None)
        what = f"SP embedding positions={with_positions}"
        close(y, chunk(ref.detach(), 0, group), f"{what} output (this rank's sequence slice)")
        assert y.shape == (seq // p, 3, 6), y.shape
        pos_grad_ref = pos.weight.grad.clone() if with_positions else None
        pos.zero_grad()
        y.backward(chunk(dy, 0, group))
        close(full_tensor(split.weight.grad, split.weight, group), emb.weight.grad, f"{what} dW (padding dropped)")
        if with_positions:
            close(pos.weight.grad, pos_grad_ref, f"{what} position dW (whole, on every rank)")
            copies = [torch.empty_like(pos.weight.grad) for _ in range(p)]
            dist.all_gather(copies, pos.weight.grad, group=group)
            assert all(torch.equal(copies[0], c) for c in copies[1:]), "replicated position gradient differs"


def check_rng(group):
    import torch.distributed as dist

    from plugin.tensor_parallel import TensorParallelRNG

    r = dist.get_rank(group)
    seeded(5)
    rng = TensorParallelRNG(torch.initial_seed(), r)
    before = torch.get_rng_state()
    with rng.fork():
        sharded = F.dropout(torch.ones(64), 0.5)
    assert torch.equal(torch.get_rng_state(), before), "fork must leave the default stream where it was"
    replicated = F.dropout(torch.ones(64), 0.5)
    with rng.fork():
        again = F.dropout(torch.ones(64), 0.5)
    assert not torch.equal(again, sharded), "the sharded stream advances between forks"
    masks = [torch.empty(64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(masks, sharded, group=group)
    assert all(not torch.equal(masks[0], m) for m in masks[1:]), "sharded-region dropout must differ across ranks"
    dist.all_gather(masks, replicated, group=group)
    assert all(torch.equal(masks[0], m) for m in masks[1:]), "replicated-region dropout must agree across ranks"


def check_sequential_plan(group):
    from plugin.tensor_parallel import apply_tensor_parallel, full_tensor

    seeded(6)
    whole = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    split = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    split.load_state_dict(whole.state_dict())
    apply_tensor_parallel(split, {"0": "column", "2": "row"}, group)
    x, dy = torch.randn(4, 8), torch.randn(4, 8)
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yr, ys = whole(xr), split(xs)
    yr.backward(dy)
    ys.backward(dy)
    close(ys, yr, "Sequential plan output")
    close(xs.grad, xr.grad, "Sequential plan input grad")
    for (n, pw), (_, ps) in zip(whole.named_parameters(), split.named_parameters(), strict=True):
        close(full_tensor(ps.grad, ps, group), pw.grad, f"Sequential plan grad {n}")


def layers_worker(rank, world_size):
    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology

    pairs = build_groups(Topology(dp_size=2, tp_size=2))
    whole = build_groups(Topology(tp_size=4))
    for groups in (whole, pairs):
        g = groups.tensor_group
        check_collectives(g)
        check_linears(g)
        check_sequence_parallel_linears(g)
        check_vocab(g)
        check_sequence_parallel_embedding(g)
        check_rng(g)
        check_sequential_plan(g)
    return "ok"


def test_layers_equal_unsharded_at_tp2_and_tp4():
    assert run(layers_worker, 4) == ["ok"] * 4
