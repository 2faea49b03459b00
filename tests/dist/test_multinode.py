"""Two nodes on localhost give the losses of one node of four: launch.sh started twice at once, with
``--nodes 2 --node-rank 0|1 --master 127.0.0.1:PORT --nproc 2``, against launch.sh with ``--nproc 4``.

One layout per launcher, each with a group that crosses the two "nodes": torchrun runs cpu_pp2_dp2 (the
pipeline's two stages sit on different nodes), accelerate launch runs cpu_dp4 at ZeRO-0 (Accelerate's own
DDP engine), deepspeed (``--no_ssh`` with a generated hostfile) runs cpu_tp2_dp2. All three in .ci/run's slow step,
in the venv with deepspeed: torchrun's recipe is forced native by its ``launcher`` field.
Each run must name the back end and layout it trained (train.py's summary), and both the one-node and the
two-node losses must equal one plain python process's (cpu_single, the parity suites' reference).
"""
import importlib.util
import math
import re
import subprocess
import sys
import time

import pytest

from .needs import need
from .ports import free_port
from .runs import ROOT, Run, cpu_env, recipe_variant, train

pytestmark = [pytest.mark.dist, pytest.mark.native]

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS, RTOL, TIMEOUT = 3, 1e-4, 240
CASES = {  # launcher -> (base recipe, replaced blocks, the back end that trains, its layout in the summary)
    "torchrun": ("cpu_pp2_dp2", {"launcher": "torchrun"}, "native", "data 2 x tensor 1 x pipeline 2"),
    "accelerate": ("cpu_dp4", {"zero": {"stage": 0}}, "accelerate", "data 4 x tensor 1 x pipeline 1"),
    "deepspeed": ("cpu_tp2_dp2", {}, "deepspeed", "data 2 x tensor 2 x pipeline 1"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """cpu_single, one plain python process: what every layout must give."""
    run = train("cpu_single", 1, tmp_path_factory.mktemp("reference"), launcher="python", steps=STEPS)
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.log()
    return run.losses


def summary_layout(run: Run) -> str:
    found = re.search(r"^trained \S+ with \w+: (data \d+ x tensor \d+ x pipeline \d+),", run.stderr, re.M)
    return found.group(1) if found else ""


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


# every launcher's case in .ci/run's slow step (-m slow): two launches of launch.sh each, one node and two; the
# torchrun case forced native by its recipe, the accelerate one Accelerate's DDP (ZeRO-0) with or without deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(CASES))
def test_two_nodes_equal_one_node_of_four(launcher, reference, tmp_path):
    if launcher == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    if launcher == "accelerate":
        need("accelerate")
    base, blocks, backend, layout = CASES[launcher]
    recipe = recipe_variant(base, tmp_path, f"{base}_{launcher}", **blocks)

    start = time.perf_counter()
    one = finish(*launch_sh(launcher, recipe, tmp_path, "one", "--nproc", "4"), start)
    assert one.returncode == 0, one.log()
    assert (one.backend, summary_layout(one)) == (backend, layout), one.log()
    for step in range(1, STEPS + 1):
        assert math.isclose(one.losses[step], reference[step], rel_tol=RTOL), \
            f"step {step}: one node {one.losses[step]!r} != one process {reference[step]!r}\n{one.log()}"

    master = f"127.0.0.1:{free_port()}"
    start = time.perf_counter()
    nodes = [launch_sh(launcher, recipe, tmp_path, f"node{r}", "--nodes", "2", "--node-rank", str(r),
                       "--master", master, "--nproc", "2") for r in (0, 1)]
    runs = [finish(*node, start) for node in nodes]
    for run in runs:
        assert run.returncode == 0, run.log()
    two = runs[0]  # global rank 0 lives on node 0 and writes the metrics
    assert sorted(two.losses) == list(range(1, STEPS + 1)), two.log() + runs[1].log()
    assert (two.backend, summary_layout(two)) == (backend, layout), two.log()
    assert not runs[1].backend, "rank 0 alone (on node 0) prints the summary\n" + runs[1].log()
    for step in range(1, STEPS + 1):
        assert math.isclose(two.losses[step], one.losses[step], rel_tol=RTOL), \
            f"step {step}: two nodes {two.losses[step]!r} != one node {one.losses[step]!r}\n{two.log()}"
