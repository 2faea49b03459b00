"""Recipe -> ds_config / accelerate YAML, ds_config -> recipe, and DeepSpeed's own acceptance."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plugin.checks import load_recipe
from plugin.ds_config import DEEPSPEED_DEFAULT_GRADIENT_CLIPPING, from_ds_config, to_accelerate_config, to_ds_config
from plugin.recipe import recipe_from_data, shipped_recipes

ROOT = Path(__file__).resolve().parents[2]


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


def test_adam_is_not_silently_adamw():
    cfg = to_ds_config(_recipe(optimizer={"name": "adam"}))
    assert cfg["optimizer"]["type"] == "Adam" and cfg["optimizer"]["params"]["adam_w_mode"] is False


def test_sgd_has_no_deepspeed_type():
    assert "optimizer" not in to_ds_config(_recipe(optimizer={"name": "sgd", "momentum": 0.9}))


def test_offload_and_fp16_blocks():
    r = _recipe(zero={"stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": "/nvme"},
                precision="fp16", fp16={"initial_scale_power": 12})
    cfg = to_ds_config(r)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == 12 and cfg["fp16"]["loss_scale"] == 0


def test_raw_block_is_merged_last_but_may_not_contradict():
    r = _recipe(deepspeed={"wall_clock_breakdown": True, "zero_optimization": {"overlap_comm": True, "stage": 0}})
    cfg = to_ds_config(r)
    assert cfg["wall_clock_breakdown"] is True and cfg["zero_optimization"] == {"stage": 0, "overlap_comm": True}
    from plugin.checks import check_recipe

    bad = _recipe(deepspeed={"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}})
    paths = {p.path for p in check_recipe(bad) if p.is_error}
    assert paths == {"$.deepspeed.train_micro_batch_size_per_gpu", "$.deepspeed.bf16.enabled"}


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
    # an optimizer type the recipe cannot say stays raw
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
     "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0},
]


@pytest.mark.parametrize("cfg", REAL_WORLD_CONFIGS)
def test_import_then_export_gives_an_equivalent_config(cfg):
    data = from_ds_config(cfg, world_size=8)
    recipe, problems = recipe_from_data(data)
    assert recipe is not None, problems
    out = to_ds_config(recipe, 8)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    theirs, ours = dict(flat(cfg)), dict(flat(out))
    for key, value in theirs.items():  # everything they said is said again, with the same value
        assert ours[key] == value, key
    extra = {k: v for k, v in ours.items() if k not in theirs}
    # what we add is explicit defaults: the derived triple member, disabled precisions, Adam defaults
    allowed = {"train_batch_size", "gradient_accumulation_steps", "bf16.enabled", "fp16.enabled",
               "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay"}
    if "optimizer" not in cfg:  # the recipe always names one; `import` warns that it took the default
        allowed |= {"optimizer.type", "optimizer.params.lr"}
    assert set(extra) <= allowed, extra


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
            results[name] = [c.train_batch_size, c.zero_optimization_stage, c.gradient_clipping, c.bfloat16_config.enabled]
        except Exception as e:
            results[name] = repr(e)
    print(json.dumps(results))
""")


def test_every_exported_config_is_accepted_by_deepspeed():
    pytest.importorskip("deepspeed")
    from tests.dist.ports import free_port

    configs, expect = {}, {}
    for path in shipped_recipes():
        recipe = load_recipe(path, _world(path.stem))
        lay = recipe.layout(_world(path.stem))
        configs[path.stem] = [to_ds_config(recipe, _world(path.stem)), lay.data]
        expect[path.stem] = [lay.global_batch, recipe.zero.stage, recipe.gradient_clipping, recipe.precision == "bf16"]
    # a wrong data size must be refused, or the check above proves nothing
    configs["wrong_data_size"] = [to_ds_config(load_recipe("tp2_dp4")), 3]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", DS_CHECK, str(free_port())], input=json.dumps(configs), text=True,
                         capture_output=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert "train_batch_size is not equal" in results.pop("wrong_data_size")
    assert results == expect
