"""A transformers causal LM as an ordered list of layers, for pipeline stages: any family whose config declares a
``base_model_pp_plan``, and GPT-2 (which declares none) by the plugin's own plan.

``stage_layers(model) -> [Embed, DecoderLayer x L, Head]``: wrappers around the model's own module objects (its
parameters, exactly; nothing copied). The plan names the modules in order: those before the decoder-layer list go
to ``Embed``, the list's entries each to a ``DecoderLayer``, those after it (the final norm) with the CausalLM's
``lm_head`` to ``Head``. Between layers travels what the plan says the decoder layers take, ``hidden_states`` and
``attention_mask``, plus ``position_ids``: one tuple ``hidden [B, S, H]``, ``attention_mask [B, S]`` int64 (``[B,
1]`` when the batch had none: the shape says so without a device sync), ``position_ids [B, S]`` int64. Positions
are made once, on the first stage. Nothing else can travel: DeepSpeed's pipeline wants a gradient for every floating
tensor it sends, so neither 4-D masks nor rotary tables ``(cos, sin)`` can.

Each wrapper runs **the model's own forward** around its one layer (:class:`_Window`): the base model's forward with
its decoder-layer list swapped, for the call, for stand-ins (:class:`_Probe`). ``Embed`` runs it on the input ids
and keeps what reaches layer 0 (embeddings scaled, dropped out, multiplied as the family does); ``DecoderLayer`` ``i``
runs it on the travelling hidden states, lets layers before ``i`` pass them through, and calls the real layer ``i``
on them with exactly the arguments the family's forward gives it: its mask (causal, sliding window, chunked, per
``config.layer_types``) and its rotary tables (global or local), built there from the travelling mask and
positions; ``Head`` runs the whole CausalLM forward with every layer giving back the last hidden states, so the
final norm, the head, soft-capping, logit scaling and any other family step after the layers are the model's own.
Composed on one process the list equals ``model(input_ids, attention_mask=..., position_ids=...,
use_cache=False).logits`` bitwise (``tests/unit/models/test_hf_stages.py``, every family with a plan).

That holds only where the model's forward does nothing between its layers but hand the hidden states on, and
computes what the layers take from the mask, the positions and the hidden states alone. :func:`stage_problem`
refuses the rest before anything runs, naming the family and the reason: no ``base_model_pp_plan``; a plan whose
decoder layers take or give more than hidden states and the mask; parameters outside the plan (per-layer input
embeddings, hyper-connections: they would be needed on every stage); a layer loop that carries more than the hidden
states from layer to layer (``for ... in self.layers`` doing anything but ``hidden = layer(hidden, ...)``), or that
hands a layer the input ids.

The wrappers are cached on the model and re-synced on every call: after the tensor-parallel plan swapped
``embed_tokens`` or ``lm_head`` for sharded layers, the wrappers hold the new modules (a stale one would train the
unsharded copy, with correct losses and whole memory).
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PluginError

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")  # the families whose stages this module knows
_CACHE = "_plugin_stage_layers"
_TRAVELS = ("hidden_states", "attention_mask")  # what the plan's decoder layers may take (position_ids ride along)
_FIX = "-> train it at pipeline 1 (tensor and data parallelism), or pass your own list of layers"


def is_hf_model(model) -> bool:
    """A transformers ``PreTrainedModel`` (checked only when transformers is imported: no import cost)."""
    if sys.modules.get("transformers") is None:  # absent, or blocked (a None entry: import would raise)
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _get(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


@dataclass(frozen=True)
class _Plan:
    """Where a model's stage modules are: ``base`` (the base model's attribute), ``before`` / ``after`` (its children
    before / after the decoder-layer list ``layers``), ``context`` (its parameter-free children holding buffers: the
    rotary tables, which every stage needs), ``n`` decoder layers."""

    base: str
    before: tuple[str, ...]
    layers: str
    after: tuple[str, ...]
    context: tuple[str, ...]
    n: int
    own: bool = False  # the plugin's own plan (GPT-2): the wrappers compute the few steps themselves


class _Refused(PluginError):
    pass


def _refuse(model, reason: str):
    raise _Refused(f"transformers {model.config.model_type!r} ({type(model).__name__}) cannot be cut into pipeline "
                   f"stages: {reason} {_FIX}")


def _loop_problem(base, layers: str) -> str | None:
    """Why the base model's forward does more between its decoder layers than hand the hidden states on, or None."""
    cls = type(base)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return f"the source of {cls.__name__}.forward cannot be read to check its layer loop"
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For)
             and any(isinstance(a, ast.Attribute) and a.attr == layers and isinstance(a.value, ast.Name)
                     and a.value.id == "self" for a in ast.walk(node.iter))]
    if len(loops) != 1:
        return f"{cls.__name__}.forward has {len(loops)} loops over self.{layers}, not one"
    loop = loops[0]
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    layer_var = target.id if isinstance(target, ast.Name) else None
    calls = 0
    for stmt in loop.body:
        line = ast.unparse(stmt).splitlines()[0]
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        targets = (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) if value is not None else []
        if value is None or len(targets) != 1 or not isinstance(targets[0], ast.Name):
            return f"the layer loop of {cls.__name__}.forward does more than hand the hidden states on ({line!r})"
        inner = [n for n in ast.walk(value) if isinstance(n, ast.Call)]
        if not inner:
            continue  # a plain look-up: a layer type, a mask out of the mapping
        if (len(inner) != 1 or not isinstance(value, ast.Call) or not isinstance(value.func, ast.Name)
                or value.func.id != layer_var or not value.args or not isinstance(value.args[0], ast.Name)
                or value.args[0].id != targets[0].id):
            return f"the layer loop of {cls.__name__}.forward computes between layers ({line!r})"
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        if "input_ids" in names:
            return f"{cls.__name__}.forward hands its layers the input ids, which do not travel between stages"
        calls += 1
    if calls != 1:
        return f"the layer loop of {cls.__name__}.forward calls its layer {calls} times"
    return None


