"""A training layout as the estimates see it (:class:`Setup`), and named byte counts (:class:`Breakdown`). Pure."""
from __future__ import annotations

from dataclasses import dataclass

from ..interop.precision import PRECISIONS
from .model_states import state_bytes_per_param


@dataclass(frozen=True)
class Setup:
    """A layout as the estimates see it: degrees, batch, memory savers, precision."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: the sequence split over cp ranks (gradients reduced over dp x cp)
    cp_method: str = "ring"  # "ring" (K/V point-to-point) or "all_to_all" (Ulysses)
    ep: int = 1  # expert parallelism: each MoE layer's experts over ep ranks carved out of dp x cp
    etp: int | None = None  # tensor ranks per expert (None: tp)
    zero_stage: int = 0
    micro_batch: int = 1
    micro_batches: int = 1  # per optimizer step on each data-parallel rank (grad_accum)
    recompute: str = "none"
    checkpoint_interval: int = 1  # full recompute: blocks per checkpoint (DeepSpeed's interval)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    precision: str = "bf16"
    optimizer: str = "adamw"
    momentum: float = 0.0
    offload_optimizer: bool = False
    offload_param: bool = False
    fused_attention: bool = True  # FlashAttention / SDPA: the softmax is not stored
    dropout: bool = True  # dropout masks stored (the paper's assumption; a recipe says model.dropout)
    fused_swiglu: bool = True  # a SwiGLU MLP stores 6sbf (fused kernel), not eager PyTorch's 8sbf

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which ZeRO shards and gradients are reduced: data x context."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, over which their ZeRO shards and gradient reductions run: dp x cp x tp /
        (ep x etp) (data x context / ep with experts split over the tensor group)."""
        etp = self.tp if self.etp is None else self.etp
        return max(1, self.dp * self.cp * self.tp // (self.ep * etp))

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def bytes_per_value(self) -> float:
        return float(PRECISIONS[self.precision].bytes_per_value)

    def state_bytes(self) -> tuple[float, float, float]:
        return state_bytes_per_param(self.precision, self.optimizer, self.momentum, self.zero_stage)

    def label(self) -> str:
        """``tp2 pp1 dp4 zero1 mb4x8 cp2 ring ep2 sp full``: a layout in one short line."""
        out = f"tp{self.tp} pp{self.pp} dp{self.dp} zero{self.zero_stage} mb{self.micro_batch}x{self.micro_batches}"
        if self.cp > 1:
            out += f" cp{self.cp} {self.cp_method}"
        if self.ep > 1:
            out += f" ep{self.ep}"
        if self.sequence_parallel:
            out += " sp"
        if self.recompute != "none":
            out += f" {self.recompute}-recompute"
        return out

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Breakdown:
    """Named byte counts (memory of one rank, or bytes it sends per step), in a fixed order."""

    terms: tuple[tuple[str, float], ...]
    stage: int = 0
    note: str = ""

    @property
    def total(self) -> float:
        return sum(v for _, v in self.terms)

    def get(self, name: str) -> float:
        return sum(v for k, v in self.terms if k == name)

    def to_json(self) -> dict:
        return {"stage": self.stage, "total": self.total, "terms": {k: v for k, v in self.terms}}
