"""Column splits by whole attention heads (transformers' ``unit_colwise``, the plugin's ``column_heads``): key and
value projections, whose heads may be fewer than the tensor ranks.

A projection of ``n`` heads of ``head_dim`` rows each, over ``p`` tensor ranks whose query heads are split evenly
(``heads % p == 0``, rank ``r`` holds query heads ``[r h/p, (r+1) h/p)``):

* ``n % p == 0``: rank ``r`` holds heads ``[r n/p, (r+1) n/p)``, a plain column split, exactly the key/value heads
  its query heads read;
* ``p % n == 0`` (fewer heads than ranks): the ``k = p / n`` consecutive ranks whose query heads read head
  ``s`` each hold all of it (rank ``r`` holds head ``r // k``), the rule of Megatron-style GQA with the tensor size
  above the key/value heads. Each replica computes the gradient of its own query heads only, so the weight's
  gradient is summed over the head's replicas inside autograd (:func:`.comm.sum_grads_over_replicas`); the input's
  gradient is the column layer's ``f`` as ever. The attention module's ``num_key_value_groups`` (query heads per
  key/value head, which transformers' attention repeats the key/value heads by) becomes ``h/p``, its local ratio;
* anything else cannot hold whole heads on every rank: refused before anything is swapped.

The head dim is the attention module's ``head_dim``, else the model config's ``head_dim``, else hidden / heads (as
transformers' ``UnitColwiseParallel`` reads it).
"""
from __future__ import annotations

from torch import nn

from .auto import _head_dim
from .comm import sum_grads_over_replicas
from .errors import TensorParallelError
from .fused import column_linear
from .layers import ColumnParallelLinear, _param, _record_transposed, linear_weights
from .sharding import mark_sharded, shard


def replicas_of(heads: int, tp: int) -> int:
    """How many ranks hold each head: 1 when the heads split evenly, ``tp / heads`` when fewer; 0 when neither."""
    if heads % tp == 0:
        return 1
    return tp // heads if tp % heads == 0 else 0


class HeadParallelLinear(ColumnParallelLinear):
    """``Y = X A^T + b`` with ``A``'s rows split by whole heads over the tensor group, each head held by
    :attr:`replicas` consecutive ranks when there are fewer heads than ranks (see the module docstring)."""

    @classmethod
    def from_linear(cls, module: nn.Module, tp_group, *, heads: int,
                    sequence_parallel: bool = False) -> HeadParallelLinear:
        """This rank's heads of an existing ``nn.Linear`` of ``heads`` heads; the module itself is left as is."""
        weight, bias = linear_weights(module)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard_heads(weight, bias, tp_group, heads, sequence_parallel)
        _record_transposed(layer, module)
        return layer

    def _shard_heads(self, weight, bias, tp_group, heads: int, sequence_parallel: bool) -> None:
        out_features, in_features = weight.shape
        self._setup(tp_group, in_features, out_features, sequence_parallel)
        p, r = self.tp_size, self.tp_rank
        replicas = replicas_of(heads, p)
        if not replicas or out_features % heads:
            raise TensorParallelError(
                f"HeadParallelLinear: {heads} heads of {out_features} output features cannot be held whole by "
                f"every one of {p} tensor ranks; use a tensor size that divides {heads} or that {heads} divides")
        self.gather_output, self.parts = False, 1
        self.heads, self.replicas = heads, replicas
        slices, mine, first = p // replicas, r // replicas, r % replicas == 0
        self.weight = mark_sharded(_param(shard(weight, 0, slices, mine), weight.requires_grad), 0,
                                   replicas=replicas, first=first)
        self.bias = None if bias is None else mark_sharded(
            _param(shard(bias, 0, slices, mine), bias.requires_grad), 0, replicas=replicas, first=first)

    def _local(self, x):
        own = [t for t in (self.weight, self.bias) if t is not None]
        weight, *bias = sum_grads_over_replicas(own, self.tp_group, self.replicas)
        return column_linear(x, weight, bias[0] if bias else None, self.tp_group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads={self.heads}, replicas={self.replicas}"


def head_dim(model: nn.Module, owner: nn.Module) -> int | None:
    """The head dim of the attention module ``owner`` (see the module docstring); None when nothing gives it."""
    own = getattr(owner, "head_dim", None)
    if isinstance(own, int) and own > 0:
        return own
    found = _head_dim(model)
    return found if isinstance(found, int) and found > 0 else None


def heads_problems(name: str, module: nn.Module, owner: nn.Module, dim: int | None, tp: int) -> list[str]:
    """Why ``module`` (the projection ``name`` of attention ``owner``) cannot be split by whole heads of ``dim``."""
    what = f"module {name!r} (style 'column_heads', transformers' unit_colwise)"
    out_features = linear_weights(module)[0].shape[0]
    if dim is None or out_features % dim:
        return [f"{what}: {out_features} output features are not whole heads of the head dim {dim} (the attention's "
                "head_dim, else config.head_dim, else hidden / heads); give it 'column' or 'replicate'"]
    heads = out_features // dim
    replicas = replicas_of(heads, tp)
    if not replicas:
        return [f"{what}: {heads} heads can neither be split whole over tensor size {tp} nor replicated over it "
                f"(tensor a multiple of the heads); use a tensor size that divides {heads} or a multiple of it"]
    groups = getattr(owner, "num_key_value_groups", None)
    if replicas == 1:
        return []
    fewer = f"{what}: its {heads} heads are fewer than tensor size {tp}, so each is replicated over {replicas} ranks"
    if not isinstance(groups, int):
        return [f"{fewer}, and {type(owner).__name__} has no num_key_value_groups (query heads per key/value head) to "
                f"repeat them by; use a tensor size that divides {heads}"]
    if groups % replicas:
        return [f"{fewer}, which must share its {groups} query heads (num_key_value_groups of "
                f"{type(owner).__name__}) whole: {groups} is not a multiple of {replicas}; use a tensor size that "
                "divides the query heads"]
    return []


def fix_key_value_groups(model: nn.Module) -> None:
    """After the swap: each attention module whose key/value heads are replicated repeats them ``replicas`` times
    fewer (its local query heads per local key/value head)."""
    done = set()
    for name, module in model.named_modules():
        if isinstance(module, HeadParallelLinear) and module.replicas > 1:
            owner_name = name.rpartition(".")[0]
            owner = model.get_submodule(owner_name)
            if id(owner) not in done:
                done.add(id(owner))
                owner.num_key_value_groups //= module.replicas
