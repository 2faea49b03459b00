"""The data contract without processes: the batch fingerprint, the verdict every rank reaches from the gathered
fingerprints (:func:`plugin.engines.data_contract.mismatch_message`), and the step loader's rows
(:mod:`plugin.data.loader`). The collectives and the engines are in tests/dist/test_data_contract*.py."""
import pytest
import torch

from plugin.data.loader import StepLoader
from plugin.distributed.topology import Topology
from plugin.engines.batches import shard_rows
from plugin.engines.data_contract import digest, fingerprint, mismatch_message
from plugin.errors import PluginError


def _tokens(rows=8, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 128, (rows, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


# ---------------------------------------------------------------------------- fingerprint
def test_digest_sees_order_shifts_and_single_changes_but_not_copies():
    x, y = _tokens()
    base = int(digest(x))
    assert int(digest(x.clone())) == base
    assert int(digest(x[torch.randperm(8, generator=torch.Generator().manual_seed(1))])) != base  # rows permuted
    assert int(digest(x.flip(0))) != base
    assert int(digest(y)) != base  # the window shifted by one token
    changed = x.clone()
    changed[3, 7] += 1
    assert int(digest(changed)) != base
    assert int(digest(x.reshape(4, 32))) != base  # same bits, other shape
    assert int(digest(x.to(torch.int32))) != int(digest(x))


def test_digest_is_exact_on_floats_nan_included_and_on_non_contiguous_views():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    x[1, 1] = float("nan")
    assert int(digest(x)) == int(digest(x.clone()))  # NaN equals itself: bits, not values, are compared
    nudged = x.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(10.0))  # one ulp
    assert int(digest(nudged)) != int(digest(x))
    t = x.t()  # not contiguous
    assert int(digest(t)) == int(digest(t.contiguous()))
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.bool, torch.uint8, torch.complex128):
        v = x.nan_to_num().to(dtype)
        assert int(digest(v)) == int(digest(v.clone())), dtype


def test_fingerprint_covers_inputs_and_labels_apart():
    x, y = _tokens()
    fp = fingerprint((x, y), 8).tolist()
    assert fp[0] == 8 and fingerprint((x.clone(), y.clone()), 8).tolist() == fp
    other_y = y.roll(1, dims=0)  # labels of other rows: what a pipeline's last stage meets
    got = fingerprint((x, other_y), 8).tolist()
    assert got[1] == fp[1] and got[2] != fp[2]
    assert fingerprint(None, 6).tolist() == [6, 0, 0]


# ---------------------------------------------------------------------------- the verdict
def _values(topology, batch_of_rank, rows=8):
    return [fingerprint(batch_of_rank(r), rows).tolist() for r in range(topology.world_size)]


def test_the_same_rows_on_every_peer_pass():
    topo = Topology(pp_size=2, dp_size=2, tp_size=2)
    shares = {d: _tokens(seed=d) for d in range(2)}  # data replicas differ, as they should
    values = _values(topo, lambda r: shares[topo.coord(r).dp])
    assert mismatch_message(values, topo, call="train_step", global_rows=16, local_rows=8) is None


def test_distributed_sampler_over_the_world_is_named_with_peers_and_fix():
    """DistributedSampler(dataset) under tp2 x dp2: each process its own rows, so the tensor pairs differ."""
    topo = Topology(dp_size=2, tp_size=2)
    values = _values(topo, lambda r: _tokens(seed=10 + r))
    msg = mismatch_message(values, topo, call="train_step", global_rows=16, local_rows=8)
    assert msg.startswith("train_step: the ranks of one model replica were given different rows")
    assert "data rank 0: rank 0 (tensor 0) != rank 1 (tensor 1) (inputs and labels differ)" in msg
    assert "data rank 1: rank 2 (tensor 0) != rank 3 (tensor 1) (inputs and labels differ)" in msg
    assert "give every rank the global batch (16 rows" in msg and "engine.dataloader(dataset)" in msg
    assert "DistributedSampler(dataset, num_replicas=engine.data_size, rank=engine.data_rank)" in msg
    assert "data_size 2 here" in msg and "all 4 processes" in msg


def test_a_pipeline_whose_last_stage_holds_other_labels_is_refused():
    topo = Topology(pp_size=2, dp_size=2)
    x, y = _tokens()
    values = _values(topo, lambda r: (x, y) if topo.coord(r).pp == 0 or topo.coord(r).dp == 1 else (x, y.flip(0)))
    msg = mismatch_message(values, topo, call="eval_step", global_rows=16, local_rows=8)
    assert msg.startswith("eval_step:")
    assert "data rank 0: rank 0 (stage 0) != rank 2 (stage 1) (labels differ)" in msg
    assert "data rank 1" not in msg  # replica 1 is fine; its ranks raise all the same (every rank gets msg)