def _plan(model) -> _Plan:
    """The stage modules of a transformers causal LM, or :class:`PluginError` naming why it cannot be cut."""
    config = model.config
    if config.model_type == "gpt2":  # no plan in transformers: the plugin's own (wte + wpe + drop, h, ln_f)
        return _Plan("transformer", ("wte", "wpe", "drop"), "h", ("ln_f",), (), len(model.transformer.h), own=True)
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        _refuse(model, f"its config ({type(config).__name__}) declares no base_model_pp_plan, and the plugin has no "
                       "plan of its own for it (it has one for gpt2)")
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if base is None or len(lists) != 1 or any(getattr(base, n, None) is None for n in names):
        _refuse(model, f"its base_model_pp_plan {names} is not modules of {prefix!r} around one list of decoder layers")
    layers = lists[0]
    takes, gives = plan[layers]
    if not set(takes) <= set(_TRAVELS) or list(gives) != ["hidden_states"]:
        _refuse(model, f"its base_model_pp_plan says the decoder layers take {list(takes)} and give {list(gives)}; "
                       f"only {' and '.join(_TRAVELS)} (and position_ids) travel between stages")
    for name in names:
        if name != layers and not set(plan[name][0]) | set(plan[name][1]) <= {"input_ids", "inputs_embeds",
                                                                              "hidden_states"}:
            _refuse(model, f"its base_model_pp_plan entry {name!r} takes {list(plan[name][0])} and gives "
                           f"{list(plan[name][1])}")
    outside = [n for n, m in base.named_children() if n not in names and any(True for _ in m.parameters())]
    outside += [n for n, m in model.named_children() if n not in (prefix, "lm_head")
                and any(True for _ in m.parameters())]
    if outside or not isinstance(getattr(model, "lm_head", None), nn.Module):
        _refuse(model, f"{outside or 'no lm_head'} outside its base_model_pp_plan holds parameters, which every stage "
                       "would need")
    problem = _loop_problem(base, layers)
    if problem:
        _refuse(model, problem)
    i = names.index(layers)
    context = tuple(c for c, m in base.named_children() if c not in names and any(True for _ in m.buffers()))
    return _Plan(prefix, tuple(names[:i]), layers, tuple(names[i + 1:]), context, len(getattr(base, layers)))


