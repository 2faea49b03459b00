"""The DeepSpeed engine on what the launcher suites cannot see, in one spawn of 4 gloo processes
(``plugin.initialize(..., backend="deepspeed")``):

* tensor x pipeline x sequence parallel with dropout 0.1 (cpu_tp2_sp_pp2, tp2 x pp2):
  - activation checkpointing (``activation_checkpointing`` full, every 1) gives the per-step losses of the same run
    without it, bitwise: the recompute draws the forward's tensor-parallel dropout masks
    (:mod:`plugin.tensor_parallel.recompute`); dropout 0.1 really draws masks (other losses than dropout 0);
  - a run saved after step 2 and resumed by a fresh engine (its generators moved elsewhere first) gives the
    uninterrupted run's steps 3-4, bitwise: the checkpoint restores each rank's tensor-parallel streams;
  - DeepSpeed's pipeline engine runs with activation partitioning off (``is_pipe_partitioned`` /
    ``is_grad_partitioned``): stage outputs are sequence slices, not replicated;
* the config each running engine holds (``DeepSpeedEngine.config``) equals the exported ds_config
  (:func:`plugin.interop.deepspeed_config.to_ds_config`) key by key, but for the keys the engine documents it adjusts
  (:data:`plugin.engines.deepspeed.config.ENGINE_ADJUSTED_KEYS`), for that pipeline, ZeRO-1 with optimizer offload
  at tp2 x dp2 (with an lr_schedule, whose exported scheduler block the engine drops), context 2 x pipeline 2 (its
  grid's batch triple) and ZeRO-3 at dp4.

The native back end's recompute is held to the same in :mod:`.test_native_engine`; both back ends' recompute
(full and selective, with and without pipelines) against no recompute, gradient for gradient, in :mod:`.test_recompute`.
"""
import pytest

from .needs import need
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
need("deepspeed")

STEPS, SAVE_AFTER = 4, 2
MODEL = {"layers": 4, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}


def _recipe(base, **blocks):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(base).to_dict()
    data.update(blocks)
    return Recipe.from_dict(data)


def _dropout_recipe(dropout, interval):
    pp = {"schedule": "1f1b", "partition": "uniform"}
    ac = {"mode": "full" if interval else "none", "every": max(1, interval)}
    return _recipe("cpu_tp2_sp_pp2", model={**MODEL, "dropout": dropout}, pipeline_parallel=pp,
                   activation_checkpointing=ac)


def _engine(recipe):
    import torch

    import plugin
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="deepspeed")


def _steps(engine, start, stop):
    from plugin.data.text import TextBatches

    data = TextBatches(engine.recipe.model.vocab, engine.recipe.model.seq_len)
    return [engine.train_step(data.global_batch(step, engine.layout.global_batch)) for step in range(start, stop)]


def _differences(got, want, prefix=""):
    """Key paths ("a.b") where two configs differ: present in one only, or with other values."""
    out = set()
    for key in set(got) | set(want):
        path = f"{prefix}{key}"
        a, b = got.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= _differences(a, b, path + ".")
        elif key not in got or key not in want or a != b:
            out.add(path)
    return out


def _config_gap(engine, recipe):
    from plugin.interop.deepspeed_config import to_ds_config

    return sorted(_differences(engine.ds.config, to_ds_config(recipe, 4)))


def _run_all(rank, world_size, ckpt):
    import torch

    out, gaps = {}, {}
    # ZeRO-3 at dp4 first: DeepSpeed keeps the last engine's model-parallel group in a module global, and an
    # engine without tensor parallelism built after one with it takes that group's size
    recipe = _recipe("cpu_zero3_dp4")
    gaps["dp4_zero3"] = _config_gap(_engine(recipe), recipe)
    for dropout, interval in ((0.1, 0), (0.1, 1), (0.0, 0)):
        recipe = _dropout_recipe(dropout, interval)
        engine = _engine(recipe)
        if (dropout, interval) == (0.1, 0):
            gaps["cpu_tp2_sp_pp2"] = _config_gap(engine, recipe)
            out["partitioned"] = (engine.ds.is_pipe_partitioned, engine.ds.is_grad_partitioned)
            losses = _steps(engine, 0, SAVE_AFTER)
            engine.save(ckpt)
            losses += _steps(engine, SAVE_AFTER, STEPS)
        else:
            losses = _steps(engine, 0, STEPS)
        out[f"dropout_{dropout}_checkpoint_{interval}"] = losses
    resumed = _engine(_dropout_recipe(0.1, 0))
    torch.manual_seed(1234)  # elsewhere than at the save: only the checkpoint can bring the generators back
    _steps(resumed, 0, 1)  # and the tensor-parallel streams moved on too
    assert resumed.load(ckpt)["step"] == SAVE_AFTER
    out["resumed"] = _steps(resumed, SAVE_AFTER, STEPS)
    # context 2 x pipeline 2: the grid counts data x context ranks in its batch triple (train_batch_size x context)
    recipe = _recipe("cpu_pp2_dp2", parallelism={"data": 1, "tensor": 1, "pipeline": 2, "context": 2})
    gaps["cp2_pp2"] = _config_gap(_engine(recipe), recipe)
    # with an lr_schedule: the export's nearest DeepSpeed scheduler block is dropped for the plugin's LambdaLR
    recipe = _recipe("cpu_tp2_dp2", zero={"stage": 1, "offload_optimizer": "cpu"},
                     lr_schedule={"warmup_steps": 2, "decay": "cosine", "decay_steps": 8})
    gaps["tp2_dp2_zero1_offload"] = _config_gap(_engine(recipe), recipe)
    out["gaps"] = gaps
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(_run_all, 4, str(tmp_path_factory.mktemp("ckpt")), timeout_s=300)


def test_recompute_draws_the_forwards_tensor_parallel_dropout_masks(results):
    for rank, out in enumerate(results):
        assert out["dropout_0.1_checkpoint_1"] == out["dropout_0.1_checkpoint_0"], f"rank {rank}"
        assert out["dropout_0.1_checkpoint_0"] != pytest.approx(out["dropout_0.0_checkpoint_0"], rel=1e-3), \
            f"rank {rank}: dropout 0.1 trains like dropout 0: no mask was drawn"


def test_resume_continues_with_the_uninterrupted_losses(results):
    for rank, out in enumerate(results):
        assert out["resumed"] == out["dropout_0.1_checkpoint_0"][SAVE_AFTER:], f"rank {rank}"


def test_sequence_parallel_stages_send_whole_activations(results):
    assert [out["partitioned"] for out in results] == [(False, False)] * 4


def test_the_engine_runs_the_exported_config_but_for_the_documented_keys(results):
    from plugin.engines.deepspeed.config import ENGINE_ADJUSTED_KEYS

    for rank, out in enumerate(results):
        for name, gap in out["gaps"].items():
            assert set(gap) <= set(ENGINE_ADJUSTED_KEYS), \
                f"rank {rank}, {name}: undocumented {set(gap) - set(ENGINE_ADJUSTED_KEYS)}"
    seen = set().union(*(gap for out in results for gap in out["gaps"].values()))
    assert seen == set(ENGINE_ADJUSTED_KEYS), f"documented but never adjusted here: {set(ENGINE_ADJUSTED_KEYS) - seen}"
