"""What a newcomer runs: ./launch.sh with no recipe (the README's main command, shortened) and the LeNet
example under a real launcher."""
import re
import subprocess
import sys

import pytest

from .runs import ROOT, cpu_env, launcher_argv

pytestmark = pytest.mark.dist


def test_launch_sh_trains_the_default_recipe(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([str(ROOT / "launch.sh"), "--", "--steps", "3", "--metrics", str(metrics)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=cpu_env(PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "trained cpu_dp4 with" in out.stderr and "data 4 x tensor 1 x pipeline 1" in out.stderr
    assert len(metrics.read_text().splitlines()) == 3


def test_lenet_example_learns_data_parallel(tmp_path):
    launcher = "deepspeed" if _has("deepspeed") else "torchrun"
    cmd = launcher_argv(launcher, 2) + [str(ROOT / "examples" / "lenet_dp.py"), "--steps", "60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    found = re.search(r"over 2 process\(es\), held-out accuracy ([\d.]+)%", out.stdout)
    assert found, out.stdout[-2000:]
    assert float(found.group(1)) > 80.0, out.stdout[-2000:]


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None
