"""The few checks that need CUDA (each skipped without the GPUs it needs): NCCL groups, the engines on GPUs,
and the paths that do nothing on a CPU.

* 2+ GPUs: a tensor-parallel x data-parallel layout launched on the GPUs gives the losses of one GPU, under
  deepspeed and torchrun; Accelerate's FSDP2 plugin (ZeRO-3 under ``accelerate launch`` where deepspeed is
  not importable: hidden from the launched processes, as in :mod:`.test_native_parity`) gives them too
  (Accelerate reaches FSDP only through its multi-GPU launcher, so not on one GPU).
* 1+ GPU: the DeepSpeed engine steps torch's fused AdamW, and DeepSpeed's CPUAdam only under optimizer offload
  (where that op builds; torch's AdamW otherwise); Accelerate's fp16 (its GradScaler, fed from the recipe's fp16 block)
  tracks fp32 on one GPU; the native FSDP2 ``CPUOffloadPolicy`` really keeps the sharded parameters, their gradients and
  Adam's moments in CPU memory inside an optimizer step while the engine computes on the GPU (on a CPU machine offload
  is a no-op, so only here can it be seen), and trains as without offload.

TF32 is off in train.py's numbers only if torch's default (off for matmul) holds; the tolerance is looser
than on the CPU because cuBLAS sums in other orders across shapes.
"""
import os

import pytest
import torch

from .needs import need
from .runs import cpu_env, recipe_variant, train

pytestmark = [pytest.mark.cuda, pytest.mark.dist]
GPUS = torch.cuda.device_count()
ONE_GPU = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA devices")
STEPS, RTOL = 5, 1e-3


def _env(hide=None, tmp_path=None):
    """The launch environment on GPUs; ``hide``: a package made unimportable in the launched processes."""
    env = cpu_env()
    env.pop("DS_ACCELERATOR", None)  # let DeepSpeed find the GPUs
    if hide:
        site = tmp_path / f"hide_{hide}"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{hide!r}] = None\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def _assert_close(got, ref, rtol=RTOL, steps=range(1, STEPS + 1)):
    for step in steps:
        assert got.losses[step] == pytest.approx(ref.losses[step], rel=rtol), f"step {step}\n{got.log()}"


@TWO_GPUS
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_tensor_and_data_parallel_on_gpus_match_one_gpu(launcher, tmp_path):
    if launcher == "deepspeed":
        need("deepspeed")
    gpus = GPUS // 2 * 2
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, "gpu_tp2_auto", parallelism={"data": "auto", "tensor": 2},
                            batch={"micro": 2, "grad_accum": 2}, cluster={"nodes": 1, "gpus_per_node": gpus},
                            launcher="auto" if launcher == "deepspeed" else "torchrun")
    single = recipe_variant("cpu_single", tmp_path, "gpu_single", batch={"micro": 2, "grad_accum": gpus})
    ref = train(single, 1, tmp_path, launcher="python", steps=STEPS, env=_env())
    got = train(recipe, gpus, tmp_path, launcher=launcher, steps=STEPS, env=_env())
    _assert_close(got, ref)


@TWO_GPUS
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_accelerate_fsdp2_plugin_matches_one_gpu(offload, tmp_path):
    """ZeRO-3 (and with CPU offload) under accelerate launch without deepspeed: Accelerator with its FSDP2 plugin."""
    need("accelerate")
    n = 4 if GPUS >= 4 else 2  # micro 4 x grad_accum 4/n x data n: cpu_single's global batch of 16
    recipe = recipe_variant("cpu_dp4", tmp_path, f"gpu_fsdp_{offload}", parallelism={"data": n},
                            zero={"stage": 3, "offload_param": offload, "offload_optimizer": offload},
                            cluster={"nodes": 1, "gpus_per_node": n})
    ref = train("cpu_single", 1, tmp_path, launcher="python", steps=STEPS, env=_env())
    got = train(recipe, n, tmp_path, launcher="accelerate", steps=STEPS, env=_env("deepspeed", tmp_path))
    assert got.backend == "accelerate", got.log()
    assert "note: accelerate launch: ZeRO-3: Accelerate's FSDP2 plugin" in got.stderr, got.log()
    _assert_close(got, ref)


@ONE_GPU
def test_accelerate_fp16_grad_scaler_tracks_fp32_on_one_gpu(tmp_path):
    """fp16 through Accelerate's DDP mode on one GPU (autocast + its GradScaler from the recipe's fp16 block):
    within 1% of fp32 (the native fp16 bound on the CPU is 0.5% over 3 steps; these are 5), and not equal to
    fp32 to 1e-4 at every step (fp16 really on)."""
    need("accelerate")
    recipe = recipe_variant("cpu_single", tmp_path, "gpu_fp16", precision="fp16", fp16={"initial_scale_power": 16})
    ref = train("cpu_single", 1, tmp_path, launcher="python", steps=STEPS, env=_env())
    got = train(recipe, 1, tmp_path, launcher="accelerate", steps=STEPS, env=_env())
    assert got.backend == "accelerate", got.log()
    assert "ZeRO-0, fp16" in got.stderr, got.log()
    _assert_close(got, ref, rtol=1e-2)
    assert any(abs(got.losses[s] / ref.losses[s] - 1) > 1e-4 for s in range(1, STEPS + 1)), got.log()


