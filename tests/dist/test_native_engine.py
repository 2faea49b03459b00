"""The native engine on layouts and options the launcher suites do not cover, in one launch of 4 gloo
processes (``plugin.initialize(..., backend="native")``, so it runs with or without deepspeed):

* ZeRO-2's row shards and FSDP2 on top of tensor parallelism (tp2 x dp2 at ZeRO-2 and ZeRO-3), ZeRO-2's row
  shards over data x context (ring attention), sequence parallelism with DDP, a pipeline with activation
  checkpointing, FSDP2 with CPU offload (ZeRO-3, and ZeRO-2 with optimizer offload), the GPipe and interleaved 1F1B
  schedules (tp2 x pp2 with 2 virtual stages each): 3 steps equal to one process (fp32, rtol 1e-4, with an
  evaluation between the first two), and the global gradient norm of the first step equal to the single-process norm;
* bf16 (autocast with DDP / ZeRO-2's row shards / pipeline stages, MixedPrecisionPolicy with FSDP2) and fp16 (the
  same plus ShardedGradScaler): 3 steps that track the fp32 losses (bf16 within 1%, fp16 within 0.5%), with every
  linear layer multiplying in that dtype (losses alone cannot tell: a run silently in fp32 tracks them too);
* activation checkpointing with dropout under tensor and sequence parallelism: the same losses as without,
  and other losses than with dropout 0 (so dropout really drew masks);
* what each rank holds (``state_bytes``), taken inside the second step's optimizer step (gradients and Adam's
  moments both exist; after the step the gradients are freed): ZeRO-1 a quarter of the optimizer states,
  ZeRO-2 also a quarter of the gradients (the parameters whole, as DeepSpeed's stage 2 keeps them), ZeRO-3 a
  quarter of everything, against ZeRO-0's whole copy;
* after an evaluation at ZeRO-3 every FSDP2 parameter is back to its shard (a DTensor): forward without backward
  would otherwise leave the gathered parameters on every rank until the next step;
* ZeRO-2's checkpoints (each rank its rows of the parameters and of Adam's moments): saved at step 2 and loaded
  into the engine that went on (steps 3-4 again, bitwise), into a ZeRO-1 engine, and a ZeRO-1 checkpoint into a
  fresh ZeRO-2 engine: steps 3-4 as the uninterrupted run's.

Each rank computes the single-process reference itself: the same GPT, AdamW groups, micro-batch loop and
``clip_grad_norm_`` (torch's formula is DeepSpeed's).
"""

import pytest
import torch

from .reference import gpt_reference
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

STEPS = 3
FP32 = {  # name -> (base recipe, {block: replacement})
    "tp2_dp2_zero2": ("cpu_tp2_dp2", {"zero": {"stage": 2}}),
    "dp4_zero2_offload": ("cpu_dp4", {"zero": {"stage": 2, "offload_optimizer": "cpu"}}),
    "cp2_dp2_zero2": ("cpu_dp4", {"parallelism": {"data": 2, "tensor": 1, "pipeline": 1, "context": 2},
                                  "context_parallel": {"method": "ring"}, "zero": {"stage": 2}}),
    "tp2_dp2_zero3": ("cpu_tp2_dp2", {"zero": {"stage": 3}}),
    "tp2_sp_dp2": ("cpu_tp2_dp2", {"tensor_parallel": {"sequence_parallel": True}}),
    "pp2_dp2_checkpointed": ("cpu_pp2_dp2", {"activation_checkpointing": {"mode": "full", "every": 1}}),
    "dp4_zero3_offload": ("cpu_dp4", {"zero": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}}),
    # the schedules only the native back end runs
    "pp2_dp2_gpipe": ("cpu_pp2_dp2", {"pipeline_parallel": {"schedule": "gpipe", "partition": "uniform"}}),
    "tp2_pp2_interleaved": ("cpu_tp2_pp2", {"pipeline_parallel": {"schedule": "interleaved_1f1b", "virtual_stages": 2,
                                                                  "partition": "uniform"}}),
}
LOW = {  # name -> (base recipe, blocks, precision, rtol against fp32)
    "bf16_dp4_zero1": ("cpu_dp4", {}, "bf16", 1e-2),
    "bf16_dp4_zero3": ("cpu_dp4", {"zero": {"stage": 3}}, "bf16", 1e-2),
    "bf16_pp2_dp2": ("cpu_pp2_dp2", {}, "bf16", 1e-2),
    "fp16_dp4_zero0": ("cpu_dp4", {"zero": {"stage": 0}}, "fp16", 5e-3),
    "fp16_dp4_zero2": ("cpu_dp4", {"zero": {"stage": 2}}, "fp16", 5e-3),
    "fp16_tp2_dp2_zero3": ("cpu_tp2_dp2", {"zero": {"stage": 3}}, "fp16", 5e-3),
    "fp16_tp2_pp2": ("cpu_tp2_pp2", {}, "fp16", 5e-3),
}
COMPUTE_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def _recipe(base, blocks, precision="fp32"):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(base).to_dict()
    data.update(blocks, precision=precision)
    return Recipe.from_dict(data)


