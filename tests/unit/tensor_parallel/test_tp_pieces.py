"""Pieces of tensor parallelism that need no process: slicing and padding math, collectives of a group of
one, the cross-entropy's single-rank form, the GPT's config and layer list, and groups in a 1-process world."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.models import GPT, GPTConfig, GPTConfigError
from plugin.tensor_parallel import comm
from plugin.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from plugin.tensor_parallel.sharding import padded_size, shard, shard_range, unshard


@given(st.integers(1, 10_000), st.integers(1, 64))
def test_padded_size_is_the_next_multiple(n, p):
    padded = padded_size(n, p)
    assert padded % p == 0 and n <= padded < n + p


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 1), st.integers(1, 5))
def test_shard_then_unshard_is_identity(p, per, parts, dim, other):
    rows = p * per * parts
    full = torch.randn(rows, other) if dim == 0 else torch.randn(other, rows)
    pieces = [shard(full, dim, p, r, parts=parts) for r in range(p)]
    assert all(x.shape[dim] == rows // p for x in pieces)
    assert torch.equal(unshard(pieces, dim, parts=parts), full)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40))
def test_padded_shards_cover_the_vocabulary_once(p, vocab):
    full = torch.randn(vocab, 3)
    pieces = [shard(full, 0, p, r, pad=True) for r in range(p)]
    padded = padded_size(vocab, p)
    assert [shard_range(padded, p, r) for r in range(p)][-1][1] == padded
    assert torch.equal(unshard(pieces, 0, padding=padded - vocab), full)
    assert torch.count_nonzero(torch.cat(pieces)[vocab:]) == 0, "padding rows are zeros"


def test_collectives_of_no_group_return_the_input_itself():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (comm.copy_to_tensor_region, comm.reduce_from_tensor_region, comm.scatter_to_tensor_region,
               comm.gather_from_tensor_region, comm.scatter_to_sequence_region, comm.gather_from_sequence_region,
               comm.reduce_scatter_to_sequence_region):
        assert fn(x, None) is x, fn.__name__
    assert comm.allreduce_grads_in_backward([x], None) == (x,)


def test_cross_entropy_without_a_group_is_torchs():
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    targets[0, 0] = -100
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, None), expected)
    padded = torch.cat([logits, torch.randn(2, 5, 1)], dim=-1)
    torch.testing.assert_close(vocab_parallel_cross_entropy(padded, targets, None, vocab_size=11), expected)


def test_gpt_config_from_recipe_model_and_its_errors():
    from plugin.recipe.spec import Model

    config = GPTConfig.from_recipe_model(Model(layers=2, hidden=64, heads=8, vocab=100, seq_len=32, kv_heads=2),
                                         tie_embeddings=True)
    assert (config.kv_heads_resolved, config.ffn_hidden_resolved, config.q_per_kv) == (2, 256, 4)
    with pytest.raises(GPTConfigError, match="hidden 30 is not divisible by heads 4"):
        GPTConfig(vocab=10, hidden=30, layers=1, heads=4, seq_len=4)
    with pytest.raises(GPTConfigError, match="no field"):
        GPTConfig.from_recipe_model(Model(layers=1, hidden=8, heads=2, vocab=10, seq_len=4), colour="red")


def _gpt_by_hand(model, tokens):
    """The reference GPT's function written out from its parameters in plain tensor math: no module of the model
    runs, attention is an explicit causal softmax (not scaled_dot_product_attention), and the fused qkv rows are
    read in the documented order (per key/value group: its query heads, then its key head, then its value head)."""
    c, w = model.config, dict(model.named_parameters())
    b, s = tokens.shape
    d, q_per_kv, groups = c.head_dim, c.q_per_kv, c.kv_heads_resolved
    x = w["embed.weight"][tokens] + w["pos_embed.weight"][:s]  # [b, s, hidden]
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(c.layers):
        p = {k[len(f"blocks.{i}."):]: v for k, v in w.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(x, (c.hidden,), p["ln1.weight"], p["ln1.bias"], c.norm_eps)
        qkv = (h @ p["attn.qkv.weight"].T + p["attn.qkv.bias"]).view(b, s, groups, q_per_kv + 2, d)
        q, k, v = qkv[..., :q_per_kv, :], qkv[..., q_per_kv, :], qkv[..., q_per_kv + 1, :]
        scores = torch.einsum("bsgqd,btgd->bgqst", q, k) / d ** 0.5
        attn = scores.masked_fill(future, float("-inf")).softmax(-1)
        y = torch.einsum("bgqst,btgd->bsgqd", attn, v).reshape(b, s, c.heads * d)
        x = x + y @ p["attn.proj.weight"].T + p["attn.proj.bias"]
        h = F.layer_norm(x, (c.hidden,), p["ln2.weight"], p["ln2.bias"], c.norm_eps)
        x = x + F.gelu(h @ p["mlp.fc.weight"].T + p["mlp.fc.bias"]) @ p["mlp.proj.weight"].T + p["mlp.proj.bias"]
    x = F.layer_norm(x, (c.hidden,), w["norm.weight"], w["norm.bias"], c.norm_eps)
    return x @ w["head.weight"].T


def test_gpt_is_deterministic_and_its_layers_compose_to_it():
    config = GPTConfig(vocab=50, hidden=16, layers=2, heads=4, kv_heads=2, seq_len=8)
    torch.manual_seed(3)
    a = GPT(config)
    torch.manual_seed(3)
    b = GPT(config)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    tokens = torch.randint(0, 50, (3, 8))
    layers = a.to_layers()
    assert len(layers) == config.layers + 2
    x = tokens
    for layer in layers:
        assert isinstance(x, torch.Tensor)
        x = layer(x)
    assert x.shape == (3, 8, 50)
    with torch.no_grad():
        want = _gpt_by_hand(a, tokens)
    # forward is the same loop over to_layers(): both are checked against the independent computation
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a(tokens), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="more than the configured seq_len 8"):
        a(torch.randint(0, 50, (1, 9)))


@pytest.fixture
def one_process_world():
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_build_groups_needs_an_initialized_world():
    from plugin.distributed.groups import GroupError, build_groups
    from plugin.distributed.topology import Topology

    assert not dist.is_initialized()
    with pytest.raises(GroupError, match="init_process_group"):
        build_groups(Topology())


def test_build_groups_in_a_one_process_world(one_process_world):
    from plugin.distributed.groups import GroupError, build_groups
    from plugin.distributed.topology import Topology

    groups = build_groups(Topology())
    assert groups.tensor_group is groups.data_group is groups.model_group is dist.group.WORLD
    assert (groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_world_size(),
            groups.get_model_parallel_rank()) == (1, 1, 0)
    with pytest.raises(GroupError, match="needs 2 processes but 1 were launched"):
        build_groups(Topology(tp_size=2))


def test_sharded_stream_seed_is_megatrons_with_the_pipeline_offset():
    from plugin.tensor_parallel.random import TensorParallelRNG, sharded_stream_seed

    # Megatron-LM: _set_random_seed adds 100 * pp_rank, model_parallel_cuda_manual_seed adds 2718 + tp_rank
    assert sharded_stream_seed(1234, tp_rank=1, pp_rank=0) == 1234 + 2718 + 1
    assert sharded_stream_seed(1234, tp_rank=1, pp_rank=3) == 1234 + 300 + 2718 + 1
    assert TensorParallelRNG(1234, 1, 3).seed == 1234 + 300 + 2718 + 1
    with pytest.raises(ValueError, match="pp_rank"):
        sharded_stream_seed(0, 0, -1)


def test_two_pipeline_stages_draw_different_sharded_dropout_masks():
    from plugin.tensor_parallel.random import TensorParallelRNG

    def masks(pp_rank, tp_rank=0):
        rng = TensorParallelRNG(42, tp_rank, pp_rank)
        with rng.fork():
            return F.dropout(torch.ones(256), 0.5)

    assert not torch.equal(masks(0), masks(1)), "stage 0 and stage 1 must not share dropout masks"
    assert not torch.equal(masks(0, tp_rank=1), masks(1, tp_rank=1))
    assert torch.equal(masks(1), masks(1)), "a stage's stream repeats with the same seed"


def test_later_stages_reseed_the_default_stream_and_stage_zero_keeps_it():
    """Replicated-region dropout: stage p > 0 reseeds torch's default stream with seed + 100 p (Megatron)."""
    from plugin.tensor_parallel.random import offset_default_stream_by_stage

    def after(pp_rank):
        torch.manual_seed(7)
        offset_default_stream_by_stage(pp_rank)
        return torch.initial_seed(), F.dropout(torch.ones(256), 0.5)

    (seed0, mask0), (seed1, mask1), (seed1_again, mask1_again) = after(0), after(1), after(1)
    assert (seed0, seed1) == (7, 107)
    assert not torch.equal(mask0, mask1), "two stages must not draw the same replicated-region masks"
    assert seed1_again == seed1 and torch.equal(mask1, mask1_again), "and a rerun repeats them"
    with pytest.raises(ValueError, match="pp_rank"):
        offset_default_stream_by_stage(-1)


