"""Weight decay on the parameters it is meant for, and bf16 gradients summed in fp32, on every back end, ZeRO stage
and init, against one process (issue 20): one 4-rank spawn per back end, each training a list of engines 4 steps.

Weight decay (fp32): SGD lr 0.5, momentum 0.9, weight_decay 0.5, clipping 0.3 (under the gradient norm at every
step: asserted, so clipping acts), on each way a back end's optimizer can be handed other parameter objects than the
model's own: DDP (eager), ZeroRedundancyOptimizer (meta), ZeRO-2's row views (from safetensors ``weights=``),
FSDP2's DTensors (ZeRO-3 from a builder, over tensor shards), pipeline stages (a builder), Accelerate's DDP;
DeepSpeed ZeRO-0 (eager), ZeRO-1 (meta), ZeRO-2 (``weights=``), ZeRO-3 (meta, where the parameters are 1-D placeholders
before the optimizer exists; ``weights=``), its pipeline, tensor x data through its mpu, and Accelerate's DeepSpeed
plugin at ZeRO-3 (a builder) and ZeRO-1. The ``weights=`` files hold another seed's model than the init would make.
Each engine's losses equal one process's (:func:`.reference.gpt_reference`, the same micro-batch split) within
rel 1e-5 (tensor parallelism 1e-4: its split reductions); the same process with the decay on the wrong group (the
1-D parameters) is asserted to be far outside that.

bf16: one process of the same back end and arithmetic is the reference (native: autocast over fp32 parameters (DDP,
ZeroRedundancyOptimizer, ZeRO-2's row shards), or FSDP2's bf16 parameters; DeepSpeed: bf16 parameters with fp32
masters at ZeRO-1), with the layout's micro-batch size.
Then only the order of the fp32 sums differs, and what that moves is a master weight's bf16 rounding (one bf16 ulp
is 3.9e-3 relative). Measured over 6 steps: native 2.8e-5 (FSDP2 6e-8), DeepSpeed 8e-5 to 1.6e-4 (pipeline);
BF16_RTOL 5e-4 leaves 3x. What these steps do not see is DeepSpeed's bf16 sums at ZeRO-1..3 (without
``communication_data_type`` / ``grad_accum_dtype`` fp32: 7e-5 to 1.1e-4 off, measured): the export's unit test
pins those keys.
DeepSpeed at ZeRO-0 (which sums in bf16) is refused on the DeepSpeed back end, before any process group.
"""
from __future__ import annotations

import math

import pytest

from plugin.engines.choose import importable

from . import spawn
from .reference import gpt_reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 2 spawns x 13-16 engines: .ci/run's slow step

STEPS, RTOL, TP_RTOL, BF16_RTOL, CLIP = 4, 1e-5, 1e-4, 5e-4, 0.3
OPTIMIZER = {"optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.5},
             "gradient_clipping": CLIP}
WEIGHTS_SEED = 5  # the weights= files: another model than seed 0's init, so a run that ignored them would differ

