"""``initialize(model, recipe) -> Engine``: checks, groups, tensor-parallel plan, the chosen back end.

The order matters for users: the recipe and the launched world are checked on every rank before any
process group exists (a mismatch exits everywhere within seconds, no hang), then the model's real dims
against the recipe, then the back end is chosen (DeepSpeed, Accelerate's Accelerator, or the native torch
back end: :mod:`plugin.engines.choose`) and builds groups, shards the model and wraps it.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..distributed.env import check_launch, ensure_single_process_env, launch_env, let_rank_0_speak, scheduler_words
from ..errors import PluginError, Problem, RecipeError
from ..interop.precision import PRECISIONS
from ..recipe.checks import check_deepspeed_back_end, check_native_back_end, load_recipe
from ..recipe.spec import Recipe
from .choose import ACCELERATE_MARK, choose, importable
from .context import BuildContext
from .model_checks import check_model


def choose_backend(recipe: Recipe, device_type: str | None = None) -> str:
    """"deepspeed", "accelerate" or "native" for ``recipe`` in this process (:func:`plugin.engines.choose.choose`)."""
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return choose(recipe, environ=os.environ, has_deepspeed=importable("deepspeed"), cuda=device_type == "cuda",
                  has_transformers=importable("transformers"))


def _device(env, meta: bool = False):
    import torch

    if meta:  # the dry run: nothing is allocated, nothing materialised (plugin.dryrun)
        return torch.device("meta")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_module(model):
    """``model`` as one ``nn.Module`` for every back end: a list or tuple of layers becomes an ``nn.Sequential``
    of the same layer objects (what a pipeline cuts, and what one stage runs whole at pipeline 1)."""
    import torch

    if isinstance(model, (list, tuple)):
        if not all(isinstance(layer, torch.nn.Module) for layer in model):
            kinds = sorted({type(layer).__name__ for layer in model if not isinstance(layer, torch.nn.Module)})
            raise PluginError(f"initialize got a list of layers holding {', '.join(kinds)} -> every layer must be "
                              "an nn.Module")
        return torch.nn.Sequential(*model)
    return model


def build_on_meta(model_or_builder):
    """A zero-argument builder called under ``torch.device("meta")``; a model or a list of layers as given."""
    import torch

    if isinstance(model_or_builder, (torch.nn.Module, list, tuple)) or not callable(model_or_builder):
        return model_or_builder
    with torch.device("meta"):
        return model_or_builder()


def _capture(model) -> list:
    import torch

    if not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        return []
    from ..materialize import capture

    return capture(model) if isinstance(model, torch.nn.Module) else []


def _weights_source(weights, units, model):
    """``initialize(weights=DIR)``'s files, checked against the meta model's units before any process group."""
    if weights is None:
        return None
    if not units:
        raise PluginError(f"initialize(weights={str(weights)!r}): {type(model).__name__} is not on the meta device -> "
                          "build it on meta (with torch.device('meta'): ...) or pass a builder, so that each rank "
                          "reads only its part of the weights")
    from ..materialize.weights import SafetensorsWeights

    source = SafetensorsWeights(weights)
    source.check(units)
    return source


def _seed(seed: int | None, weights) -> int:
    """The init seed every rank must share. With saved ``weights`` the files give every parameter and the seed only
    fills what they do not hold (non-persistent buffers): 0 then, so that a caller who never seeded (torchrun
    gives each process its own ``torch.initial_seed()``) is not refused by the ranks' seed check."""
    import torch

    if seed is None and weights is not None:
        return 0
    return int(torch.initial_seed() if seed is None else seed)


def _check_nothing_left_on_meta(engine) -> None:
    module = getattr(engine, "container", None)
    module = engine.module if module is None else module
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
    assert not left, f"materialisation left {left[:5]} on the meta device"  # internal invariant


def layers_of(model) -> list:
    """The model as an ordered list of layers, for pipeline stages: a transformers causal LM's stage list
    (:func:`plugin.models.hf_stages.stage_layers`), ``to_layers()``, or the list / Sequential itself."""
    import torch

    from ..models.hf_stages import is_hf_model, stage_layers

    if is_hf_model(model):
        return stage_layers(model)
    if hasattr(model, "to_layers"):
        return list(model.to_layers())
    if isinstance(model, (list, tuple, torch.nn.Sequential)):
        return list(model)
    raise PluginError(f"pipeline parallelism needs the model as an ordered list of layers: {type(model).__name__} "
                      "has no to_layers() -> pass a list of modules or an nn.Sequential")


def _warn_on_launch_precision(recipe: Recipe, env) -> None:
    """``accelerate launch --mixed_precision X`` that disagrees with the recipe: the recipe decides; say so once."""
    launched = os.environ.get(ACCELERATE_MARK)
    wanted = PRECISIONS[recipe.precision].accelerate
    if env.is_main and launched not in (None, wanted):
        print(f"{recipe.source}: $.precision: warning: accelerate launch --mixed_precision {launched} is ignored; the "
              f'recipe\'s "precision": "{recipe.precision}" decides -> launch with --mixed_precision {wanted}',
              file=sys.stderr)