def _reference(recipe):
    """(losses, first-step gradient norm) of one process on the whole global batch."""
    losses, norms = gpt_reference(recipe, STEPS)
    return losses, norms[0]


def _measure_in_next_step(engine) -> dict:
    """``engine.state_bytes()`` taken inside the next optimizer step (the innermost torch optimizer's ``step``:
    ZeroRedundancyOptimizer's local one at ZeRO-1), when gradients and optimizer states both exist."""
    inner, found = getattr(engine.optimizer, "optim", engine.optimizer), {}
    original = inner.step

    def step(*args, **kwargs):
        found.update(engine.state_bytes())
        inner.step = original
        return original(*args, **kwargs)

    inner.step = step
    return found


def _all_sharded(engine) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in engine.wrapped.parameters())


def _record_linear_dtypes(module, seen: set) -> None:
    """Add to ``seen`` the dtype each linear layer of ``module`` (this rank's part: plain, column, row and
    vocabulary-parallel) multiplies in as it runs: autocast's dtype where autocast is on (linear is on its
    lower-precision list), else its weight's (FSDP2's MixedPrecisionPolicy casts the weights for forward).
    Not the output's dtype: a row-parallel layer adds its fp32 bias after the reduction, and autocast leaves an
    add to type promotion (fp32)."""
    def hook(layer, inputs, output):
        device = inputs[0].device.type
        autocast = torch.is_autocast_enabled(device)
        seen.add(str(torch.get_autocast_dtype(device) if autocast else layer.weight.dtype))

    for m in module.modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("ParallelLinear"):
            m.register_forward_hook(hook)


def _train(recipe, measure=False, dtypes=None):
    """``dtypes``: a set the linear layers' output dtypes of the whole run (steps and evaluation) are added to."""
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")
    if dtypes is not None:
        _record_linear_dtypes(engine.module, dtypes)
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norm, held, sharded_after_eval = [], None, None, None
    for step in range(STEPS):
        if measure and step == 1:
            held = _measure_in_next_step(engine)
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
        norm = norm if norm is not None else engine.last_grad_norm
        if step == 0:  # an evaluation between steps must leave training exactly as it was
            engine.eval_step(data.global_batch(0, engine.layout.global_batch, split="eval"))
            sharded_after_eval = _all_sharded(engine) if engine.fsdp else None
    if measure:
        return held, sharded_after_eval
    return engine, losses, norm


def _tp_stream_seed(engine) -> int:
    """The seed of the tensor-parallel dropout stream the rank's sharded layers draw from."""
    from plugin.tensor_parallel.random import TensorParallelRNG

    seeds = {m.rng.seed for m in engine.module.modules() if isinstance(getattr(m, "rng", None), TensorParallelRNG)}
    assert len(seeds) == 1, seeds
    return seeds.pop()


