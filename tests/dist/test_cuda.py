"""The few checks that need CUDA (skipped without 2+ GPUs): NCCL groups, the engine on GPUs.

Same parity as on the CPU: a tensor-parallel x data-parallel layout launched on the GPUs gives the losses
of one GPU. TF32 is off in train.py's numbers only if torch's default (off for matmul) holds; the tolerance
is looser than on the CPU because cuBLAS sums in other orders across shapes.
"""
import pytest
import torch

from .runs import recipe_variant, train

pytestmark = [pytest.mark.cuda, pytest.mark.dist,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices")]


def _env():
    from .runs import cpu_env

    env = cpu_env()
    env.pop("DS_ACCELERATOR", None)  # let DeepSpeed find the GPUs
    return env


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_tensor_and_data_parallel_on_gpus_match_one_gpu(launcher, tmp_path):
    if launcher == "deepspeed":
        pytest.importorskip("deepspeed")
    gpus = torch.cuda.device_count() // 2 * 2
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, "gpu_tp2_auto", parallelism={"data": "auto", "tensor": 2},
                            batch={"micro": 2, "grad_accum": 2}, cluster={"nodes": 1, "gpus_per_node": gpus},
                            launcher="auto" if launcher == "deepspeed" else "torchrun")
    single = recipe_variant("cpu_single", tmp_path, "gpu_single", batch={"micro": 2, "grad_accum": gpus})
    ref = train(single, 1, tmp_path, launcher="python", steps=5, env=_env())
    got = train(recipe, gpus, tmp_path, launcher=launcher, steps=5, env=_env())
    for step in range(1, 6):
        assert got.losses[step] == pytest.approx(ref.losses[step], rel=1e-3), got.log()
