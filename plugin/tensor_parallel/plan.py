"""``apply_tensor_parallel``: shard a model by a plan of name globs -> styles, through the plugin's own layers.

A plan maps ``fnmatch`` globs on module names (``model.named_modules()``; ``*`` also crosses dots), or on parameter
names where no module matches (transformers' 3-D expert weights), to a style of :data:`.styles.TABLE` (the plugin's
names, or transformers' for the same style: ``colwise``, ``rowwise``, ``packed_colwise``, ``moe_tp_experts``, ...).
Linear layers and embeddings are swapped for :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`VocabParallelEmbedding`, ... (only when their forward is the one the layer reproduces: :mod:`.fit`); other
modules keep their own class and forward, with collectives around it (:mod:`.inplace`); bare parameters are split
in place. ``"auto"`` picks the plan by model (see :mod:`.auto`). The plan is checked whole before anything is
swapped, and every problem found is reported in one :class:`TensorParallelError`, each naming the module, the values
and the fix; a failed call leaves the model untouched. Modules tied to one weight (an embedding and its head) stay
tied.
"""
from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import logging
import re
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from . import auto, fit, heads
from .comm import group_rank, group_size
from .context import TensorParallelContext
from .embedding import HiddenParallelEmbedding, VocabParallelEmbedding
from .errors import TensorParallelError
from .heads import HeadParallelLinear
from .inplace import split_parameter, wrap
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelLinear
from .random import TensorParallelRNG
from .sharding import is_sharded
from .styles import Style, parse_style

log = logging.getLogger("plugin.tensor_parallel")
_WRAPPED = ("grad_sum", "region", "identity_expert", "mla_kv_a")  # kept modules with collectives around forward


def resolve_plan(model: nn.Module, plan: str | Mapping[str, str], tp_size: int, *,
                 sequence_parallel: bool = False) -> dict[str, Style]:
    """``{module or parameter name: style}`` for everything the plan does not leave whole; raises with every problem
    found.

    Pure (no process group): the checks of :func:`apply_tensor_parallel`, runnable before any launch, on a model
    built on the meta device too.
    """
    explicit = plan != "auto"
    if plan == "auto":
        plan = auto.auto_plan(model)
    if not isinstance(plan, Mapping) or not plan:
        raise TensorParallelError(f"a tensor-parallel plan is 'auto' or a non-empty mapping of module-name "
                                  f"globs to styles, got {plan!r}")
    modules = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if n]
    params = dict(model.named_parameters(remove_duplicate=False))
    problems: list[str] = []
    assignment: dict[str, Style] = {}
    chosen_by: dict[str, str] = {}
    for glob, text in plan.items():
        try:
            style = parse_style(text)
        except ValueError as e:
            problems.append(f"plan entry {glob!r}: {e}")
            continue
        hits = [n for n, _ in modules if fnmatch.fnmatchcase(n, glob)] or \
            [n for n in params if fnmatch.fnmatchcase(n, glob)]
        if not hits and explicit:
            problems.append(_no_match(model, modules, glob))
        for n in hits:
            if n in assignment and assignment[n] != style:
                problems.append(f"module {n!r} is matched by {chosen_by[n]!r} ({assignment[n].text}) and by "
                                f"{glob!r} ({style.text}); make the globs name it once")
                continue
            assignment[n], chosen_by[n] = style, glob
    by_name = dict(modules)
    split = {n for n, s in assignment.items() if n in params and s.kind != "replicate"}
    for n, style in assignment.items():
        if n in params:
            owner = n.rpartition(".")[0]
            owners = [(o, assignment[o]) for o in _ancestors(owner) if o in assignment]
            problems += fit.parameter_problems(n, params[n], style, tp_size, owners)
            if owner in assignment and assignment[owner].kind in fit._SWAPPED:
                problems.append(f"parameter {n!r}: its module {owner!r} is swapped ({assignment[owner].text}); "
                                "give the module or its parameter a style, not both")
            continue
        problems += fit.module_problems(n, by_name[n], style, tp_size)
        if style.kind == "heads" and fit.is_linear(by_name[n]):
            problems += heads.heads_problems(n, by_name[n], *_owner_and_dim(model, n), tp_size)
        if style.kind == "region":
            problems += fit.region_problems(n, by_name[n], split, assignment)
        if style.kind == "identity_expert" and not any(assignment.get(o, Style("")).kind == "region"
                                                       for o in _ancestors(n)[1:]):
            problems.append(f"module {n!r}: style {style.text!r} divides its input by the tensor size for the sum "
                            "of an enclosing 'experts' module, and none encloses it; give it 'replicate'")
        if style.kind == "mla_kv_a":
            problems += _rope_problems(model, n, by_name[n])
    problems += _tie_problems(modules, assignment, tp_size)
    if not problems:
        styles = {n: s for n, s in assignment.items() if s.kind != "replicate"}
        problems += auto.check_known_model(model, styles, tp_size, sequence_parallel)
        check = getattr(model, "check_tensor_parallel", None)
        if check is not None:
            problems += list(check(styles, tp_size, sequence_parallel))
    if sequence_parallel and not hasattr(model, "configure_tensor_parallel"):
        problems.append(f"sequence parallelism needs a model that moves its activations into and out of the "
                        f"sequence-split region (configure_tensor_parallel); {type(model).__name__} does not: "
                        f"set sequence_parallel false for it, or use the reference GPT (plugin.models.gpt)")
    if problems:
        raise TensorParallelError(problems)
    return {n: s for n, s in assignment.items() if s.kind not in ("replicate", "local")}


