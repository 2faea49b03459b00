"""Expert parallelism, the fifth axis: a mixture-of-experts layer's experts placed over the expert group (ranks carved
out of data x context), each token sent to its experts' ranks and back by all-to-all, dropless.

``layer`` (the MoE module: router, experts), ``router`` (softmax top-k, load-balancing loss), ``dispatch`` (sort,
exchange counts, all-to-all there and back, combine), ``comm`` (the autograd collectives), ``apply`` (cut each rank's
experts, mark their parameters), ``hf`` (a transformers family's experts module behind the dispatch), ``aux`` (the
load-balancing losses added to the training loss), ``grads`` (the experts' gradients reduced over the expert-data
group).
"""
from __future__ import annotations

from .. import lazy_attributes

# name -> module that defines it, loaded on first use (PEP 562): ``checks`` is pure (no torch), and the back-end choice
# (plugin.engines.choose, on paths that only read a recipe) imports it without loading the torch modules below.
_LAZY = {"MoE": "layer", "apply_expert_parallel": "apply", "is_expert_param": "apply", "expert_modules": "apply",
         "hf_experts": "hf", "moe_layers": "aux",
         "update_router_biases": "aux", "with_aux_losses": "aux"}

__all__ = sorted(_LAZY)
__getattr__ = lazy_attributes(__name__, _LAZY, globals())
