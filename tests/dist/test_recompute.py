"""The recipe's ``activation_checkpointing`` on both back ends, one launch of 4 gloo processes each:

* with dropout 0.1 under tensor parallelism, tp2 x pp2 (pipeline stages) and tp2 x dp2 (no pipeline): ``full``
  (spans of 1 and of 2 layers) and ``selective`` (the attention core) give the run without recompute's losses and
  gradients, bitwise: 2 SGD steps (momentum 0, so each parameter is ``p - lr x clipped gradient``) leave every
  parameter of every rank equal. The recompute really ran: on the second step ``full`` calls each block twice
  per micro-batch (forward, then the recompute in backward), ``selective`` the attention core twice and the
  block once; and dropout 0.1 really drew masks (other losses than dropout 0);
* a transformers Llama at tp2 x dp2 (no pipeline): ``full`` checkpoints each decoder layer's forward (its
  attention runs twice per micro-batch on the second step) and gives the gradients of no recompute, bitwise;
* with dropout 0 (the parity recipes), ``full`` at tp2 x dp2 (every 2), ``selective`` at tp2 x pp2 and ``full``
  at ZeRO-3 dp4 (DeepSpeed's partitioned parameters, the native back end's FSDP2) train one process's losses
  (rtol 1e-4).
"""
import importlib.util

import pytest
import torch

from .needs import need
from .reference import gpt_reference
from .spawn import run

pytestmark = [pytest.mark.dist]

STEPS = 2
MODEL = {"layers": 4, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.0}
MODES = {"none": {"mode": "none"}, "full1": {"mode": "full", "every": 1}, "full2": {"mode": "full", "every": 2},
         "selective": {"mode": "selective"}}
PARITY = {"tp2_dp2_full2": ("cpu_tp2_dp2", MODES["full2"]), "tp2_pp2_selective": ("cpu_tp2_pp2", MODES["selective"]),
          "zero3_dp4_full1": ("cpu_zero3_dp4", MODES["full1"])}


def _recipe(base, **blocks):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(base).to_dict()
    data.update(blocks)
    return Recipe.from_dict(data)


def _local_params(engine) -> dict:
    from torch.distributed.tensor import DTensor

    module = getattr(engine, "container", None) or engine.module
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def _count_calls(model, counts: dict) -> None:
    """``counts["block"]``: Block forwards begun (the recompute of ``full`` begins each again; a pre-hook, as torch's
    checkpoint stops a recompute once it has what backward needs, before the block returns); ``counts["core"]``:
    attention-core calls (``selective`` recomputes it)."""
    from plugin.models.gpt import Block

    def block_hook(*_):
        counts["block"] += 1

    for m in model.modules():
        if isinstance(m, Block):
            m.register_forward_pre_hook(block_hook)
            core = m.attn._core

            def counted(*args, _core=core):
                counts["core"] += 1
                return _core(*args)

            m.attn._core = counted


def _count_hf_attention(model, counts: dict) -> None:
    """``counts["block"]``: decoder-layer attention forwards begun (inside the checkpointed layer forward)."""
    from plugin.engines.recompute import hf_decoder_layers

    def hook(*_):
        counts["block"] += 1

    for layer in hf_decoder_layers(model):
        layer.self_attn.register_forward_pre_hook(hook)


def _train(recipe, backend, hf=False):
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if hf:
        from plugin.models.hf import build_hf_model

        model = build_hf_model("llama", recipe.model)
    else:
        model = GPT(GPTConfig.from_recipe_model(recipe.model))
    engine = plugin.initialize(model, recipe, backend=backend)
    counts = {"block": 0, "core": 0}
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses = []
    for step in range(STEPS):
        if step == STEPS - 1:  # the last step only: a native pipeline's first step runs one more forward
            (_count_hf_attention if hf else _count_calls)(engine.whole_model, counts)
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
    return losses, _local_params(engine), counts


