"""Which back end trains a recipe: pure decisions from the recipe, the launcher's environment and what is
installed (no torch import; :func:`plugin.engines.initialize.choose_backend` feeds in the live values).

* ``"deepspeed"``: DeepSpeed is importable and the recipe allows it (launcher auto/deepspeed; a pipeline
  schedule DeepSpeed runs, i.e. 1F1B), and the job was not started by ``accelerate launch``.
* ``"accelerate"``: started by ``accelerate launch`` (launcher auto/accelerate) and the recipe needs nothing
  Accelerate cannot carry (:func:`accelerate_mode`): ``Accelerator`` itself trains, with DDP, its
  DeepSpeed plugin (which imports transformers: only where deepspeed and transformers are both installed)
  or its FSDP2 plugin.
* ``"native"``: everything else: DeepSpeed missing, launcher torchrun/accelerate, tensor, pipeline or context
  parallelism under ``accelerate launch``, or what Accelerate cannot do on this device or with what
  is installed (ZeRO >= 1 without transformers: as without deepspeed); an ``"auto"`` recipe whose MoE layers only
  the native back end trains (:func:`native_only`).

``accelerate launch`` is recognised by ``ACCELERATE_MIXED_PRECISION``, which its simple, multi-GPU/CPU and
DeepSpeed launchers all export to every process they start (accelerate 1.x, ``utils/launch.py``);
``ACCELERATE_USE_CPU`` is not a sign of it (users export that one themselves).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from ..errors import PluginError

ACCELERATE_MARK = "ACCELERATE_MIXED_PRECISION"


def importable(name: str) -> bool:
    """Whether ``import name`` would find the package, without importing it (importing deepspeed picks its
    accelerator, and both it and accelerate take seconds): what :func:`choose` and :func:`accelerate_mode` are told."""
    return importlib.util.find_spec(name) is not None


def launched_by_accelerate(environ: Mapping[str, str]) -> bool:
    return ACCELERATE_MARK in environ


def accelerate_mode(recipe, *, cuda: bool, has_deepspeed: bool, has_transformers: bool) -> tuple[str | None, str]:
    """(``"ddp"`` | ``"deepspeed"`` | ``"fsdp"`` | None, why): how ``Accelerator`` carries the recipe, or None
    with the reason the native back end must (under the same ``accelerate launch``).

    Accelerate's DeepSpeed plugin imports transformers (``HfDeepSpeedConfig``, accelerate 1.x), so without
    transformers ZeRO >= 1 is decided as if deepspeed were missing, and the reason says so."""
    par = recipe.parallelism
    if par.tensor > 1 or par.pipeline > 1 or par.context > 1:
        return None, ("tensor/pipeline/context parallelism: Accelerate takes no custom process groups, so the "
                      "plugin's native back end builds them")
    if recipe.precision == "fp16" and not cuda:
        return None, "fp16 on CPU: Accelerate would silently train in fp32 there; the native back end autocasts"
    z = recipe.zero
    if z.stage == 0:
        return "ddp", "ZeRO-0: Accelerate's DistributedDataParallel"
    if has_deepspeed and has_transformers:
        return "deepspeed", f"ZeRO-{z.stage}: Accelerate's DeepSpeed plugin with the recipe's ds_config"
    missing = ("deepspeed is not installed" if not has_deepspeed else
               "transformers is not installed, and Accelerate's DeepSpeed plugin imports it")
    if z.stage >= 2 and cuda and "nvme" not in (z.offload_param, z.offload_optimizer):
        return "fsdp", f"ZeRO-{z.stage}: Accelerate's FSDP2 plugin ({missing})"
    if z.stage == 1:
        return None, f"ZeRO-1 ({missing}): Accelerate alone has no optimizer-state sharding; ZeroRedundancyOptimizer"
    return None, f"ZeRO-{z.stage} on CPU ({missing}): Accelerate's FSDP needs an accelerator; FSDP2 directly"


def native_only(recipe) -> str | None:
    """Why only the native back end can train ``recipe`` (None: any can): its reference GPT's MoE layers, or an expert
    axis on any model, reach what :func:`plugin.expert_parallel.checks.moe_native_only` says only the native back end
    reaches, so ``"launcher":
    "auto"`` resolves to it and launch.sh to torchrun instead of starting a launcher whose processes would refuse
    the recipe."""
    moe = recipe.model.moe if recipe.model is not None else None
    par = recipe.parallelism
    from ..expert_parallel.checks import moe_native_only

    if moe is None:  # an expert axis on a model built elsewhere (a transformers family's experts)
        return moe_native_only(None, par.expert, 1).get("spread") if par.expert > 1 else None
    reasons = moe_native_only(moe.router, par.expert, None if par.data == "auto" else par.data * par.context,
                              par.pipeline)
    return reasons.get("router") or reasons.get("spread") or reasons.get("pipeline")


def choose(recipe, *, environ: Mapping[str, str], has_deepspeed: bool, cuda: bool,
           has_transformers: bool = True) -> str:
    """The back end for ``recipe`` (see the module docstring). ``has_deepspeed`` / ``has_transformers``: whether
    each is importable (the caller looks; this module imports neither). ``has_transformers`` matters only under
    ``accelerate launch`` at ZeRO >= 1 with deepspeed installed; left out, it is taken as installed."""
    if recipe.launcher == "deepspeed":
        if not has_deepspeed:
            raise PluginError('the recipe says "launcher": "deepspeed" but deepspeed is not installed -> '
                              'pip install deepspeed (with torch pinned), or set "launcher": "auto"')
        return "deepspeed"
    if recipe.launcher in ("auto", "accelerate") and native_only(recipe):
        return "native"
    if launched_by_accelerate(environ) and recipe.launcher in ("auto", "accelerate"):
        mode, _ = accelerate_mode(recipe, cuda=cuda, has_deepspeed=has_deepspeed, has_transformers=has_transformers)
        return "accelerate" if mode else "native"
    if recipe.launcher in ("accelerate", "torchrun"):
        return "native"
    if recipe.parallelism.pipeline > 1 and recipe.pipeline_parallel.schedule != "1f1b":
        return "native"  # DeepSpeed's PipelineEngine runs 1F1B only
    return "deepspeed" if has_deepspeed else "native"
