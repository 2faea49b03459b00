"""The data contract on real engines, 4 gloo processes (issue 10, item 2).

* The tutorials' mistake, ``DataLoader(dataset, sampler=DistributedSampler(dataset))`` (num_replicas = the
  world size, so every process its own rows), under a tensor x data layout (cpu_tp2_dp2) and a pipeline x data
  layout (cpu_pp2_dp2): ``train_step`` (and ``eval_step``) raise a PluginError on every rank of the world within
  seconds, naming the peers and the fix; so does one rank alone giving too few rows; the engine then trains on
  correct rows (nothing was half-done, no rank hangs). On the native back end (also in the no-DeepSpeed suite) and on
  DeepSpeed (its mpu path and its PipelineModule).
* At pure data parallelism (cpu_dp4, issue 21): the tutorials' loop, ``DataLoader(dataset, batch_size=global,
  sampler=DistributedSampler(dataset))`` (each rank its own "global batch"), the same share on every data rank, and
  a short last batch (every rank 5 rows) are each refused on every rank, naming the data ranks and the fix; the
  share of each data rank gives the same loss as the global batch, and the global batch then trains from the
  untrained model (the refused steps changed nothing).
* ``engine.dataloader(dataset)`` on both layouts (native): 4 steps (3 per epoch, so the second epoch's reshuffle
  is in) give the losses of one process training on the same dataset's global batches, and on the pipeline a
  resume from step 2 (engine checkpoint plus the loader's state, read through 1 worker process) gives the
  uninterrupted steps 3 and 4.
* Refused after the backward (issue 32): once a batch was accepted, a rank given the global batch with its shapes
  takes the verdict after its backward. Between steps 2 and 3 of the loader (native: tensor x data, pipeline x data,
  pure data), and after a first step (DeepSpeed: tensor x data, pure data), two such steps are refused on every rank
  with the same message: each rank its own global batch of those shapes (every rank deferred), and rank 3 alone
  too few rows (it waits before its forward and runs the last accepted rows beside its peers); the two steps after
  them give one process's losses (the second's shows the first's update), so a refused step left nothing behind.

The reference is computed in each rank: the same GPT from the same seed, AdamW and clipping per the recipe,
on the whole global batch.
"""
import functools
import time

import pytest
import torch

from .spawn import run

pytestmark = pytest.mark.dist
# A refusal takes the step's one collective (under a second; bench/data_contract.py times the check), a rank waiting
# for a peer that already refused takes the group's timeout (minutes): the ceiling tells them apart on a loaded machine
CEILING_S = 60

ROWS, STEPS, SEED = 48, 4, 7  # 48 rows / global 16: 3 steps per epoch
LAYOUTS = ("cpu_tp2_dp2", "cpu_pp2_dp2")


def _recipe(name):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(name).to_dict()
    data["model"] = {**data["model"], "layers": 2}  # smaller: the rows, not the model, are under test
    return Recipe.from_dict(data)


def _dataset(recipe, rows=ROWS):
    from plugin.data.text import TextBatches

    x, y = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=3).global_batch(0, rows)
    return list(zip(x, y, strict=True))  # a map-style dataset of (inputs, labels) rows


def _engine(recipe, backend):
    import plugin
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend)


def _reference(recipe, dataset) -> list[float]:
    """One process on the whole global batches of the same loader (data rank 0 of 1)."""
    from plugin.data.loader import StepLoader

    loader = StepLoader(dataset, global_batch=recipe.layout().global_batch, data_rank=0, data_size=1, seed=SEED)
    return _steps(recipe, [batch for _, batch in zip(range(STEPS), loader.stream(), strict=False)])


def _refusals(engine, dataset, calls=("train_step",)) -> dict:
    """The tutorials' sharding, fed to each of ``calls``, and train_step with too few rows on rank 3 alone
    ("short"): {case: (error type, message, seconds, a PluginError?)}."""
    from torch.utils.data import DataLoader, DistributedSampler

    from plugin.errors import PluginError

    share = engine.layout.global_batch // engine.data_size  # the row count train_step accepts as a share
    batch = next(iter(DataLoader(dataset, batch_size=share, sampler=DistributedSampler(dataset))))
    short = [t[:share - 3] for t in batch] if engine.rank == 3 else batch  # rank 3 alone: too few rows
    cases = {call: functools.partial(getattr(engine, call), batch) for call in calls}
    cases["short"] = functools.partial(engine.train_step, short)
    out = {}
    for call, fn in cases.items():
        start = time.perf_counter()
        try:
            fn()
            out[call] = (None, "not refused", time.perf_counter() - start, False)
        except Exception as e:  # the type is asserted by the test
            out[call] = (type(e).__name__, str(e), time.perf_counter() - start, isinstance(e, PluginError))
    return out


