"""The native and Accelerate back ends refuse, before any process group, what they cannot do."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import plugin
from plugin.checks import load_recipe
from plugin.errors import PluginError, RecipeError


def test_nvme_offload_is_refused_before_any_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    r = load_recipe("cpu_zero3_dp4")
    r = dataclasses.replace(r, zero=dataclasses.replace(r.zero, offload_param="nvme", nvme_path="/nvme"))
    with pytest.raises(RecipeError):
        plugin.initialize(torch.nn.Linear(2, 2), r, backend="native")
    assert "nvme offload is DeepSpeed's" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_accelerate_traps_are_caught():
    pytest.importorskip("accelerate")
    from accelerate.utils import DistributedType

    from plugin.engines.accelerate_engine import _check_accelerator

    _check_accelerator(SimpleNamespace(num_processes=4, distributed_type=DistributedType.MULTI_CPU), "ddp", 4)
    # `accelerate launch --multi_gpu` without cpu=True on a CPU machine: N copies of a world of one
    copies = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(PluginError, match="--multi_gpu --num_processes 4"):
        _check_accelerator(copies, "ddp", 4)
    # Accelerate dropped the DeepSpeed plugin (ACCELERATE_USE_CPU forces plain DDP)
    with pytest.raises(PluginError, match="DEEPSPEED"):
        _check_accelerator(SimpleNamespace(num_processes=4, distributed_type=DistributedType.MULTI_CPU), "deepspeed", 4)


def test_accelerate_engine_without_transformers_explains_instead_of_crashing(monkeypatch):
    """backend="accelerate" forced at ZeRO-1 with deepspeed but no transformers: Accelerate's DeepSpeedPlugin would
    die on `import transformers` inside Accelerator(); the engine refuses first and says what to install."""
    pytest.importorskip("accelerate")
    from plugin.engines import accelerate_engine

    monkeypatch.setattr(accelerate_engine, "importable", lambda name: name != "transformers")
    r = load_recipe("cpu_dp4")
    env = SimpleNamespace(world_size=4, rank=0, is_main=True)
    with pytest.raises(PluginError, match="transformers is not installed.*-> pip install transformers"):
        accelerate_engine.build(torch.nn.Linear(2, 2), r, r.layout(4), env, device=torch.device("cpu"),
                                layers_of=None, apply_tp=None, loss_for=None)
    assert not torch.distributed.is_initialized()