def _check_context_parallel(model, recipe: Recipe, backend: str, env) -> None:
    """Before any group: a model whose attention cannot be told the sequence is split, and back ends that cannot take
    the context groups, are refused."""
    from ..context_parallel.apply import supports_context_parallel

    problems = []
    why = supports_context_parallel(model)
    if why:
        problems.append(Problem("$.parallelism.context", why, 'use the reference GPT or a transformers causal LM, or '
                                'set "context": 1'))
    if backend == "accelerate":
        problems.append(Problem("$.parallelism.context", "Accelerate's Accelerator takes no custom process groups, so "
                                "it cannot reduce gradients over data x context", 'use backend "native" (what '
                                "accelerate launch runs for a context axis)"))
    if problems:
        _fail([p.with_file(recipe.source) for p in problems], env)


def _expert_parallel(model, recipe: Recipe, layout, backend: str, env, loss_for):
    """Before any group: what the expert axis does not reach on this back end is refused
    (:func:`plugin.expert_parallel.checks.check_expert_reach`); the loss gains the MoE layers' load-balancing terms."""
    from ..expert_parallel import hf_experts, moe_layers, with_aux_losses
    from ..expert_parallel.checks import check_expert_reach

    layers = moe_layers(model)
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) if not hasattr(model, "to_layers") else None
    problems = check_expert_reach(recipe, layout, backend, len(layers), family,
                                  bool(getattr(config, "base_model_ep_plan", None)), len(hf_experts(model)),
                                  bool(getattr(config, "output_router_logits", False)))
    if problems:
        _fail([p.with_file(recipe.source) for p in problems], env)
    return with_aux_losses(loss_for, model)


def _fail(problems: list[Problem], env) -> None:
    """Every rank reached these problems: rank 0 prints them, the others give it time to (a launcher stops every rank
    once one has exited), then every rank raises."""
    if env.is_main:
        print("\n".join(p.format() for p in problems), file=sys.stderr, flush=True)
    else:
        let_rank_0_speak()
    raise RecipeError(problems)


