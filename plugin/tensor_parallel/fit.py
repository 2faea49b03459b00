"""Whether a plan's style fits the module (or bare parameter) it names: every reason it does not, as one line each
naming the module, its class, the values and the fix. Pure checks on the model's structure (shapes, classes): they
run before any process group exists, on a model built on the meta device too.

No silent swap: a module is replaced by a plugin layer only when its forward is the one that layer reproduces
(``type(module).forward is nn.Linear.forward``, ``nn.Embedding.forward``, transformers' ``Conv1D.forward``), compared
generically, not by a list of names. A subclass with a forward of its own is accepted only under a rule that names
its pattern (:data:`RULES`); any other is refused.
"""
from __future__ import annotations

from torch import nn

from .layers import linear_weights
from .sharding import padded_size
from .styles import Style

# A subclass with its own forward that a plugin layer still reproduces: (name, applies to (module, style), what it is)
RULES = (
    ("scaled embedding", lambda m, s: isinstance(m, nn.Embedding) and s.kind in ("vocab", "embed_hidden")
     and hasattr(m, "embed_scale"),
     "an nn.Embedding subclass with an embed_scale whose forward is embedding(ids) * embed_scale (Gemma's "
     "*ScaledWordEmbedding): the split embedding multiplies by the same scale (checked on real weights)"),
)
_SWAPPED = ("column", "heads", "row", "vocab", "embed_hidden")  # the kinds that replace the module by a plugin layer


def is_linear(module: nn.Module) -> bool:
    try:
        linear_weights(module)
        return True
    except TypeError:
        return False


def describe(module: nn.Module) -> str:
    if is_linear(module):
        out, inp = linear_weights(module)[0].shape
        return f"{type(module).__name__} {inp}->{out}"
    if isinstance(module, nn.Embedding):
        kind = "nn.Embedding" if type(module) is nn.Embedding else type(module).__name__
        return f"{kind} {module.num_embeddings}x{module.embedding_dim}"
    return type(module).__name__


def layer_base(module: nn.Module) -> type:
    """The class whose forward the plugin's layer reproduces: nn.Embedding, nn.Linear or transformers' Conv1D."""
    for base in (nn.Embedding, nn.Linear):
        if isinstance(module, base):
            return base
    return next(c for c in type(module).__mro__ if c.__name__ == "Conv1D")


def rule_for(module: nn.Module, style: Style) -> str | None:
    """The name of the rule under which a subclass with its own forward is still swapped, else None."""
    return next((name for name, applies, _ in RULES if applies(module, style)), None)


def own_forward(module: nn.Module) -> bool:
    """True when the module's forward is not its layer base's (an override in a subclass, or on the instance)."""
    return "forward" in vars(module) or type(module).forward is not layer_base(module).forward


def _forward_problem(name: str, module: nn.Module, style: Style) -> list[str]:
    if not own_forward(module) or rule_for(module, style) is not None:
        return []
    cls, base = type(module), layer_base(module)
    layer = {"column": "ColumnParallelLinear", "heads": "HeadParallelLinear", "row": "RowParallelLinear",
             "embed_hidden": "HiddenParallelEmbedding",
             "vocab": "VocabParallelEmbedding" if base is nn.Embedding else "VocabParallelLinear"}[style.kind]
    return [f"module {name!r} is {cls.__module__}.{cls.__qualname__}, a subclass of {base.__name__} with a forward of "
            f"its own: {layer} computes {base.__name__}.forward and would drop what {cls.__qualname__}.forward adds; "
            f"give {name!r} 'replicate' in an explicit tensor_parallel.plan (or split the layers inside it)"]


