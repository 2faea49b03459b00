"""The reference GPT trained with a context axis on the native back end against one process.

One launch of 2 gloo processes trains ``context = 2`` (the whole world one context group) twice, by ring and by
all-to-all, 3 steps each, and compares every step's loss and gradient norm (before clipping) and the parameters after
the last step with one process trained on the whole global batch (:func:`.reference.gpt_reference`), fp32, rel 1e-5.

The optimizer is SGD with momentum 0.9 and the clipping threshold sits below the gradient norm on every step, so the
clipping acts: a gradient that is wrong by a factor (a context rank's loss not divided as its share, a reduction over
the wrong group) changes the norm and, through momentum, the parameters; AdamW would divide it away.
"""
from __future__ import annotations

import pytest
import torch

from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

STEPS, TOL = 3, dict(rtol=1e-5, atol=1e-6)
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9}
CLIP = 0.5  # below every step's gradient norm (asserted): the clipping acts


def _recipe(parallelism: dict, method: str = "ring"):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_single").to_dict()
    data.update(parallelism={"data": 1, "tensor": 1, "pipeline": 1, **parallelism},
                context_parallel={"method": method}, optimizer=SGD, gradient_clipping=CLIP, launcher="torchrun",
                cluster={"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4})
    return Recipe.from_dict(data)


def _reference(recipe):
    """Losses, gradient norms and final parameters of one process on the whole global batch."""
    from plugin.data.text import TextBatches
    from plugin.engines.optim import build_optimizer
    from plugin.models.gpt import GPT, GPTConfig, gpt_loss

    lay = recipe.layout()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    opt = build_optimizer(model.parameters(), recipe.optimizer)
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data.global_batch(step, lay.global_batch)
        parts = list(zip(x.chunk(lay.grad_accum * lay.data), y.chunk(lay.grad_accum * lay.data)))
        total = 0.0
        for xs, ys in parts:
            loss = gpt_loss(model(xs), ys)
            (loss / len(parts)).backward()
            total += float(loss.detach()) / len(parts)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(recipe):
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
        norms.append(engine.last_grad_norm)
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, norms, params


def _alone(rank, world):
    out = {}
    for method in ("ring", "all_to_all"):
        recipe = _recipe({"context": world}, method)
        out[method] = _train(recipe)
    return out


def test_context_2_trains_one_process_losses_gradients_and_weights():
    ref_losses, ref_norms, ref_params = _reference(_recipe({}))
    assert min(ref_norms) > CLIP, f"the clipping must act: gradient norms {ref_norms} against {CLIP}"
    results = run(_alone, 2, timeout_s=240)
    for rank, out in enumerate(results):
        for method, (losses, norms, params) in out.items():
            what = f"context 2 {method} rank {rank}"
            print(what, "losses", losses, "reference", ref_losses, "norms", norms, "reference", ref_norms)
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                       torch.tensor(ref_losses, dtype=torch.float64), **TOL,
                                       msg=lambda m: f"{what} losses: {m}")
            torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                                       torch.tensor(ref_norms, dtype=torch.float64), **TOL,
                                       msg=lambda m: f"{what} gradient norms: {m}")
            assert params.keys() == ref_params.keys()
            for name, p in params.items():
                torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m: f"{what} {name}: {m}")
