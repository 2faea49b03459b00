"""The router: which ``top_k`` experts each token goes to, with what weights, and the load-balancing loss.

Softmax top-k, as Mixtral and Qwen-MoE route: ``p = softmax(x W_r)`` over every expert, the ``top_k`` largest kept and
renormalised to sum to one. The load-balancing loss is Switch's and Mixtral's ``E * sum_e f_e * P_e``: ``f_e`` the
share of the (token, slot) choices that went to expert ``e``, ``P_e`` the mean router probability of ``e``. Both means
run over every token of one micro-batch step on every data x context rank (``group``: the counts and probability
sums are added over it), so the loss is what one process computes on those tokens together, whatever the layout;
with a group of one, the micro-batch's own tokens. The router z-loss (ST-MoE), a plain mean, needs no collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import group_size, sum_over_ranks


def softmax_top_k(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [T, E] fp32, weights [T, k] renormalised, chosen [T, k] expert ids)`` from router ``logits [T, E]``.

    >>> probs, w, chosen = softmax_top_k(torch.tensor([[0.0, 1.0, 2.0]]), 2)
    >>> chosen.tolist(), [round(v, 4) for v in w[0].tolist()]
    ([[2, 1]], [0.7311, 0.2689])
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = probs.topk(top_k, dim=-1)
    return probs, top / top.sum(dim=-1, keepdim=True), chosen


def sigmoid_top_k(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """DeepSeek-V3's router: ``(scores [T, E] fp32, weights [T, k], chosen [T, k])``: sigmoid scores, the experts
    chosen by score plus ``bias`` (the score-correction bias, which steers the choice only), weighted by their own
    scores renormalised over the chosen.

    >>> scores, w, chosen = sigmoid_top_k(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([5.0, 0.0, 0.0]), 2)
    >>> chosen.tolist(), [round(v, 4) for v in w[0].tolist()]
    ([[0, 2]], [0.3621, 0.6379])
    """
    scores = torch.sigmoid(logits.float())
    chosen = (scores + bias.float()).topk(top_k, dim=-1).indices
    top = scores.gather(-1, chosen)
    return scores, top / top.sum(dim=-1, keepdim=True), chosen


def updated_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: ``b_e + rate x sign(mean load - load_e)`` (an expert that got
    fewer than the mean of the step's token choices is raised, one that got more is lowered; not a gradient).

    >>> updated_bias(torch.zeros(3), torch.tensor([5.0, 1.0, 3.0]), 0.1).tolist()
    [-0.10000000149011612, 0.10000000149011612, 0.0]
    """
    return bias + rate * torch.sign(load.mean() - load)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022): the mean over the tokens of ``logsumexp(logits)^2``, which keeps
    the router's logits small. This rank's tokens only, unlike the load-balancing loss: a mean is linear, so the mean
    of the data ranks' means (the back ends average the losses and the gradients over data x context, each rank
    holding as many tokens) is the mean over all of them, what one process computes.

    >>> round(float(router_z_loss(torch.zeros(2, 4))), 4)  # logsumexp = ln 4 for every token
    1.9218
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, group=None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the tokens of every rank of ``group`` (the data x context group).

    >>> probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    >>> float(load_balancing_loss(probs, torch.tensor([[0], [1]])))  # balanced: 2 * (0.5 * 0.5 + 0.5 * 0.5)
    1.0
    >>> float(load_balancing_loss(probs, torch.tensor([[0], [0]])))  # every token to expert 0
    1.0
    """
    experts = probs.shape[-1]
    counts = probs.new_zeros(experts) if chosen.is_meta else \
        torch.bincount(chosen.reshape(-1), minlength=experts).to(probs.dtype)  # meta: the dry run, no counts
    stats = torch.cat([counts, counts.new_tensor([probs.shape[0]])])
    if group_size(group) > 1:
        dist.all_reduce(stats, group=group)  # counts are not differentiable: a plain sum
    counts, tokens = stats[:-1], stats[-1].clamp(min=1)
    prob_sum = sum_over_ranks(probs.sum(dim=0), group)
    return experts * ((counts / tokens) * (prob_sum / tokens)).sum()