def test_apply_and_the_recipe_hook_pass_the_pipeline_rank_to_the_stream():
    from types import SimpleNamespace

    from plugin.recipe.spec import TensorParallel
    from plugin.tensor_parallel import apply_tensor_parallel
    from plugin.tensor_parallel.hooks import tensor_parallel_hooks

    config = GPTConfig(vocab=50, hidden=16, layers=2, heads=4, seq_len=8)
    model = apply_tensor_parallel(GPT(config), "auto", None, seed=5, pp_rank=2)
    assert model.tp.rng.seed == 5 + 200 + 2718 and model.blocks[1].attn.rng is model.tp.rng
    recipe = SimpleNamespace(tensor_parallel=TensorParallel())
    apply_tp, _ = tensor_parallel_hooks(GPT(config), recipe, None)
    torch.manual_seed(9)
    assert apply_tp(GPT(config), None, pp_rank=1).tp.rng.seed == 9 + 100 + 2718
    assert apply_tp(GPT(config), None).tp.rng.seed == 9 + 2718


def test_sequence_parallel_embedding_of_one_rank_is_the_transposed_sum_with_positions():
    from plugin.tensor_parallel import VocabParallelEmbedding

    torch.manual_seed(0)
    emb, pos = torch.nn.Embedding(11, 4), torch.nn.Embedding(6, 4)
    ids = torch.randint(0, 11, (3, 6))
    split = VocabParallelEmbedding.from_embedding(emb, None, sequence_parallel=True)
    positions = pos(torch.arange(6))
    torch.testing.assert_close(split(ids, position_embeddings=positions),
                               (emb(ids) + positions).transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(split(ids), emb(ids).transpose(0, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"position_embeddings must be \[seq, hidden\] = \[6, 4\]"):
        split(ids, position_embeddings=positions[:5])
    with pytest.raises(ValueError, match=r"takes token ids \[batch, seq\]"):
        split(ids[0])


def test_gpt_under_sequence_parallelism_keeps_its_position_embedding_whole():
    from plugin.tensor_parallel import TensorParallelError, resolve_plan

    model = GPT(GPTConfig(vocab=50, hidden=16, layers=1, heads=4, seq_len=8))
    plan = dict(model.tensor_parallel_plan(), pos_embed="vocab")
    with pytest.raises(TensorParallelError,
                       match="GPT pos_embed is 'vocab'; under sequence parallelism leave it whole"):
        resolve_plan(model, plan, 2, sequence_parallel=True)
    assert "pos_embed" in resolve_plan(model, plan, 2, sequence_parallel=False)


@pytest.mark.parametrize(("heads", "tp"), [(4, 2), (2, 2), (1, 2), (2, 4), (1, 4), (2, 8)])
def test_key_value_heads_fewer_than_ranks_are_replicated_counted_once_and_saved_once(heads, tp):
    """unit_colwise's layout (plugin.tensor_parallel.heads): rank r holds the heads its query heads read (head
    r // (tp / heads) when there are fewer heads than ranks); the norms count each slice on its first holder only
    (tensor_model_parallel), every holder writes the same checkpoint box, and the shards give the whole tensor."""
    from plugin.checkpoint.boxes import box, compose, layout_of, tp_segments, whole_held
    from plugin.tensor_parallel.heads import replicas_of
    from plugin.tensor_parallel.sharding import is_sharded, mark_sharded

    head_dim = 3
    full = torch.arange(heads * head_dim * 5.0).view(heads * head_dim, 5)
    replicas = replicas_of(heads, tp)
    out = torch.full_like(full, float("nan"))
    shards, counted = [], 0
    for r in range(tp):
        local = mark_sharded(shard(full, 0, tp // replicas, r // replicas), 0, replicas=replicas,
                             first=r % replicas == 0)
        first_head = r * heads // tp
        assert torch.equal(local, full[first_head * head_dim:first_head * head_dim + len(local)]), r
        assert is_sharded(local)
        counted += local.tensor_model_parallel
        for p in compose(whole_held(local), tp_segments(local.shape, full.shape, layout_of(local), r, tp)):
            place = box(out, p.offsets, p.view.shape)
            assert place.isnan().all() or torch.equal(place, p.view), r  # a replica writes what its first wrote
            place.copy_(p.view)
        shards.append(local)
    assert counted == tp // replicas
    assert torch.equal(out, full) and torch.equal(unshard(shards, 0, replicas=replicas), full)
    assert replicas_of(3, 2) == replicas_of(2, 3) == 0  # neither divides: refused by the plan
