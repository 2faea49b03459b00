"""Recipe -> ds_config / accelerate YAML, ds_config -> recipe, and DeepSpeed's own acceptance."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plugin.interop import deepspeed_config
from plugin.interop.accelerate_config import to_accelerate_config
from plugin.interop.deepspeed_config import DEEPSPEED_DEFAULT_GRADIENT_CLIPPING, from_ds_config, to_ds_config
from plugin.recipe.checks import load_recipe
from plugin.recipe.load import recipe_from_data, shipped_recipes
from plugin.recipe.spec import ActivationCheckpointing

ROOT = Path(__file__).resolve().parents[3]


def _world(stem):
    return 8 if stem == "tp2_auto" else None


def test_triple_and_sections():
    cfg = to_ds_config(load_recipe("pp2_dp4"))
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (256, 4, 16)
    assert cfg["zero_optimization"] == {"stage": 1}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["pipeline"]["stages"] == 2
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 0.0003, "betas": [0.9, 0.95], "eps": 1e-08,
                                                             "weight_decay": 0.1}}


def _recipe(**extra):
    data = {"name": "r", "parallelism": {"data": 2}, "batch": {"micro": 2}, **extra}
    recipe, problems = recipe_from_data(data)
    assert recipe is not None, problems
    return recipe


def test_bf16_gradients_are_summed_in_fp32_unless_the_deepspeed_block_says_otherwise():
    """DeepSpeed sums bf16 gradients in bf16 by default; the fp32 sums are pinned here, as the 6-step parity test
    (tests/dist/test_optimizer_parity.py) does not see them (7e-5 to 1.1e-4 off without them, 8e-5 to 1.6e-4 with)."""
    for stage in (0, 1, 2, 3):
        cfg = to_ds_config(_recipe(precision="bf16", zero={"stage": stage}))
        assert cfg["communication_data_type"] == "fp32", stage
        assert cfg.get("data_types") == ({"grad_accum_dtype": "fp32"} if stage else None), stage  # refused at 0
    assert "communication_data_type" not in to_ds_config(_recipe())
    own = to_ds_config(_recipe(precision="bf16", deepspeed={"communication_data_type": "bf16"}))
    assert own["communication_data_type"] == "bf16"


def test_adam_is_not_silently_adamw():
    cfg = to_ds_config(_recipe(optimizer={"name": "adam"}))
    assert cfg["optimizer"]["type"] == "Adam" and cfg["optimizer"]["params"]["adam_w_mode"] is False


def test_sgd_is_torch_sgd_and_allowed_under_zero():
    cfg = to_ds_config(_recipe(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}))
    assert cfg["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}}
    assert "zero_allow_untested_optimizer" not in cfg  # stage 0: no ZeRO optimizer to test it
    cfg = to_ds_config(_recipe(optimizer={"name": "sgd"}, zero={"stage": 1}))
    assert cfg["zero_allow_untested_optimizer"] is True  # else DeepSpeed asserts on torch.optim.SGD under ZeRO


def test_offload_and_fp16_blocks():
    r = _recipe(zero={"stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": "/nvme"},
                precision="fp16", fp16={"initial_scale_power": 12})
    cfg = to_ds_config(r)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == 12 and cfg["fp16"]["loss_scale"] == 0


def _errors(recipe, world_size=None):
    from plugin.recipe.checks import check_recipe

    return {p.path: p for p in check_recipe(recipe, world_size) if p.is_error}


def test_raw_block_is_merged_last_but_may_not_contradict():
    r = _recipe(deepspeed={"wall_clock_breakdown": True, "zero_optimization": {"overlap_comm": True, "stage": 0}})
    cfg = to_ds_config(r)
    assert cfg["wall_clock_breakdown"] is True and cfg["zero_optimization"] == {"stage": 0, "overlap_comm": True}
    bad = _recipe(deepspeed={"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}})
    assert set(_errors(bad)) == {"$.deepspeed.train_micro_batch_size_per_gpu", "$.deepspeed.bf16.enabled"}


def test_raw_block_may_not_override_what_the_recipe_leaves_at_its_default():
    """The reviewer's case: cpu_dp4 is ZeRO-1 without offload and one stage; its export leaves those keys out."""
    base = load_recipe("cpu_dp4")
    r = dataclasses.replace(base, deepspeed={
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"},
                              "overlap_comm": True, "reduce_bucket_size": 5e7},
        "pipeline": {"stages": 4}})
    errors = _errors(r)
    assert set(errors) == {"$.deepspeed.zero_optimization.offload_optimizer.device",
                           "$.deepspeed.zero_optimization.offload_param.device", "$.deepspeed.pipeline.stages"}
    p = errors["$.deepspeed.pipeline.stages"]
    assert "4" in p.message and "gives 1" in p.message and "$.parallelism.pipeline" in p.hint
    p = errors["$.deepspeed.zero_optimization.offload_param.device"]
    assert '"nvme"' in p.message and '"none"' in p.message and "set $.zero.offload_param" in p.hint
    ok = dataclasses.replace(base, deepspeed={  # extra keys, and owned keys that repeat the recipe, are fine
        "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5e7,
                              "offload_optimizer": {"device": "none"}},
        "pipeline": {"stages": 1}, "fp16": {"enabled": False, "loss_scale_window": 1000}, "gradient_clipping": 1,
        "optimizer": {"type": "adamw", "params": {"torch_adam": True, "lr": base.optimizer.lr}}})
    assert _errors(ok) == {}
    cfg = to_ds_config(ok)
    assert cfg["zero_optimization"]["overlap_comm"] is True and cfg["zero_optimization"]["reduce_bucket_size"] == 5e7
    assert cfg["optimizer"]["params"]["torch_adam"] is True