# (label, back end, base recipe, replaced blocks, init)
NATIVE = [
    ("DDP dp4 ZeRO-0", "native", "cpu_dp4", {"zero": {"stage": 0}}, "eager"),
    ("ZeroRedundancyOptimizer dp4 ZeRO-1", "native", "cpu_dp4", {}, "meta"),
    ("row shards dp4 ZeRO-2", "native", "cpu_dp4", {"zero": {"stage": 2}}, "weights"),
    ("FSDP2 dp4 ZeRO-3", "native", "cpu_zero3_dp4", {}, "builder"),
    ("FSDP2 tp2 x dp2 ZeRO-3", "native", "cpu_tp2_dp2", {"zero": {"stage": 3}}, "meta"),
    ("stages pp2 x dp2 ZeRO-1", "native", "cpu_pp2_dp2", {}, "builder"),
    ("Accelerate DDP dp4 ZeRO-0", "accelerate", "cpu_dp4", {"zero": {"stage": 0}}, "meta"),
]
DEEPSPEED = [
    ("DeepSpeed dp4 ZeRO-0", "deepspeed", "cpu_dp4", {"zero": {"stage": 0}}, "eager"),
    ("DeepSpeed dp4 ZeRO-1", "deepspeed", "cpu_dp4", {}, "meta"),
    ("DeepSpeed dp4 ZeRO-2", "deepspeed", "cpu_dp4", {"zero": {"stage": 2}}, "weights"),
    ("DeepSpeed dp4 ZeRO-3", "deepspeed", "cpu_zero3_dp4", {}, "meta"),
    ("DeepSpeed dp4 ZeRO-3", "deepspeed", "cpu_zero3_dp4", {}, "weights"),
    ("Accelerate's DeepSpeed dp4 ZeRO-3", "accelerate", "cpu_zero3_dp4", {}, "builder"),
    ("Accelerate's DeepSpeed dp4 ZeRO-1", "accelerate", "cpu_dp4", {}, "eager"),
    ("DeepSpeed pp2 x dp2 ZeRO-1", "deepspeed", "cpu_pp2_dp2", {}, "builder"),
    ("DeepSpeed tp2 x dp2 ZeRO-1", "deepspeed", "cpu_tp2_dp2", {}, "meta"),
]
# bf16: (label, back end, base recipe, blocks, init, the one-process reference's back end and ZeRO stage)
NATIVE_BF16 = [
    ("DDP dp4 ZeRO-0 bf16", "native", "cpu_dp4", {"zero": {"stage": 0}}, "meta", ("native", 0)),
    ("ZeroRedundancyOptimizer dp4 ZeRO-1 bf16", "native", "cpu_dp4", {}, "meta", ("native", 0)),
    ("row shards dp4 ZeRO-2 bf16", "native", "cpu_dp4", {"zero": {"stage": 2}}, "meta", ("native", 0)),
    ("FSDP2 dp4 ZeRO-3 bf16", "native", "cpu_zero3_dp4", {}, "meta", ("native", 3)),
    ("stages pp2 x dp2 ZeRO-1 bf16", "native", "cpu_pp2_dp2", {}, "meta", ("native", 0)),
    ("Accelerate DDP dp4 ZeRO-0 bf16", "accelerate", "cpu_dp4", {"zero": {"stage": 0}}, "meta", ("native", 0)),
]
DEEPSPEED_BF16 = [
    ("DeepSpeed dp4 ZeRO-1 bf16", "deepspeed", "cpu_dp4", {}, "meta", ("deepspeed", 1)),
    ("DeepSpeed dp4 ZeRO-2 bf16", "deepspeed", "cpu_dp4", {"zero": {"stage": 2}}, "meta", ("deepspeed", 1)),
    ("DeepSpeed dp4 ZeRO-3 bf16", "deepspeed", "cpu_zero3_dp4", {}, "meta", ("deepspeed", 1)),
    ("DeepSpeed pp2 x dp2 ZeRO-1 bf16", "deepspeed", "cpu_pp2_dp2", {}, "meta", ("deepspeed", 1)),
    ("Accelerate's DeepSpeed dp4 ZeRO-1 bf16", "accelerate", "cpu_dp4", {}, "meta", ("deepspeed", 1)),
]


def _recipe(base, blocks, precision="fp32"):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(base).to_dict()
    data.update(OPTIMIZER, **blocks, precision=precision)
    data["name"] = f"{base}_{precision}"
    return Recipe.from_dict(data)


def _single(recipe, backend: str, stage: int):
    """One process, the same micro-batches as ``recipe``'s layout (global batch, micro-batch size), at ``stage``."""
    import dataclasses

    from plugin.recipe.spec import Recipe

    lay = recipe.layout()
    data = recipe.to_dict()
    data.update(parallelism={"data": 1, "tensor": 1, "pipeline": 1}, zero={"stage": stage},
                batch={"global": lay.global_batch, "micro": lay.micro_batch}, launcher="auto")
    data.pop("pipeline_parallel", None)
    return dataclasses.replace(Recipe.from_dict(data), name=f"single_{backend}_{stage}")


def _model(init: str, recipe, weights: str):
    """``(model or builder, initialize's keyword arguments)`` for one init path, seed 0 (``weights``: seed 5's)."""
    import torch

    from plugin.models.gpt import GPT, GPTConfig

    config = GPTConfig.from_recipe_model(recipe.model)
    if init == "eager":
        torch.manual_seed(0)
        return GPT(config), {}
    if init == "meta":
        with torch.device("meta"):
            return GPT(config), {"seed": 0}
    if init == "builder":
        return (lambda: GPT(config)), {"seed": 0}
    return (lambda: GPT(config)), {"weights": weights}


def _train(recipe, backend: str, init: str, weights: str) -> list[float]:
    import plugin
    from plugin.data.text import TextBatches

    model, kwargs = _model(init, recipe, weights)
    engine = plugin.initialize(model, recipe, backend=backend, **kwargs)
    if backend == "accelerate":  # Accelerate's DDP, or its DeepSpeed plugin from ZeRO-1 on
        assert engine.mode == ("ddp" if recipe.zero.stage == 0 else "deepspeed"), engine.mode
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses = [engine.train_step(data.global_batch(s, engine.layout.global_batch)) for s in range(STEPS)]
    if backend == "accelerate":  # Accelerate keeps one state per process (one Accelerator): the next case makes its own
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return losses


