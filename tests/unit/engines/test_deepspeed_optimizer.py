"""Which optimizer the DeepSpeed engine steps (:mod:`plugin.engines.deepspeed.optimizer`): torch's unless an
offloaded Adam on CUDA needs DeepSpeed's CPUAdam, and torch's again, with one line saying why, where that op
cannot be built. The CUDA side of the choice is decided here without a GPU (no tensor is made on the device);
DeepSpeed's real CPUAdam builder is made to fail the way it fails on a machine without a C++ compiler (a
compiler that does not exist, a fresh extensions directory). Its success, and training on the GPU with each
choice, are in tests/dist/test_cuda.py."""
import dataclasses

import pytest
import torch

from plugin.engines.deepspeed.optimizer import choose_optimizer, cpu_adam_error
from plugin.engines.optim import WeightDecay, build_optimizer
from plugin.recipe.checks import load_recipe

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _recipe(name="adamw", offload="none"):
    recipe = load_recipe("cpu_dp4")
    return dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, name=name),
                               zero=dataclasses.replace(recipe.zero, offload_optimizer=offload))


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_on_cpu_torch_steps_unfused(name, offload):
    choice = choose_optimizer(_recipe(name, offload), CPU)
    assert (choice.deepspeed_op, choice.fused, choice.note) == (False, False, "")


@pytest.mark.parametrize("name,fused", [("adamw", True), ("adam", True), ("sgd", False)])
def test_on_cuda_without_offload_torch_steps_fused_adam(name, fused):
    choice = choose_optimizer(_recipe(name), CUDA)
    assert (choice.deepspeed_op, choice.fused, choice.note) == (False, fused, "")


def test_offloaded_sgd_on_cuda_needs_no_deepspeed_op():
    assert choose_optimizer(_recipe("sgd", "cpu"), CUDA) == choose_optimizer(_recipe("sgd"), CPU)


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """DeepSpeed's CPUAdam builder as on a machine without a C++ compiler: nothing prebuilt or cached to load."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if builder.name in type(builder)._loaded_ops:
        pytest.skip("this process already loaded DeepSpeed's CPUAdam")
    return builder


def test_offloaded_adam_on_cuda_falls_back_to_torch_when_cpu_adam_cannot_build(no_compiler):
    error = cpu_adam_error(no_compiler)
    assert error and "\n" not in error and error.startswith("RuntimeError: Error building extension 'cpu_adam"), error
    choice = choose_optimizer(_recipe("adamw", "cpu"), CUDA, builder=no_compiler)
    assert (choice.deepspeed_op, choice.fused) == (False, False)  # the states live on the CPU: no fused kernel
    assert "\n" not in choice.note and choice.note.startswith("note: DeepSpeed's CPUAdam op could not be built ("), \
        choice.note
    assert "ZeRO-Offload steps torch.optim.AdamW on the CPU instead" in choice.note, choice.note
    assert "DS_BUILD_CPU_ADAM=1" in choice.note


def test_fused_reaches_torchs_adam_only():
    model = torch.nn.Linear(2, 2)
    params, decay = list(model.parameters()), WeightDecay.of(model)
    recipe = _recipe()
    opt = build_optimizer(params, recipe.optimizer, decay, fused=True)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [recipe.optimizer.weight_decay, 0.0]
    assert not build_optimizer(params, recipe.optimizer, decay).defaults["fused"]
    assert "fused" not in build_optimizer(params, _recipe("sgd").optimizer, decay, fused=True).defaults or \
        not build_optimizer(params, _recipe("sgd").optimizer, decay, fused=True).defaults["fused"]