def initialize(model, recipe: Recipe | str | Path, *, seed: int | None = None, loss_fn: Callable | None = None,
               world_size: int | None = None, backend: str | None = None, weights=None, job_dir=None,
               meta: bool = False):
    """Shard ``model`` per ``recipe`` and wrap it in the chosen back end's :class:`~plugin.engines.base.Engine`.

    This is the call that creates the process group (from the launcher's ``RANK`` / ``WORLD_SIZE``): build what asks
    for it, a ``DistributedSampler`` (torch: "Default process group has not been initialized"), after it, with
    ``num_replicas=engine.data_size, rank=engine.data_rank``, or iterate ``engine.dataloader(dataset)``.

    ``model``: an ``nn.Module`` built on the meta device (``with torch.device("meta"): GPT(cfg)``), or a
    zero-argument callable that builds one (called here under ``torch.device("meta")``): each rank then
    materialises only what it holds (its tensor shards, its stage, its ZeRO-3 / FSDP2 partition), every module
    filled by the model's ``init_module(name, module)``, transformers' ``_init_weights`` or its own
    ``reset_parameters()`` under a generator seeded by ``(seed, qualified name)``, so the values do not depend on
    the layout (:mod:`plugin.materialize`).
    Or an ``nn.Module`` built whole, with the same seed, on every rank (the plugin shards it, values kept). For
    pipelines an ordered list of layers, an ``nn.Sequential`` or a model with ``to_layers()``. A list or
    tuple is wrapped in an ``nn.Sequential`` first (:func:`as_module`), whatever the layout and back end.
    ``seed``: the init seed of meta tensors (default ``torch.initial_seed()``, or 0 with ``weights``; the same on
    every rank, checked).
    ``loss_fn(output, labels)``: defaults to next-token cross entropy, vocab-parallel when the head is sharded.
    ``world_size``: the world the caller expects; it must equal the launcher's WORLD_SIZE.
    ``backend``: "deepspeed", "accelerate" or "native" to override :func:`choose_backend`.
    ``weights``: a directory ``save_pretrained`` wrote (``*.safetensors``), for a model on meta or a builder: each
    rank reads only its part of the tensors (:mod:`plugin.materialize.weights`), checked against the model first.
    ``job_dir``: where the hang guard writes its ledgers at a timeout (``<job_dir>/watchdog/<run>``, e.g. the
    ``--save`` directory; default a directory under the system's temporary one): :mod:`plugin.watchdog`, set up here
    for any world of more than one process, its pre-flight passed before this returns.
    ``meta``: build on the meta device and stop there (:mod:`plugin.dryrun`, over a process group it created): every
    group, the tensor plan, the stage and the sharding are real, nothing is materialised, no hang guard is started.
    Raises :class:`RecipeError` with every problem, before building anything, when the recipe does not fit the
    launched world or the model.
    """
    env = launch_env()
    if world_size is not None and world_size != env.world_size:
        _fail([Problem("$.parallelism", f"initialize(world_size={world_size}) but the launcher started "
                       f"{env.world_size} process(es)", "drop world_size, or launch that many processes")], env)
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    check_launch(recipe, env)
    model = as_module(build_on_meta(model))
    units = _capture(model)  # before any wrapping, the same on every rank: refuses a module that cannot be filled
    source = _weights_source(weights, units, model)
    problems = check_model(model, recipe)
    if any(p.is_error for p in problems):
        _fail([p for p in problems if p.is_error], env)
    if env.is_main:
        for p in problems:
            print(p.format(), file=sys.stderr)
    layout = recipe.layout(env.world_size)
    ensure_single_process_env()  # a plain `python train.py` still needs a rendezvous address for its group of one
    device = _device(env, meta)
    backend = backend or choose_backend(recipe, device.type)
    _warn_on_launch_precision(recipe, env)
    if recipe.parallelism.context > 1:
        _check_context_parallel(model, recipe, backend, env)
    # the chosen back end's own rules (a recipe that names no launcher is checked by them only now)
    rule = {"native": check_native_back_end, "deepspeed": check_deepspeed_back_end}.get(backend)
    problems = [p.with_file(recipe.source) for p in rule(recipe, layout, chosen=True)] if rule else []
    if problems:
        _fail(problems, env)
    from ..tensor_parallel.hooks import tensor_parallel_hooks  # imports torch: not before the checks have passed

    apply_tp, loss_for = tensor_parallel_hooks(model, recipe, loss_fn)
    loss_for = _expert_parallel(model, recipe, layout, backend, env, loss_for)
    from .recompute import apply_activation_checkpointing

    apply_activation_checkpointing(model, recipe, layers_of)  # the recipe's recompute, the same for every back end
    from ..checkpoint.adapt import model_index, recording_tp

    index = model_index(model)  # checkpoints name every tensor as the unsharded model does, with its global shape
    from .optim import WeightDecay

    decay = WeightDecay.of(model)  # from the true shapes, before a back end shards, partitions or wraps anything
    cuts = apply_tp.cuts
    apply_tp, tp_layouts = recording_tp(apply_tp)  # each sharded parameter's layout, before FSDP2 replaces it
    apply_tp.cuts = cuts  # the plan's cuts, which materialising a meta model re-runs on whole values
    if backend == "deepspeed":
        from .deepspeed.engine import build
    elif backend == "native":
        from .native.build import build
    elif backend == "accelerate":
        from .accelerate import build
    else:
        raise PluginError(f'unknown backend {backend!r} -> use "deepspeed", "accelerate" or "native"')
    from ..watchdog.guard import prepare

    # before any process group: rank 0 may fork its store (none in a dry run)
    guard = None if meta else prepare(recipe, env, device.type, job_dir)
    try:
        engine = build(BuildContext(model=model, recipe=recipe, layout=layout, env=env, device=device,
                                    layers_of=layers_of, apply_tp=apply_tp, loss_for=loss_for, decay=decay,
                                    seed=_seed(seed, weights), units=tuple(units), weights=source, guard=guard))
        if not meta:
            _check_nothing_left_on_meta(engine)
        from .lr_schedule import build_lr_schedule

        engine.lr_schedule = build_lr_schedule(engine.schedule_optimizer(), recipe)  # one LambdaLR, every back end
        engine.model_index, engine.tp_layouts, engine.whole_model = index, tp_layouts, model
        from ..models.hf_stages import is_hf_model

        engine.calls_with_kwargs = is_hf_model(model)  # dict batches as keyword arguments, use_cache=False
        if guard is not None:
            guard.attach(engine)  # every group's timeout, the phase hooks, one all-reduce per group (pre-flight)
            engine.guard = guard
    except BaseException as e:
        if guard is not None:  # every rank refuses alike here (a failing rank alone: its peers' guards report it)
            guard.start_failed(e)  # a rendezvous that never completed: the ranks that never reached it, named
            guard.stop()
            guard.release()
        raise
    if env.is_main and not meta:  # here, not in each back end: every back end passes this line
        print(f"{recipe.source or recipe.name}: {startup_line(engine)}", file=sys.stderr, flush=True)
    from ..monitor.excepthook import install as install_excepthook

    install_excepthook()  # a PluginError raised in the user's loop: its message once per rank, no traceback
    return engine


def startup_line(engine) -> str:
    """What trains on what, printed by rank 0 once the engine exists: back end, device, process-group backend,
    layout, precision and the torch build, so that a CUDA machine running a CPU-only torch shows
    "on cpu, gloo" and "CPU-only build" before the first (slow) step."""
    import torch
    import torch.distributed as dist

    d = engine.describe()
    mode = getattr(engine, "mode", None)  # Accelerate's: ddp, deepspeed or fsdp
    backend = d["backend"] + (f" ({mode})" if mode else "")
    groups = dist.get_backend() if dist.is_initialized() else "no process group"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return (f"start: {backend} on {engine.device.type}, {groups}, {engine.layout.words}, ZeRO-{d['zero']}, "
            f"{d['precision']} (torch {torch.__version__}, {build}){scheduler_words()}")