@pytest.mark.parametrize("block,path,words", [
    ({"fp16": {"loss_scale": 128}}, "$.deepspeed.fp16.loss_scale", ["128", "gives 0", "$.fp16.loss_scale"]),
    ({"fp16": {"enabled": True}}, "$.deepspeed.fp16.enabled", ["true", "false", "$.precision"]),
    ({"amp": {"enabled": True}}, "$.deepspeed.amp.enabled", ["$.precision"]),
    ({"zero_optimization": {"cpu_offload": True}}, "$.deepspeed.zero_optimization.cpu_offload",
     ["deprecated", "$.zero.offload_optimizer"]),
    ({"zero_optimization": {"offload_param": {"nvme_path": "/x"}}},
     "$.deepspeed.zero_optimization.offload_param.nvme_path", ["no zero.nvme_path", "$.zero.nvme_path"]),
    ({"zero_optimization": 3}, "$.deepspeed.zero_optimization", ["not an object", "$.zero"]),
    ({"gradient_clipping": 0.5}, "$.deepspeed.gradient_clipping", ["0.5", "gives 1.0"]),
    ({"pipeline": {"partition": "uniform"}}, "$.deepspeed.pipeline.partition", ['"parameters"']),
    ({"optimizer": {"params": {"lr": 0.5}}}, "$.deepspeed.optimizer.params.lr", ["0.5", "gives 0.001"]),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "$.deepspeed.optimizer.type",
     ["build adam", '"adamw"', "$.optimizer.name"]),
    ({"optimizer": {"type": "Lamb"}}, "$.deepspeed.optimizer.type", ['"Lamb"', "adamw, adam and sgd"]),
    ({"optimizer": {"params": {"momentum": 0.9}}}, "$.deepspeed.optimizer.params.momentum", ["takes no momentum"]),
])
def test_each_owned_key_is_checked(block, path, words):
    errors = _errors(_recipe(deepspeed=block))
    assert path in errors, errors
    text = errors[path].format()
    for w in words:
        assert w in text, text


