"""The DeepSpeed engine in one plain ``python`` process (a world of one): a model given as a plain list of
layers at pipeline 1, in fp32 and in bf16 with float inputs (DeepSpeed casts the model; the engine casts the
inputs, not the integer labels). The same process reads ``engine.last_step.grad_norm`` on DeepSpeed's fp32 path
without ZeRO, which drops the norm it clips with (and computes none without clipping: plugin/engines/deepspeed/
grad_norm.py), against the native engine's, with clipping at 0.1 (acting) and off."""
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

base = load_recipe("cpu_single").to_dict()  # 1 process, global 16 = micro 4 x grad_accum 4, AdamW, clipping 1
runs = {}
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
for precision in ("fp32", "bf16"):
    recipe = Recipe.from_dict({**base, "name": f"list_{precision}", "precision": precision, "zero": {"stage": 1}})
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]  # a plain list, pipeline 1
    engine = plugin.initialize(layers, recipe, loss_fn=F.cross_entropy)
    losses = [engine.train_step((x, y)) for _ in range(5)]
    runs[precision] = {"backend": engine.backend, "losses": losses, "eval": engine.eval_step((x, y)),
                       "module": type(engine.module).__name__, "dtype": str(next(engine.module.parameters()).dtype),
                       "input_dtype": str(engine.local_batch((x, y))[0].dtype),
                       "label_dtype": str(engine.local_batch((x, y))[1].dtype)}
norms = {}
for backend in ("deepspeed", "native"):
    for clip in (0.0, 0.1):
        recipe = Recipe.from_dict({**base, "name": "norm", "zero": {"stage": 0}, "gradient_clipping": clip,
                                   "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}})  # clipping shows
        torch.manual_seed(0)
        engine = plugin.initialize([torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)], recipe,
                                   loss_fn=F.cross_entropy, backend=backend)
        norms[f"{backend} {clip}"] = [engine.train_step((x, y)) and engine.last_step.grad_norm for _ in range(3)]
runs["norms"] = norms
engine.close()
print("RESULT " + json.dumps(runs))
"""


@pytest.fixture(scope="module")
def runs():
    """One process runs every engine of SCRIPT once; the tests below read its result."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=cpu_env())
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_a_list_of_layers_trains_in_fp32_and_bf16(runs):
    fp32, bf16 = runs["fp32"], runs["bf16"]
    for run in (fp32, bf16):
        assert run["backend"] == "deepspeed" and run["module"] == "Sequential", run
        assert run["losses"][-1] < run["losses"][0] and run["eval"] < run["losses"][0], run
        assert run["label_dtype"] == "torch.int64", run
    assert (fp32["dtype"], fp32["input_dtype"]) == ("torch.float32", "torch.float32"), fp32
    assert (bf16["dtype"], bf16["input_dtype"]) == ("torch.bfloat16", "torch.bfloat16"), bf16
    # the same weights and data: the first loss (before any update) agrees to bf16's precision
    assert abs(bf16["losses"][0] - fp32["losses"][0]) < 2e-2 * fp32["losses"][0], runs


def test_the_step_reports_deepspeeds_fp32_norm_with_and_without_clipping(runs):
    norms = runs["norms"]
    for clip in ("0.0", "0.1"):
        ds, native = norms[f"deepspeed {clip}"], norms[f"native {clip}"]
        assert all(n is not None for n in ds) and ds == pytest.approx(native, rel=1e-5), norms
    assert min(norms["native 0.1"]) > 0.1 and norms["native 0.1"][1:] != pytest.approx(norms["native 0.0"][1:]), norms