def _checkpoints(directory):
    """ZeRO-2 saved at step 2 and loaded back, into ZeRO-1, and ZeRO-1's checkpoint into ZeRO-2: losses of steps 3-4."""
    from plugin.data.text import TextBatches

    zero1, zero2 = _recipe("cpu_dp4", {}), _recipe("cpu_dp4", {"zero": {"stage": 2}})
    data = TextBatches(zero1.model.vocab, zero1.model.seq_len)
    batches = [data.global_batch(step, zero1.layout().global_batch) for step in range(4)]

    def engine(recipe):
        import plugin
        from plugin.models.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        return plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")

    out = {}
    for name, recipe in (("zero1", zero1), ("zero2", zero2)):
        e = engine(recipe)
        out[name] = [e.train_step(b) for b in batches[:2]]
        e.save(f"{directory}/{name}")
        out[name] += [e.train_step(b) for b in batches[2:]]
        if name == "zero2":
            e.load(f"{directory}/zero2")
            out["zero2 again"] = [e.train_step(b) for b in batches[2:]]
    for name, recipe, source in (("zero2 into zero1", zero1, "zero2"), ("zero1 into zero2", zero2, "zero1")):
        e = engine(recipe)
        assert e.load(f"{directory}/{source}")["step"] == 2
        out[name] = [e.train_step(b) for b in batches[2:]]
    return out


