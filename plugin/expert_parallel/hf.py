"""transformers' mixture-of-experts layers over the expert group: each family's own experts module, cut to this rank's
experts, behind the plugin's dropless dispatch.

transformers 5.25 gives its MoE families (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2 and v3, ...) one experts
interface: ``experts(hidden_states [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]``, the tokens' weighted
sum over their chosen experts, with every weight of the module stacked along dim 0 by expert (``gate_up_proj [E, 2f,
h]``, ``down_proj [E, h, f]``, and biases where the family has them). The family's router (and its shared experts,
its dense layers) stays whole on every rank and runs as it does on one process. :func:`cut_experts` keeps this rank's
``E / ep`` experts in a copy of the module whose ``forward`` is :func:`_dispatching_forward`: the choices go to their
experts' ranks (:func:`.dispatch.dispatch_combine`), where the family's own forward runs its experts on the rows they
received (each with weight 1: one row, one expert), and come back to be weighted and summed.

A choice whose index is not an expert (transformers uses ``E`` as an empty slot) adds nothing, as in the family's
forward. Every local expert joins the backward (a zero gradient when it received no row), so every rank of the
expert-data group reduces the same gradients.
"""
from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch import nn

from .dispatch import dispatch_combine

INTERFACE = ("hidden_states", "top_k_index", "top_k_weights")


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module the dispatch can drive: its forward takes
    :data:`INTERFACE`, it says ``num_experts``, and each of its own parameters is stacked by expert."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.") or not cls.__name__.endswith("Experts"):
        return False
    try:
        names = list(inspect.signature(cls.forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (tuple(names) == INTERFACE and isinstance(n, int) and bool(params)
            and all(p.dim() >= 1 and p.shape[0] == n for p in params)
            and not any(True for c in module.children() for _ in c.parameters()))  # an activation module at most


def hf_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every transformers experts module in ``model`` (:func:`is_hf_experts`)."""
    return [(n, m) for n, m in model.named_modules() if is_hf_experts(m)]


def cut_experts(whole: nn.Module, ep_rank: int, ep_size: int, group) -> nn.Module:
    """A copy of the transformers experts module ``whole`` holding expert rank ``ep_rank``'s experts (of ``ep_size``),
    dispatching over ``group``; meta stays meta. Each parameter keeps its name; ``param_boxes`` gives its
    box's place in the whole stacked tensor (checkpoints store the whole model's names and shapes)."""
    total = whole.num_experts
    local = total // ep_size
    first = ep_rank * local
    piece = copy.copy(whole)  # the family's attributes (activation, sizes, config) shared; its tensors its own
    piece._parameters = {}
    piece._buffers = dict(whole._buffers)
    piece._modules = dict(whole._modules)  # its activation module (no parameters)
    piece.param_boxes = {}
    for name, p in whole._parameters.items():
        piece._parameters[name] = nn.Parameter(p.detach()[first:first + local].clone(), requires_grad=p.requires_grad)
        piece.param_boxes[name] = (first,) + (0,) * (p.dim() - 1)
    piece.num_experts, piece.ep_first, piece.ep_total, piece.ep_group = local, first, total, group
    piece.forward = functools.partial(_dispatching_forward, piece)
    return piece


class _LocalExperts:
    """This rank's experts as :func:`.dispatch.dispatch_combine` calls them: ``(rows grouped by local expert, counts)
    -> each row through its expert``, by the family's own forward (each row one choice of weight 1)."""

    def __init__(self, module: nn.Module):
        self.module, self.total = module, module.ep_total

    def __call__(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        m = self.module
        index = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                        torch.tensor(counts, device=rows.device)).unsqueeze(-1)
        out = type(m).forward(m, rows, index, rows.new_ones(rows.shape[0], 1))
        # every local expert in the graph, whether it received a row or not: the same gradients on every rank
        return out + sum(p.reshape(-1)[:1].sum() for p in m.parameters()).to(out.dtype) * 0


def _dispatching_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    total = module.ep_total
    valid = (top_k_index >= 0) & (top_k_index < total)  # transformers' empty slot (index E) adds nothing
    index = torch.where(valid, top_k_index, torch.zeros_like(top_k_index))
    weights = torch.where(valid, top_k_weights, torch.zeros_like(top_k_weights)).to(hidden_states.dtype)
    return dispatch_combine(hidden_states, index, weights, _LocalExperts(module), module.ep_group)