def test_many_bad_replicas_are_counted_and_classes_grouped():
    topo = Topology(pp_size=2, dp_size=5, tp_size=2)
    values = _values(topo, lambda r: _tokens(seed=topo.coord(r).tp))  # stages agree, tensor ranks do not
    msg = mismatch_message(values, topo, call="train_step", global_rows=40, local_rows=8)
    first = topo.model_groups()[0]  # [0, 1, 10, 11]
    assert (f"data rank 0: rank {first[0]} (stage 0, tensor 0) = rank {first[2]} (stage 1, tensor 0) != "
            f"rank {first[1]} (stage 0, tensor 1) = rank {first[3]} (stage 1, tensor 1)") in msg
    assert "and 2 more data rank(s)" in msg


def test_a_wrong_row_count_on_one_rank_is_named_to_every_rank():
    topo = Topology(dp_size=2, tp_size=2)
    x, y = _tokens()
    values = [fingerprint((x, y), 8).tolist()] * 4
    values[3] = fingerprint(None, 5).tolist()
    msg = mismatch_message(values, topo, call="train_step", global_rows=16, local_rows=8)
    assert msg.startswith("train_step: rank 3 (data rank 1, tensor 1) got 5 rows; every rank takes the global "
                          "batch (16 rows) or its data rank's share (micro x grad_accum = 8 rows)")


# ---------------------------------------------------------------------------- the step loader
def _rows(n):
    return [(torch.tensor([i, i]), torch.tensor(i)) for i in range(n)]


def _ids(batch):
    inputs, labels = batch
    assert torch.equal(inputs[:, 0], labels)  # default_collate kept each row's inputs with its labels
    return labels.tolist()


@pytest.mark.parametrize("data_size", [1, 2, 4])
def test_the_union_over_data_ranks_is_one_global_batch_in_shard_rows_order(data_size):
    data = _rows(37)  # 37 // 8 = 4 steps per epoch, 5 rows dropped
    one = StepLoader(data, global_batch=8, data_rank=0, data_size=1, seed=5)
    loaders = [StepLoader(data, global_batch=8, data_rank=d, data_size=data_size, seed=5) for d in range(data_size)]
    assert len(one) == 4 and all(len(ld) == 4 for ld in loaders)
    for epoch in range(3):  # epochs continue: every iteration is the next epoch
        whole = [_ids(b) for b in one]
        per_rank = [[_ids(b) for b in ld] for ld in loaders]
        assert len(whole) == 4
        for step, rows in enumerate(whole):
            assert len(set(rows)) == 8
            for d in range(data_size):
                assert per_rank[d][step] == shard_rows(torch.tensor(rows), d, data_size).tolist()
        seen = sorted(r for rows in whole for r in rows)
        assert len(set(seen)) == 32 and set(seen) <= set(range(37))
        if epoch == 0:
            first_epoch = whole
    assert whole != first_epoch  # reshuffled


def test_unshuffled_order_and_the_docstring_s_dropped_tail():
    ld = StepLoader(_rows(10), global_batch=4, data_rank=1, data_size=2, shuffle=False)
    assert [_ids(b) for b in ld] == [[2, 3], [6, 7]]  # rows 8 and 9 never seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_with_the_uninterrupted_rows(num_workers):
    data = _rows(24)  # 3 steps per epoch of 8
    whole = StepLoader(data, global_batch=8, data_rank=1, data_size=2, seed=3, num_workers=num_workers)
    it = whole.stream()
    expected = [_ids(next(it)) for _ in range(5)]  # into the second epoch
    first = StepLoader(data, global_batch=8, data_rank=1, data_size=2, seed=3, num_workers=num_workers)
    it = iter(first)
    got = [_ids(next(it)) for _ in range(2)]  # the workers read ahead; two were yielded
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (0, 2)
    del it
    resumed = StepLoader(data, global_batch=8, data_rank=0, data_size=1, seed=3)  # another layout's loader
    resumed.load_state_dict(state)
    again = StepLoader(data, global_batch=8, data_rank=1, data_size=2, seed=3, num_workers=num_workers)
    again.load_state_dict(resumed.state_dict())
    it = again.stream()
    got += [_ids(next(it)) for _ in range(3)]
    assert got == expected


def test_a_loop_left_early_continues_where_it_stopped():
    ld = StepLoader(_rows(16), global_batch=4, data_rank=0, data_size=1, shuffle=False)
    for _ in ld:
        break
    assert [_ids(b) for b in ld] == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["step"] == 0


