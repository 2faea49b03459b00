"""How initialize shards a model and picks its loss: the recipe's tensor_parallel block as two callables.

``apply_tp(model, tp_group, pp_rank=0) -> model`` shards with the recipe's plan (``"auto"`` picks by model
class); ``pp_rank``, the rank's pipeline stage, offsets the dropout stream of sharded regions per stage;
``loss_for(tp_group) -> loss_fn(output, labels)`` is the user's loss, or next-token cross entropy over the
output's logits: vocab-parallel for a model whose ``vocab_parallel_logits`` is true (the reference GPT, whose head
is split by vocabulary). Both are called by a back end once its groups exist.
"""
from __future__ import annotations

from collections.abc import Callable

from ..recipe.spec import thaw
from .cross_entropy import token_cross_entropy
from .plan import apply_tensor_parallel


def tensor_parallel_hooks(model, recipe, loss_fn: Callable | None) -> tuple[Callable, Callable]:
    tp_cfg = recipe.tensor_parallel
    plan = tp_cfg.plan if isinstance(tp_cfg.plan, str) else thaw(tp_cfg.plan)

    def apply_tp(target, tp_group, pp_rank: int = 0):
        return apply_tensor_parallel(target, plan, tp_group, sequence_parallel=tp_cfg.sequence_parallel,
                                     pp_rank=pp_rank, cuts=apply_tp.cuts)

    apply_tp.cuts = {}  # what each swapped module's cut was: a meta model is materialised through the same cuts

    def loss_for(tp_group) -> Callable:
        if loss_fn is not None:
            return loss_fn
        # A model says whether its logits come split by vocabulary (the reference GPT's
        # vocab_parallel_logits); the plans of other models (transformers GPT-2, Llama) gather their logits
        # whole, as their own forward and loss expect.
        split_logits = getattr(model, "vocab_parallel_logits", False)

        def loss(output, labels):
            logits = getattr(output, "logits", output)  # transformers models return an output object
            return token_cross_entropy(logits, labels, tp_group if split_logits else None)

        return loss

    return apply_tp, loss_for
