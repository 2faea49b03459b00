"""The layouts that combine axes, over transformers causal-LM families, on both back ends, against one process:
tensor 2 x pipeline 2 (4 processes) and ZeRO-3 at data 2 (DeepSpeed ZeRO-3; FSDP2 under the native back end).
Tensor 2 alone and pipeline 2 alone are tests/dist/test_tp_families.py and test_pp_families.py; the four together
are issue 20's family matrix, and docs/models-and-data.md's table is generated from these lists
(tests/family_table.py).

:data:`MATRIX_FAMILIES` (tests/hf_families.py) are the families the pipeline test trains, each with the pipeline
feature overrides of ``MATRIX_OVERRIDES`` and its tensor plan ``tp_plan``: the 4-layer tiny
model cut [embed, 0, 1 | 2, 3, head], trained with its own Hugging Face loss on a padded batch (right and left padding,
uneven lengths over 16 tokens, so that windows of 8 act and the loss is the token mean over the global batch). SGD
with momentum and clipping below every norm (the reference asserts it): a gradient wrong anywhere moves the losses
from step 2 on and the clipped update at once. One spawn per layout and back end trains every family in turn.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.hf_families import MATRIX_FAMILIES, MATRIX_OVERRIDES, PP_DIMS, padded_batch, pp_model, tp_plan

from .needs import need
from .spawn import run

need("transformers")
pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 4 spawns x 13 families: .ci/run's slow step

STEPS = 3
REL = 1e-4
SEQ = 16
ROWS = 8
CLIP = 0.05
SGD = {"name": "sgd", "lr": 2.0, "momentum": 0.9, "weight_decay": 0.0}
# name -> (the shipped recipe it starts from, its parallelism, processes, micro-batch rows): 2 micro-batches through
# the pipeline, one per data rank under ZeRO-3 (the suite's time: every family trains in each)
LAYOUTS = {"tp2_pp2": ("cpu_tp2_pp2", {"data": 1, "tensor": 2, "pipeline": 2}, 4, 4),
           "zero3_dp2": ("cpu_zero3_dp4", {"data": 2, "tensor": 1, "pipeline": 1}, 2, 4)}
FAMILIES = MATRIX_FAMILIES


def build(family: str):
    import transformers as tf

    tf.logging.set_verbosity_error()
    return pp_model(family, PP_DIMS, seed=0, overrides=MATRIX_OVERRIDES)


def recipe_dict(layout: str, family: str) -> dict:
    """The layout's recipe for ``family``: its own dims (from its config), SGD, clipping, its tensor plan."""
    from plugin.engines.model_checks import model_dims
    from plugin.recipe.checks import load_recipe

    base, parallelism, world, micro = LAYOUTS[layout]
    with torch.device("meta"):
        model = build(family)
    data = load_recipe(base).to_dict()
    data.update(name=f"{layout}_{family}", parallelism=parallelism, optimizer=SGD,
                gradient_clipping=CLIP, batch={"global": ROWS, "micro": micro},
                model={**model_dims(model), "seq_len": PP_DIMS.seq_len, "dropout": 0.0},
                cluster={"nodes": 1, "gpus_per_node": world, "gpu_memory_gb": 4})
    if parallelism["tensor"] > 1:
        data["tensor_parallel"] = {"plan": tp_plan(model, family)}
    return data


@functools.cache
def reference(family: str) -> tuple[list[float], list[float]]:
    """One process: (losses, gradient norms before clipping) with the model's own loss over the whole batch."""
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    batch = padded_batch(ROWS, model.config.vocab_size, SEQ)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert min(norms) > CLIP, f"{family}: gradient norms {norms}: clipping at {CLIP} would not act"
    return losses, norms


def train_families(rank, world_size, recipes: dict, backend: str):
    import plugin
    from plugin.recipe.spec import Recipe

    out, engines = {}, []
    for family, data in recipes.items():
        engine = plugin.initialize(build(family), Recipe.from_dict(data), backend=backend)
        engines.append(engine)  # alive until the spawn tears the process group down
        batch = padded_batch(ROWS, data["model"]["vocab"], SEQ)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(engine.train_step(batch))
            norms.append(engine.grad_norm())
        out[family] = losses, norms
    return out


def check(results: list[dict]) -> None:
    wrong = []
    for family, (losses, norms) in results[0].items():
        assert all(r[family][0] == losses for r in results), f"{family}: ranks report different losses"
        ref_losses, ref_norms = reference(family)
        if losses != pytest.approx(ref_losses, rel=REL):
            wrong.append(f"{family}: losses {losses} vs one process {ref_losses}")
        if None in norms or norms != pytest.approx(ref_norms, rel=REL):  # rank 0's: the global norm
            wrong.append(f"{family}: gradient norms {norms} vs one process {ref_norms}")
    assert not wrong, "\n".join(wrong)


CASES = [pytest.param(layout, backend, marks=[pytest.mark.deepspeed] if backend == "deepspeed" else [])
         for layout in LAYOUTS for backend in ("native", "deepspeed")]


@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_families_train_one_process_losses(layout, backend):
    if backend == "deepspeed":
        need("deepspeed")
    recipes = {family: recipe_dict(layout, family) for family in MATRIX_FAMILIES}
    check(run(train_families, LAYOUTS[layout][2], recipes, backend, timeout_s=600))
