"""Tell a model it runs with its sequence split: the one call every back end makes once its groups exist."""
from __future__ import annotations

import torch

from .attention import ContextParallelContext, context_rng
from .errors import ContextParallelError


def context_of(groups, method: str, seed: int | None = None) -> ContextParallelContext:
    """This rank's :class:`ContextParallelContext` from its :class:`plugin.distributed.groups.ParallelGroups`, with
    its dropout stream (``seed``: the same on every rank; default ``torch.initial_seed()``, as the tensor-parallel
    stream's)."""
    seed = torch.initial_seed() if seed is None else seed
    return ContextParallelContext(groups.context_group, groups.cp_size, groups.cp_rank, method,
                                  rng=context_rng(seed, groups.tp_rank, groups.tp_size, groups.cp_rank, groups.pp_rank))


def _is_transformers(model) -> bool:
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def supports_context_parallel(model) -> str | None:
    """None when :func:`apply_context_parallel` can tell ``model`` its sequence is split, else why not (before any
    process group exists, so every rank refuses alike)."""
    if hasattr(model, "configure_context_parallel"):
        return None
    if _is_transformers(model):
        from .hf import attention_modules

        return None if attention_modules(model) else (
            f"{type(model).__name__} has no attention module (a layer_idx, called through transformers' attention "
            "interface) that context parallelism can route")
    return (f"{type(model).__name__} has no configure_context_parallel(ctx) and is no transformers model: its "
            "attention cannot be told that the sequence is split (give it a configure_context_parallel that routes "
            "its attention through plugin.context_parallel.context_attention)")


def apply_context_parallel(model, groups, method: str, seed: int | None = None) -> None:
    """``model.configure_context_parallel(ctx)`` (the reference GPT), or a transformers model's attention switched to
    the context attention (:mod:`.hf`); another model is refused by name. Nothing at context 1."""
    if groups.cp_size == 1:
        return
    cp = context_of(groups, method, seed)
    configure = getattr(model, "configure_context_parallel", None)
    if configure is not None:
        configure(cp)
        return
    why = supports_context_parallel(model)
    if why:
        raise ContextParallelError(f'{why} -> use the reference GPT or a transformers causal LM, or set "context": 1')
    from .hf import configure_hf

    configure_hf(model, cp)
