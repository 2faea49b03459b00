"""Batches (plugin.engines.batches) and the token-weighted loss (plugin.tensor_parallel.hooks.TokenLoss).

The loss test is the formula every back end relies on, checked on one process: split a padded batch into
data 2 x grad_accum 2 pieces; ``1 / (data x grad_accum)`` times the sum of the pieces' gradients of the plugin's
loss (denominator ``N / (data x grad_accum)``) equals the whole batch's Hugging Face loss gradient, and the
mean of per-micro-batch means (what the engines did before) does not."""
from __future__ import annotations

import pytest
import torch

from plugin.engines.batches import HF, SHIFTED, micro_batches, shard_rows, split_batch, target_count
from plugin.engines.data_contract import fingerprint
from plugin.errors import PluginError
from plugin.tensor_parallel.hooks import TokenLoss


def hf_batch(rows=8, seq=6):
    ids = torch.arange(rows * seq).reshape(rows, seq) % 11
    mask = torch.ones(rows, seq, dtype=torch.long)
    for r in range(rows):
        mask[r, 2 + r % 4:] = 0  # uneven lengths: 2..5 tokens
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_dict_batches_split_like_tuples():
    batch = hf_batch()
    inputs, labels, convention = split_batch(batch)
    assert convention == HF and set(inputs) == {"input_ids", "attention_mask"} and labels is batch["labels"]
    share = shard_rows((inputs, labels), 1, 2)
    assert torch.equal(share[0]["input_ids"], batch["input_ids"][4:]) and torch.equal(share[1], labels[4:])
    micro = micro_batches(share, 2)
    assert len(micro) == 2 and torch.equal(micro[1][0]["attention_mask"], batch["attention_mask"][6:])
    x = torch.zeros(4, 3)
    assert split_batch((x, x))[2] == SHIFTED
    assert target_count(batch["labels"], HF) == sum(1 + r % 4 for r in range(8))  # the shift drops one per row
    assert target_count(batch["labels"], SHIFTED) == sum(2 + r % 4 for r in range(8))


def test_fingerprint_sees_every_dict_value():
    inputs, labels, _ = split_batch(hf_batch())
    base = fingerprint((inputs, labels), 8)
    other = dict(inputs, attention_mask=inputs["attention_mask"].flip(0))
    assert not torch.equal(base, fingerprint((other, labels), 8))
    assert torch.equal(base, fingerprint((dict(reversed(list(inputs.items()))), labels), 8))  # key order free


@pytest.mark.parametrize("batch, match", [
    ({"input_ids": torch.zeros(2, 3)}, "'labels'"),
    ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3), "num_items_in_batch": torch.tensor(3)},
     "num_items_in_batch"),
    ({"input_ids": torch.zeros(2, 3), "labels": [1, 2]}, "'labels' is list"),
    ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(3, 3)}, "different row counts"),
    ((torch.zeros(2), torch.zeros(2), torch.zeros(2)), "of 3 items"),
])
def test_bad_batches_are_refused(batch, match):
    with pytest.raises(PluginError, match=match):
        split_batch(batch)


def test_token_loss_over_pieces_is_the_whole_batch_mean():
    torch.manual_seed(0)
    batch = hf_batch()
    vocab, hidden = 11, 5
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)

    def logits(ids):
        return head(embed(ids))

    def grads_of(loss):
        embed.zero_grad()
        head.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in (*embed.parameters(), *head.parameters())]

    # Hugging Face's loss on the whole batch: shift, ignore -100, one mean over every target token
    whole = torch.nn.functional.cross_entropy(logits(batch["input_ids"])[:, :-1].reshape(-1, vocab),
                                              batch["labels"][:, 1:].reshape(-1))
    expected = grads_of(whole)
    dp, gas = 2, 2
    loss_fn = TokenLoss(None, split_logits=False)
    loss_fn.prepare(int(target_count(batch["labels"], HF)) / (dp * gas), HF)
    pieces = micro_batches((batch["input_ids"], batch["labels"]), dp * gas)
    total = sum(loss_fn(logits(x), y) for x, y in pieces) / (dp * gas)
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    for g, e in zip(grads_of(total), expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    loss_fn.prepare(None, HF)  # each micro-batch its own mean: the gradient-accumulation bug
    mean_of_means = sum(loss_fn(logits(x), y) for x, y in pieces) / (dp * gas)
    assert abs(float(mean_of_means.detach()) - float(whole.detach())) > 1e-3


def _one_process_engine(rows: int):
    """An Engine of one process (data 1; no process group: the data contract's all-reduce is skipped) with the
    default loss, whose train steps are driven through local_batch and rows_checked, as every back end drives them."""
    from types import SimpleNamespace

    from plugin.distributed.topology import Topology
    from plugin.engines.base import Engine

    class Probe(Engine):
        train_step = eval_step = save = load = None

    layout = SimpleNamespace(data=1, tensor=1, pipeline=1, context=1, grad_accum=1, micro_batch=rows, global_batch=rows)
    engine = Probe(None, layout, Topology(), SimpleNamespace(dp_rank=0), torch.nn.Identity(), torch.device("cpu"))
    engine.loss_fn = TokenLoss(None, split_logits=False)
    return engine


def _train_batch(engine, batch) -> None:
    engine.local_batch(batch, "train_step")
    engine.rows_checked()  # where the back end waits for the verdict, before its first backward


def test_engine_refuses_a_batch_without_targets():
    engine = _one_process_engine(2)
    labels = torch.full((2, 4), -100)
    labels[:, 0] = 3  # only first labels, which the shift drops
    with pytest.raises(PluginError, match="no target token"):
        _train_batch(engine, {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels})
    _train_batch(engine, (torch.zeros(2, 4, dtype=torch.long), labels))
    assert engine.loss_fn.denominator == 2


def test_pipeline_stages_refuse_a_batch_of_another_shape():
    from plugin.engines.base import Engine

    class Probe(Engine):
        train_step = eval_step = save = load = None

    engine = Probe(None, None, None, None, torch.nn.Identity(), torch.device("cpu"))
    ids = torch.zeros(4, 8, dtype=torch.long)
    assert engine.first_stage_input({"input_ids": ids}) is ids
    with pytest.raises(PluginError, match=r"the first had \[4, 8\], this one \[4, 7\] -> pad every batch"):
        engine.first_stage_input(ids[:, :7])
    with pytest.raises(PluginError, match="takes input_ids only"):
        engine.first_stage_input({"input_ids": ids, "attention_mask": ids})


def test_first_train_step_refuses_labels_of_the_other_convention():
    engine = _one_process_engine(2)
    x = torch.arange(12).reshape(2, 6)
    with pytest.raises(PluginError, match="would learn to copy its input"):
        _train_batch(engine, (x, x))
    with pytest.raises(PluginError, match="look already shifted"):
        _train_batch(engine, {"input_ids": x, "labels": torch.cat([x[:, 1:], x[:, :1]], 1)})
    _train_batch(engine, {"input_ids": x, "labels": x})  # the right conventions pass
    _train_batch(engine, (x[:, :-1], x[:, 1:]))
    engine.step_count = 1
    _train_batch(engine, (x, x))  # checked on the first step only
