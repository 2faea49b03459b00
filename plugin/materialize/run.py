"""Materialise a meta model unit by unit: whole at the dense shape under its own generator, cut, handed to a sink.

At most one unit (for the reference GPT one weight and its bias) is whole at a time; what another rank holds (a
pipeline stage elsewhere) is never made. ``init_in_place`` is the same rule for an eagerly built model, so an eager
reference GPT equals a meta-built one for the same seed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

from .seeds import unit_seed
from .sinks import PlainSink
from .units import Unit, capture, check_written, init_call, own_tensors, twin


@contextlib.contextmanager
def seeded(seed: int, device: torch.device):
    """torch's default generator (and the CUDA device's) seeded with ``seed`` inside, the caller's restored after
    (``torch.initial_seed()`` included, which seeds the tensor-parallel dropout streams)."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield


def _live(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _is_meta(t) -> bool:
    return t is not None and t.device.type == "meta"


def materialize(model: nn.Module, units: list[Unit], seed: int, device: torch.device, *, sink=None,
                held: set[int] | None = None, cuts: Mapping[str, Callable] | None = None, source=None) -> int:
    """Fill every meta tensor of ``model`` that this rank holds (``held``: ids of its parameters and buffers; None:
    all), unit by unit; returns the number of units made. ``cuts``: ``{module name: dense module -> this rank's
    tensor-parallel module}`` for the modules a plan swapped (the plan's own cut, re-run on the whole values).
    ``sink``: how a whole (or cut) tensor becomes this rank's (default: swapped in as it is). ``source``: where the
    values come from after the init call (:class:`.weights.SafetensorsWeights`: the part the cut keeps, from files;
    for a sink that shards, its own piece, read by the sink after sharding: :func:`_read_by_sink`)."""
    sink = sink or PlainSink(model)
    cuts = cuts or {}
    work = []
    for unit in units:  # decided before the sink prepares: FSDP2's to_empty leaves nothing on meta
        live = _live(model, unit.name)
        keys = [(kind, key) for kind, key in _keys(live)
                if _is_meta(_table(live, kind)[key]) and (held is None or id(_table(live, kind)[key]) in held)]
        if keys:
            work.append((unit, keys))
    sink.prepare()
    for unit, keys in work:
        dense = twin(unit, device)
        with seeded(unit_seed(seed, unit.name), device), torch.no_grad():
            unit.init(unit.name, dense)
        live = _live(model, unit.name)
        late = _read_by_sink(sink, source, unit, live, keys, unit.name in cuts)
        if source is not None:
            source.fill(unit, dense, cuts.get(unit.name), skip=late)
        check_written(unit, dense)
        piece = cuts[unit.name](dense) if unit.name in cuts else dense
        dtypes = {(kind, key): _table(dense, kind)[key].dtype for kind, key in late}
        put = []
        for kind, key in keys:  # no name left holding a whole tensor: the next unit's twin must find it freed
            put.append(sink.put(live, kind, key, _table(piece, kind)[key].detach()))
        sink.finish_unit(live, [p for p in put if p is not None])
        del dense, piece
        for kind, key in late:  # through the twin's dtype, as the whole path goes: the same values
            sink.read_piece(live, kind, key, _reader(source, unit, key, dtypes[kind, key]))
    sink.close()
    return len(work)


def _read_by_sink(sink, source, unit, live, keys, cut: bool) -> set:
    """The ``(kind, key)`` pairs whose values the sink reads from ``source`` itself after sharding, each rank only
    its piece (``sink.takes_piece``: FSDP2's rows, ZeRO-3's flat range); their twins keep the init until the sink
    overwrites its piece. Not for a unit with a tensor-parallel cut: the source reads the part the cut keeps."""
    takes = getattr(sink, "takes_piece", None)
    if source is None or cut or takes is None:
        return set()
    return {(kind, key) for kind, key in keys if source.holds(unit, key) and takes(live, kind, key)}


def _reader(source, unit, key: str, dtype: torch.dtype):
    """``read(box=... | flat=...)``: that piece of ``unit``'s tensor ``key`` from ``source``, cast to ``dtype``."""
    return lambda **where: source.read(unit, key, **where).to(dtype)


def _keys(module):
    return [("param", k) for k, p in module._parameters.items() if p is not None] + \
        [("buffer", k) for k, b in module._buffers.items() if b is not None]


def _table(module, kind):
    return module._parameters if kind == "param" else module._buffers


def init_in_place(model: nn.Module, seed: int) -> None:
    """The meta path's values for an eagerly built ``model``: each unit filled in place under
    ``unit_seed(seed, name)``, ties kept (a tied tensor is filled once, by its first module)."""
    for name, module, _ in list(own_tensors(model, meta=False)):
        init = init_call(model, name, module)
        with seeded(unit_seed(seed, name), next(iter(module.parameters(recurse=False)), torch.empty(0)).device), \
                torch.no_grad():
            init(name, module)


__all__ = ["capture", "init_in_place", "materialize", "seeded"]
