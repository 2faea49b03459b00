"""How initialize shards a model and picks its loss: the recipe's tensor_parallel block as two callables.

``apply_tp(model, tp_group, pp_rank=0) -> model`` shards with the recipe's plan (``"auto"`` picks by model
class); ``pp_rank``, the rank's pipeline stage, offsets the dropout stream of sharded regions per stage;
``loss_for(tp_group) -> loss_fn(output, labels)`` is the user's loss, or the plugin's :class:`TokenLoss`:
next-token cross entropy over the output's logits, vocab-parallel for a model whose ``vocab_parallel_logits`` is
true (the reference GPT, whose head is split by vocabulary). Both are called by a back end once its groups exist.
"""
from __future__ import annotations

from collections.abc import Callable

from ..recipe.spec import thaw
from .cross_entropy import TensorParallelError, vocab_parallel_cross_entropy
from .plan import apply_tensor_parallel

_HF = "hf"  # plugin.engines.batches.HF (the engines room sits above this one)


class TokenLoss:
    """The default loss of one micro-batch: the sum of next-token cross entropy over its non-ignored targets,
    divided by the step's :attr:`denominator`.

    Every back end sets the gradient to ``1 / (data x grad_accum)`` times the sum over data ranks and
    micro-batches of ``grad(loss_mb)`` (DeepSpeed's and Accelerate's backward divide by grad_accum, the native
    engines by the micro-batch count, the pipeline schedules by theirs; the data group averages). With
    ``denominator = N / (data x grad_accum)``, ``N`` the non-ignored targets of the whole global batch, the
    gradient and the engines' reported loss (mean over micro-batches and data ranks) are then exactly the mean
    over every target token of the global batch, whatever the padding, the layout or the micro-batch cut (not a
    mean of per-micro-batch means). The engine calls :meth:`prepare` before each step
    (:meth:`plugin.engines.base.Engine.local_batch`); without it (a direct call) the loss is the micro-batch's
    own token mean.

    ``convention``: ``"shifted"`` (labels already shifted: ``labels[:, t]`` is position t's target) or ``"hf"``
    (labels = input ids: logits of position t score label t + 1, as Hugging Face's loss shifts them).
    """

    def __init__(self, tp_group, split_logits: bool):
        self.tp_group = tp_group if split_logits else None
        self.denominator: float | None = None
        self.convention = "shifted"

    def prepare(self, denominator: float | None, convention: str) -> None:
        self.denominator, self.convention = denominator, convention

    def __call__(self, output, labels):
        logits = getattr(output, "logits", output)  # transformers models return an output object
        if self.convention == _HF:
            logits, labels = logits[:, :-1], labels[:, 1:]
        if logits.shape[:-1] != labels.shape:
            raise TensorParallelError(f"loss: logits {tuple(logits.shape)} do not match targets "
                                      f"{tuple(labels.shape)}; expected logits [batch, seq, vocab] for targets "
                                      "[batch, seq]")
        total = vocab_parallel_cross_entropy(logits, labels, self.tp_group, reduction="sum")
        if self.denominator is None:
            return total / (labels != -100).sum().clamp(min=1)
        return total / self.denominator


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
        return TokenLoss(tp_group, getattr(model, "vocab_parallel_logits", False))

    return apply_tp, loss_for