def _run_all(rank, world_size, directory):
    out = {"checkpoints": _checkpoints(directory)}
    references = {}
    dropout = {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 128, "seq_len": 64, "dropout": 0.1}
    for interval, p in ((0, 0.1), (1, 0.1), (0, 0.0)):  # tensor-parallel dropout streams replayed when checkpointed
        pp = {"schedule": "1f1b", "partition": "uniform"}
        recipe = _recipe("cpu_tp2_pp2", {"model": {**dropout, "dropout": p}, "pipeline_parallel": pp,
                                         "activation_checkpointing": {"mode": "full" if interval else "none",
                                                                      "every": max(1, interval)},
                                         "tensor_parallel": {"sequence_parallel": True}})
        engine, out[f"dropout_{p}_checkpoint_{interval}"], _ = _train(recipe)
        out["tp_stream"] = (engine.groups.pp_rank, engine.groups.tp_rank, _tp_stream_seed(engine))
    for name, (base, blocks) in FP32.items():
        recipe, dtypes = _recipe(base, blocks), set()
        _, losses, norm = _train(recipe, dtypes=dtypes)
        out[name] = (losses, norm, _reference(recipe), dtypes)
    for name, (base, blocks, precision, _) in LOW.items():
        if base not in references:
            references[base] = _reference(_recipe(base, {}))
        dtypes = set()
        _, losses, _ = _train(_recipe(base, blocks, precision), dtypes=dtypes)
        out[name] = (losses, None, references[base], dtypes)
    for stage in (0, 1, 2, 3):
        out[f"bytes_zero{stage}"], out[f"sharded_after_eval_zero{stage}"] = \
            _train(_recipe("cpu_dp4", {"zero": {"stage": stage}}), measure=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(_run_all, 4, str(tmp_path_factory.mktemp("checkpoints")), timeout_s=400)


@pytest.mark.parametrize("name", list(FP32))
def test_fp32_layouts_match_one_process(name, results):
    for rank, out in enumerate(results):
        losses, norm, (want, want_norm), dtypes = out[name]
        assert dtypes == {"torch.float32"}, f"rank {rank}: linear layers computed in {dtypes}"
        assert losses == pytest.approx(want, rel=1e-4), f"rank {rank}"
        assert norm == pytest.approx(want_norm, rel=1e-4), f"rank {rank}: global norm {norm} != {want_norm}"
        assert want_norm > 1.0, "the reference must clip, or the norm proves little"


@pytest.mark.parametrize("name", list(LOW))
def test_low_precision_tracks_fp32(name, results):
    """Computed in the recipe's dtype (every linear layer on every rank: tracking the fp32 losses alone cannot
    tell a run that silently stayed in fp32), and still tracking the fp32 losses."""
    precision, rtol = LOW[name][2:]
    for rank, out in enumerate(results):
        losses, _, (want, _), dtypes = out[name]
        assert dtypes == {COMPUTE_DTYPE[precision]}, f"rank {rank}: {precision}, linear layers computed in {dtypes}"
        assert losses == pytest.approx(want, rel=rtol), f"rank {rank}: {losses} vs fp32 {want}"
        assert losses[-1] < losses[0], f"rank {rank}: {losses} does not learn"
    assert len({tuple(out[name][0]) for out in results}) == 1, "every rank reports the same loss"


def test_activation_checkpointing_replays_dropout(results):
    """tp2 x pp2 with sequence parallelism and dropout 0.1: checkpointed layers recompute the same masks, and
    those masks are real (the losses differ from dropout 0's by far more than rounding)."""
    for rank, out in enumerate(results):
        assert out["dropout_0.1_checkpoint_1"] == out["dropout_0.1_checkpoint_0"], f"rank {rank}"
        assert out["dropout_0.1_checkpoint_0"] != pytest.approx(out["dropout_0.0_checkpoint_0"], rel=1e-3), \
            f"rank {rank}: dropout 0.1 trains like dropout 0: no mask was drawn"


def test_each_stage_and_tensor_rank_draws_its_own_sharded_dropout_stream(results):
    """The engine passes the pipeline rank to the tensor-parallel stream: seed + 100 pp_rank + 2718 + tp_rank
    (Megatron's), so no two of the 4 ranks of tp2 x pp2 drop in lockstep."""
    streams = [out["tp_stream"] for out in results]
    assert sorted((pp, tp) for pp, tp, _ in streams) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for pp, tp, seed in streams:
        assert seed == 0 + 100 * pp + 2718 + tp, (pp, tp, seed)


def test_zero_stages_hold_their_share(results):
    """Inside an optimizer step: what DeepSpeed's stages shard, the native stages shard (4 data ranks)."""
    for rank, out in enumerate(results):
        whole, zero1, zero2, zero3 = (out[f"bytes_zero{stage}"] for stage in range(4))
        assert whole["gradients"] == whole["parameters"] > 0, (rank, whole)  # fp32 gradients exist in the step
        assert zero1["parameters"] == zero1["gradients"] == whole["parameters"], (rank, zero1)
        assert zero1["optimizer_states"] == pytest.approx(whole["optimizer_states"] / 4, rel=0.15), rank
        assert zero2["parameters"] == whole["parameters"], (rank, zero2, whole)  # whole, as DeepSpeed's stage 2
        for kind in ("gradients", "optimizer_states"):  # each rank's rows (padded to whole rows per rank)
            assert zero2[kind] == pytest.approx(whole[kind] / 4, rel=0.05), (rank, kind, zero2, whole)
        for kind in ("gradients", "optimizer_states", "parameters"):  # FSDP2 resharded after the last backward
            assert zero3[kind] == pytest.approx(whole[kind] / 4, rel=0.05), (rank, kind, zero3, whole)


def test_evaluation_leaves_fsdp2_parameters_sharded(results):
    for rank, out in enumerate(results):
        assert out["sharded_after_eval_zero3"] is True, f"rank {rank}: gathered parameters left after eval"


def test_zero2_checkpoints_resume_and_cross_to_zero1_and_back(results):
    for rank, out in enumerate(results):
        ck = out["checkpoints"]
        assert ck["zero2"] == pytest.approx(ck["zero1"], rel=1e-6), f"rank {rank}: ZeRO-2 trains as ZeRO-1"
        assert ck["zero2 again"] == ck["zero2"][2:], f"rank {rank}: a resume of the same layout is bitwise"
        assert ck["zero2 into zero1"] == pytest.approx(ck["zero2"][2:], rel=1e-6), f"rank {rank}"
        assert ck["zero1 into zero2"] == pytest.approx(ck["zero1"][2:], rel=1e-6), f"rank {rank}"
