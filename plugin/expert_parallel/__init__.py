"""Expert parallelism, the fifth axis: a mixture-of-experts layer's experts placed over the expert group (ranks carved
out of data x context), each token sent to its experts' ranks and back by all-to-all, dropless.

``layer`` (the MoE module: router, experts), ``router`` (softmax top-k, load-balancing loss), ``dispatch`` (sort,
exchange counts, all-to-all there and back, combine), ``comm`` (the autograd collectives), ``apply`` (cut each rank's
experts, mark their parameters), ``aux`` (the load-balancing losses added to the training loss), ``grads`` (the
experts' gradients reduced over the expert-data group).
"""
from .apply import apply_expert_parallel, is_expert_param
from .aux import moe_layers, update_router_biases, with_aux_losses
from .layer import MoE

__all__ = ["MoE", "apply_expert_parallel", "is_expert_param", "moe_layers", "update_router_biases", "with_aux_losses"]