def test_adam_recipes_own_adam_w_mode_and_sgd_owns_its_params():
    errors = _errors(_recipe(optimizer={"name": "adam"}, deepspeed={"optimizer": {"params": {"adam_w_mode": True}}}))
    assert "$.deepspeed.optimizer.params.adam_w_mode" in errors
    errors = _errors(_recipe(optimizer={"name": "sgd"}, deepspeed={"optimizer": {"params": {"betas": [0.9, 0.9]}}}))
    assert "takes no betas" in errors["$.deepspeed.optimizer.params.betas"].message
    # DeepSpeed's "Adam" with adam_w_mode left at its default is AdamW: the same as the recipe's adamw
    assert _errors(_recipe(deepspeed={"optimizer": {"type": "Adam"}})) == {}


def test_sequence_parallel_pipelines_turn_deepspeeds_activation_partitioning_off():
    """Stage outputs under sequence parallelism are each tensor rank's own slice: DeepSpeed's partitioning (on by
    default) would rebuild them from every rank's part of a different tensor. Without sequence parallelism they
    are replicated and DeepSpeed's default is right: the export leaves it, and a raw block may set it either way."""
    sp = load_recipe("cpu_tp2_sp_pp2")
    assert to_ds_config(sp)["pipeline"] == {"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 0,
                                            "pipe_partitioned": False, "grad_partitioned": False}
    raw = {"pipeline": {"pipe_partitioned": True, "grad_partitioned": True}}
    errors = _errors(dataclasses.replace(sp, deepspeed=raw))
    assert set(errors) == {"$.deepspeed.pipeline.pipe_partitioned", "$.deepspeed.pipeline.grad_partitioned"}
    text = errors["$.deepspeed.pipeline.pipe_partitioned"].format()
    assert "true" in text and "$.tensor_parallel.sequence_parallel" in text, text
    assert _errors(dataclasses.replace(sp, deepspeed={"pipeline": {"pipe_partitioned": False}})) == {}
    plain = load_recipe("cpu_tp2_pp2")
    assert not {"pipe_partitioned", "grad_partitioned"} & set(to_ds_config(plain)["pipeline"])
    assert _errors(dataclasses.replace(plain, deepspeed={"pipeline": {"pipe_partitioned": False}})) == {}
    sp_dp = load_recipe("tp2_sp_dp4")  # no pipeline: no pipeline section at all
    assert "pipeline" not in to_ds_config(sp_dp)


def test_checkpointed_pipelines_export_deepspeeds_non_reentrant_checkpoint():
    """DeepSpeed's reentrant checkpoint (its default) fails in backward on a first stage fed token ids."""
    base = load_recipe("cpu_pp2_dp2")
    checkpointed = dataclasses.replace(base, activation_checkpointing=ActivationCheckpointing("full", 2))
    assert to_ds_config(checkpointed)["pipeline"]["use_reentrant"] is False
    assert to_ds_config(checkpointed)["pipeline"]["activation_checkpoint_interval"] == 2  # spans of `every` layers
    assert "use_reentrant" not in to_ds_config(base)["pipeline"]
    errors = _errors(dataclasses.replace(checkpointed, deepspeed={"pipeline": {"use_reentrant": True}}))
    assert set(errors) == {"$.deepspeed.pipeline.use_reentrant"}
    assert "$.activation_checkpointing" in errors["$.deepspeed.pipeline.use_reentrant"].format()
    # selective recompute is the model's own (the attention core): DeepSpeed's pipeline checkpoints nothing
    selective = dataclasses.replace(base, activation_checkpointing=ActivationCheckpointing("selective"))
    assert to_ds_config(selective)["pipeline"]["activation_checkpoint_interval"] == 0
    assert "use_reentrant" not in to_ds_config(selective)["pipeline"]
    wrong = _errors(dataclasses.replace(checkpointed, deepspeed={"pipeline": {"activation_checkpoint_interval": 1}}))
    assert set(wrong) == {"$.deepspeed.pipeline.activation_checkpoint_interval"}
    assert "$.activation_checkpointing" in wrong["$.deepspeed.pipeline.activation_checkpoint_interval"].format()


