"""The native and Accelerate back ends refuse, before any process group, what they cannot do; Accelerate's silent
traps are caught on real Accelerators (this one-process world; the launches in tests/dist pass the same check
with MULTI_CPU and DEEPSPEED on 2-4 processes)."""
import dataclasses
import sys

import pytest
import torch

import plugin
from plugin.errors import PluginError, RecipeError
from plugin.recipe.checks import load_recipe

pytestmark = pytest.mark.nods  # also in the venv without deepspeed: initialize without deepspeed


def test_nvme_offload_is_refused_before_any_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    r = load_recipe("cpu_zero3_dp4")
    r = dataclasses.replace(r, zero=dataclasses.replace(r.zero, offload_param="nvme", nvme_path="/nvme"))
    with pytest.raises(RecipeError):
        plugin.initialize(torch.nn.Linear(2, 2), r, backend="native")
    assert "nvme offload is DeepSpeed's" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


@pytest.fixture
def accelerate_state(monkeypatch):
    """Accelerate keeps one state per process: start each test from none, and leave none behind."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_world_of_one_where_the_launch_has_four_is_caught(accelerate_state):
    """What each of N unsynchronised copies sees (Accelerator() without cpu=True under --multi_gpu on a CPU
    machine): a real Accelerator of one process, while the launch started four."""
    from accelerate import Accelerator

    from plugin.engines.accelerate import _check_accelerator

    acc = Accelerator(cpu=True)
    assert (acc.distributed_type.value, acc.num_processes) == ("NO", 1)
    _check_accelerator(acc, "ddp", 1)  # a world of one launched as one: fine
    with pytest.raises(PluginError, match=r"set up NO with 1 process\(es\), but this launch has 4 .*"
                                          r"--multi_gpu --num_processes 4"):
        _check_accelerator(acc, "ddp", 4)


def test_accelerate_dropping_its_deepspeed_plugin_is_caught(accelerate_state, monkeypatch):
    """ACCELERATE_USE_CPU=true makes a real Accelerator drop the DeepSpeed plugin it is given, silently (plain
    DDP, or here no distribution at all): the check refuses what the recipe's ZeRO stage needed."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")  # Accelerate's DeepSpeedPlugin imports it
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    from plugin.engines.accelerate import _check_accelerator

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    assert acc.distributed_type != DistributedType.DEEPSPEED, "Accelerate kept the plugin: the trap is gone"
    with pytest.raises(PluginError, match="needs DEEPSPEED"):
        _check_accelerator(acc, "deepspeed", 1)


def test_accelerate_engine_without_transformers_explains_instead_of_crashing(monkeypatch):
    """backend="accelerate" forced at ZeRO-1 with deepspeed but no transformers: Accelerate's DeepSpeedPlugin would
    die on `import transformers` inside Accelerator(); the engine refuses first and says what to install.
    transformers is hidden as where it is not installed (``find_spec`` answers None, importing it fails)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    from plugin.distributed.env import launch_env
    from plugin.engines import accelerate as accelerate_engine
    from plugin.engines.context import BuildContext
    from plugin.engines.optim import WeightDecay

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert not accelerate_engine.importable("transformers")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    r = load_recipe("cpu_dp4")
    with pytest.raises(PluginError, match="transformers is not installed.*-> pip install transformers"):
        model = torch.nn.Linear(2, 2)
        accelerate_engine.build(BuildContext(model=model, recipe=r, layout=r.layout(4), env=launch_env(),
                                             device=torch.device("cpu"), layers_of=None, apply_tp=None,
                                             loss_for=None, decay=WeightDecay.of(model)))
    assert not torch.distributed.is_initialized()