def module_problems(name: str, module: nn.Module, style: Style, tp: int) -> list[str]:
    """Why ``style`` cannot apply to ``module`` over ``tp`` ranks (empty when it can)."""
    what = f"module {name!r} ({describe(module)})"
    kind = style.kind
    if kind in ("replicate", "local", "grad_sum", "region", "identity_expert"):
        return []  # any module (regions are checked whole in region_problems)
    if isinstance(module, nn.Embedding):
        unsupported = [n for n in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(module, n)]
        if kind in ("vocab", "embed_hidden") and unsupported:
            return [f"{what}: a split embedding does not support its option(s) {unsupported}; use 'replicate'"]
        if kind == "embed_hidden" and module.embedding_dim % tp:
            return [f"{what}: {module.embedding_dim} hidden features are not divisible by tensor size {tp}; use a "
                    f"tensor size that divides {module.embedding_dim}, or 'replicate'"]
        if (kind == "vocab" and not style.gather_output) or kind == "embed_hidden":
            return _forward_problem(name, module, style)
        return [f"{what}: style {style.text!r} does not fit an embedding; use 'vocab' (split its rows), "
                f"'embed_hidden' (split its columns) or 'replicate'"]
    if not is_linear(module) or kind == "embed_hidden":
        return [f"{what}: style {style.text!r} needs an nn.Linear{' or nn.Embedding' if kind == 'vocab' else ''}; "
                f"point the glob at the linear layers inside it, or use 'replicate'"]
    out_features, in_features = linear_weights(module)[0].shape
    if kind == "mla_kv_a":
        return []
    if kind == "heads":  # whole heads or replicated ones: plan.resolve_plan checks them with the head dim
        return _forward_problem(name, module, style)
    if kind == "column" and out_features % (tp * style.parts):
        unit = f"tensor size {tp}" + (f" x {style.parts} packed parts" if style.parts > 1 else "")
        return [f"{what}: {out_features} output features are not divisible by {unit}; use a tensor size "
                f"that divides {out_features // style.parts}, or 'replicate'"]
    if kind == "row" and style.parts > 1:
        return [f"{what}: style {style.text!r} (packed input parts) applies to bare parameters only; use 'row'"]
    if kind == "row" and in_features % tp:
        return [f"{what}: {in_features} input features are not divisible by tensor size {tp}; use a tensor "
                f"size that divides {in_features}, or 'replicate'"]
    return _forward_problem(name, module, style)


def parameter_problems(name: str, param, style: Style, tp: int, owners: list[tuple[str, Style]]) -> list[str]:
    """Why a bare parameter entry cannot be split (``owners``: the styles of its module and that module's ancestors)."""
    kind = style.kind
    what = f"parameter {name!r} ({tuple(param.shape)})"
    if kind == "replicate":
        return []
    if kind not in ("column", "row"):
        return [f"{what}: style {style.text!r} applies to modules; a bare parameter takes column, column:K, row, "
                "row:K or replicate"]
    if not any(s.kind in ("region", "local") for _, s in owners):
        return [f"{what}: a bare parameter is split only inside a module the plan marks 'experts' / 'partial' "
                "(its output summed over the tensor group) or 'local' (per-head parameters of an attention whose "
                "heads the plan splits); add that entry for its module, or give the parameter 'replicate'"]
    if kind == "row" and param.dim() < 2:
        return [f"{what}: style {style.text!r} splits the input dimension, and a 1-D parameter has none; use "
                "'replicate' or 'column'"]
    dim = max(param.dim() - 2, 0) if kind == "column" else param.dim() - 1
    if param.shape[dim] % (tp * style.parts):
        unit = f"tensor size {tp}" + (f" x {style.parts} packed parts" if style.parts > 1 else "")
        return [f"{what}: dimension {dim} ({param.shape[dim]}) is not divisible by {unit}; use a tensor size that "
                f"divides {param.shape[dim] // style.parts}, or 'replicate'"]
    return []


def region_problems(name: str, module: nn.Module, split: set[str], styles: dict[str, Style]) -> list[str]:
    """A region (experts / partial) sums its output over the tensor group: every parameter inside must be a split
    bare parameter (``split``: their full names), or it would count tensor-size times; no plugin layer inside."""
    problems = []
    for sub, _ in module.named_modules(prefix=name):
        if sub != name and sub in styles and styles[sub].kind in _SWAPPED:
            problems.append(f"module {sub!r} ({styles[sub].text}) sits inside {name!r} ({type(module).__name__}, a "
                            "region whose output is summed over the tensor group): its own collective would sum it "
                            "twice; split its weight as a bare parameter instead")
    whole = [n for n, _ in module.named_parameters(prefix=name) if n not in split]
    if whole:
        problems.append(f"module {name!r} ({type(module).__name__}) sums its output over the tensor group, but its "
                        f"parameter(s) {whole} are not split: each rank would add them, tensor-size times; add plan "
                        "entries that split them, or give the module 'replicate'")
    if not split & {n for n, _ in module.named_parameters(prefix=name)}:
        problems.append(f"module {name!r} ({type(module).__name__}): style 'experts' / 'partial' with no parameter "
                        "split inside it; split its expert weights, or give it 'replicate'")
    return problems


def layout(module: nn.Module, style: Style, tp: int) -> str:
    """How a weight ends up split: modules tied to one weight must agree on it to stay tied."""
    rows = module.num_embeddings if isinstance(module, nn.Embedding) else linear_weights(module)[0].shape[0]
    if style.kind not in _SWAPPED:
        return "whole"
    if style.kind == "row":
        return "split by input features"
    if style.kind == "embed_hidden":
        return "split by columns"
    if style.kind == "heads":
        return "split by whole heads"
    if style.kind == "vocab" or style.parts == 1:  # a plain column split is a vocab split that needs no padding
        return f"split by rows, {padded_size(rows, tp)} rows in all"
    return f"split by rows in {style.parts} packed parts"
