"""An Accelerate config read back as a recipe (plugin.interop.accelerate_import): the inverse of the export, for every
shipped recipe and context layout; what ``accelerate config`` itself writes; what has no recipe equivalent."""
import sys

import pytest

from plugin.interop.accelerate_config import to_accelerate_config
from plugin.interop.accelerate_import import from_accelerate_config, parse_yaml
from plugin.recipe.checks import check_recipe, load_recipe
from plugin.recipe.load import recipe_from_data, shipped_recipes
from plugin.recipe.spec import Recipe

# what `accelerate config` writes for DeepSpeed ZeRO-2 on 8 GPUs (PyYAML's dump: 'no' quoted, tpu_env a flow list)
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def _imported(text: str, world_size=None):
    """(recipe or None, the import's problems + the recipe's own)."""
    cfg, problems = parse_yaml(text)
    assert not problems, problems
    data, found = from_accelerate_config(cfg, text, world_size)
    recipe, own = recipe_from_data(data, "")
    if recipe is not None:
        own += check_recipe(recipe, None)
    return recipe, found + own


def _errors(problems):
    return [p.format() for p in problems if p.is_error]


def _what_trains(recipe: Recipe, world_size=None):
    lay, z = recipe.layout(world_size), recipe.zero
    return (lay.words, lay.global_batch, lay.micro_batch, z.stage, z.offload_optimizer, z.offload_param,
            recipe.precision, recipe.gradient_clipping, recipe.context_parallel.method if lay.context > 1 else None)


def _context(method: str, tensor: int = 1) -> Recipe:
    data = load_recipe("cpu_tp2_dp2").to_dict()
    data["parallelism"] = {"data": 2, "tensor": tensor, "pipeline": 1, "context": 2}
    data["context_parallel"] = {"method": method}
    return Recipe.from_dict(data)


@pytest.mark.parametrize("flavour", [{}, {"cpu": True}, {"deepspeed": False}], ids=["gpu", "cpu", "no-deepspeed"])
def test_every_shipped_recipe_and_context_layout_comes_back(flavour):
    recipes = [load_recipe(p.stem) for p in shipped_recipes()] + [_context("ring"), _context("all_to_all", tensor=2)]
    for recipe in recipes:
        world = 16 if recipe.parallelism.data == "auto" else None
        back, problems = _imported(to_accelerate_config(recipe, world, **flavour))
        assert back is not None and not _errors(problems), (recipe.name, _errors(problems))
        assert _what_trains(back) == _what_trains(recipe, world), recipe.name
        assert back.launcher == "accelerate"


def test_what_accelerate_config_writes():
    recipe, problems = _imported(ACCELERATE_CONFIG)
    assert not _errors(problems), _errors(problems)
    lay = recipe.layout()
    assert (lay.words, lay.micro_batch, lay.grad_accum, recipe.zero.stage, recipe.precision) == \
        ("data 8 x tensor 1 x pipeline 1", 1, 4, 2, "bf16")
    (said,) = [p.format() for p in problems if p.path == "$"]  # what the YAML could not say, once
    assert "holds no batch size, model, optimizer or pipeline stages" in said and "set $.batch" in said


def test_fsdp_and_accelerates_parallelism_config():
    text = ("distributed_type: FSDP\nnum_processes: 8\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_sharding_strategy: "
            "SHARD_GRAD_OP\nparallelism_config:\n  parallelism_config_tp_size: 2\n  parallelism_config_sp_size: 2\n")
    recipe, problems = _imported(text)
    assert not _errors(problems), _errors(problems)
    assert _what_trains(recipe)[0] == "data 2 x tensor 2 x pipeline 1 x context 2" and recipe.zero.stage == 2
    assert recipe.context_parallel.method == "all_to_all"  # sp_size: DeepSpeed's Ulysses
    fsdp2 = "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: "
    assert _imported(fsdp2 + "false\n")[0].zero.stage == 2 and _imported(fsdp2 + "true\n")[0].zero.stage == 3


@pytest.mark.parametrize("text, world_size, said", [
    ("distributed_type: MEGATRON_LM\nnum_processes: 4\n", None, "$.distributed_type: MEGATRON_LM has no recipe "
                                                                "equivalent"),
    ("distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: fp8\n", None, "$.mixed_precision: 'fp8' has no "
                                                                                    "recipe precision"),
    ("distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n", None,
     "-> import that file instead: python -m plugin import ds.json"),
    ("distributed_type: MULTI_GPU\nnum_processes: 6\nparallelism_config:\n  parallelism_config_tp_size: 4\n", None,
     "$.num_processes: 6 processes do not split into tensor 4 x pipeline 1 x context 1"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\nparallelism_config:\n  parallelism_config_cp_size: 2\n"
     "  parallelism_config_sp_size: 2\n", None, "the recipe has one context axis"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\n", 4, "$.num_processes: 8 processes, but --world-size 4"),
])
def test_what_has_no_recipe_equivalent_is_an_error(text, world_size, said):
    cfg, _ = parse_yaml(text)
    _, problems = from_accelerate_config(cfg, text, world_size)
    assert any(said in line for line in _errors(problems)), _errors(problems)


def test_a_recipe_line_that_disagrees_with_num_processes_is_said_and_ignored():
    text = to_accelerate_config(load_recipe("cpu_tp2_pp2")).replace("num_processes: 4", "num_processes: 8")
    recipe, problems = _imported(text)
    assert "the '# recipe:' line says 4 processes, num_processes 8: that line is ignored" in \
        " ".join(p.message for p in problems)
    assert recipe.layout().words == "data 8 x tensor 1 x pipeline 1"


def test_not_yaml_names_the_line_and_no_pyyaml_says_what_to_install(monkeypatch):
    value, problems = parse_yaml("distributed_type: [DEEPSPEED\n", "acc.yaml")
    assert value is None and problems[0].format().startswith("acc.yaml: $: not YAML: line 2, column 1: ")
    monkeypatch.setitem(sys.modules, "yaml", None)  # how Python says a module is not installed: ImportError
    value, problems = parse_yaml("distributed_type: NO\n")
    assert value is None and "pip install pyyaml" in problems[0].format()