def _write_weights(rank, directory: str) -> None:
    """Rank 0 saves seed 5's GPT as ``model.safetensors`` (what ``save_pretrained`` writes for it)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from plugin.models.gpt import GPT, GPTConfig

    if rank == 0:
        torch.manual_seed(WEIGHTS_SEED)
        model = GPT(GPTConfig.from_recipe_model(_recipe("cpu_single", {}).model))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}/model.safetensors")
    dist.barrier()


def _layouts(rank, world, cases, bf16_cases, directory):
    """Every case's losses, in order (the fp32 ones, then the bf16 ones); DeepSpeed's shm buffer released."""
    import torch.distributed as dist

    _write_weights(rank, directory)
    out = [_train(_recipe(base, blocks), backend, init, directory) for _, backend, base, blocks, init in cases]
    out += [_train(_recipe(base, blocks, "bf16"), backend, init, directory)
            for _, backend, base, blocks, init, _ in bf16_cases]
    refused = None
    if any(backend == "deepspeed" for _, backend, *_ in cases):
        refused = _refusal()
        from plugin.engines.shm import release_shm_buffer

        dist.barrier()
        release_shm_buffer(rank)
    return out, refused


def _refusal() -> str:
    """bf16 at ZeRO-0 on the DeepSpeed back end: the recipe error, raised before any group or engine is made."""
    import plugin
    from plugin.errors import RecipeError

    recipe = _recipe("cpu_dp4", {"zero": {"stage": 0}}, "bf16")
    model, kwargs = _model("meta", recipe, "")
    try:
        plugin.initialize(model, recipe, backend="deepspeed", **kwargs)
    except RecipeError as e:
        return str(e)
    return "not refused"


def _bf16_references(rank, world, cases):
    """One process per distinct reference (back end, ZeRO stage, micro-batch size) of ``cases``: its bf16 losses."""
    out = {}
    for _, _, base, blocks, _, (backend, stage) in cases:
        single = _single(_recipe(base, blocks, "bf16"), backend, stage)
        key = (backend, stage, single.batch.micro)
        if key not in out:
            out[key] = _train(single, backend, "eager", "")
    return out


def _wrong_group(model):
    """The sabotage the comparison must see: weight decay on the 1-D parameters instead of the matrices."""
    from plugin.engines.optim import WeightDecay

    return WeightDecay(model, {n: p.dim() < 2 for n, p in model.named_parameters(remove_duplicate=False)})


def _relative(got, want) -> float:
    return max(abs(g / w - 1) for g, w in zip(got, want, strict=True))


def _check(cases, bf16_cases, tmp_path):
    single = spawn.run(_bf16_references, 1, bf16_cases, timeout_s=600)[0] if bf16_cases else {}
    results = spawn.run(_layouts, 4, cases, bf16_cases, str(tmp_path), timeout_s=900)
    for rank in range(1, 4):  # the loss is the global batch's, the same float on every rank
        assert results[rank][0] == results[0][0], rank
    losses, refused = results[0]
    report, failures = [], []
    for (label, _, base, blocks, init), got in zip(cases, losses[:len(cases)], strict=True):
        recipe = _recipe(base, blocks)
        want, norms = gpt_reference(recipe, STEPS, seed=WEIGHTS_SEED if init == "weights" else 0)
        assert min(norms) > CLIP, f"clipping at {CLIP} does not act: norms {norms}"
        wrong, _ = gpt_reference(recipe, STEPS, seed=WEIGHTS_SEED if init == "weights" else 0, decay=_wrong_group)
        tol = TP_RTOL if recipe.parallelism.tensor > 1 else RTOL
        off, sabotage = _relative(got, want), _relative(wrong, want)
        assert sabotage > 100 * tol, f"{label}: the decay on the wrong group moves the losses by {sabotage:.1e} only"
        report.append(f"{label} ({init}): {off:.1e} off one process (rtol {tol:g}; wrong group: {sabotage:.1e})")
        if not off <= tol:
            failures.append(f"{report[-1]}\n  got  {got}\n  want {want}")
    for (label, _, base, blocks, init, (backend, stage)), got in zip(bf16_cases, losses[len(cases):], strict=True):
        ref = _single(_recipe(base, blocks, "bf16"), backend, stage)
        want = single[(backend, stage, ref.batch.micro)]
        off = _relative(got, want)
        report.append(f"{label} ({init}): {off:.1e} off one {backend} bf16 process at ZeRO-{stage} "
                      f"(rtol {BF16_RTOL:g})")
        if not off <= BF16_RTOL or not all(math.isfinite(x) for x in got):
            failures.append(f"{report[-1]}\n  got  {got}\n  want {want}")
    print("\n".join(report))
    assert not failures, "\n".join(failures)
    return refused


@pytest.mark.native
def test_native_and_accelerate_weight_decay_and_bf16_match_one_process(tmp_path):
    cases = NATIVE if importable("accelerate") else [c for c in NATIVE if c[1] != "accelerate"]
    bf16 = NATIVE_BF16 if importable("accelerate") else [c for c in NATIVE_BF16 if c[1] != "accelerate"]
    _check(cases, bf16, tmp_path)


@pytest.mark.deepspeed
def test_deepspeed_weight_decay_and_bf16_match_one_process(tmp_path):
    from .needs import need

    need("deepspeed")
    need("transformers")  # Accelerate's DeepSpeed plugin imports it
    need("accelerate")
    refused = _check(DEEPSPEED, DEEPSPEED_BF16, tmp_path)
    assert '"zero": {"stage": 1}' in refused and "bf16" in refused, refused
