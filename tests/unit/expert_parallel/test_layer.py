"""The MoE layer on one process: the sorted dispatch equals a token-by-token loop, with any routing (experts left
without a token included), and the load-balancing loss is Mixtral's formula."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plugin.expert_parallel.layer import MoE
from plugin.expert_parallel.router import load_balancing_loss


def _naive(moe, tokens):
    probs = torch.softmax(moe.router(tokens), -1)
    top, chosen = probs.topk(moe.top_k, -1)
    top = top / top.sum(-1, keepdim=True)
    w1, w2 = moe.experts.w1, moe.experts.w2
    return torch.stack([sum(top[t, j] * (F.gelu(tokens[t] @ w1[e]) @ w2[e]) for j, e in enumerate(chosen[t]))
                        for t in range(tokens.shape[0])])


def _moe(experts=4, top_k=2):
    torch.manual_seed(0)
    moe = MoE(hidden=8, experts=experts, top_k=top_k, ffn_hidden=12)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    return moe


def test_dispatch_equals_a_token_by_token_loop():
    moe, tokens = _moe(), torch.randn(3, 5, 8)
    torch.testing.assert_close(moe(tokens), _naive(moe, tokens.reshape(-1, 8)).reshape(3, 5, 8))


def test_every_token_to_one_expert_leaves_the_others_a_zero_gradient():
    moe, tokens = _moe(top_k=1), torch.randn(6, 8)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    tokens = tokens.abs()  # every token's logit for expert 2 is the largest
    y = moe(tokens)
    torch.testing.assert_close(y, _naive(moe, tokens))
    y.sum().backward()
    grads = moe.experts.w1.grad.abs().sum(dim=(1, 2))
    assert grads[2] > 0 and grads[[0, 1, 3]].eq(0).all()


def test_load_balancing_loss_is_mixtrals():
    torch.manual_seed(1)
    probs, chosen = torch.softmax(torch.randn(10, 4), -1), torch.randint(0, 4, (10, 2))
    # transformers' load_balancing_loss_func: E * sum(mean one-hot over tokens [k, E] * mean probs [E])
    expected = 4 * (F.one_hot(chosen, 4).float().mean(0) * probs.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(probs, chosen), expected)
