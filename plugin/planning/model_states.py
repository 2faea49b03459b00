"""Bytes of parameters, gradients and optimizer states per rank, ZeRO stage by stage (pure).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Section 5 and
Figure 1 (model states per device at each stage). Psi parameters, N_d data-parallel ranks, K optimizer bytes per
parameter; bytes throughout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer states one rank holds."""

    parameters: float
    gradients: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    def to_json(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer_states": self.optimizer_states, "total": self.total}


def model_state_terms(params_on_rank: float, *, dp: int = 1, zero_stage: int = 0, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelStates:
    """ZeRO's per-device model states for ``params_on_rank`` parameters replicated over ``dp`` ranks.

    Rajbhandari et al. 2020, Figure 1, with Psi = params_on_rank and N_d = dp:
    stage 0 (2+2+K)Psi; stage 1 (P_os) 2Psi + 2Psi + K Psi/N_d; stage 2 (P_os+g) 2Psi + (2+K)Psi/N_d;
    stage 3 (P_os+g+p) (2+2+K)Psi/N_d. The 2, 2 and K are ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    psi = params_on_rank
    return ModelStates(
        parameters=param_bytes * psi / (dp if zero_stage >= 3 else 1),
        gradients=grad_bytes * psi / (dp if zero_stage >= 2 else 1),
        optimizer_states=optimizer_bytes * psi / (dp if zero_stage >= 1 else 1),
    )


def model_state_bytes(num_params: float, *, dp: int = 1, zero_stage: int = 0, tp: int = 1, pp: int = 1,
                      param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Bytes of parameters, gradients and optimizer states per rank (ZeRO paper, Figure 1).

    ``num_params`` (Psi) is divided evenly over the ``tp`` x ``pp`` model-parallel ranks, then sharded over
    the ``dp`` data-parallel ranks by the ZeRO stage: (2+2+K)Psi, 2Psi+2Psi+K Psi/N_d, 2Psi+(2+K)Psi/N_d,
    (2+2+K)Psi/N_d. Defaults are mixed-precision Adam: 2-byte parameters and gradients, K = 12 (fp32
    master weights, momentum and variance). :func:`model_state_terms` gives the three parts separately.
    """
    return model_state_terms(num_params / (tp * pp), dp=dp, zero_stage=zero_stage, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes).total


def state_bytes_per_param(precision: str, optimizer: str = "adamw", momentum: float = 0.0,
                          zero_stage: int = 0) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per parameter for a recipe's precision and optimizer.

    bf16/fp16 (mixed precision): 2, 2 and K = 4 (fp32 master) + 8 (Adam's two moments) = 12, the ZeRO
    paper's K; SGD keeps the master copy and, with momentum, one fp32 buffer. fp32: 4, 4 and the moments
    only (8 for Adam), no master copy; except that DeepSpeed's ZeRO optimizers clone an fp32 partition of
    the weights even when they are fp32 already (``single_partition_of_fp32_groups`` in
    ``deepspeed/runtime/zero/stage_1_and_2.py``, ``fp32_partitioned_groups_flat`` in ``stage3.py``: measured
    by ``plugin.engines.memory``), which adds 4 bytes per parameter at stages 1 to 3.
    """
    moments = 8.0 if optimizer in ("adam", "adamw") else (4.0 if momentum > 0 else 0.0)
    if precision in ("bf16", "fp16"):
        return 2.0, 2.0, 4.0 + moments
    master = 4.0 if zero_stage >= 1 else 0.0
    return 4.0, 4.0, moments + master