def _refused_after_backward(engine, like) -> dict:
    """Two refusals taken after the backward, once ``like`` (a global batch) was accepted: every rank its own global
    batch of the same shapes, and rank 3 alone 5 rows: {case: (error type, message, seconds)}."""
    from plugin.data.text import TextBatches

    m, rows = engine.recipe.model, engine.layout.global_batch
    own = TextBatches(m.vocab, m.seq_len, seed=11 + engine.rank).global_batch(0, rows)
    assert [tuple(t.shape) for t in own] == [tuple(t.shape) for t in like]
    short = [t[:5] for t in like] if engine.rank == 3 else like
    return _train_steps(engine, {"own global batch": own, "rank 3 short": short})


def _train_steps(engine, batches: dict) -> dict:
    """``train_step`` of each batch: {case: (error type, message, seconds)} (None, "not refused" when it trained)."""
    out = {}
    for case, batch in batches.items():
        start = time.perf_counter()
        try:
            engine.train_step(batch)
            out[case] = (None, "not refused", time.perf_counter() - start)
        except Exception as e:  # the type is asserted by the test
            out[case] = (type(e).__name__, str(e), time.perf_counter() - start)
    return out


def _steps(recipe, batches) -> list[float]:
    """One process trains ``batches`` (global batches) from the seed-0 GPT: the losses."""
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    opt = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    losses = []
    for x, y in batches:
        loss = gpt_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _pure_data_parallel(engine, dataset) -> dict:
    """cpu_dp4's refusals ({case: (type, message, seconds)}), then the loss of the global batch and of the shares."""
    from torch.utils.data import DataLoader, DistributedSampler

    from plugin.data.text import TextBatches

    lay = engine.layout
    per_process = next(iter(DataLoader(dataset, batch_size=lay.global_batch, sampler=DistributedSampler(dataset))))
    same_share = [t[:lay.global_batch // engine.data_size] for t in dataset_batch(dataset, lay.global_batch)]
    short = dataset_batch(dataset, 5)  # every rank 5 rows: a short last batch
    out = _train_steps(engine, {"per process": per_process, "same share": same_share, "short": short})
    x, y = TextBatches(engine.recipe.model.vocab, engine.recipe.model.seq_len, seed=5).global_batch(0, lay.global_batch)
    share = lay.global_batch // engine.data_size
    out["global"] = engine.eval_step((x, y))
    out["shares"] = engine.eval_step((x[engine.data_rank * share:(engine.data_rank + 1) * share],
                                      y[engine.data_rank * share:(engine.data_rank + 1) * share]))
    out["then"] = engine.train_step((x, y))
    out["later"] = _refused_after_backward(engine, (x, y))
    data = TextBatches(engine.recipe.model.vocab, engine.recipe.model.seq_len, seed=5)
    more = [data.global_batch(step, lay.global_batch) for step in (1, 2)]
    out["more"] = [engine.train_step(b) for b in more]  # the last loss shows the update of the step after the refusals
    out["reference"] = _steps(engine.recipe, [(x, y), *more])
    return out


def _global_of(engine, share):
    """The global batch whose data-rank shares the loader gave: every data rank's share, in data-rank order."""
    import torch.distributed as dist

    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (engine.data_rank, share))
    by_rank = dict(shares)
    return [torch.cat([by_rank[d][k] for d in range(engine.data_size)]) for k in range(2)]


def dataset_batch(dataset, rows):
    """The first ``rows`` rows of the dataset, collated: the same on every rank."""
    return [torch.stack([dataset[i][k] for i in range(rows)]) for k in range(2)]


def _native(rank, world_size, directory):
    out, references = {}, {}
    recipe = _recipe("cpu_dp4")
    out["cpu_dp4"] = _pure_data_parallel(_engine(recipe, "native"), _dataset(recipe, 64))
    for name in LAYOUTS:
        recipe = _recipe(name)
        dataset = _dataset(recipe)
        engine = _engine(recipe, "native")
        refused = _refusals(engine, dataset, ("train_step", "eval_step"))
        loader = engine.dataloader(dataset, seed=SEED, num_workers=1 if name == "cpu_pp2_dp2" else 0)
        losses, later = [], None
        for step, batch in zip(range(STEPS), loader.stream(), strict=False):
            if step >= 1:  # the same rows as the global batch: its shapes accepted, the next steps defer their verdict
                batch = _global_of(engine, batch)
            losses.append(engine.train_step(batch))
            if step == 1 and name == "cpu_pp2_dp2":
                engine.save(directory, client_state={"data": loader.state_dict()})
            if step == 1:  # steps 3 and 4 after them: the loss of step 4 shows step 3's update
                later = _refused_after_backward(engine, batch)
        resumed = None
        if name == "cpu_pp2_dp2":
            engine = _engine(recipe, "native")
            loader = engine.dataloader(dataset, seed=SEED, num_workers=1)
            loader.load_state_dict(engine.load(directory)["data"])
            resumed = [engine.train_step(b) for _, b in zip(range(STEPS - 2), loader.stream(), strict=False)]
        key = repr((recipe.model, recipe.optimizer, recipe.gradient_clipping, recipe.layout().global_batch))
        if key not in references:  # both layouts train the same model on the same global batches
            references[key] = _reference(recipe, dataset)
        out[name] = {"refused": refused, "losses": losses, "resumed": resumed, "reference": references[key],
                     "data_rank": engine.data_rank, "data_size": engine.data_size, "later": later}
    return out


def _deepspeed(rank, world_size):
    import torch.distributed as dist

    from plugin.data.text import TextBatches
    from plugin.engines.shm import release_shm_buffer

    out = {}
    recipe = _recipe("cpu_dp4")
    out["cpu_dp4"] = _pure_data_parallel(_engine(recipe, "deepspeed"), _dataset(recipe, 64))
    for name in LAYOUTS:
        recipe = _recipe(name)
        dataset = _dataset(recipe)
        engine = _engine(recipe, "deepspeed")
        refused = _refusals(engine, dataset)
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        whole, *more = (data.global_batch(step, engine.layout.global_batch) for step in (0, 1, 2))
        then = engine.train_step(whole)  # the global batch is not refused
        # refused after the backward on cpu_tp2_dp2 (DeepSpeed's pipeline: before)
        later = _refused_after_backward(engine, whole) if name == "cpu_tp2_dp2" else None
        out[name] = {"refused": refused, "then": then, "later": later, "more": [engine.train_step(b) for b in more],
                     "reference": _steps(recipe, [whole, *more])}
    dist.barrier()
    release_shm_buffer(rank)
    return out


# The peers each layout's message must name: rank 1's tensor peer (tp2 x dp2: ranks 2k, 2k+1); rank 0's
# stage-1 peer (pp2 x dp2: ranks d and d + 2).
PEERS = {"cpu_tp2_dp2": ["data rank 0: rank 0 (tensor 0) != rank 1 (tensor 1) (inputs and labels differ)",
                         "data rank 1: rank 2 (tensor 0) != rank 3 (tensor 1) (inputs and labels differ)"],
         "cpu_pp2_dp2": ["data rank 0: rank 0 (stage 0) != rank 2 (stage 1) (inputs and labels differ)",
                         "data rank 1: rank 1 (stage 0) != rank 3 (stage 1) (inputs and labels differ)"]}


def _check_refused(results, name, call):
    messages = set()
    for rank, out in enumerate(results):
        kind, message, seconds, plugin_error = out[name]["refused"][call]
        assert kind == "BatchMismatchError" and plugin_error, f"{name} rank {rank}: {call} {kind}: {message}"
        assert seconds < CEILING_S, f"{name} rank {rank}: refused after {seconds:.1f} s"
        messages.add(message)
    assert len(messages) == 1, f"{name}: every rank should say the same: {messages}"
    message = messages.pop()
    assert message.startswith(f"{call}: the ranks of one model replica were given different rows"), message
    for line in PEERS[name]:
        assert line in message, message
    assert "DistributedSampler(dataset, num_replicas=engine.data_size, rank=engine.data_rank)" in message
    assert "engine.dataloader(dataset)" in message and "give every rank the global batch (16 rows" in message


def _check_short(results, name):
    """Rank 3 alone gives 5 rows: every rank refuses, naming it (no rank enters the step to wait for it)."""
    for rank, out in enumerate(results):
        kind, message, seconds, _ = out[name]["refused"]["short"]
        assert kind == "BatchMismatchError", f"{name} rank {rank}: {kind}: {message}"
        where = "tensor 1" if name == "cpu_tp2_dp2" else "stage 1"
        assert message.startswith(f"train_step: rank 3 (data rank 1, {where}) got 5 rows; every rank takes the "
                                  "global batch (16 rows) or its data rank's share"), message
        assert seconds < CEILING_S, f"{name} rank {rank}: refused after {seconds:.1f} s"


LATER = {"own global batch": ("train_step: every rank passed 16 rows, the global batch, but not the same rows",
                                "train_step: the ranks of one model replica were given different rows"),
         "rank 3 short": ("train_step: rank 3 (data rank ",)}


def _check_later(results, name):
    """The two refusals after the backward: every rank, one message, within seconds."""
    for case, starts in LATER.items():
        messages = set()
        for rank, out in enumerate(results):
            kind, message, seconds = out[name]["later"][case]
            assert kind == "BatchMismatchError", f"{name} rank {rank}: {case}: {kind}: {message}"
            assert seconds < 10, f"{name} rank {rank}: {case} refused after {seconds:.1f} s"
            messages.add(message)
        assert len(messages) == 1, f"{name}: {case}: every rank should say the same: {messages}"
        message = messages.pop()
        assert message.startswith(starts), f"{name}: {case}: {message}"
        if case == "rank 3 short":
            assert " got 5 rows; every rank takes the global batch (16 rows)" in message, message


def _check_pure_data_parallel(results):
    """Every rank refuses each case with the same message, within seconds, and then trains on the global batch."""
    starts = {"per process": "train_step: every rank passed 16 rows, the global batch, but not the same rows on every "
                             "data rank (data rank 0 != data rank 1 != data rank 2 != data rank 3)",
              "same share": "train_step: each data rank must train on its own share of the global batch, but data "
                            "ranks 0, 1, 2, 3 the same 4 rows",
              "short": "train_step: every rank got 5 rows; every rank takes the global batch (16 rows) or its data "
                       "rank's share (micro x grad_accum = 4 rows); a DataLoader ends each epoch with a short batch "
                       "unless drop_last=True -> DataLoader(..., drop_last=True), or iterate engine.dataloader"}
    for case, start in starts.items():
        messages = set()
        for rank, out in enumerate(results):
            kind, message, seconds = out["cpu_dp4"][case]
            assert kind == "BatchMismatchError", f"rank {rank}: {case}: {kind}: {message}"
            assert seconds < CEILING_S, f"rank {rank}: {case} refused after {seconds:.1f} s"
            messages.add(message)
        assert len(messages) == 1, messages
        assert messages.pop().startswith(start), case
    losses = {(out["cpu_dp4"]["global"], out["cpu_dp4"]["shares"], out["cpu_dp4"]["then"]) for out in results}
    assert len(losses) == 1, losses  # the same floats on every rank
    (whole, shares, then), = losses
    # the first step's loss is the untrained model's (dropout 0): the refused steps, the first of which ran its
    # forward behind the check's all-reduce, trained nothing
    assert whole == pytest.approx(shares, rel=1e-6) and then == pytest.approx(whole, rel=1e-6)
    _check_later(results, "cpu_dp4")
    for rank, out in enumerate(results):  # the steps refused after their backward left nothing behind
        r = out["cpu_dp4"]
        assert [r["then"], *r["more"]] == pytest.approx(r["reference"], rel=1e-4), f"rank {rank}"


@pytest.mark.native
def test_native_refuses_mismatched_peers_everywhere_and_its_loader_gives_one_process_losses(tmp_path):
    results = run(_native, 4, str(tmp_path / "ckpt"), timeout_s=240)
    _check_pure_data_parallel(results)
    for name in LAYOUTS:
        for call in ("train_step", "eval_step"):
            _check_refused(results, name, call)
        _check_short(results, name)
        _check_later(results, name)
        assert [out[name]["data_size"] for out in results] == [2] * 4
        for rank, out in enumerate(results):
            r = out[name]
            assert r["losses"] == pytest.approx(r["reference"], rel=1e-4), f"{name} rank {rank}"
            assert r["reference"][-1] < r["reference"][0], "the reference must learn, or parity proves little"
    assert [out["cpu_tp2_dp2"]["data_rank"] for out in results] == [0, 0, 1, 1]
    assert [out["cpu_pp2_dp2"]["data_rank"] for out in results] == [0, 1, 0, 1]
    for rank, out in enumerate(results):
        r = out["cpu_pp2_dp2"]
        assert r["resumed"] == pytest.approx(r["losses"][2:], rel=1e-6), f"rank {rank}: resumed mid-epoch"


@pytest.mark.deepspeed
def test_deepspeed_refuses_mismatched_peers_everywhere():
    from .needs import need

    need("deepspeed")
    results = run(_deepspeed, 4, timeout_s=240)
    _check_pure_data_parallel(results)
    for name in LAYOUTS:
        _check_refused(results, name, "train_step")
        _check_short(results, name)
        losses = [out[name]["then"] for out in results]
        assert len(set(losses)) == 1 and losses[0] > 0, f"{name}: the global batch trains after the refusal"
        if name == "cpu_tp2_dp2":
            _check_later(results, name)
        for rank, out in enumerate(results):  # the steps refused after their backward left nothing behind
            got = [out[name]["then"], *out[name]["more"]]
            assert got == pytest.approx(out[name]["reference"], rel=1e-4), f"{name} rank {rank}"
