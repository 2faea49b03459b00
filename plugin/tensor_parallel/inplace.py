"""Styles applied to a module the plan keeps (its own class, forward and parameter names): collectives around its
forward, and bare parameters split in place.

:func:`wrap` puts a small subclass in front of the module's class (``Qwen3RMSNorm`` -> ``Qwen3RMSNorm[grad_sum]``)
whose ``forward`` runs the module's own forward between the style's collectives. Inside ``forward`` (not as hooks),
so that whatever an engine hooks onto the module (ZeRO-3 gathering its parameters) has run first:

* ``grad_sum`` (replicated_with_grad_allreduce): the module's own parameters enter through
  :func:`.comm.allreduce_grads_in_backward` (forward identity, backward ``dw = sum_q dw_q``): a norm on this rank's
  heads sees only their gradient, the sum is the whole one, inside autograd (so gradient accumulation and engines
  that reduce from hooks see it summed once).
* ``region`` (moe_tp_experts, all_reduce): every floating tensor argument enters with ``f`` (each rank's slice of
  every expert consumed the same hidden states and routing weights: their gradients are partial sums), the output
  leaves with ``g`` (each rank computed a partial sum over its slice of the experts' intermediate features).
* ``identity_expert`` (moe_identity_expert): the input divided by the tensor size; the enclosing region's ``g``
  sums ``p`` copies of it back to one.
* ``mla_kv_a`` (mla_kv_a_proj): the last ``rope`` output features go straight to attention on this rank's heads,
  so they leave with ``f``; the rest reaches the column-split ``kv_b_proj``, whose own ``f`` sums its gradient.

:func:`split_parameter` cuts a bare parameter (3-D expert weights ``[experts, out, in]``, attention sinks
``[heads]``) to this rank's slice, tagged like the layers' weights (:func:`.sharding.mark_sharded`), so checkpoints,
clipping and :func:`.state.full_tensor` treat it as they treat any split weight.
"""
from __future__ import annotations

import torch
from torch import nn

from .comm import allreduce_grads_in_backward, copy_to_tensor_region, group_size, reduce_from_tensor_region
from .errors import TensorParallelError
from .sharding import mark_sharded, shard

_CLASSES: dict[tuple[type, str], type] = {}  # one subclass per (module class, style kind), made once


class _Around:
    """Put in front of a module's class by :func:`wrap`: the module's own forward between the style's collectives."""

    def forward(self, *args, **kwargs):
        kind, group = self._tp_kind, self._tp_group
        if kind == "grad_sum":
            own = {k: p for k, p in self._parameters.items() if p is not None and p.requires_grad}
            summed = allreduce_grads_in_backward(list(own.values()), group)
            self._parameters.update(zip(own, summed, strict=True))
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._parameters.update(own)
        if kind == "identity_expert":
            return super().forward(args[0] / group_size(group), *args[1:], **kwargs)
        if kind == "region":
            enter = lambda t: copy_to_tensor_region(t, group) if _floating(t) else t  # noqa: E731
            out = super().forward(*map(enter, args), **{k: enter(v) for k, v in kwargs.items()})
            if not isinstance(out, torch.Tensor):
                raise TensorParallelError(f"{type(self).__name__}: a tensor-parallel region sums its output over the "
                                          f"tensor group, but its forward returned {type(out).__name__}, not a tensor")
            return reduce_from_tensor_region(out, group)
        out = super().forward(*args, **kwargs)  # mla_kv_a
        rope = self._tp_rope
        return torch.cat([out[..., :-rope], copy_to_tensor_region(out[..., -rope:], group)], dim=-1)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def wrap(module: nn.Module, kind: str, tp_group, *, rope: int = 0) -> nn.Module:
    """``module`` itself, its class now the ``kind`` subclass of its own (see the module docstring)."""
    cls = type(module)
    if issubclass(cls, _Around):
        raise TensorParallelError(f"{cls.__name__}: tensor parallelism is applied to this module already")
    key = (cls, kind)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{cls.__name__}[{kind}]", (_Around, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[key]
    module._tp_kind, module._tp_group, module._tp_rope = kind, tp_group, rope
    return module


def split_dim(param: torch.Tensor, kind: str) -> int:
    """The dimension a bare parameter is split along: column its output one (the second last; a 1-D parameter its
    only one), row its last."""
    if kind == "column":
        return max(param.dim() - 2, 0)
    return param.dim() - 1


def split_parameter(module: nn.Module, key: str, kind: str, parts: int, tp_size: int, tp_rank: int) -> None:
    """Replace ``module``'s parameter ``key`` by this rank's slice of it (see the module docstring)."""
    param = module._parameters[key]
    dim = split_dim(param, kind)
    piece = nn.Parameter(shard(param.detach(), dim, tp_size, tp_rank, parts=parts), requires_grad=param.requires_grad)
    module._parameters[key] = mark_sharded(piece, dim, parts=parts)