def test_import_reads_deepspeeds_interval_as_full_recompute_and_round_trips():
    """pipeline.activation_checkpoint_interval k > 0 is {"mode": "full", "every": k}; the export gives k back."""
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
           "pipeline": {"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 3,
                        "use_reentrant": False}}
    data = from_ds_config(cfg, world_size=4)
    assert data["activation_checkpointing"] == {"mode": "full", "every": 3}
    assert "activation_checkpoint_interval" not in data.get("pipeline_parallel", {})
    recipe, problems = recipe_from_data(data)
    assert recipe is not None and not [p for p in problems if p.is_error], problems
    assert to_ds_config(recipe, 4)["pipeline"]["activation_checkpoint_interval"] == 3
    off = from_ds_config({**cfg, "pipeline": {"stages": 2, "activation_checkpoint_interval": 0}}, world_size=4)
    assert "activation_checkpointing" not in off


def test_raw_batch_keys_are_checked_before_the_world_size_is_known():
    r = _recipe(parallelism={"data": "auto"}, batch={"global": 64, "micro": 2},
                deepspeed={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2})
    assert set(_errors(r)) == {"$.deepspeed.train_batch_size"}
    assert set(_errors(r, 8)) == {"$.deepspeed.train_batch_size"}


def test_gradient_clipping_default_is_deepspeeds():
    constants = pytest.importorskip("deepspeed.runtime.constants")
    assert constants.GRADIENT_CLIPPING_DEFAULT == DEEPSPEED_DEFAULT_GRADIENT_CLIPPING


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.stem)
def test_export_import_export_is_stable(path):
    recipe = load_recipe(path, _world(path.stem))
    cfg = to_ds_config(recipe, _world(path.stem))
    world = recipe.layout(_world(path.stem)).world_size
    data = from_ds_config(cfg, world_size=world // recipe.parallelism.tensor, name=recipe.name)
    again, problems = recipe_from_data(data)
    assert again is not None, problems
    assert to_ds_config(again, world // recipe.parallelism.tensor) == cfg


REAL_WORLD_CONFIGS = [
    # the Hugging Face / DeepSpeed docs' ZeRO-2 example shape
    {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
     "gradient_clipping": 1.0, "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                                     "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
     "bf16": {"enabled": True}, "wall_clock_breakdown": False},
    # ZeRO-3 with offload and fp16 dynamic loss scaling, and a scheduler the recipe does not model
    {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "gradient_clipping": 0.5,
     "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
              "hysteresis": 2, "min_loss_scale": 1},
     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                           "offload_param": {"device": "cpu", "pin_memory": True}, "stage3_max_live_parameters": 1e9},
     "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 100}}},
    # the DeepSpeed docs' optimizer example: "Adam" with adam_w_mode at its default True is AdamW
    {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
     "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}},
    {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.999], "eps": 1e-8,
                                                                     "weight_decay": 3e-7}}},
    # classic (L2) Adam, and torch's AdamW (whose weight_decay default is 0.01) through torch_adam
    {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}},
    {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}},
    # lower-case type (DeepSpeed lower-cases its own optimizers' names)
    {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "adamw", "params": {"weight_decay": 0.1}}},
    # SGD is torch.optim.SGD; under ZeRO DeepSpeed wants zero_allow_untested_optimizer
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
     "zero_allow_untested_optimizer": True,
     "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}}},
    # offload with pin_memory off, and a one-stage pipeline section
    {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                             "pin_memory": False}},
     "pipeline": {"stages": 1, "partition": "uniform"}},
]


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _built_optimizer(cfg):
    """What DeepSpeed's own engine code builds from a config's optimizer section: the class and every argument
    (its signature's defaults filled in), from DeepSpeedEngine._configure_basic_optimizer run on a stand-in
    engine that records the call instead of building (FusedAdam would JIT-compile)."""
    import inspect

    engine = pytest.importorskip("deepspeed.runtime.engine")
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = cfg["optimizer"]["type"]
    calls = []

    class StandIn:
        optimizer_params = staticmethod(lambda: dict(cfg["optimizer"].get("params", {})))
        optimizer_name = staticmethod(lambda: name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name)
        zero_use_cpu_optimizer = staticmethod(lambda: False)  # DeepSpeedCPUAdam has FusedAdam's defaults

        def get_optimizer_configuration(self, params, adam_w_mode, **kw):
            cls, kwargs = engine.DeepSpeedEngine.get_optimizer_configuration(self, params, adam_w_mode, **kw)
            return (lambda _, **args: calls.append((cls, args))), kwargs

    if name == "SGD":
        import torch

        calls.append((torch.optim.SGD, dict(cfg["optimizer"].get("params", {}))))
    else:
        engine.DeepSpeedEngine._configure_basic_optimizer(StandIn(), [])
    (cls, args), = calls
    sig = inspect.signature(cls.__init__)
    full = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    full.update(args)
    full = {k: list(v) if isinstance(v, tuple) else v for k, v in full.items()}
    full.pop("adamw_mode", None)  # DeepSpeedCPUAdam's spelling, unused here
    return cls.__name__, full


