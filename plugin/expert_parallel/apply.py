"""Placing a model's experts over the expert group: each MoE layer keeps its ranks' experts, learns its groups, and
its expert parameters are marked (for the back ends' two reductions and the gradient norm).

``apply_expert_parallel(model, groups, cuts)`` runs once the process groups exist, after tensor parallelism and before
a back end wraps the model. On a meta model the cut is recorded in ``cuts`` (``{module name: whole module -> this
rank's}``, the tensor-parallel plan's own table) so that materialising fills each rank's experts from the whole
values: the same numbers on every layout.

An expert parameter carries ``expert_parallel = True`` and, as DeepSpeed's MoE layer marks its experts,
``allreduce = False`` and ``group_name`` (its expert-data group's name in DeepSpeed's ``ep_size_<E>`` form).
"""
from __future__ import annotations

from torch import nn

from .hf import cut_experts, hf_experts
from .layer import ExpertContext, MoE


def is_expert_param(p) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding this rank's experts (the reference GPT's :class:`.layer.Experts`, a transformers family's
    experts cut by :func:`.hf.cut_experts`): those whose own parameters are all marked expert parameters."""
    return [m for m in model.modules() if list(m.parameters(recurse=False))
            and all(is_expert_param(p) for p in m.parameters(recurse=False))]


def mark_expert_params(experts: nn.Module, ep_size: int) -> None:
    for p in experts.parameters():
        p.expert_parallel = True
        p.allreduce = False
        p.group_name = f"ep_size_{ep_size}"
        if getattr(experts, "tensor_group", None) is not None:
            p.tensor_model_parallel = True  # a different slice on every expert-tensor rank: counted on each


def apply_expert_parallel(model: nn.Module, groups, cuts: dict | None = None,
                          sequence_parallel: bool = False) -> list[str]:
    """Cut every MoE layer of ``model`` to this rank's experts (``groups``: a
    :class:`plugin.distributed.groups.ParallelGroups`), the reference GPT's and, with an expert axis, a transformers
    family's (:mod:`.hf`); returns the expert modules' names. ``sequence_parallel``: the model's activations between
    blocks are slices of the sequence over the tensor group (each MoE layer gathers them and keeps its slice)."""
    split = len(groups.expert_tensor_ranks) > 1
    tp_rank = groups.expert_tensor_ranks.index(groups.rank) if split else 0
    tp_size = len(groups.expert_tensor_ranks) if split else 1
    context = ExpertContext(expert_group=groups.expert_group if groups.ep_size > 1 else None,
                            expert_tensor_group=groups.expert_tensor_group if split else None,
                            data_context_group=groups.data_context_group if groups.data_context_size > 1 else None,
                            sequence_group=groups.tensor_group if sequence_parallel and len(groups.tensor_ranks) > 1
                            else None)
    names = []
    for name, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]:
        moe.ep = context
        key = f"{name}.experts" if name else "experts"
        whole = moe.experts
        if groups.ep_size > 1 or split:
            def cut(dense, ep_rank=groups.ep_rank, ep_size=groups.ep_size):
                return dense.cut(ep_rank, ep_size, tp_rank, tp_size)

            moe.experts = cut(whole)
            if cuts is not None:
                cuts[key] = cut
        moe.experts.tensor_group = context.expert_tensor_group
        mark_expert_params(moe.experts, groups.ep_size)
        names.append(key)
    if groups.ep_size > 1:  # a transformers family's experts: cut here, the family's router and the rest untouched
        for name, whole in hf_experts(model):
            def cut_hf(dense, ep_rank=groups.ep_rank, ep_size=groups.ep_size, group=context.expert_group):
                return cut_experts(dense, ep_rank, ep_size, group)

            piece = cut_hf(whole)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, piece)
            if cuts is not None:
                cuts[name] = cut_hf
            mark_expert_params(piece, groups.ep_size)
            names.append(name)
    return names