def test_loader_refusals():
    with pytest.raises(PluginError, match="fewer than one global batch"):
        StepLoader(_rows(3), global_batch=4, data_rank=0, data_size=1)
    with pytest.raises(PluginError, match="map-style dataset"):
        StepLoader(iter(_rows(8)), global_batch=4, data_rank=0, data_size=1)
    ld = StepLoader(_rows(8), global_batch=4, data_rank=0, data_size=2)
    state = ld.state_dict()
    with pytest.raises(PluginError, match=r"seed 1 \(here 0\)"):
        ld.load_state_dict({**state, "seed": 1})
    with pytest.raises(PluginError, match=r"rows 9 \(here 8\)"):
        ld.load_state_dict({**state, "rows": 9})


def test_collate_fn_output_is_yielded_as_it_returns_it():
    def as_dict(samples):
        return {"ids": [int(s[1]) for s in samples]}

    ld = StepLoader(_rows(8), global_batch=4, data_rank=1, data_size=2, shuffle=False, collate_fn=as_dict)
    assert list(ld) == [{"ids": [2, 3]}, {"ids": [6, 7]}]


def _reduced(topo, values, tokens=None):
    """The exchange's table as every rank holds it after the collective: each rank's fingerprint, share tokens,
    suspect (0) and deferred (0), rank order."""
    tokens = tokens or [7] * topo.world_size
    return torch.tensor([list(v) + [tokens[r], 0, 0] for r, v in enumerate(values)], dtype=torch.int64)


def _ok(topo, values, global_rows, local_rows):
    from plugin.engines.data_contract import verdict

    return bool(verdict(_reduced(topo, values), topo, global_rows=global_rows, local_rows=local_rows)[0])


def test_the_fast_verdict_agrees_with_the_message_on_every_kind_of_case():
    """The step decides with verdict (tensor ops on the gathered table) and only then builds the message: both
    must agree, on every layout and every kind of case."""
    topo = Topology(pp_size=2, dp_size=3, tp_size=2)
    x, y = _tokens()
    good = {d: (x.roll(d, 0), y.roll(d, 0)) for d in range(3)}
    whole = (x.repeat(3, 1), y.repeat(3, 1))
    cases = {
        "agree": (lambda r: good[topo.coord(r).dp], 8),
        "one tensor rank": (lambda r: (x.flip(0), y) if r == topo.rank(1, 2, 1) else good[topo.coord(r).dp], 8),
        "one stage's labels": (lambda r: (good[0][0], y.flip(0)) if topo.coord(r) == (1, 0, 0, 0) else
                               good[topo.coord(r).dp], 8),
        "per process": (lambda r: _tokens(seed=r), 8),
        "the same share everywhere": (lambda r: good[0], 8),
        "two replicas alike": (lambda r: good[min(topo.coord(r).dp, 1)], 8),
        "the global batch everywhere": (lambda r: whole, 24),
        "a global batch per replica": (lambda r: (whole[0].roll(topo.coord(r).dp, 0), whole[1]), 24),
    }
    for name, (batch_of, rows) in cases.items():
        values = _values(topo, batch_of, rows)
        message = mismatch_message(values, topo, call="train_step", global_rows=24, local_rows=8)
        assert _ok(topo, values, 24, 8) == (message is None), (name, message)
        assert (message is None) == (name in ("agree", "the global batch everywhere")), (name, message)
    values = _values(topo, cases["agree"][0])
    values[5] = fingerprint(None, 3).tolist()
    assert not _ok(topo, values, 24, 8)
    values = _values(topo, cases["agree"][0])
    values[5] = fingerprint(whole, 24).tolist()  # one rank the global batch, its peers their share: refused
    assert not _ok(topo, values, 24, 8)
    assert "(rows and inputs and labels differ)" in mismatch_message(values, topo, call="train_step", global_rows=24,
                                                                      local_rows=8)


def _kinds_of_case(topo):
    """(every rank's batch, the rows it passed) of each kind of case the verdict tells apart, at ``topo``."""
    x, y = _tokens()
    dp, ranks = topo.dp_size, range(topo.world_size)
    good = [(x.roll(topo.coord(r).dp, 0), y.roll(topo.coord(r).dp, 0)) for r in ranks]
    whole = (x.repeat(dp, 1), y.repeat(dp, 1))
    return [(good, [8] * len(good)), ([whole] * len(good), [8 * dp] * len(good)),
            ([_tokens(seed=r) for r in ranks], [8] * len(good)), ([good[0]] * len(good), [8] * len(good)),
            ([(x.flip(0), y) if r == 1 else good[r] for r in ranks], [8] * len(good)),
            ([whole if r else good[0] for r in ranks], [8 * dp if r else 8 for r in ranks]),
            ([None] * len(good), [3] * len(good))]