@pytest.mark.parametrize("cfg", REAL_WORLD_CONFIGS, ids=lambda c: json.dumps(c.get("optimizer", {}))[:40])
def test_import_then_export_gives_an_equivalent_config(cfg):
    from plugin.recipe.checks import check_recipe

    data = from_ds_config(cfg, world_size=8)
    recipe, problems = recipe_from_data(data)
    assert recipe is not None, problems
    assert [p for p in check_recipe(recipe, 8) if p.is_error] == []
    out = to_ds_config(recipe, 8)
    theirs, ours = dict(_flat(cfg)), dict(_flat(out))
    for key, value in theirs.items():  # everything they said is said again, with the same value
        if not key.startswith("optimizer."):
            assert ours[key] == value, key
    extra = {k: v for k, v in ours.items() if k not in theirs and not k.startswith("optimizer.")}
    # what we add is explicit defaults: the derived triple members and disabled precisions
    allowed = {"train_batch_size", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
               "gradient_clipping", "bf16.enabled", "fp16.enabled", "zero_optimization.stage"}
    if recipe.precision == "bf16":  # and bf16's gradients summed in fp32, as on every other back end
        allowed |= set(dict(_flat(deepspeed_config.bf16_sums_in_fp32(recipe.zero.stage))))
    assert set(extra) <= allowed, extra
    if "optimizer" in cfg:  # the same optimizer, as DeepSpeed's code reads both
        assert _built_optimizer(out) == _built_optimizer(cfg)
    else:
        assert recipe.optimizer.name == "adamw"  # the recipe's default; `import` warns that it took it


def test_import_keeps_an_optimizer_the_recipe_cannot_say_and_reports_it():
    from plugin.recipe.checks import check_recipe

    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Lamb",
                                                                                       "params": {"lr": 1e-3}}}
    data = from_ds_config(cfg, world_size=8)
    assert data["deepspeed"]["optimizer"] == cfg["optimizer"]
    recipe, _ = recipe_from_data(data)
    (p,) = [p for p in check_recipe(recipe, 8) if p.is_error]
    assert p.path == "$.deepspeed.optimizer.type" and "Lamb" in p.message and "$.optimizer.name" in p.hint