def stage_problem(model) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot be cut into pipeline stages, or None."""
    try:
        _plan(model)
    except _Refused as e:
        return str(e)
    return None


class _Stop(Exception):
    """Ends a window's forward early, carrying the value it was run for."""

    def __init__(self, value):
        super().__init__()
        self.value = value


class _Probe(nn.Module):
    """Stands in for decoder layer ``index`` during a window's forward: hands its arguments to the window's handler."""

    def __init__(self, index: int, window: _Window):
        super().__init__()
        self.index, self._window = index, (window,)  # a tuple: not a submodule

    def forward(self, hidden, *args, **kwargs):
        return self._window[0].handler(self.index, hidden, args, kwargs)


class _Window:
    """Runs the model's own forward with its decoder layers swapped for :class:`_Probe` stand-ins."""

    def __init__(self, model, plan: _Plan):
        self.model, self.plan = model, plan
        self.probes = nn.ModuleList(_Probe(i, self) for i in range(plan.n))
        self.handler = None
        self.router_logits = "output_router_logits" in inspect.signature(type(model).forward).parameters

    def run(self, handler, forward, **inputs):
        """``forward(**inputs)`` with each decoder layer's call answered by ``handler(index, hidden, args, kwargs)``;
        a handler that raises :class:`_Stop` ends it with the stop's value."""
        base = getattr(self.model, self.plan.base)
        real = base._modules[self.plan.layers]
        base._modules[self.plan.layers], self.handler = self.probes, handler
        try:
            return forward(**inputs, use_cache=False)
        except _Stop as stop:
            return stop.value
        finally:
            base._modules[self.plan.layers], self.handler = real, None

    def run_to(self, index: int, handler, forward, **inputs):
        """:meth:`run`, which must stop at decoder layer ``index`` (a forward that never calls it is an error)."""
        out = self.run(handler, forward, **inputs)
        if not isinstance(out, torch.Tensor):
            raise PluginError(f"transformers {self.model.config.model_type!r}: {type(self.model).__name__}'s forward "
                              f"never called decoder layer {index} of {self.plan.base}.{self.plan.layers} (it holds "
                              f"{self.plan.n}) {_FIX}")
        return out

    def inputs(self, hidden, mask, pos) -> dict:
        return dict(attention_mask=None if mask.shape[1] != hidden.shape[1] else mask,  # [B, 1]: the batch had none
                    position_ids=pos)


class _Stage(nn.Module):
    """A wrapper over some of the model's modules (registered, so a stage holds and counts their parameters)."""

    def __init__(self, window: _Window, modules: dict[str, nn.Module]):
        super().__init__()
        self._window = (window,)  # a tuple: the model is not a submodule
        for name, module in modules.items():
            setattr(self, name, module)


class Embed(_Stage):
    """Everything the model does before its first decoder layer: the hidden states that reach layer 0."""

    def forward(self, x):
        input_ids, mask, pos = x
        window = self._window[0]
        if window.plan.own:
            h = self.wte(input_ids) + self.wpe(pos)
            return self.drop(h), mask, pos

        def reached(index, hidden, args, kwargs):
            raise _Stop(hidden)

        base = getattr(window.model, window.plan.base)
        return window.run_to(0, reached, base, input_ids=input_ids, **window.inputs(input_ids, mask, pos)), mask, pos


class DecoderLayer(_Stage):
    """Decoder layer ``index``, given what the model's own forward gives it (its mask and rotary tables rebuilt from
    the travelling mask and positions)."""

    def __init__(self, window: _Window, layer: nn.Module, index: int, context: dict[str, nn.Module]):
        super().__init__(window, {"layer": layer, **context})
        self.index = index

    def forward(self, x):
        hidden, mask, pos = x
        window = self._window[0]
        if window.plan.own:
            from transformers.masking_utils import create_causal_mask

            causal = create_causal_mask(config=window.model.config, inputs_embeds=hidden,
                                        attention_mask=window.inputs(hidden, mask, pos)["attention_mask"], cache=None,
                                        position_ids=pos)
            out = self.layer(hidden, attention_mask=causal, position_ids=pos)  # by name: the order moved in 5.x
            return (out[0] if isinstance(out, tuple) else out), mask, pos

        def handler(index, given, args, kwargs):
            if index < self.index:
                return given  # an earlier stage's layer: its output is what travelled here
            raise _Stop(self.layer(hidden, *args, **kwargs))

        base = getattr(window.model, window.plan.base)
        out = window.run_to(self.index, handler, base, inputs_embeds=hidden, **window.inputs(hidden, mask, pos))
        return out, mask, pos


