"""The context-parallel attention against torch's SDPA on one process: 4 gloo processes, one launch, both methods
at context 2 (two groups of 2) and 4 (the world), causal and padded batches (right padding, a left-padded row whose
first queries see no key), grouped-query and multi-head, outputs and gradients of q, k and v (fp32, each rank its
chunks of the whole-sequence result). The ring's dropout against a whole-sequence attention with the same masks
(fp64: the masks assembled from the ring's per-block seeds), and Ulysses's dropout drawn from the rank's stream
again by a recompute that replays it. How many point-to-point hops and all-to-alls a layer costs is counted too.
"""
import pytest
import torch

from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

B, S, D = 3, 16, 8  # 2 x 4 chunks of 2 tokens at context 4
HEADS = {"gqa": (8, 4), "mha": (4, 4)}


def _inputs(heads, kv_heads, padded, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    q, dy = (torch.randn(B, heads, S, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, S, D, generator=gen, dtype=dtype) for _ in range(2))
    key_mask = None
    if padded:
        key_mask = torch.ones(B, S, dtype=torch.bool)
        key_mask[0, 11:] = False  # right-padded
        key_mask[1, :5] = False  # left-padded: queries 0-4 see no key (zeros out, zero gradients)
    return q, k, v, dy, key_mask


def _sdpa_reference(q, k, v, dy, key_mask):
    """One process: SDPA over the whole sequence, causal (and the key mask), every q/k/v gradient."""
    import torch.nn.functional as F

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if key_mask is None:
        y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        mask = key_mask[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()
        seen = mask.any(-1, keepdim=True)
        first = torch.arange(S) == 0
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask | (~seen & first)) * seen
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad


def _mine(t, rank, size):
    from plugin.context_parallel import take_chunks

    return take_chunks(t, 2, rank, size)


def _context_result(q, k, v, dy, key_mask, cp):
    from plugin.context_parallel import context_attention

    q, k, v = (_mine(t, cp.rank, cp.size).requires_grad_() for t in (q, k, v))
    y = context_attention(q, k, v, cp, key_mask=key_mask)
    y.backward(_mine(dy, cp.rank, cp.size))
    return y.detach(), q.grad, k.grad, v.grad


def _counting(calls):
    import torch.distributed as dist

    real = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_to_all_single")}

    def wrap(name):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return counted

    for name in real:
        setattr(dist, name, wrap(name))
    return real


def _dropout_reference(q, k, v, dy, cp, p, seed):
    """The ring's masks, assembled over the whole sequence from its per-block seeds (every rank drew the same seed
    here), in a plain fp64 attention."""
    from plugin.context_parallel.chunks import chunk_ids
    from plugin.context_parallel.ring import _keep, _visible

    size, n = cp.size, S // (2 * cp.size)
    h, hk = q.shape[1], k.shape[1]
    keep = torch.zeros(B, hk, h // hk, S, S, dtype=torch.float64)
    for r in range(size):  # every rank's queries: their masks shape this rank's key gradients too
        for step in range(size):
            src = (r - step) % size
            for i, a in enumerate(chunk_ids(r, size)):
                for j, b in enumerate(chunk_ids(src, size)):
                    if _visible(a, b, True):
                        block = _keep((B, hk, h // hk, n, n), p, seed + (step * 2 + i) * 2 + j, q.device, torch.float64)
                        keep[..., a * n:(a + 1) * n, b * n:(b + 1) * n] = block
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    scores = torch.matmul(q.reshape(B, hk, h // hk, S, D), k.unsqueeze(2).transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    probs = torch.softmax(scores, -1) * keep / (1 - p)
    y = torch.matmul(probs, v.unsqueeze(2)).reshape(B, h, S, D)
    y.backward(dy)
    pick = lambda t: _mine(t, cp.rank, size)  # noqa: E731
    return [pick(t) for t in (y.detach(), q.grad, k.grad, v.grad)], keep


def _all(rank, world_size):
    import torch.distributed as dist

    from plugin.context_parallel import ContextParallelContext, context_rng
    from plugin.tensor_parallel.recompute import checkpoint

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    contexts = {2: (pairs[rank // 2], rank % 2), 4: (dist.group.WORLD, rank)}
    errors, calls = {}, {}
    for size, (group, cp_rank) in contexts.items():
        for method in ("ring", "all_to_all"):
            cp = ContextParallelContext(group, size, cp_rank, method)
            for heads, (h, hk) in HEADS.items():
                for padded in (False, True):
                    q, k, v, dy, key_mask = _inputs(h, hk, padded)
                    want = [_mine(t, cp_rank, size) for t in _sdpa_reference(q, k, v, dy, key_mask)]
                    real = _counting(counted := {})
                    got = _context_result(q, k, v, dy, key_mask, cp)
                    for name, fn in real.items():
                        setattr(dist, name, fn)
                    calls[(size, method, heads, padded)] = counted
                    errors[(size, method, heads, padded)] = [
                        float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)]
        # the ring's dropout: the same masks as a whole-sequence attention drawing them from the same seeds
        cp = ContextParallelContext(group, size, cp_rank, "ring")
        q, k, v, dy, _ = _inputs(8, 4, False, torch.float64)
        torch.manual_seed(123)
        seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        torch.manual_seed(123)
        from plugin.context_parallel import context_attention

        mine = [_mine(t, cp_rank, size).requires_grad_() for t in (q, k, v)]
        y = context_attention(*mine, cp, dropout_p=0.3)
        y.backward(_mine(dy, cp_rank, size))
        want, keep = _dropout_reference(q, k, v, dy, cp, 0.3, seed)
        got = [y.detach()] + [t.grad for t in mine]
        errors[(size, "ring", "dropout", False)] = [float((a - b).abs().max() / b.abs().max())
                                                    for a, b in zip(got, want, strict=True)]
        errors[(size, "ring", "dropped", False)] = float(
            1 - keep[..., torch.ones(S, S, dtype=torch.bool).tril()].mean())
        # Ulysses's dropout under a recompute replaying the rank's stream: the gradients of no recompute, bitwise
        cp = ContextParallelContext(group, size, cp_rank, "all_to_all", rng=context_rng(5, 0, 1, cp_rank))
        q, k, v, dy, _ = _inputs(8, 4, False)
        grads = []
        for recompute in (False, True):
            cp.rng.load_state_dict({})
            mine = [_mine(t, cp_rank, size).requires_grad_() for t in (q, k, v)]
            fn = lambda a, b, c, _cp=cp: context_attention(a, b, c, _cp, dropout_p=0.3)  # noqa: E731
            y = checkpoint(fn, *mine, rngs=[cp.rng]) if recompute else fn(*mine)
            y.backward(_mine(dy, cp_rank, size))
            grads.append([y.detach()] + [t.grad for t in mine])
        errors[(size, "all_to_all", "recompute", False)] = all(
            torch.equal(a, b) for a, b in zip(*grads, strict=True))
        without = _context_result(q, k, v, dy, None, ContextParallelContext(group, size, cp_rank, "all_to_all"))[0]
        errors[(size, "all_to_all", "dropout differs", False)] = not torch.equal(grads[0][0], without)
    return errors, calls


@pytest.fixture(scope="module")
def results():
    return run(_all, 4, timeout_s=300)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_outputs_and_gradients_equal_sdpa_on_one_process(results, size, method):
    for rank, (errors, _) in enumerate(results):
        for heads in HEADS:
            for padded in (False, True):
                worst = errors[(size, method, heads, padded)]
                where = f"context {size} {method} {heads} {'padded' if padded else 'causal'} rank {rank}"
                assert max(worst) < 1e-5, f"{where}: relative max error of y, dq, dk, dv = {worst}"


@pytest.mark.parametrize("size", [2, 4])
def test_ring_dropout_is_the_attention_of_its_masks(results, size):
    for rank, (errors, _) in enumerate(results):
        worst = errors[(size, "ring", "dropout", False)]
        assert max(worst) < 1e-12, f"context {size} rank {rank}: y, dq, dk, dv {worst}"
        assert 0.25 < errors[(size, "ring", "dropped", False)] < 0.35  # p = 0.3 really drew masks


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_dropout_replays_under_recompute(results, size):
    for rank, (errors, _) in enumerate(results):
        assert errors[(size, "all_to_all", "recompute", False)], f"context {size} rank {rank}"
        assert errors[(size, "all_to_all", "dropout differs", False)], f"context {size} rank {rank}: no mask drawn"


def test_communication_per_attention(results):
    """Ring: C - 1 hops of keys/values forward; backward C - 1 of keys/values and C of their gradients (each one
    batched send + receive). Ulysses: 4 all-to-alls forward (q, k, v, output), 4 backward."""
    for _, calls in results:
        for (size, method, _, _), counted in calls.items():
            if method == "ring":
                assert counted == {"batch_isend_irecv": (size - 1) * 2 + size}, (size, counted)
            else:
                assert counted == {"all_to_all_single": 8}, (size, counted)