def _where_offloaded_state_lives(rank, world_size):
    """One process on a GPU: ZeRO-3 with and without CPU offload; devices seen inside the second optimizer step."""
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    out = {}
    for offload in ("cpu", "none"):
        data = load_recipe("cpu_single").to_dict()
        data["zero"] = {"stage": 3, "offload_param": offload, "offload_optimizer": offload}
        recipe = Recipe.from_dict(data)
        torch.manual_seed(0)
        engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")
        batches = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        seen, inner = {}, engine.optimizer
        original = inner.step

        def step(*args, engine=engine, seen=seen, inner=inner, original=original, **kwargs):
            local = [getattr(p, "_local_tensor", p) for p in engine.container.parameters()]
            seen["parameters"] = {t.device.type for t in local}
            seen["gradients"] = {getattr(p.grad, "_local_tensor", p.grad).device.type
                                 for p in engine.container.parameters() if p.grad is not None}
            seen["optimizer_states"] = {getattr(v, "_local_tensor", v).device.type for state in inner.state.values()
                                        for v in state.values() if torch.is_tensor(v) and v.dim() > 0}
            inner.step = original
            return original(*args, **kwargs)

        losses = []
        for i in range(3):
            if i == 1:
                inner.step = step
            losses.append(engine.train_step(batches.global_batch(i, engine.layout.global_batch)))
        out[offload] = {"devices": seen, "engine_device": engine.device.type, "losses": losses}
    return out


@ONE_GPU
def test_native_cpu_offload_keeps_shards_on_the_cpu():
    from .spawn import run

    out = run(_where_offloaded_state_lives, 1, backend="nccl", timeout_s=300)[0]
    offloaded, resident = out["cpu"], out["none"]
    assert offloaded["engine_device"] == resident["engine_device"] == "cuda", out
    assert offloaded["devices"] == {"parameters": {"cpu"}, "gradients": {"cpu"}, "optimizer_states": {"cpu"}}, out
    assert resident["devices"] == {"parameters": {"cuda"}, "gradients": {"cuda"}, "optimizer_states": {"cuda"}}, out
    assert offloaded["losses"] == pytest.approx(resident["losses"], rel=RTOL), out


def _deepspeed_optimizers_on_gpu(rank, world_size):
    """One process on a GPU, DeepSpeed engine at ZeRO-1 with and without optimizer offload: which optimizer steps."""
    import plugin
    from plugin.data.text import TextBatches
    from plugin.engines.deepspeed.optimizer import cpu_adam_error
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    out = {"cpu_adam_error": cpu_adam_error()}
    for offload in ("none", "cpu"):
        data = load_recipe("cpu_single").to_dict()
        data["zero"] = {"stage": 1, "offload_optimizer": offload}
        recipe = Recipe.from_dict(data)
        torch.manual_seed(0)
        engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="deepspeed")
        inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)  # ZeRO wraps the optimizer it steps
        batches = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        losses = [engine.train_step(batches.global_batch(i, engine.layout.global_batch)) for i in range(3)]
        out[offload] = {"type": type(inner).__name__, "fused": inner.defaults.get("fused"), "losses": losses,
                        "device": engine.device.type}
    return out


@ONE_GPU
def test_deepspeed_steps_torchs_fused_adamw_and_cpu_adam_only_under_offload():
    """Nothing JIT-builds inside deepspeed.initialize: torch's fused AdamW on the GPU; under optimizer offload
    DeepSpeed's CPUAdam where its op builds here, else torch's AdamW on the CPU states. Both train alike."""
    need("deepspeed")
    from .spawn import run

    out = run(_deepspeed_optimizers_on_gpu, 1, backend="nccl", timeout_s=600)[0]
    resident, offloaded = out["none"], out["cpu"]
    assert resident["device"] == offloaded["device"] == "cuda", out
    assert (resident["type"], resident["fused"]) == ("AdamW", True), out
    if out["cpu_adam_error"] is None:
        assert offloaded["type"] == "DeepSpeedCPUAdam", out
    else:
        assert (offloaded["type"], offloaded["fused"]) == ("AdamW", False), out
    assert offloaded["losses"] == pytest.approx(resident["losses"], rel=RTOL), out
    assert resident["losses"][-1] < resident["losses"][0], out
