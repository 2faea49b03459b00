"""A raw ``deepspeed`` block's LR scheduler across a checkpoint: DeepSpeed's schedulers set the optimizer's lr in
``step()``, not in ``load_state_dict()``, so a resume that only restored the step would train its next steps at the
initial lr and exit 0. One plain process (a world of one), three engines: 6 steps uninterrupted, then 3 + save,
then load + 3: the resumed losses equal the uninterrupted ones exactly. (fp16 at ZeRO 0-3, its loss scaler and the
steps it skipped: test_checkpoint_fp16.py.)"""
import json
import subprocess
import sys

import pytest

from .needs import need
from .runs import ROOT, cpu_env

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
need("deepspeed")

SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
import plugin
from plugin.recipe.spec import Recipe
from plugin.recipe.checks import load_recipe

ckpt = sys.argv[1]
base = load_recipe("cpu_single").to_dict()
warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 8}}
recipe = Recipe.from_dict({**base, "name": "warmup", "deepspeed": {"scheduler": warmup}})
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)

def engine():
    torch.manual_seed(0)
    return plugin.initialize([torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)], recipe,
                             loss_fn=F.cross_entropy)

a = engine()
whole = [a.train_step((x, y)) for _ in range(6)]
lrs = [a.ds.lr_scheduler.get_last_lr()[0]]
b = engine()
first = [b.train_step((x, y)) for _ in range(3)]
b.save(ckpt)
c = engine()
step = c.load(ckpt)["step"]
lrs.append(c.ds.optimizer.param_groups[0]["lr"])
rest = [c.train_step((x, y)) for _ in range(3)]
c.close()
print("RESULT " + json.dumps({"whole": whole, "first": first, "rest": rest, "step": step, "lrs": lrs}))
"""


def test_a_resumed_run_continues_the_deepspeed_schedulers_lr(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert r["step"] == 3, r
    assert r["first"] == r["whole"][:3], r
    assert r["rest"] == r["whole"][3:], r  # exactly: same weights, moments and lr at steps 4-6
    assert r["lrs"][1] > 0, r  # the resumed optimizer's lr is the scheduler's, not load_state_dict's leftover
