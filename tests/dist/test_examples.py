"""What a newcomer runs: ./launch.sh with no recipe (the README's main command, shortened), the LeNet example
under a real launcher, in bf16 in one process (float images, cast or autocast by the engine), and in bf16 at
ZeRO-1 under `accelerate launch` (Accelerate's DeepSpeed plugin: DeepSpeed casts LeNet, the images must follow).

Each launch also checks rank 0's start-up line (back end, device, process groups, layout, precision). The
launch.sh, torchrun and plain-python paths are ``native`` too: they run in the no-DeepSpeed suite, where the
native back end trains them (with deepspeed installed, launcher "auto" picks DeepSpeed under torchrun and
python); the `deepspeed` launcher and Accelerate's DeepSpeed plugin need deepspeed.
"""
import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

from .needs import need
from .runs import ROOT, cpu_env, launcher_argv, release_deepspeed_shm

pytestmark = pytest.mark.dist
LENET = ROOT / "examples" / "lenet_dp.py"


def _has(module) -> bool:
    return importlib.util.find_spec(module) is not None


def _auto_backend() -> str:
    """What launcher "auto" trains with outside `accelerate launch`: DeepSpeed where it is installed."""
    return "deepspeed" if _has("deepspeed") else "native"


def _lenet_recipe(tmp_path, name, **changes):
    data = json.loads((ROOT / "examples" / "lenet_dp.json").read_text())
    data.pop("$schema")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**data, "name": name, **changes}))
    return path


