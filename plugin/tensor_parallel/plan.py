"""``apply_tensor_parallel``: swap a model's linears and embeddings for tensor-parallel ones, by name globs.

A plan maps ``fnmatch`` globs on module names (``model.named_modules()``; ``*`` also crosses dots) to a
style:

==============  ===========================================================================================
``column``      ``nn.Linear`` -> :class:`ColumnParallelLinear`, output left split (a ``row`` layer follows)
``column:K``    the same for an output of ``K`` packed parts (GPT-2's fused ``[q | k | v]`` is ``column:3``)
``column_gather`` ``nn.Linear`` -> :class:`ColumnParallelLinear` that all-gathers its output
``row``         ``nn.Linear`` -> :class:`RowParallelLinear` (input split by the ``column`` before it)
``vocab``       ``nn.Embedding`` -> :class:`VocabParallelEmbedding` (under sequence parallelism its
                sequence-parallel form: ``[seq/p, batch, hidden]`` out); ``nn.Linear`` (a head) ->
                :class:`VocabParallelLinear`, vocabulary-split logits for :func:`vocab_parallel_cross_entropy`
``vocab_gather`` ``nn.Linear`` head -> :class:`VocabParallelLinear` returning whole ``[..., vocab]`` logits
``replicate``   left whole (the default for modules no glob names)
==============  ===========================================================================================

transformers' names are accepted too (``colwise``, ``rowwise``, ``colwise_gather_output``,
``packed_colwise``, ``embedding_rowwise``, ``replicate``). ``"auto"`` picks the plan by model (see
:mod:`.auto`). The plan is checked whole before anything is swapped, and every problem found is
reported in one :class:`TensorParallelError`, each naming the module, the values and the fix; a failed
call leaves the model untouched. Modules tied to one weight (an embedding and its head) stay tied.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import logging
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from . import auto
from .comm import group_rank, group_size
from .context import TensorParallelContext
from .embedding import VocabParallelEmbedding
from .errors import TensorParallelError
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelLinear, linear_weights
from .random import TensorParallelRNG
from .sharding import padded_size

log = logging.getLogger("plugin.tensor_parallel")

STYLES = ("column", "column:K", "column_gather", "row", "vocab", "vocab_gather", "replicate")
HF_STYLES = {"colwise": "column", "rowwise": "row", "colwise_gather_output": "column_gather",
             "colwise_rep": "column_gather", "packed_colwise": "column:2", "embedding_rowwise": "vocab"}
# transformers' other style names (4.5x and 5.x), refused as unsupported rather than as unknown
HF_UNSUPPORTED = frozenset({
    "replicated_with_grad_allreduce", "local_colwise", "local_rowwise", "local", "local_packed_rowwise", "gather",
    "isolated", "sequence_parallel", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "embedding_colwise",
    "all_reduce", "local_params", "grouped_gemm", "ep_router", "ep_dispatch_experts", "moe_tp_experts",
    "moe_identity_expert", "mla_kv_a_proj"})


@dataclass(frozen=True)
class Style:
    """A parsed style: ``kind`` is column, row, vocab or replicate."""

    kind: str
    gather_output: bool = False
    parts: int = 1
    text: str = ""


def parse_style(text: str) -> Style:
    """``"column:3"`` -> ``Style("column", parts=3)``; raises :class:`ValueError` with the accepted styles."""
    name = HF_STYLES.get(text, text) if isinstance(text, str) else text
    simple = {"column": Style("column", text=text), "column_gather": Style("column", True, text=text),
              "row": Style("row", text=text), "vocab": Style("vocab", text=text),
              "vocab_gather": Style("vocab", True, text=text), "replicate": Style("replicate", text=text)}
    if isinstance(name, str) and name in simple:
        return simple[name]
    if isinstance(name, str) and name.startswith("column:") and name[7:].isdigit() and int(name[7:]) >= 1:
        return Style("column", parts=int(name[7:]), text=text)
    supported = f"supported: {', '.join(STYLES)}, or transformers' {', '.join(HF_STYLES)}"
    if isinstance(name, str) and name in HF_UNSUPPORTED:
        raise ValueError(f"unsupported style {text!r}: a transformers tensor-parallel style the plugin does not "
                         f"implement ({supported}); give the module one of those in an explicit plan, or "
                         f"'replicate' to leave it whole")
    raise ValueError(f"unknown style {text!r} ({supported})")


def _is_linear(module: nn.Module) -> bool:
    try:
        linear_weights(module)
        return True
    except TypeError:
        return False


def _describe(module: nn.Module) -> str:
    if _is_linear(module):
        out, inp = linear_weights(module)[0].shape
        return f"{type(module).__name__} {inp}->{out}"
    if isinstance(module, nn.Embedding):
        return f"nn.Embedding {module.num_embeddings}x{module.embedding_dim}"
    return type(module).__name__


def _fit(name: str, module: nn.Module, style: Style, tp: int) -> list[str]:
    """Why ``style`` cannot shard ``module`` over ``tp`` ranks (empty when it can)."""
    what = f"module {name!r} ({_describe(module)})"
    if style.kind == "replicate":
        return []
    if isinstance(module, nn.Embedding):
        unsupported = [n for n in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(module, n)]
        if style.kind == "vocab" and unsupported:
            return [f"{what}: a split embedding does not support its option(s) {unsupported}; use 'replicate'"]
        if style.kind == "vocab" and not style.gather_output:
            return []
        return [f"{what}: style {style.text!r} does not fit an embedding; use 'vocab' (split its rows) or "
                f"'replicate'"]
    if not _is_linear(module):
        return [f"{what}: style {style.text!r} needs an nn.Linear or nn.Embedding; point the glob at the "
                f"linear layers inside it, or use 'replicate'"]
    out_features, in_features = linear_weights(module)[0].shape
    if style.kind == "column" and out_features % (tp * style.parts):
        unit = f"tensor size {tp}" + (f" x {style.parts} packed parts" if style.parts > 1 else "")
        return [f"{what}: {out_features} output features are not divisible by {unit}; use a tensor size "
                f"that divides {out_features // style.parts}, or 'replicate'"]
    if style.kind == "row" and in_features % tp:
        return [f"{what}: {in_features} input features are not divisible by tensor size {tp}; use a tensor "
                f"size that divides {in_features}, or 'replicate'"]
    return []


def _layout(module: nn.Module, style: Style, tp: int):
    """How a weight ends up split: tied modules must agree on it to stay tied."""
    rows = module.num_embeddings if isinstance(module, nn.Embedding) else linear_weights(module)[0].shape[0]
    if style.kind == "replicate":
        return "whole"
    if style.kind == "row":
        return "split by input features"
    if style.kind == "vocab" or style.parts == 1:  # a plain column split is a vocab split that needs no padding
        return f"split by rows, {padded_size(rows, tp)} rows in all"
    return f"split by rows in {style.parts} packed parts"


def resolve_plan(model: nn.Module, plan: str | Mapping[str, str], tp_size: int, *,
                 sequence_parallel: bool = False) -> dict[str, Style]:
    """``{module name: style}`` for every module the plan shards; raises with every problem found.

    Pure (no process group): the checks of :func:`apply_tensor_parallel`, runnable before any launch.
    """
    explicit = plan != "auto"
    if plan == "auto":
        plan = auto.auto_plan(model)
    if not isinstance(plan, Mapping) or not plan:
        raise TensorParallelError(f"a tensor-parallel plan is 'auto' or a non-empty mapping of module-name "
                                  f"globs to styles, got {plan!r}")
    modules = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if n]
    problems: list[str] = []
    assignment: dict[str, Style] = {}
    chosen_by: dict[str, str] = {}
    for glob, text in plan.items():
        try:
            style = parse_style(text)
        except ValueError as e:
            problems.append(f"plan entry {glob!r}: {e}")
            continue
        hits = [n for n, _ in modules if fnmatch.fnmatchcase(n, glob)]
        if not hits and explicit:
            shardable = [n for n, m in modules if _is_linear(m) or isinstance(m, nn.Embedding)]
            if "*" in glob:  # suggest globs: "blocks.0.attn.qkv" -> "blocks.*.attn.qkv"
                shardable = list(dict.fromkeys(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", n) for n in shardable))
            close = difflib.get_close_matches(glob, shardable, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else \
                f"its linear/embedding modules are named like {', '.join(map(repr, shardable[:4]))}"
            problems.append(f"plan entry {glob!r} matches no module of {type(model).__name__}; {hint}")
        for n in hits:
            if n in assignment and assignment[n] != style:
                problems.append(f"module {n!r} is matched by {chosen_by[n]!r} ({assignment[n].text}) and by "
                                f"{glob!r} ({style.text}); make the globs name it once")
                continue
            assignment[n], chosen_by[n] = style, glob
    by_name = dict(modules)
    for n, style in assignment.items():
        problems += _fit(n, by_name[n], style, tp_size)
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
    return {n: s for n, s in assignment.items() if s.kind != "replicate"}


def _tie_problems(modules, assignment: dict[str, Style], tp: int) -> list[str]:
    users = defaultdict(list)
    for n, m in modules:
        if _is_linear(m) or isinstance(m, nn.Embedding):
            users[id(m.weight)].append(n)
    problems = []
    by_name = dict(modules)
    for names in users.values():
        layouts = {n: _layout(by_name[n], assignment.get(n, Style("replicate")), tp) for n in names}
        if len(set(layouts.values())) > 1:
            detail = "; ".join(f"{n!r} {how}" for n, how in layouts.items())
            problems.append(f"modules {', '.join(map(repr, names))} share one weight but the plan splits it "
                            f"differently ({detail}); give them the same kind of style (e.g. 'vocab' for an "
                            f"embedding and its tied head) or 'replicate' for all")
    return problems


def _build(module: nn.Module, style: Style, tp_group, sequence_parallel: bool) -> nn.Module:
    if style.kind == "column":
        return ColumnParallelLinear.from_linear(module, tp_group, gather_output=style.gather_output,
                                                sequence_parallel=sequence_parallel, parts=style.parts)
    if style.kind == "row":
        return RowParallelLinear.from_linear(module, tp_group, sequence_parallel=sequence_parallel)
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_embedding(module, tp_group, sequence_parallel=sequence_parallel)
    return VocabParallelLinear.from_linear(module, tp_group, gather_output=style.gather_output,
                                           sequence_parallel=sequence_parallel)


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

    ``cuts``: filled with ``{module name: dense module -> this rank's layer}``, the cut each swapped module got, so
    that a model swapped on the meta device is materialised by re-running the same cut on the whole values
    (:mod:`plugin.materialize`).
    """
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    assignment = resolve_plan(model, plan, tp_size, sequence_parallel=sequence_parallel)
    new_of: dict[int, nn.Module] = {}
    weight_of: dict[int, nn.Parameter] = {}
    for name, style in assignment.items():
        old = model.get_submodule(name)
        new = new_of.get(id(old))
        if new is None:
            new = _build(old, style, tp_group, sequence_parallel)
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
            cuts[name] = functools.partial(_build, style=style, tp_group=tp_group, sequence_parallel=sequence_parallel)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    auto.fix_known_model(model, tp_size)
    configure = getattr(model, "configure_tensor_parallel", None)
    if configure is not None:
        rng = TensorParallelRNG(torch.initial_seed() if seed is None else seed, tp_rank, pp_rank)
        configure(TensorParallelContext(tp_group, tp_size, tp_rank, sequence_parallel, rng))
    return model


def padding_report(model: nn.Module) -> dict[str, int]:
    """``{module name: padded rows}`` for every vocabulary-split layer that needed padding."""
    return {n: m.padding for n, m in model.named_modules()
            if isinstance(m, (VocabParallelEmbedding, VocabParallelLinear)) and m.padding}