def _owner_and_dim(model: nn.Module, name: str) -> tuple[nn.Module, int | None]:
    """The module holding projection ``name`` (its attention) and the head dim its heads are cut by."""
    owner = model.get_submodule(name.rpartition(".")[0])
    return owner, heads.head_dim(model, owner)


def _ancestors(name: str) -> list[str]:
    """``name`` and the modules above it, nearest first (``"a.b.c"`` -> ``["a.b.c", "a.b", "a"]``)."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 0, -1)]


def _no_match(model, modules, glob: str) -> str:
    shardable = [n for n, m in modules if fit.is_linear(m) or isinstance(m, nn.Embedding)]
    if "*" in glob:  # suggest globs: "blocks.0.attn.qkv" -> "blocks.*.attn.qkv"
        shardable = list(dict.fromkeys(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", n) for n in shardable))
    close = difflib.get_close_matches(glob, shardable, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(map(repr, close))}?" if close else \
        f"its linear/embedding modules are named like {', '.join(map(repr, shardable[:4]))}"
    return f"plan entry {glob!r} matches no module of {type(model).__name__}; {hint}"


def _rope_dim(model) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return getattr(text, "qk_rope_head_dim", None)


def _rope_problems(model, name: str, module: nn.Module) -> list[str]:
    rope = _rope_dim(model)
    if not isinstance(rope, int) or not 0 < rope < fit.linear_weights(module)[0].shape[0]:
        return [f"module {name!r}: style 'mla_kv_a' splits off the rope part of its output by the model config's "
                f"qk_rope_head_dim, which is {rope!r} here; give it 'replicate' (and leave its attention whole)"]
    return []


def _tie_problems(modules, assignment: dict[str, Style], tp: int) -> list[str]:
    users = defaultdict(list)
    for n, m in modules:
        if fit.is_linear(m) or isinstance(m, nn.Embedding):
            users[id(m.weight)].append(n)
    problems = []
    by_name = dict(modules)
    for names in users.values():
        layouts = {n: fit.layout(by_name[n], assignment.get(n, Style("replicate")), tp) for n in names}
        if len(set(layouts.values())) > 1:
            detail = "; ".join(f"{n!r} {how}" for n, how in layouts.items())
            problems.append(f"modules {', '.join(map(repr, names))} share one weight but the plan splits it "
                            f"differently ({detail}); give them the same kind of style (e.g. 'vocab' for an "
                            f"embedding and its tied head) or 'replicate' for all")
    return problems


def _build(module: nn.Module, style: Style, tp_group, sequence_parallel: bool, head_count: int = 0) -> nn.Module:
    if style.kind == "heads":
        return HeadParallelLinear.from_linear(module, tp_group, heads=head_count, sequence_parallel=sequence_parallel)
    if style.kind == "column":
        return ColumnParallelLinear.from_linear(module, tp_group, gather_output=style.gather_output,
                                                sequence_parallel=sequence_parallel, parts=style.parts)
    if style.kind == "row":
        return RowParallelLinear.from_linear(module, tp_group, sequence_parallel=sequence_parallel,
                                             input_is_parallel=not style.split_input)
    scaled = fit.rule_for(module, style) == "scaled embedding"
    if style.kind == "embed_hidden":
        return HiddenParallelEmbedding.from_embedding(module, tp_group, scaled=scaled)
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_embedding(module, tp_group, sequence_parallel=sequence_parallel,
                                                     scaled=scaled)
    return VocabParallelLinear.from_linear(module, tp_group, gather_output=style.gather_output,
                                           sequence_parallel=sequence_parallel)


def _split_copy(dense: nn.Module, entries: list[tuple[str, Style]], tp_size: int, tp_rank: int) -> nn.Module:
    """The cut of a module whose bare parameters the plan splits: a shallow copy holding this rank's slices."""
    piece = copy.copy(dense)
    piece._parameters = dict(dense._parameters)
    for key, style in entries:
        split_parameter(piece, key, style.kind, style.parts, tp_size, tp_rank)
    return piece