def _reference(recipe):
    """One process, the whole global batch, no recompute: the losses every layout must train."""
    return gpt_reference(recipe, STEPS)[0]


def _run_all(rank, world_size, backend):
    out = {}
    for layout in ("cpu_tp2_pp2", "cpu_tp2_dp2"):
        for dropout in (0.1, 0.0):
            for mode, ac in MODES.items():
                if dropout == 0.0 and mode != "none":
                    continue
                recipe = _recipe(layout, model={**MODEL, "dropout": dropout}, optimizer=SGD,
                                 activation_checkpointing=ac)
                out[(layout, dropout, mode)] = _train(recipe, backend)
    if importlib.util.find_spec("transformers") is not None:
        for mode in ("none", "full1"):
            recipe = _recipe("cpu_tp2_dp2", model=MODEL, optimizer=SGD, activation_checkpointing=MODES[mode])
            out[("hf_llama", mode)] = _train(recipe, backend, hf=True)
    for name, (base, ac) in PARITY.items():
        recipe = _recipe(base, activation_checkpointing=ac)
        out[name] = (_train(recipe, backend)[0], _reference(recipe))
    return out


def _launch(backend):
    return run(_run_all, 4, backend, timeout_s=300)


@pytest.fixture(scope="module", params=[pytest.param("native", marks=pytest.mark.native),
                                        pytest.param("deepspeed", marks=[pytest.mark.deepspeed, pytest.mark.slow])])
def results(request):
    if request.param == "deepspeed":
        need("deepspeed")
    return request.param, _launch(request.param)


@pytest.mark.parametrize("layout", ["cpu_tp2_pp2", "cpu_tp2_dp2"])
def test_recompute_gives_the_gradients_of_no_recompute(results, layout):
    backend, outs = results
    for rank, out in enumerate(outs):
        losses, params, counts = out[(layout, 0.1, "none")]
        assert counts["block"] > 0 and counts["core"] == counts["block"], (rank, counts)
        for mode in ("full1", "full2", "selective"):
            got_losses, got_params, got_counts = out[(layout, 0.1, mode)]
            where = f"{backend} {layout} {mode} rank {rank}"
            assert got_losses == losses, f"{where}: {got_losses} != {losses}"
            assert got_params.keys() == params.keys(), where
            different = [n for n in params if not torch.equal(got_params[n], params[n])]
            assert not different, f"{where}: parameters after {STEPS} SGD steps differ: {different}"
            if mode == "selective":
                assert got_counts == {"block": counts["block"], "core": 2 * counts["core"]}, (where, got_counts)
            else:
                assert got_counts == {"block": 2 * counts["block"], "core": 2 * counts["core"]}, (where, got_counts)
        no_dropout = out[(layout, 0.0, "none")][0]
        assert max(abs(a - b) for a, b in zip(losses, no_dropout, strict=True)) > 1e-4, \
            f"{backend} {layout} rank {rank}: dropout 0.1 trains like dropout 0 ({losses}): no mask was drawn"


@pytest.mark.parametrize("name", list(PARITY))
def test_recompute_trains_one_process_losses(results, name):
    backend, outs = results
    for rank, out in enumerate(outs):
        losses, want = out[name]
        assert losses == pytest.approx(want, rel=1e-4), f"{backend} {name} rank {rank}"


def test_transformers_decoder_layers_recompute_with_the_gradients_of_no_recompute(results):
    backend, outs = results
    need("transformers")
    for rank, out in enumerate(outs):
        (losses, params, counts), (got_losses, got_params, got_counts) = out[("hf_llama", "none")], \
            out[("hf_llama", "full1")]
        where = f"{backend} llama tp2 x dp2 rank {rank}"
        assert got_losses == losses, f"{where}: {got_losses} != {losses}"
        different = [n for n in params if not torch.equal(got_params[n], params[n])]
        assert got_params.keys() == params.keys() and not different, f"{where}: {different}"
        assert counts["block"] > 0 and got_counts["block"] == 2 * counts["block"], (where, counts, got_counts)