class Head(_Stage):
    """Everything the model does after its last decoder layer: final norm, head and the family's logit steps."""

    def forward(self, x):
        hidden, mask, pos = x
        window = self._window[0]
        if window.plan.own:
            return self.lm_head(self.ln_f(hidden))
        extra = {"output_router_logits": False} if window.router_logits else {}  # no router ran here: no aux loss
        return window.run(lambda index, given, args, kwargs: hidden, window.model, inputs_embeds=hidden,
                          **window.inputs(hidden, mask, pos), **extra).logits


def _specs(model, plan: _Plan) -> list[dict[str, str]]:
    """``{wrapper attribute: module path}`` per layer of the stage list."""
    b = plan.base
    context = {c: f"{b}.{c}" for c in plan.context}
    return ([{**{n: f"{b}.{n}" for n in plan.before}, **context}]
            + [{"layer": f"{b}.{plan.layers}.{i}", **context} for i in range(plan.n)]
            + [{**{n: f"{b}.{n}" for n in plan.after}, "lm_head": "lm_head", **context}])


def stage_layers(model) -> list[nn.Module]:
    """``[Embed, DecoderLayer x L, Head]`` over ``model``'s own modules, cached and re-synced (module docstring);
    :class:`PluginError` naming the reason for a model that cannot be cut (:func:`stage_problem`)."""
    cached = model.__dict__.get(_CACHE)
    if cached is None:
        plan = _plan(model)
        window = _Window(model, plan)
        specs = _specs(model, plan)
        mods = [{a: _get(model, p) for a, p in spec.items()} for spec in specs]
        context = {c: mods[0][c] for c in plan.context}
        layers = [Embed(window, mods[0])]
        layers += [DecoderLayer(window, m["layer"], i, context) for i, m in enumerate(mods[1:-1])]
        layers.append(Head(window, mods[-1]))
        cached = model.__dict__[_CACHE] = (tuple(layers), specs)
    layers, specs = cached
    for wrapper, spec in zip(layers, specs, strict=True):  # re-sync: the tensor-parallel plan may have swapped modules
        for attr, path in spec.items():
            now = _get(model, path)
            if getattr(wrapper, attr) is not now:
                setattr(wrapper, attr, now)
    return list(layers)


def first_stage_inputs(inputs) -> tuple:
    """``(input_ids, attention_mask int64 or [B, 1] ones, position_ids [B, S])`` from a tensor or a dict batch."""
    if not isinstance(inputs, Mapping):
        inputs = {"input_ids": inputs}
    extra = sorted(set(inputs) - {"input_ids", "attention_mask", "position_ids", "use_cache"})
    if "context_key_mask" in extra:  # plugin.context_parallel.batch.KEY_MASK: the context cut adds it for padding
        raise PluginError("padded rows (an attention_mask with zeros) under context parallelism and pipeline stages: "
                          "the whole sequence's key mask, which every context rank's attention needs, does not cross "
                          "stage boundaries -> unpadded (packed) rows, or pipeline 1, or context 1")
    if extra:
        raise PluginError(f"a dict batch holds {extra}: under pipeline stages only input_ids, attention_mask and "
                          "position_ids cross stage boundaries -> drop those keys, or train at pipeline 1")
    ids = inputs["input_ids"]
    rows, seq = ids.shape
    if seq < 2:
        raise PluginError(f"pipeline stages got sequences of length {seq} -> at least 2 tokens per row")
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise PluginError(f"pipeline stages take a 2-D attention_mask [batch, seq], not {tuple(mask.shape)}")
    # int64, never bool: DeepSpeed sends bool tensors down a slow special path
    mask = torch.ones(rows, 1, dtype=torch.int64, device=ids.device) if mask is None else (mask != 0).long()
    pos = inputs.get("position_ids")
    pos = (torch.arange(seq, device=ids.device).expand(rows, seq) if pos is None else pos.long().expand(rows, seq))
    return ids, mask, pos.contiguous()
