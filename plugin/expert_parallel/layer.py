"""The mixture-of-experts feed-forward: a router and a bank of GELU experts, placed over the expert group.

``MoE(hidden, experts, top_k, ffn_hidden)`` is built whole (every expert, ``w1 [E, hidden, ffn]`` and ``w2 [E, ffn,
hidden]`` as two stacked parameters, so that materialising a meta model fills them under one seed whatever the
layout); :func:`plugin.expert_parallel.apply.apply_expert_parallel` then keeps on each rank its ``E / ep`` experts
(and, with the tensor degree, its columns of ``w1`` and rows of ``w2``: Megatron's column-then-row split of each
expert). Input and output are ``[..., hidden]``: tokens are flattened, routed, dispatched and combined
(:func:`.dispatch.dispatch_combine`). In training, each forward keeps its load-balancing loss in ``aux_loss`` (over
the data x context group, :mod:`.router`), which :func:`.aux.with_aux_losses` adds to the training loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.comm import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    reduce_from_tensor_region,
    scatter_to_sequence_region,
)
from .comm import group_size
from .dispatch import dispatch_combine
from .router import load_balancing_loss, router_z_loss, sigmoid_top_k, softmax_top_k, updated_bias


@dataclass(frozen=True)
class ExpertContext:
    """What a MoE layer needs of the layout: the expert group (tokens travel over it), the expert-tensor group
    (each expert's columns and rows split over it; ``None``: whole experts), the data x context group (the
    load-balancing statistics are summed over it) and, under sequence parallelism, the tensor group over which the
    layer's input is a slice of the sequence."""

    expert_group: Any = None
    expert_tensor_group: Any = None
    data_context_group: Any = None
    sequence_group: Any = None  # sequence parallelism: the tensor group whose ranks hold slices of the sequence


class Experts(nn.Module):
    """This rank's experts: ``y_e = gelu(x w1[e]) w2[e]``; ``total`` experts in the layer, ``first`` the global index
    of ``w1[0]``. With an expert-tensor group, ``w1`` holds this rank's columns and ``w2`` its rows: the input's
    gradient and the output are summed over that group (Megatron's f and g)."""

    def __init__(self, experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.w2 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.total, self.first = experts, 0
        self.tensor_group = None

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        rows = copy_to_tensor_region(rows, self.tensor_group)
        outs = [F.gelu(chunk @ self.w1[e]) @ self.w2[e] for e, chunk in enumerate(rows.split(counts))]
        return reduce_from_tensor_region(torch.cat(outs), self.tensor_group)

    def cut(self, ep_rank: int, ep_size: int, tp_rank: int = 0, tp_size: int = 1) -> Experts:
        """A module holding expert rank ``ep_rank``'s experts (of ``ep_size``) and tensor rank ``tp_rank``'s columns
        of them (of ``tp_size``), cut from this whole one (meta stays meta)."""
        local, ffn = self.total // ep_size, self.w1.shape[-1] // tp_size
        first, cols = ep_rank * local, slice(tp_rank * ffn, (tp_rank + 1) * ffn)
        piece = Experts.__new__(Experts)
        nn.Module.__init__(piece)
        piece.w1 = nn.Parameter(self.w1.detach()[first:first + local, :, cols].clone())
        piece.w2 = nn.Parameter(self.w2.detach()[first:first + local, cols, :].clone())
        piece.total, piece.first, piece.tensor_group = self.total, first, None
        # where this rank's box lies in the whole tensors: checkpoints store the whole model's names and shapes (on the
        # module, which keeps it when materialising or FSDP2 replaces the parameters)
        piece.param_boxes = {"w1": (first, 0, cols.start), "w2": (first, cols.start, 0)}
        return piece

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.w1.shape[0] - 1} of {self.total}, w1 {tuple(self.w1.shape)}"


