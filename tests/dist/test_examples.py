"""What a newcomer runs: ./launch.sh with no recipe (the README's main command, shortened) and the LeNet
example under a real launcher, and in bf16 in one process (float images, cast by the engine)."""
import json
import re
import subprocess
import sys

import pytest

from .runs import ROOT, cpu_env, launcher_argv

pytestmark = pytest.mark.dist


def test_launch_sh_trains_the_default_recipe(tmp_path):
    """From the caller's own directory: train.py's relative --metrics lands there, not in the checkout."""
    out = subprocess.run([str(ROOT / "launch.sh"), "--", "--steps", "3", "--metrics", "m.jsonl"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cpu_env(PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "trained cpu_dp4 with" in out.stderr and "data 4 x tensor 1 x pipeline 1" in out.stderr
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


def test_lenet_example_learns_data_parallel(tmp_path):
    launcher = "deepspeed" if _has("deepspeed") else "torchrun"
    cmd = launcher_argv(launcher, 2) + [str(ROOT / "examples" / "lenet_dp.py"), "--steps", "60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    found = re.search(r"over 2 process\(es\), held-out accuracy ([\d.]+)%", out.stdout)
    assert found, out.stdout[-2000:]
    assert float(found.group(1)) > 80.0, out.stdout[-2000:]


def test_lenet_example_in_bf16(tmp_path):
    """Under bf16 DeepSpeed casts LeNet to bf16; the float images must be cast too (train and evaluation)."""
    if not _has("deepspeed"):
        pytest.skip("bf16 casting is the DeepSpeed engine's; the native engines autocast")
    data = json.loads((ROOT / "examples" / "lenet_dp.json").read_text())
    data.pop("$schema")
    recipe = tmp_path / "lenet_bf16.json"
    recipe.write_text(json.dumps({**data, "name": "lenet_bf16", "precision": "bf16"}))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "lenet_dp.py"), "--recipe", str(recipe),
                          "--steps", "10"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    found = re.search(r"deepspeed over 1 process\(es\), held-out accuracy ([\d.]+)%", out.stdout)
    assert found, out.stdout[-2000:]
    assert float(found.group(1)) > 20.0, "10 steps already beat chance (10%)\n" + out.stdout[-2000:]


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None
