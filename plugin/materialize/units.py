"""Init units of a model: what one init call fills, captured before any wrapping (TP swap, stage cut, FSDP2).

A unit is a module with parameters or buffers of its own (``recurse=False``) that are on the meta device; a
tensor tied to one seen earlier (``named_modules()`` order: the GPT's head shares ``embed.weight``) belongs to
the first. Each unit keeps a dense template (a shallow copy of the module without its children) and the call
that fills it: the root model's ``init_module(name, module)`` when it has one (the reference GPT), a transformers
model's ``_init_weights(module)``, else the module's own ``reset_parameters()``. A module that has none of these is
refused now, naming the module and the fix.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PluginError


@dataclass
class Unit:
    name: str
    template: nn.Module      # dense, children dropped, its own tensors still the meta ones
    owned: list[tuple[str, str]]  # (kind "param" | "buffer", key): the tensors this unit fills (ties excluded)
    init: Callable[[str, nn.Module], None]


def own_tensors(model: nn.Module, *, meta: bool) -> Iterator[tuple[str, nn.Module, list[tuple[str, str]]]]:
    """``(name, module, [(kind, key), ...])`` of every module's own tensors on (``meta``) or off the meta device,
    each tensor once: a tie goes to the first module holding it."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        owned = []
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for key, t in table.items():
                if t is None or (t.device.type == "meta") != meta or id(t) in seen:
                    continue
                seen.add(id(t))
                owned.append((kind, key))
        if owned:
            yield name, module, owned


def init_call(model: nn.Module, name: str, module: nn.Module) -> Callable[[str, nn.Module], None]:
    """How ``module`` (called ``name`` in ``model``) is filled; a :class:`PluginError` when nothing can."""
    if callable(getattr(model, "init_module", None)):
        return model.init_module
    if callable(getattr(model, "_init_weights", None)) and hasattr(model, "_no_split_modules"):
        return lambda _name, twin: model._init_weights(twin)  # a transformers model: its own per-module init
    if callable(getattr(module, "reset_parameters", None)):
        return lambda _name, twin: twin.reset_parameters()
    tensors = [k for k, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    kind = type(module).__name__
    raise PluginError(
        f"initialize: model {type(model).__name__} is on the meta device, but nothing can fill module {name!r} "
        f"({kind}): it has parameters/buffers {tensors}, {type(model).__name__} has no init_module(name, module) "
        f"and {kind} has no reset_parameters() -> give {kind} a reset_parameters() that fills its own tensors, "
        f"give {type(model).__name__} init_module(name, module), or build the model on the CPU and pass it whole")


def capture(model: nn.Module) -> list[Unit]:
    """The model's init units, in ``named_modules()`` order; refuses a unit nothing can fill."""
    units = []
    for name, module, owned in own_tensors(model, meta=True):
        template = copy.copy(module)  # shallow: the live module is never touched, later wrappers do not reach this
        template._modules = {}
        template._parameters = dict(module._parameters)
        template._buffers = dict(module._buffers)
        units.append(Unit(name, template, owned, init_call(model, name, module)))
    return units


def twin(unit: Unit, device: torch.device) -> nn.Module:
    """A real, dense copy of the unit's module on ``device``, every tensor filled with a sentinel (NaN; an
    integer dtype's minimum) so that what its init leaves unwritten is seen."""
    t = copy.copy(unit.template)
    t._parameters = {k: None if p is None else nn.Parameter(_sentinel(p, device), requires_grad=p.requires_grad)
                     for k, p in unit.template._parameters.items()}
    t._buffers = {k: None if b is None else _sentinel(b, device) for k, b in unit.template._buffers.items()}
    return t


def _sentinel(t: torch.Tensor, device) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full(t.shape, float("nan"), dtype=t.dtype, device=device)
    if t.dtype == torch.bool:
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return torch.full(t.shape, torch.iinfo(t.dtype).min, dtype=t.dtype, device=device)


def check_written(unit: Unit, module: nn.Module) -> None:
    """Refuse what the init left at the sentinel (a buffer computed in ``__init__`` has no values on meta)."""
    for kind, key in unit.owned:
        t = (module._parameters if kind == "param" else module._buffers)[key]
        unwritten = torch.isnan(t).any() if t.dtype.is_floating_point else \
            (t == torch.iinfo(t.dtype).min).all() if t.dtype not in (torch.bool,) and not t.dtype.is_complex else False
        if bool(unwritten):
            kind_name = type(unit.template).__name__
            raise PluginError(
                f"initialize: the init of module {unit.name!r} ({kind_name}) left "
                f"{unit.name + '.' if unit.name else ''}{key} unwritten (a buffer computed in __init__ has no values "
                f"on the meta device) -> fill it in {kind_name}.reset_parameters(), or build the model on the CPU and "
                "pass it whole")
