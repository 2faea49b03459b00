"""``train.py --verbose`` keeps the engines' own lines: one plain ``python`` process of cpu_single (DeepSpeed, a
world of one), 2 steps. DeepSpeed's CPU backend prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built
successfully" to stdout whenever it starts (deepspeed/comm/torch.py, build_shm_op), which train.py keeps out of the
console without --verbose (plugin.monitor.quiet; that side is held by test_lr_schedule's assert_no_engine_chatter on
its DeepSpeed runs)."""
import pytest

from .needs import need
from .runs import train

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
need("deepspeed")

SHM_BUILT = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"


def test_verbose_keeps_deepspeeds_own_lines(tmp_path):
    run = train("cpu_single", 1, tmp_path, launcher="python", steps=2, extra=["--verbose"], timeout=300)
    assert run.backend == "deepspeed" and [r["step"] for r in run.records] == [1, 2], run.log()
    assert SHM_BUILT in run.stdout.splitlines(), f"--verbose lost DeepSpeed's own print\n{run.log()}"
    assert "step 2/2  loss " in run.stderr, run.log()  # the plugin's own lines are there as without it
