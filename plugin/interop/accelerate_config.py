"""Recipe -> an ``accelerate launch --config_file`` YAML (:func:`to_accelerate_config`). Pure: no accelerate import.

The YAML is written by hand (a few scalar types, nested maps): Accelerate reads it with PyYAML, which the plugin
does not need otherwise. An Accelerate config cannot say pipeline stages, the batch size, the ZeRO stage of a plain
launch, or tensor and context degrees (outside its ``parallelism_config``, which the plugin does not write): a comment
line, ``# recipe: ...`` (:data:`RECIPE_LINE`), says them, and ``python -m plugin import`` reads it back
(:mod:`.accelerate_import`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .precision import PRECISIONS

# the export's comment line that carries what the YAML cannot say (see _recipe_line)
RECIPE_LINE = re.compile(r"^# recipe: data (?P<data>\d+) x tensor (?P<tensor>\d+) x pipeline (?P<pipeline>\d+)"
                         r"(?: x context (?P<context>\d+) \((?P<method>ring|all_to_all)\))?, batch (?P<global>\d+) = "
                         r"micro (?P<micro>\d+) x grad_accum (?P<grad_accum>\d+) x data \d+, ZeRO-(?P<zero>\d)"
                         r"(?: offload optimizer (?P<offload_optimizer>\w+) param (?P<offload_param>\w+))?, "
                         r"clipping (?P<clip>[0-9.e+-]+)", re.M)


def _yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _yaml(data: Mapping, indent: int = 0) -> list[str]:
    lines = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            lines.append(" " * indent + f"{key}:")
            lines.extend(_yaml(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")
    return lines


def to_accelerate_config(recipe, world_size: int | None = None, *, cpu: bool = False,
                         deepspeed: bool = True) -> str:
    """An ``accelerate launch --config_file`` YAML for ``recipe``.

    tensor = pipeline = 1: ZeRO 0 is Accelerate's DDP (MULTI_GPU, or MULTI_CPU with ``cpu``); ZeRO >= 1 is
    its DeepSpeed plugin with the recipe's stage, offload, accumulation and clipping (that plugin needs
    deepspeed and transformers installed where it runs). ``deepspeed=False``, for machines without it: ZeRO >= 1
    is a plain MULTI_GPU launch too, and train.py picks Accelerate's FSDP2 plugin (CUDA, ZeRO-2/3) or the
    plugin's native back end, as :func:`plugin.engines.choose.accelerate_mode` decides. With tensor, pipeline or
    context > 1
    Accelerate only launches the processes (MULTI_GPU/MULTI_CPU) and train.py runs the plugin's native
    back end, which builds those groups itself.
    """
    layout = recipe.layout(world_size)
    nodes = recipe.cluster.nodes if recipe.cluster else 1
    mixed = PRECISIONS[recipe.precision].accelerate
    native_only = layout.tensor > 1 or layout.pipeline > 1 or layout.context > 1
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if cpu:
        cfg["distributed_type"] = "MULTI_CPU" if layout.world_size > 1 else "NO"
    elif recipe.zero.stage >= 1 and not native_only and deepspeed:
        z = recipe.zero
        ds = {"gradient_accumulation_steps": layout.grad_accum, "gradient_clipping": float(recipe.gradient_clipping),
              "offload_optimizer_device": z.offload_optimizer, "offload_param_device": z.offload_param,
              "zero3_init_flag": z.stage == 3, "zero_stage": z.stage}
        if z.nvme_path:
            ds["offload_optimizer_nvme_path"] = ds["offload_param_nvme_path"] = z.nvme_path
        if nodes > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = ds
    else:
        cfg["distributed_type"] = "MULTI_GPU" if layout.world_size > 1 else "NO"
    cfg.update({"machine_rank": 0, "main_training_function": "main", "mixed_precision": mixed,
                "num_machines": nodes, "num_processes": layout.world_size, "rdzv_backend": "static",
                "same_network": True, "use_cpu": cpu})
    header = [f"# accelerate config for recipe {recipe.name!r} ({layout.world_size} processes)", _recipe_line(recipe,
                                                                                                          layout)]
    if layout.context > 1:
        header.append("# context parallelism: accelerate launches, the plugin's native back end trains; Accelerate's "
                      "own parallelism_config (cp_size: torch's context_parallel under FSDP2 on CUDA; sp_size: "
                      "DeepSpeed's Ulysses) is not written, as it would split the sequence a second time")
    elif native_only:
        header.append("# tensor/pipeline parallelism: accelerate launches, the plugin's native back end trains")
    elif cfg["distributed_type"] == "DEEPSPEED":
        header.append("# needs deepspeed and transformers installed (Accelerate's DeepSpeed plugin imports "
                      "transformers); export with --no-deepspeed for a machine without them")
    elif recipe.zero.stage >= 1 and not deepspeed:
        header.append(f"# ZeRO-{recipe.zero.stage} without deepspeed: accelerate launches the processes; train.py "
                      "runs Accelerate's FSDP2 plugin (CUDA, ZeRO-2/3) or the plugin's native back end")
    elif recipe.zero.stage >= 1:  # cpu: MULTI_CPU launches; train.py picks the mode (plugin.engines.choose)
        header.append(f"# ZeRO-{recipe.zero.stage} on CPU: accelerate launches the processes; train.py runs "
                      "Accelerate's DeepSpeed plugin where deepspeed and transformers are installed, else the "
                      "plugin's native back end")
    return "\n".join(header + _yaml(cfg)) + "\n"


def _recipe_line(recipe, layout) -> str:
    """``# recipe: data 2 x tensor 1 x pipeline 1 x context 2 (ring), batch 16 = micro 4 x grad_accum 2 x data 2,
    ZeRO-1, clipping 1.0`` (after the stage `` offload optimizer cpu param none`` when it offloads): what the YAML
    cannot say, read back by :func:`from_accelerate_config`."""
    lay, z = layout, recipe.zero
    context = f" x context {lay.context} ({recipe.context_parallel.method})" if lay.context > 1 else ""
    offload = (f" offload optimizer {z.offload_optimizer} param {z.offload_param}"
               if (z.offload_optimizer, z.offload_param) != ("none", "none") else "")
    return (f"# recipe: data {lay.data} x tensor {lay.tensor} x pipeline {lay.pipeline}{context}, batch "
            f"{lay.global_batch} = micro {lay.micro_batch} x grad_accum {lay.grad_accum} x data {lay.data}, "
            f"ZeRO-{z.stage}{offload}, clipping {float(recipe.gradient_clipping)!r} (python -m plugin import reads "
            "this line back)")
