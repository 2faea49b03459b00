"""The native engine on layouts and options the launcher suites do not cover, in one launch of 4 gloo
processes (``plugin.initialize(..., backend="native")``, so it runs with or without deepspeed):

* FSDP2 on top of tensor parallelism (tp2 x dp2 at ZeRO-2 and ZeRO-3), sequence parallelism with DDP, a
  pipeline with activation checkpointing, FSDP2 with CPU offload: 3 steps equal to one process (fp32,
  rtol 1e-4, with an evaluation between the first two), and the global gradient norm of the first step equal
  to the single-process norm;
* bf16 (autocast with DDP / pipeline stages, MixedPrecisionPolicy with FSDP2) and fp16 (the same plus
  ShardedGradScaler): 3 steps that track the fp32 losses (bf16 within 1%, fp16 within 0.5%);
* activation checkpointing with dropout under tensor and sequence parallelism: the same losses as without;
* what each rank holds (``state_bytes``): ZeRO-1 a quarter of the optimizer states, ZeRO-3 a quarter of
  everything, against ZeRO-0's whole copy.

Each rank computes the single-process reference itself: the same GPT, AdamW groups, micro-batch loop and
``clip_grad_norm_`` (torch's formula is DeepSpeed's).
"""

import pytest
import torch

from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

STEPS = 3
FP32 = {  # name -> (base recipe, {block: replacement})
    "tp2_dp2_zero2": ("cpu_tp2_dp2", {"zero": {"stage": 2}}),
    "tp2_dp2_zero3": ("cpu_tp2_dp2", {"zero": {"stage": 3}}),
    "tp2_sp_dp2": ("cpu_tp2_dp2", {"tensor_parallel": {"sequence_parallel": True}}),
    "pp2_dp2_checkpointed": ("cpu_pp2_dp2", {"pipeline_parallel": {"schedule": "1f1b", "partition": "parameters",
                                                                   "activation_checkpoint_interval": 1}}),
    "dp4_zero3_offload": ("cpu_dp4", {"zero": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}}),
}
LOW = {  # name -> (base recipe, blocks, precision, rtol against fp32)
    "bf16_dp4_zero1": ("cpu_dp4", {}, "bf16", 1e-2),
    "bf16_dp4_zero3": ("cpu_dp4", {"zero": {"stage": 3}}, "bf16", 1e-2),
    "bf16_pp2_dp2": ("cpu_pp2_dp2", {}, "bf16", 1e-2),
    "fp16_dp4_zero0": ("cpu_dp4", {"zero": {"stage": 0}}, "fp16", 5e-3),
    "fp16_tp2_dp2_zero3": ("cpu_tp2_dp2", {"zero": {"stage": 3}}, "fp16", 5e-3),
    "fp16_tp2_pp2": ("cpu_tp2_pp2", {}, "fp16", 5e-3),
}


def _recipe(base, blocks, precision="fp32"):
    from plugin.checks import load_recipe
    from plugin.recipe import Recipe

    data = load_recipe(base).to_dict()
    data.update(blocks, precision=precision)
    return Recipe.from_dict(data)


def _reference(recipe):
    """(losses, first-step gradient norm) of one process on the whole global batch."""
    from plugin.data import TextBatches
    from plugin.models.gpt import GPT, GPTConfig, gpt_loss
    from plugin.optim import build_optimizer

    lay = recipe.layout()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    opt = build_optimizer(model.parameters(), recipe.optimizer)
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data.global_batch(step, lay.global_batch)
        parts = list(zip(x.chunk(lay.grad_accum * lay.data), y.chunk(lay.grad_accum * lay.data)))  # micro-batches
        total = 0.0
        for xs, ys in parts:
            loss = gpt_loss(model(xs), ys)
            (loss / len(parts)).backward()
            total += float(loss) / len(parts)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms[0]


def _train(recipe):
    import plugin
    from plugin.data import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norm = [], None
    for step in range(STEPS):
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
        norm = norm if norm is not None else engine.last_grad_norm
        if step == 0:  # an evaluation between steps must leave training exactly as it was
            engine.eval_step(data.global_batch(0, engine.layout.global_batch, split="eval"))
    return engine, losses, norm


def _run_all(rank, world_size):
    out = {}
    references = {}
    dropout = {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 128, "seq_len": 64, "dropout": 0.1}
    for interval in (0, 1):  # tensor-parallel dropout streams replayed under activation checkpointing
        pp = {"schedule": "1f1b", "partition": "uniform", "activation_checkpoint_interval": interval}
        recipe = _recipe("cpu_tp2_pp2", {"model": dropout, "pipeline_parallel": pp,
                                         "tensor_parallel": {"sequence_parallel": True}})
        out[f"dropout_checkpoint_{interval}"] = _train(recipe)[1]
    for name, (base, blocks) in FP32.items():
        recipe = _recipe(base, blocks)
        _, losses, norm = _train(recipe)
        out[name] = (losses, norm, _reference(recipe))
    for name, (base, blocks, precision, _) in LOW.items():
        if base not in references:
            references[base] = _reference(_recipe(base, {}))
        _, losses, _ = _train(_recipe(base, blocks, precision))
        out[name] = (losses, None, references[base])
    for stage in (0, 1, 3):
        recipe = _recipe("cpu_dp4", {"zero": {"stage": stage}})
        engine, _, _ = _train(recipe)
        out[f"bytes_zero{stage}"] = engine.state_bytes()
    return out


@pytest.fixture(scope="module")
def results():
    return run(_run_all, 4, timeout_s=300)


@pytest.mark.parametrize("name", list(FP32))
def test_fp32_layouts_match_one_process(name, results):
    for rank, out in enumerate(results):
        losses, norm, (want, want_norm) = out[name]
        assert losses == pytest.approx(want, rel=1e-4), f"rank {rank}"
        assert norm == pytest.approx(want_norm, rel=1e-4), f"rank {rank}: global norm {norm} != {want_norm}"
        assert want_norm > 1.0, "the reference must clip, or the norm proves little"


@pytest.mark.parametrize("name", list(LOW))
def test_low_precision_tracks_fp32(name, results):
    rtol = LOW[name][3]
    for rank, out in enumerate(results):
        losses, _, (want, _) = out[name]
        assert losses == pytest.approx(want, rel=rtol), f"rank {rank}: {losses} vs fp32 {want}"
        assert losses[-1] < losses[0], f"rank {rank}: {losses} does not learn"
    assert len({tuple(out[name][0]) for out in results}) == 1, "every rank reports the same loss"


def test_activation_checkpointing_replays_dropout(results):
    """tp2 x pp2 with sequence parallelism and dropout 0.1: checkpointed layers recompute the same masks."""
    for rank, out in enumerate(results):
        assert out["dropout_checkpoint_1"] == out["dropout_checkpoint_0"], f"rank {rank}"


def test_zero_stages_hold_their_share(results):
    for rank, out in enumerate(results):
        whole, zero1, zero3 = out["bytes_zero0"], out["bytes_zero1"], out["bytes_zero3"]
        assert zero1["parameters"] == whole["parameters"], rank
        assert zero1["optimizer_states"] == pytest.approx(whole["optimizer_states"] / 4, rel=0.15), rank
        for kind in ("parameters", "optimizer_states"):
            assert zero3[kind] == pytest.approx(whole[kind] / 4, rel=0.05), (rank, kind, zero3, whole)
