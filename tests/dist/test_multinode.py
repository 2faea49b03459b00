"""Two nodes on localhost give the losses of one node of four: launch.sh started twice at once, with
``--nodes 2 --node-rank 0|1 --master 127.0.0.1:PORT --nproc 2``, against launch.sh with ``--nproc 4``.

One layout per launcher, each with a group that crosses the two "nodes": torchrun runs cpu_pp2_dp2 (the
pipeline's two stages sit on different nodes), accelerate launch runs cpu_dp4 at ZeRO-0 (Accelerate's own
DDP engine where deepspeed is missing), deepspeed (``--no_ssh`` with a generated hostfile) runs cpu_tp2_dp2.
torchrun and accelerate run where deepspeed is not installed (launch.sh's own choice there), deepspeed where it is.
"""
import importlib.util
import math
import subprocess
import sys
import time

import pytest

from .ports import free_port
from .runs import ROOT, Run, cpu_env, recipe_variant

pytestmark = [pytest.mark.dist, pytest.mark.native]

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS, RTOL, TIMEOUT = 3, 1e-4, 240
CASES = {  # launcher -> (base recipe, replaced blocks)
    "torchrun": ("cpu_pp2_dp2", {}),
    "accelerate": ("cpu_dp4", {"zero": {"stage": 0}}),
    "deepspeed": ("cpu_tp2_dp2", {}),
}


def launch_sh(launcher, recipe, tmp, tag, *node_args):
    metrics = tmp / f"metrics-{tag}.jsonl"
    cmd = ["bash", str(ROOT / "launch.sh"), "--launcher", launcher, *node_args, str(recipe), "--",
           "--steps", str(STEPS), "--metrics", str(metrics)]
    env = cpu_env(PYTHON=sys.executable)
    return cmd, metrics, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          cwd=tmp, env=env)


def finish(cmd, metrics, proc, start) -> Run:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return Run(cmd, proc.returncode, out, err, time.perf_counter() - start, metrics)


@pytest.mark.parametrize("launcher", list(CASES))
def test_two_nodes_equal_one_node_of_four(launcher, tmp_path):
    if launcher == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    if launcher != "deepspeed" and HAS_DEEPSPEED:
        pytest.skip("runs where deepspeed is not installed (.ci/run's second venv), as the native suite does")
    if launcher == "accelerate":
        pytest.importorskip("accelerate")
    base, blocks = CASES[launcher]
    recipe = recipe_variant(base, tmp_path, f"{base}_{launcher}", **blocks)

    start = time.perf_counter()
    one = finish(*launch_sh(launcher, recipe, tmp_path, "one", "--nproc", "4"), start)
    assert one.returncode == 0, one.log()

    master = f"127.0.0.1:{free_port()}"
    start = time.perf_counter()
    nodes = [launch_sh(launcher, recipe, tmp_path, f"node{r}", "--nodes", "2", "--node-rank", str(r),
                       "--master", master, "--nproc", "2") for r in (0, 1)]
    runs = [finish(*node, start) for node in nodes]
    for run in runs:
        assert run.returncode == 0, run.log()
    two = runs[0]  # global rank 0 lives on node 0 and writes the metrics
    assert sorted(two.losses) == list(range(1, STEPS + 1)), two.log() + runs[1].log()
    for step in range(1, STEPS + 1):
        assert math.isclose(two.losses[step], one.losses[step], rel_tol=RTOL), \
            f"step {step}: two nodes {two.losses[step]!r} != one node {one.losses[step]!r}\n{two.log()}"