class MoE(nn.Module):
    """Router and experts. ``forward(x [..., hidden]) -> [..., hidden]``.

    ``router``: ``"softmax"`` (with the load-balancing loss) or ``"sigmoid"`` (DeepSeek-V3: ``score_bias``, a
    parameter without gradient, steers the choice; each training forward adds its choices to ``load``, and
    :meth:`update_bias`, called after every optimizer step, sums them over data x context and moves the bias by
    ``bias_update_rate`` towards balance: the same on every rank and layout as on one process). ``z_loss_coef`` > 0:
    each training forward also keeps ST-MoE's router z-loss in ``z_loss``. Both are added to the training loss, times
    ``aux_loss_coef`` and ``z_loss_coef`` (:meth:`take_terms`, :mod:`.aux`)."""

    def __init__(self, hidden: int, experts: int, top_k: int, ffn_hidden: int, router: str = "softmax",
                 bias_update_rate: float = 0.001, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.kind, self.bias_update_rate = router, bias_update_rate
        if router == "sigmoid":
            self.score_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.load: torch.Tensor | None = None
        self.experts = Experts(experts, hidden, ffn_hidden)
        self.top_k = top_k
        self.ep = ExpertContext()
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_coef = aux_loss_coef  # the load-balancing loss's weight in the training loss
        self.z_loss_coef = z_loss_coef  # > 0: each training forward keeps its router z-loss in z_loss
        self.z_loss: torch.Tensor | None = None
        self.force_expert: int | None = None  # tests: every token's first choice is this expert (an unbalanced routing)
        # pipeline stages (.aux.StageLosses): (output, weighted term) -> output carrying the term's gradient
        self.attach = None

    def forward(self, x: torch.Tensor, out_bias: torch.Tensor | None = None) -> torch.Tensor:
        sequence = self.ep.sequence_group
        if sequence is not None:  # every token of the tensor group, routed alike on each of its ranks (below)
            x = gather_from_sequence_region(x, sequence, tensor_parallel_output_grad=False)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        if self.force_expert is not None:  # a large margin on one expert: differentiable, and every token goes there
            logits = logits + F.one_hot(torch.full((1,), self.force_expert), logits.shape[-1]).to(logits.dtype) * 8.0
        if self.z_loss_coef and self.training and torch.is_grad_enabled():
            self.z_loss = router_z_loss(logits)
        if self.kind == "sigmoid":
            _, weights, chosen = sigmoid_top_k(logits, self.score_bias, self.top_k)
            if self.training and torch.is_grad_enabled() and not chosen.is_meta:  # meta: the dry run, no loads
                counts = torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).float()
                self.load = counts if self.load is None else self.load + counts
        else:
            probs, weights, chosen = softmax_top_k(logits, self.top_k)
            if self.training and torch.is_grad_enabled():
                self.aux_loss = load_balancing_loss(probs, chosen, self.ep.data_context_group)
        y = dispatch_combine(tokens, chosen, weights.to(tokens.dtype), self.experts, self.ep.expert_group)
        if self.attach is not None:  # carried by the output, not by the loss function
            term = self.take_terms()
            y = y if term is None else self.attach(y, term)
        y = y.reshape(shape)
        # Under sequence parallelism each rank keeps its slice. Each rank's gradient of the whole output is whole (the
        # slices' gradients all-gathered), and the layer computes alike on every rank of the tensor group (the router
        # whole, the experts' columns and rows summed by its f and g), so the input's gradient is whole too: the
        # gather's backward keeps the rank's slice of it, without a sum.
        return scatter_to_sequence_region(y, sequence) if sequence is not None else y

    def take_terms(self) -> torch.Tensor | None:
        """The weighted load-balancing and z terms of the last training forward (None: none), cleared."""
        # a term of weight 0 too: each softmax forward gives one term (the pipeline's StageLosses counts on it)
        terms = [c * t for c, t in ((self.aux_loss_coef, self.aux_loss), (self.z_loss_coef, self.z_loss))
                 if t is not None]
        self.aux_loss = self.z_loss = None
        return sum(terms) if terms else None

    @torch.no_grad()
    def update_bias(self) -> None:
        """After an optimizer step: the sigmoid router's bias moved by the step's loads (summed over data x context);
        nothing for a softmax router or a step without training forwards."""
        if self.kind != "sigmoid" or self.load is None:
            return
        load, self.load = self.load, None
        group = self.ep.data_context_group
        if group_size(group) > 1:
            torch.distributed.all_reduce(load, group=group)
        self.score_bias.copy_(updated_bias(self.score_bias, load.to(self.score_bias.device), self.bias_update_rate))