def test_the_small_world_verdict_and_the_tensor_verdict_agree():
    """RowsExchange.finish decides a small world's table in Python: the same outcome, tokens, suspect and deferred
    as :func:`verdict`'s tensor operations, on every kind of case and layout."""
    from plugin.engines.data_contract import RowsExchange, verdict

    for topo in (Topology(pp_size=2, dp_size=3, tp_size=2), Topology(dp_size=3, cp_size=2),
                 Topology(dp_size=1, tp_size=2)):
        dp = topo.dp_size
        for n, (batches, rows) in enumerate(_kinds_of_case(topo)):
            table = torch.tensor([fingerprint(b, k).tolist() + [10 + r, r % 2 if n == 2 else 0, int(r == 0)]
                                  for r, (b, k) in enumerate(zip(batches, rows, strict=True))], dtype=torch.int64)
            ok, tokens, suspect, deferred = verdict(table, topo, global_rows=8 * dp, local_rows=8).tolist()
            small = RowsExchange(table, None, topo, 8 * dp, 8).finish("train_step")
            assert (small.error is None, small.tokens, small.suspect, small.deferred) == \
                (bool(ok), tokens, suspect, bool(deferred)), (topo, n)


def test_the_global_token_count_is_the_sum_of_the_replicas_shares():
    from plugin.engines.data_contract import verdict

    topo = Topology(dp_size=3, tp_size=2)
    x, y = _tokens()
    values = _values(topo, lambda r: (x.roll(topo.coord(r).dp, 0), y))
    tokens = [10 * (topo.coord(r).dp + 1) for r in range(topo.world_size)]
    ok, n, suspect, deferred = verdict(_reduced(topo, values, tokens), topo, global_rows=24, local_rows=8).tolist()
    assert (ok, n, suspect, deferred) == (1, 60, 0, 0)


# ---------------------------------------------------------------------------- pure data parallelism (issue 21)
def test_the_tutorial_s_per_process_global_batches_are_refused_with_the_fix():
    """DataLoader(dataset, batch_size=global, sampler=DistributedSampler(dataset)) at data 2: each rank its own
    64 rows as "the global batch", of which it keeps 32."""
    topo = Topology(dp_size=2)
    values = _values(topo, lambda r: _tokens(rows=64, seed=r), rows=64)
    msg = mismatch_message(values, topo, call="train_step", global_rows=64, local_rows=32)
    assert msg.startswith("train_step: every rank passed 64 rows, the global batch, but not the same rows on every "
                          "data rank (data rank 0 != data rank 1)"), msg
    assert "64 of the 128 rows passed would train" in msg
    assert ("DistributedSampler(dataset, num_replicas=engine.data_size, rank=engine.data_rank) (data_size 2 here; "
            "without those arguments DistributedSampler shards over all 2 processes) with batch_size = micro x "
            "grad_accum = 32") in msg and "engine.dataloader(dataset)" in msg
    assert not _ok(topo, values, 64, 32)


def test_identical_shares_on_every_data_rank_are_refused():
    topo = Topology(dp_size=4)
    values = _values(topo, lambda r: _tokens(seed=r % 2))  # data ranks 0 = 2 and 1 = 3
    msg = mismatch_message(values, topo, call="train_step", global_rows=32, local_rows=8)
    assert msg.startswith("train_step: each data rank must train on its own share of the global batch, but data "
                          "ranks 0, 2 the same 8 rows; data ranks 1, 3 the same 8 rows"), msg
    assert not _ok(topo, values, 32, 8)


def test_a_short_last_batch_names_drop_last_and_the_step_loader():
    topo = Topology(dp_size=2)
    values = [fingerprint(_tokens(rows=20, seed=r), 20).tolist() for r in range(2)]
    msg = mismatch_message(values, topo, call="train_step", global_rows=64, local_rows=32)
    assert msg.startswith("train_step: every rank got 20 rows; every rank takes the global batch (64 rows) or its "
                          "data rank's share (micro x grad_accum = 32 rows); a DataLoader ends each epoch with a short "
                          "batch unless drop_last=True -> DataLoader(..., drop_last=True), or iterate "
                          "engine.dataloader(dataset)"), msg
    values[1] = fingerprint(_tokens(rows=32, seed=1), 32).tolist()
    assert mismatch_message(values, topo, call="train_step", global_rows=64, local_rows=32).startswith(
        "train_step: rank 0 (data rank 0) got 20 rows;")


def test_mixed_global_and_share_across_data_ranks_is_refused():
    topo = Topology(dp_size=2)
    values = [fingerprint(_tokens(rows=16), 16).tolist(), fingerprint(_tokens(rows=8, seed=1), 8).tolist()]
    msg = mismatch_message(values, topo, call="eval_step", global_rows=16, local_rows=8)
    assert msg.startswith("eval_step: data rank 0 passed the global batch (16 rows) and data rank 1 their share "
                          "(8 rows)"), msg
    assert not _ok(topo, values, 16, 8)