@pytest.mark.parametrize("section,expected", [
    ({"type": "Adam", "params": {"lr": 1e-4}}, {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, {"name": "adam", "lr": 1e-3}),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, {"name": "adamw"}),  # "AdamW" wins over adam_w_mode
    ({"type": "AdamW", "params": {"torch_adam": True}}, {"name": "adamw", "weight_decay": 0.01}),
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, {"name": "adam", "weight_decay": 0.0}),
    ({"type": "SGD", "params": {"lr": 0.1}}, {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"lr": "auto", "betas": "auto"}}, {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.999]}),
])
def test_import_maps_the_optimizer_with_deepspeeds_defaults(section, expected):
    opt = from_ds_config({"train_batch_size": 8, "optimizer": section}, world_size=8)["optimizer"]
    assert {k: opt[k] for k in expected} == expected, opt


def test_accelerate_yaml_is_loaded_by_accelerate(tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    for name, cpu, kind in (("dp8_zero3_offload", False, "DEEPSPEED"), ("cpu_dp4", True, "MULTI_CPU"),
                            ("tp2_dp4", False, "MULTI_GPU"), ("cpu_single", True, "NO")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(to_accelerate_config(load_recipe(name), cpu=cpu))
        cfg = config_args.load_config_from_file(str(path))
        assert str(cfg.distributed_type).endswith(kind), (name, cfg.distributed_type)
        assert cfg.num_processes == load_recipe(name).layout().world_size
        if kind == "DEEPSPEED":
            assert cfg.deepspeed_config["zero_stage"] == 3 and cfg.deepspeed_config["offload_param_device"] == "cpu"
    # without deepspeed on the machine: a plain multi-GPU launch, which train.py then carries itself
    path = tmp_path / "nods.yaml"
    text = to_accelerate_config(load_recipe("dp8_zero3"), deepspeed=False)
    path.write_text(text)
    cfg = config_args.load_config_from_file(str(path))
    assert str(cfg.distributed_type).endswith("MULTI_GPU") and cfg.num_processes == 8
    assert "# ZeRO-3 without deepspeed" in text and "needs deepspeed" in to_accelerate_config(load_recipe("dp8_zero3"))


DS_CHECK = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo")
    class DataGroupSize:  # DeepSpeed checks the batch triple against the mpu's data-parallel size
        def __init__(self, n): self.n = n
        def get_data_parallel_world_size(self): return self.n
    results = {}
    for name, (cfg, data) in json.load(sys.stdin).items():
        try:
            c = DeepSpeedConfig(cfg, mpu=DataGroupSize(data))
            z, f = c.zero_config, c.float16_config
            results[name] = {
                "batch": c.train_batch_size, "stage": c.zero_optimization_stage, "clip": c.gradient_clipping,
                "bf16": c.bfloat16_config.enabled, "fp16": f.enabled, "scale_power": f.initial_scale_power,
                "scale_window": f.loss_scale_window, "overlap_comm": z.overlap_comm,
                "reduce_bucket_size": z.reduce_bucket_size,
                "offload_param": z.offload_param.device if z.offload_param else None,
                "nvme_path": str(z.offload_param.nvme_path) if z.offload_param and z.offload_param.nvme_path else None,
                "optimizer": c.optimizer_name, "pipe_partitioned": c.pipeline["pipe_partitioned"],
                "grad_partitioned": c.pipeline["grad_partitioned"], "use_reentrant": c.pipeline.get("use_reentrant")}
        except Exception as e:
            results[name] = repr(e)
    print(json.dumps(results))
""")


def _expected(recipe, lay) -> dict:
    """What DeepSpeed should read back from the recipe's export (its own defaults where the recipe is silent)."""
    z, scale, raw = recipe.zero, recipe.fp16, (recipe.deepspeed or {}).get("zero_optimization", {})
    sequence_parallel_pipeline = recipe.tensor_parallel.sequence_parallel and lay.tensor > 1 and lay.pipeline > 1
    return {"batch": lay.global_batch, "stage": z.stage, "clip": recipe.gradient_clipping,
            "bf16": recipe.precision == "bf16", "fp16": recipe.precision == "fp16",
            "scale_power": scale.initial_scale_power if scale else 16,
            "scale_window": scale.loss_scale_window if scale else 1000,
            "overlap_comm": raw.get("overlap_comm", z.stage == 3),  # DeepSpeed's default: on for ZeRO-3 only
            "reduce_bucket_size": raw.get("reduce_bucket_size", 5e8),
            "offload_param": None if z.offload_param == "none" else z.offload_param,
            "nvme_path": z.nvme_path if z.offload_param == "nvme" else None,
            "optimizer": {"adamw": "adamw", "adam": "adam", "sgd": "SGD"}[recipe.optimizer.name],
            # DeepSpeed partitions stage outputs over the tensor group by default: not sequence slices
            "pipe_partitioned": not sequence_parallel_pipeline, "grad_partitioned": not sequence_parallel_pipeline,
            "use_reentrant": False if lay.pipeline > 1 and recipe.activation_checkpointing.interval else None}


def _beyond_the_shipped_recipes() -> dict:
    """Exports the shipped recipes do not cover: a merged raw block, fp16 with a loss-scale block, nvme offload."""
    def recipe(**extra):
        data = {"name": "r", "parallelism": {"data": 2}, "batch": {"micro": 2, "grad_accum": 2}, **extra}
        r, problems = recipe_from_data(data)
        assert r is not None and not [p for p in problems if p.is_error], problems
        from plugin.recipe.checks import check_recipe

        assert [p for p in check_recipe(r) if p.is_error] == []
        return r

    return {
        "merged_block": recipe(zero={"stage": 2}, deepspeed={
            "zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 5e7, "contiguous_gradients": True},
            "wall_clock_breakdown": False, "steps_per_print": 50,
            "optimizer": {"params": {"torch_adam": True}}}),
        "fp16_loss_scale": recipe(precision="fp16", fp16={"initial_scale_power": 12, "loss_scale_window": 500,
                                                          "hysteresis": 4, "min_loss_scale": 2}),
        "nvme_offload": recipe(zero={"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                     "nvme_path": "/local_nvme"}, launcher="deepspeed", precision="bf16"),
        "sgd_zero1": recipe(zero={"stage": 1}, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}),
        "checkpointed_pipeline": recipe(parallelism={"data": 2, "pipeline": 2},
                                        activation_checkpointing={"mode": "full", "every": 1}),
    }


def test_every_exported_config_is_accepted_by_deepspeed():
    pytest.importorskip("deepspeed")
    from tests.dist.ports import free_port

    recipes = {p.stem: load_recipe(p, _world(p.stem)) for p in shipped_recipes()}
    recipes.update(_beyond_the_shipped_recipes())
    configs, expect = {}, {}
    for name, recipe in recipes.items():
        lay = recipe.layout(_world(name))
        configs[name] = [to_ds_config(recipe, _world(name)), lay.data]
        expect[name] = _expected(recipe, lay)
    # a wrong data size must be refused, or the check above proves nothing
    configs["wrong_data_size"] = [to_ds_config(load_recipe("tp2_dp4")), 3]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", DS_CHECK, str(free_port())], input=json.dumps(configs), text=True,
                         capture_output=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert "train_batch_size is not equal" in results.pop("wrong_data_size")
    assert results == expect


def test_the_engines_guide_names_every_key_the_deepspeed_engine_adjusts():
    """The keys where the engine's config differs from the export (tests/dist/test_deepspeed_engine.py holds the
    running engine to them) are the engines guide's list, each by name, in its section "What the engine adds to the
    export"."""
    from plugin.engines.deepspeed.config import ENGINE_ADJUSTED_KEYS

    guide = (ROOT / "docs" / "engines.md").read_text()
    section = guide[guide.index("### What the engine adds to the export\n"):]
    section = section[:section.index("\n#", 1)]
    for key in ENGINE_ADJUSTED_KEYS:
        assert f"`{key}`" in section or f"`{key.split('.')[-1]}`" in section, key
