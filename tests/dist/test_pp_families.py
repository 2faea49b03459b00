"""Pipeline stages of transformers families (plugin.models.hf_stages) trained at pipeline 2
on both back ends, against one process: the losses (and the last step's gradient norm) of the same tiny model
(tests/hf_families.py's ``PP_FAMILIES``, 4 layers cut [embed, 0, 1 | 2, 3, head], ``PP_OVERRIDES`` making each
feature act) trained with its own Hugging Face loss on the whole global batch.

SGD with momentum 0.9 and clipping at :data:`CLIP`, below every family's gradient norm (the reference asserts it),
on the same batch every step, so that the loss falls and follows each update: a gradient bug moves the losses from
step 2 on (AdamW on random tokens would divide it away; a fresh random batch per step hides it under its noise), and
a stage whose norm is missing or counted twice moves the clipped update. Measured on one process: the gradient into
stage 0 scaled by 0.9 moves the losses by 1.5e-4 to 1.8e-3 by step 3-4 (cohere the least). The batch holds right and
left padded rows of uneven lengths over 16 tokens, so that the attention windows of 8 act and the loss is the
token-weighted mean over the whole batch.

One spawn per layout and back end trains every family in turn (one process group, torn down by the spawn).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.hf_families import PP_DIMS, PP_FAMILIES, padded_batch, pp_model

from .needs import need
from .spawn import run

need("transformers")
pytestmark = pytest.mark.dist

STEPS = 4
REL = 1e-4
SEQ = 16
CLIP = 0.05
SGD = {"name": "sgd", "lr": 2.0, "momentum": 0.9, "weight_decay": 0.0}
# pipeline 2 x data 2 over the families is left to the GPT layouts' tests (the suite's time); the families' data
# parallelism is the ZeRO-3 matrix's (test_family_matrix.py)
LAYOUTS = {"pp2": {"data": 1, "tensor": 1, "pipeline": 2}}


def recipe_dict(layout: str) -> dict:
    from plugin.recipe.checks import load_recipe

    data = load_recipe("cpu_pp2_dp2").to_dict()
    d = PP_DIMS
    data.update(name=f"pp_families_{layout}", parallelism=LAYOUTS[layout], optimizer=SGD, gradient_clipping=CLIP,
                batch={"global": 8, "micro": 2},
                model={"layers": d.layers, "hidden": d.hidden, "heads": d.heads, "kv_heads": d.kv_heads,
                       "ffn_hidden": d.ffn_hidden, "vocab": d.vocab, "seq_len": d.seq_len, "dropout": 0.0})
    return data


def build(family: str):
    import transformers as tf

    tf.logging.set_verbosity_error()
    return pp_model(family, PP_DIMS, seed=0)


@functools.cache
def reference(family: str) -> tuple[list[float], float, list[float]]:
    """One process: (losses, last step's gradient norm, every step's norm) with the model's own HF loss (the same
    for every layout: the global batch, optimizer and clipping are the layouts')."""
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.recipe.spec import Recipe

    data = recipe_dict("pp2")
    recipe = Recipe.from_dict(data)
    model = build(family)
    optimizer = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    losses, norms = [], []
    batch = padded_batch(data["batch"]["global"], data["model"]["vocab"], SEQ)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second OpenMP thread spins on a loaded machine (182 s -> 8 s wall)
    try:
        for _ in range(STEPS):
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    return losses, norms[-1], norms


def grad_norm(engine):
    """The last step's global gradient norm (DeepSpeed's pipeline engine records it under ZeRO-1)."""
    if engine.backend != "deepspeed":
        return engine.last_grad_norm
    norm = engine.ds.get_global_grad_norm()
    return None if norm is None else float(norm)


def train_families(rank, world_size, data: dict, backend: str, families: list[str]):
    import plugin
    from plugin.recipe.spec import Recipe

    recipe = Recipe.from_dict(data)
    out, engines = {}, []
    for family in families:
        engine = plugin.initialize(build(family), recipe, backend=backend)
        engines.append(engine)
        batch = padded_batch(engine.layout.global_batch, recipe.model.vocab, SEQ)
        losses = [engine.train_step(batch) for _ in range(STEPS)]
        out[family] = losses, grad_norm(engine)
    return out  # the engines live until the spawn tears the process group down


def check(results, families):
    failures = []
    for family in families:
        losses, norm = results[0][family]
        assert all(r[family][0] == losses for r in results), f"{family}: ranks report different losses"
        ref, ref_norm, norms = reference(family)
        assert min(norms) > CLIP, f"{family}: gradient norms {norms} not above the clipping {CLIP}: it would not act"
        if losses != pytest.approx(ref, rel=REL):
            failures.append(f"{family}: losses {losses} vs one process {ref}")
        if norm is None or norm != pytest.approx(ref_norm, rel=REL):  # rank 0's: the global norm, every stage in it
            failures.append(f"{family}: grad norm {norm} vs one process {ref_norm}")
    assert not failures, "\n".join(failures)


FAMILIES = list(PP_FAMILIES)
CASES = [("pp2", "native"), pytest.param("pp2", "deepspeed", marks=[pytest.mark.deepspeed, pytest.mark.slow])]


@pytest.mark.parametrize(("layout", "backend"), CASES)
def test_families_train_one_process_losses_at_pipeline_2(layout, backend):
    if backend == "deepspeed":
        need("deepspeed")
    data = recipe_dict(layout)
    world = LAYOUTS[layout]["data"] * LAYOUTS[layout]["pipeline"]
    check(run(train_families, world, data, backend, FAMILIES, timeout_s=600), FAMILIES)