def _run_example(cmd, launcher, tmp_path, **env):
    """Run an example's launch; a deepspeed launch's shm buffers are released even when a rank crashed."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=cpu_env(**env))
    finally:
        if launcher in ("deepspeed", "accelerate"):
            flag = "--master_port" if launcher == "deepspeed" else "--main_process_port"
            release_deepspeed_shm(cmd[cmd.index(flag) + 1])


def _start_line(stderr: str) -> str:
    found = re.findall(r": (start: .*)$", stderr, re.M)
    assert len(found) == 1, f"rank 0 prints one start-up line, found {found}\n{stderr[-3000:]}"
    return found[0]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", stdout, re.M)]


@pytest.mark.native
@pytest.mark.nods
def test_launch_sh_trains_the_default_recipe(tmp_path):
    """From the caller's own directory: train.py's relative --metrics lands there, not in the checkout. Also in the
    venv without deepspeed (nods), where launch.sh picks another launcher and the native back end trains."""
    out = subprocess.run([str(ROOT / "launch.sh"), "--", "--steps", "3", "--metrics", "m.jsonl"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cpu_env(PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "trained cpu_dp4 with" in out.stderr and "data 4 x tensor 1 x pipeline 1" in out.stderr
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    assert " on cpu, gloo, data 4 x tensor 1 x pipeline 1, ZeRO-1, fp32 (torch " in _start_line(out.stderr)


# the README suite runs it under torchrun; under deepspeed (its engine's other paths are the parity suites') it is slow
@pytest.mark.parametrize("launcher", [pytest.param("deepspeed", marks=[pytest.mark.deepspeed, pytest.mark.slow]),
                                      pytest.param("torchrun", marks=pytest.mark.native)])
def test_lenet_example_learns_data_parallel(launcher, tmp_path):
    if launcher == "deepspeed":
        need("deepspeed")
    cmd = launcher_argv(launcher, 2) + [str(LENET), "--steps", "60"]
    out = _run_example(cmd, launcher, tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    backend = "deepspeed" if launcher == "deepspeed" else _auto_backend()
    assert _start_line(out.stderr).startswith(f"start: {backend} on cpu, gloo, data 2 x tensor 1 x pipeline 1, "
                                              "ZeRO-0, fp32 (torch "), out.stderr[-3000:]
    found = re.search(rf"{backend} over 2 process\(es\), held-out accuracy ([\d.]+)%", out.stdout)
    assert found, out.stdout[-2000:]
    assert float(found.group(1)) > 80.0, out.stdout[-2000:]


@pytest.mark.native
def test_lenet_example_in_bf16(tmp_path):
    """One process, bf16: DeepSpeed casts LeNet to bf16 and the engine casts the float images (train and
    evaluation); the native engine autocasts instead. Either way it learns."""
    recipe = _lenet_recipe(tmp_path, "lenet_bf16", precision="bf16")
    out = subprocess.run([sys.executable, str(LENET), "--recipe", str(recipe), "--steps", "10"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    backend = _auto_backend()
    assert f"start: {backend} on cpu, gloo, data 1 x tensor 1 x pipeline 1, ZeRO-0, bf16" in out.stderr, \
        out.stderr[-3000:]
    found = re.search(rf"{backend} over 1 process\(es\), held-out accuracy ([\d.]+)%", out.stdout)
    assert found, out.stdout[-2000:]
    assert float(found.group(1)) > 20.0, "10 steps already beat chance (10%)\n" + out.stdout[-2000:]


@pytest.mark.deepspeed
@pytest.mark.slow  # Accelerate's DeepSpeed plugin under accelerate launch is also test_native_parity's (cpu_dp4_zero1)
def test_lenet_bf16_zero1_under_accelerate_launch(tmp_path):
    """ZeRO-1 under `accelerate launch` is Accelerate's DeepSpeed plugin, which casts LeNet to bf16 and adds no
    autocast: without the engine casting the float images, the first convolution fails ("Input type (float)
    and bias type (c10::BFloat16) should be the same")."""
    for name in ("accelerate", "deepspeed", "transformers"):
        need(name)
    recipe = _lenet_recipe(tmp_path, "lenet_bf16_zero1", precision="bf16", zero={"stage": 1})
    cmd = launcher_argv("accelerate", 2) + [str(LENET), "--recipe", str(recipe), "--steps", "30"]
    out = _run_example(cmd, "accelerate", tmp_path, ACCELERATE_USE_CPU="true")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "note: accelerate launch: ZeRO-1: Accelerate's DeepSpeed plugin" in out.stderr, out.stderr[-3000:]
    assert _start_line(out.stderr).startswith("start: accelerate (deepspeed) on cpu, gloo, data 2 x tensor 1 x "
                                              "pipeline 1, ZeRO-1, bf16"), out.stderr[-3000:]
    losses = _losses(out.stdout)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out.stdout[-2000:]
    assert losses[-1] < 0.8 * losses[0], f"bf16 LeNet does not learn: {losses}"
    assert re.search(r"accelerate over 2 process\(es\), held-out accuracy", out.stdout), out.stdout[-2000:]


@pytest.mark.parametrize("launcher", [pytest.param("deepspeed", marks=[pytest.mark.deepspeed, pytest.mark.slow]),
                                      pytest.param("torchrun", marks=[pytest.mark.native, pytest.mark.slow]),
                                      pytest.param("accelerate", marks=[pytest.mark.native, pytest.mark.slow])])
def test_hf_llama_example_trains_tp2_pp2_on_local_data(launcher, tmp_path):
    """examples/hf_llama.py: a transformers Llama from a config, the shipped JSONL through engine.dataloader (dict
    batches), cpu_tp2_pp2 on 4 processes, a save; the loss falls, the checkpoint is written."""
    need("transformers")
    need("datasets")
    if launcher != "torchrun":
        need(launcher)
    cmd = launcher_argv(launcher, 4) + [str(ROOT / "examples" / "hf_llama.py"), "--steps", "4",
                                        "--save", str(tmp_path / "ckpt")]
    out = _run_example(cmd, launcher, tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    backend = {"deepspeed": "deepspeed", "torchrun": _auto_backend(), "accelerate": "native"}[launcher]
    assert _start_line(out.stderr).startswith(f"start: {backend} on cpu, gloo, data 1 x tensor 2 x pipeline 2"), \
        out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", out.stdout, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0], out.stdout[-2000:]
    assert any((tmp_path / "ckpt").iterdir())