def apply_tensor_parallel(model: nn.Module, plan: str | Mapping[str, str], tp_group, *,
                          sequence_parallel: bool = False, seed: int | None = None,
                          pp_rank: int = 0, cuts: dict | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_group`` as ``plan`` says, and return it.

    Build the model whole with the same seed on every rank of the group first: each rank then keeps its
    slice of the weights the modules already hold, and the sharded model computes the same function.
    ``tp_group`` None (or a group of one) swaps the layers with no communication at all.
    ``sequence_parallel`` splits norms and dropout along the sequence (models that implement
    ``configure_tensor_parallel``, like the reference GPT). ``seed`` seeds the per-rank dropout stream of
    sharded regions (default ``torch.initial_seed()``, the same on ranks seeded alike); ``pp_rank``, this
    rank's pipeline stage, offsets that stream as Megatron does (``seed + 100 * pp_rank + 2718 + tp_rank``,
    see :mod:`.random`), so stages holding different layers draw different masks.

    Models may implement ``tensor_parallel_plan()`` (used by "auto"), ``check_tensor_parallel(styles,
    tp_size, sequence_parallel) -> list[str]`` and ``configure_tensor_parallel(ctx)``, called after the swap
    with a :class:`TensorParallelContext` (the reference GPT does all three). A model without the last one
    (transformers models) draws dropout inside split regions from torch's default stream, the same on
    every tensor rank: still correct, but the masks of heads on different ranks are then alike.

    ``cuts``: filled with ``{module name: dense module -> this rank's layer}``, the cut each swapped module (or
    module whose bare parameters are split) got, so that a model swapped on the meta device is materialised by
    re-running the same cut on the whole values (:mod:`plugin.materialize`).
    """
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    assignment = resolve_plan(model, plan, tp_size, sequence_parallel=sequence_parallel)
    params = dict(model.named_parameters(remove_duplicate=False))
    swapped = {n: s for n, s in assignment.items() if n not in params and s.kind not in _WRAPPED}
    new_of: dict[int, nn.Module] = {}
    weight_of: dict[int, nn.Parameter] = {}
    for name, style in swapped.items():
        old = model.get_submodule(name)
        new = new_of.get(id(old))
        count = 0
        if style.kind == "heads":  # checked in resolve_plan: whole heads of this dim
            count = fit.linear_weights(old)[0].shape[0] // _owner_and_dim(model, name)[1]
        if new is None:
            new = _build(old, style, tp_group, sequence_parallel, count)
            tied = weight_of.get(id(old.weight))
            if tied is not None:  # checked in resolve_plan: same split, so the shards have one shape
                assert tied.shape == new.weight.shape, (name, tied.shape, new.weight.shape)
                new.weight = tied
            weight_of[id(old.weight)] = new.weight
            new_of[id(old)] = new
            if getattr(new, "padding", 0):
                log.info("tensor parallel: %r vocabulary %d padded to %d (%d row%s) for tensor size %d", name,
                         getattr(new, "vocab_size", getattr(new, "num_embeddings", 0)),
                         getattr(new, "padded_vocab_size", getattr(new, "padded_num_embeddings", 0)),
                         new.padding, "s" if new.padding > 1 else "", tp_size)
        if cuts is not None:
            cuts[name] = functools.partial(_build, style=style, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                           head_count=count)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    by_owner: dict[str, list[tuple[str, Style]]] = defaultdict(list)  # bare parameters, split in place
    for name, style in assignment.items():
        if name in params:
            owner, _, key = name.rpartition(".")
            by_owner[owner].append((key, style))
    for owner, entries in by_owner.items():
        module = model.get_submodule(owner)
        for key, style in entries:
            if not is_sharded(module._parameters[key]):  # a tie: split once
                split_parameter(module, key, style.kind, style.parts, tp_size, tp_rank)
        if cuts is not None:
            cuts[owner] = functools.partial(_split_copy, entries=entries, tp_size=tp_size, tp_rank=tp_rank)
    for name, style in assignment.items():
        if style.kind in _WRAPPED and name not in params:
            module = model.get_submodule(name)
            if getattr(module, "_tp_kind", None) != style.kind:  # a module under two names: wrapped once
                wrap(module, style.kind, tp_group, rope=_rope_dim(model) if style.kind == "mla_kv_a" else 0)
    auto.fix_known_model(model, tp_size)
    heads.fix_key_value_groups(model)
    configure = getattr(model, "configure_tensor_parallel", None)
    if configure is not None:
        rng = TensorParallelRNG(torch.initial_seed() if seed is None else seed, tp_rank, pp_rank)
        configure(TensorParallelContext(tp_group, tp_size, tp_rank, sequence_parallel, rng))
    return model


def padding_report(model: nn.Module) -> dict[str, int]:
    """``{module name: padded rows}`` for every vocabulary-split layer that needed padding."""
    return {n: m.padding for n, m in model.named_modules()
            if isinstance(m, (VocabParallelEmbedding, VocabParallelLinear)) and m.padding}
