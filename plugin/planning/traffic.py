"""Bytes each rank sends per optimizer step, term by term, from the published communication volumes (pure).

Sources: ZeRO (Rajbhandari et al. 2020) Section 7 for data parallelism and ZeRO-1/2/3; Megatron-LM (Shoeybi
et al. 2019, Figure 4) and Korthikanti et al. 2022 (4.2.2) for tensor and sequence parallelism; pipeline
sends of one micro-batch's activations and gradients. Ring algorithms throughout. The layout is the same
:class:`plugin.planning.setup.Setup` the memory estimate takes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelSpec
from .setup import Setup


def ring_factor(n: int) -> float:
    """(n-1)/n: the fraction of a buffer each rank sends in a ring reduce-scatter or all-gather."""
    return (n - 1) / n


@dataclass(frozen=True)
class CommTerm:
    """Bytes one rank sends per optimizer step for one purpose, over one group."""

    name: str
    group: str  # "tensor", "data" or "pipeline"
    bytes: float
    calls: int  # collective or send operations, for the latency term of a time model


def communication_per_rank(spec: ModelSpec, setup: Setup, stage: int = 0) -> list[CommTerm]:
    """Bytes a rank of ``stage`` sends per optimizer step, by purpose (ring algorithms).

    - data parallel: gradients all-reduced, 2(N_d-1)/N_d x grad bytes (ZeRO paper 7.1); ZeRO-1/2 as a
      reduce-scatter of gradients plus an all-gather of the updated parameters, the same volume (7.2.1);
      ZeRO-2 reduce-scatters at every micro-batch; ZeRO-3 adds parameter all-gathers in forward and
      backward, 3(N_d-1)/N_d x Psi instead of 2 (7.2.2), at every micro-batch.
    - tensor parallel: per block and micro-batch two all-reduces of sbh values forward and two backward
      (Megatron-LM, Shoeybi et al. 2019, Figure 4); with sequence parallelism each becomes an all-gather
      plus a reduce-scatter, the same bytes (Korthikanti et al. 4.2.2); full recompute repeats the
      forward two. The vocab-parallel embedding adds one all-reduce forward, the output layer one backward.
    - pipeline: per micro-batch, activations (sbh, /t under sequence parallelism) to the next stage and
      their gradients to the previous one. With tied embeddings over more than one stage, the first and
      the last stage each hold the (vocab-parallel) embedding and all-reduce its gradient between them once
      per step (Megatron's ``_allreduce_word_embedding_grads``, DeepSpeed's ``allreduce_tied_weight_gradients``):
      a ring of 2 sends the whole shard, Vh/t gradient values, from each of the two. In the gradients' dtype as
      DeepSpeed holds them (bf16 under bf16); the native back end keeps fp32 gradients under autocast and sends
      twice that. ``tests/dist/test_hf_layouts.py`` counts the bytes both back ends all-reduce at fp32: equal.
    """
    t, dp, m = setup.tp, setup.dp, setup.micro_batches
    p_bytes, g_bytes, _ = setup.state_bytes()
    psi = spec.stage_params(stage, setup.pp, t)
    w = setup.bytes_per_value
    sbh = spec.seq_len * setup.micro_batch * spec.hidden
    out: list[CommTerm] = []
    if dp > 1:
        r = ring_factor(dp)
        if setup.zero_stage == 0:
            out.append(CommTerm("gradient_allreduce", "data", 2 * r * psi * g_bytes, 1))
        elif setup.zero_stage == 1:
            out.append(CommTerm("gradient_reduce_scatter", "data", r * psi * g_bytes, 1))
            out.append(CommTerm("parameter_allgather", "data", r * psi * p_bytes, 1))
        elif setup.zero_stage == 2:
            out.append(CommTerm("gradient_reduce_scatter", "data", m * r * psi * g_bytes, m))
            out.append(CommTerm("parameter_allgather", "data", r * psi * p_bytes, 1))
        else:
            out.append(CommTerm("zero3_parameter_allgather_forward", "data", m * r * psi * p_bytes, m))
            out.append(CommTerm("zero3_parameter_allgather_backward", "data", m * r * psi * p_bytes, m))
            out.append(CommTerm("gradient_reduce_scatter", "data", m * r * psi * g_bytes, m))
    if t > 1:
        layers = spec.layers_on_stage(stage, setup.pp)
        per_block = 6 if setup.recompute == "full" else 4
        ops = per_block * (2 if setup.sequence_parallel else 1)
        out.append(CommTerm("tensor_parallel_blocks", "tensor",
                            m * layers * per_block * 2 * ring_factor(t) * sbh * w, m * layers * ops))
        ends = (1 if stage == 0 else 0) + (1 if stage == setup.pp - 1 else 0)
        # one all-reduce at each end, or under sequence parallelism a reduce-scatter and an all-gather (same bytes)
        out.append(CommTerm("tensor_parallel_embedding_and_output", "tensor",
                            m * ends * 2 * ring_factor(t) * sbh * w, m * ends * (2 if setup.sequence_parallel else 1)))
    if setup.pp > 1:
        msg = sbh * w / (t if setup.sequence_parallel else 1)
        if stage < setup.pp - 1:
            out.append(CommTerm("pipeline_send_activations", "pipeline", m * msg, m))
        if stage > 0:
            out.append(CommTerm("pipeline_send_gradients", "pipeline", m * msg, m))
        if spec.tied_embeddings and stage in (0, setup.pp - 1):
            shard = spec.padded_vocab(t) * spec.hidden / t
            out.append(CommTerm("tied_embedding_grad_allreduce", "pipeline",
                                2 * ring_factor(2) * shard * g_bytes, 1))
    return out
