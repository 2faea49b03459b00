"""Estimates for a recipe: its layout as a :class:`plugin.planning.setup.Setup`, memory, traffic, time, verdict.

A recipe's ``model`` block is the reference GPT (:meth:`plugin.planning.dims.ModelSpec.from_recipe_model`); its
``activation_checkpointing`` block is the recompute mode (``full``: a checkpoint every ``every`` blocks;
``selective``: the attention core); attention is taken as fused (FlashAttention /
``scaled_dot_product_attention``: no stored softmax); dropout masks are counted only when ``model.dropout`` > 0.
Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problem, RecipeError
from .dims import ModelSpec
from .memory import expected_model_states, host_model_states, memory_per_rank, usable_memory
from .model_states import ModelStates
from .schedule import bubble_fraction
from .setup import Breakdown, Setup
from .steptime import HARDWARE, Hardware, StepTime, step_time
from .traffic import CommTerm, communication_per_rank


def recipe_world_size(recipe) -> int | None:
    """The world size a recipe means: data x tensor x pipeline x context, or its cluster's GPUs for
    ``"data": "auto"``."""
    if recipe.parallelism.data != "auto":
        return None  # the recipe fixes it
    if recipe.cluster is None:
        raise RecipeError([Problem("$.parallelism.data", '"auto" needs a world size to estimate',
                                   'set "data" to a number, or add a "cluster" block (nodes x gpus_per_node)',
                                   file=recipe.source)])
    return recipe.cluster.nodes * recipe.cluster.gpus_per_node


def setup_from_recipe(recipe, world_size: int | None = None) -> Setup:
    """The :class:`Setup` of a recipe at ``world_size`` (default: the recipe's own, see :func:`recipe_world_size`)."""
    layout = recipe.layout(world_size if world_size is not None else recipe_world_size(recipe))
    ac = recipe.activation_checkpointing
    zero = recipe.zero
    return Setup(
        tp=layout.tensor, pp=layout.pipeline, dp=layout.data, cp=layout.context,
        ep=layout.expert, etp=layout.expert_tensor, cp_method=recipe.context_parallel.method, zero_stage=zero.stage,
        micro_batch=layout.micro_batch, micro_batches=layout.grad_accum,
        recompute=ac.mode, checkpoint_interval=ac.every if ac.mode == "full" else 1,
        sequence_parallel=recipe.tensor_parallel.sequence_parallel and layout.tensor > 1,
        schedule=recipe.pipeline_parallel.schedule, virtual_stages=recipe.pipeline_parallel.virtual_stages,
        precision=recipe.precision, optimizer=recipe.optimizer.name, momentum=recipe.optimizer.momentum,
        offload_optimizer=zero.offload_optimizer != "none", offload_param=zero.offload_param != "none",
        dropout=recipe.model is not None and recipe.model.dropout > 0,
    )


def spec_from_recipe(recipe) -> ModelSpec:
    if recipe.model is None:
        raise RecipeError([Problem("$.model", "the recipe has no model block; estimates need the model's dimensions",
                                   "add a model block: layers, hidden, heads, vocab, seq_len", file=recipe.source)])
    return ModelSpec.from_recipe_model(recipe.model, name=recipe.name)


def expected_model_states_for_recipe(recipe, world_size: int | None = None, stage: int = 0) -> ModelStates:
    """Parameters, gradients and optimizer states (bytes) one rank of ``stage`` should hold.

    The number to hold an engine to (issue 6, item 5): compare with the bytes its ranks allocate.
    """
    return expected_model_states(spec_from_recipe(recipe), setup_from_recipe(recipe, world_size), stage)


@dataclass(frozen=True)
class RecipeEstimate:
    """Everything ``python -m plugin estimate`` reports about one recipe."""

    name: str
    spec: ModelSpec
    setup: Setup
    memory: Breakdown  # the most loaded rank
    host: ModelStates  # offloaded to CPU memory, per rank
    communication: tuple[CommTerm, ...]  # per rank of the same stage, per step
    time: StepTime
    hardware: Hardware
    gpus_per_node: int
    gpu_memory: float

    @property
    def usable(self) -> float:
        return usable_memory(self.gpu_memory)[0]

    @property
    def reserve(self) -> float:
        return usable_memory(self.gpu_memory)[1]

    @property
    def margin(self) -> float:
        """Usable bytes left over (negative: that much too much)."""
        return self.usable - self.memory.total

    @property
    def fits(self) -> bool:
        return self.margin >= 0

    @property
    def bubble(self) -> float:
        s = self.setup
        return bubble_fraction(s.pp, s.micro_batches, s.virtual_stages if s.schedule == "interleaved_1f1b" else 1)

    def to_json(self) -> dict:
        return {
            "recipe": self.name, "model": self.spec.to_json(), "layout": self.setup.to_json(),
            "world_size": self.setup.world_size,
            "memory": self.memory.to_json(), "host_memory": self.host.to_json(),
            "communication": [{"name": c.name, "group": c.group, "bytes": c.bytes, "calls": c.calls}
                              for c in self.communication],
            "bubble_fraction": self.bubble, "time": self.time.to_json(), "hardware": self.hardware.to_json(),
            "gpu_memory": self.gpu_memory, "usable_memory": self.usable, "reserve": self.reserve,
            "fits": self.fits, "margin": self.margin,
        }


def estimate_recipe(recipe, world_size: int | None = None, gpu_memory: float | None = None,
                    hardware: Hardware = HARDWARE["h100"]) -> RecipeEstimate:
    """Estimate a recipe; ``gpu_memory`` (bytes) defaults to its cluster's, else 80 GB.

    Raises :class:`RecipeError` when the recipe has no model block or its sizes do not resolve.
    """
    spec = spec_from_recipe(recipe)
    setup = setup_from_recipe(recipe, world_size)
    if gpu_memory is None:
        gpu_memory = recipe.cluster.gpu_memory_gb * 1e9 if recipe.cluster else 80e9
    gpus_per_node = recipe.cluster.gpus_per_node if recipe.cluster else 8
    memory = memory_per_rank(spec, setup)
    return RecipeEstimate(
        name=recipe.name, spec=spec, setup=setup, memory=memory,
        host=host_model_states(spec, setup, memory.stage),
        communication=tuple(communication_per_rank(spec, setup, memory.stage)),
        time=step_time(spec, setup, hardware, gpus_per_node), hardware=hardware,
        gpus_per_node=gpus_per_node, gpu_memory=gpu_memory)
