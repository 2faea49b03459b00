"""Meta tensors in a training step: values read from them answered, and their kernels cached.

Meta tensors have shapes and no values. :class:`MetaValues`, a dispatch mode, answers what a step reads (``.item()``,
``.tolist()``, a copy to the CPU) with zeros and ``torch.equal`` with False, and caches the meta kernels, most of
which torch writes in Python, by their inputs' shapes, strides and dtypes.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_RESHAPES = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
             "swapdims_", "swapaxes_", "detach_"}


def _kind(func) -> str | None:
    """``"new"``: ``func`` returns new tensors only (no argument mutated, no output aliasing an input); ``"inplace"``:
    it writes its first argument only (a tensor, or a list of them for the ``_foreach_*_`` ops), whose shape it keeps,
    and returns that argument or nothing; None: anything else (views, ``out=``, shape changes), run every time."""
    schema = func._schema
    if not schema.is_mutable:
        return "new" if schema.returns and all(r.alias_info is None for r in schema.returns) else None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if func._opname in _RESHAPES or schema.overload_name.startswith("out") or len(written) != 1 \
            or written[0] is not schema.arguments[0]:
        return None
    returns = schema.returns
    if not returns or (len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write):
        return "inplace"
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _key(value):
    """A hashable description of an argument: a meta tensor by its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or value.is_sparse or type(value) not in _PLAIN:
            raise _Uncacheable
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in sorted(value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    raise _Uncacheable


class _Uncacheable(Exception):
    pass


class MetaValues(TorchDispatchMode):
    """Reads of values from meta tensors answered as zeros (``.item()``, ``.tolist()``, a copy off meta) and
    ``torch.equal`` as False; every other op runs as it is.

    And a cache of meta kernels, most of which torch writes in Python (its reference decompositions): a functional op
    (nothing mutated, no output a view of an input) on meta tensors of the shapes, strides and dtypes seen before
    gives new meta tensors of the shapes it gave then, without running the kernel again. Every micro-batch, layer and
    rank of a dry run repeats the same few hundred ops, so this is what makes a rank take seconds."""

    def __init__(self, cache: dict | None = None) -> None:
        super().__init__()
        self.cache = {} if cache is None else cache  # func -> {argument key: output spec}; False: not functional

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:
                return 0.0 if first.is_floating_point() else 0
            if func is torch.ops.aten.equal.default:
                return False
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                    and torch.device(kwargs["device"]).type != "meta":
                return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype, device=kwargs["device"])
        entry = self.cache.get(func)
        if entry is None:
            kind = _kind(func)
            entry = self.cache[func] = (kind, {}) if kind else False
        if entry is not False:
            kind, cached = entry
            try:
                key = (_key(args), _key(kwargs))
            except _Uncacheable:
                key = None
            if key is not None:
                spec = cached.get(key)
                if spec is not None:  # seen before: the kernel checked these shapes then
                    if kind == "inplace":
                        return args[0] if func._schema.returns else None
                    return _make(spec)
                out = func(*args, **kwargs)
                spec = True if kind == "inplace" else _spec(out)
                if spec is not None:
                    cached[key] = spec
                return out
        return func(*args, **kwargs)


def _spec(out):
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta" or type(out) is not torch.Tensor:
            return None
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)) and out:
        specs = [_spec(o) for o in out]
        return None if any(s is None for s in specs) else ("L", tuple(specs))
    return None


def _make(spec):
    if spec[0] == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    return tuple(_make(s) for s in spec[1])
