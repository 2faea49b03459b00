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
    group: str  # "tensor", "data" (data x context with a context axis), "pipeline", "context", "expert", "expert_data"
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
    - context parallel: the data terms run over data x context (every rank holding the same parameters); the tensor
      and pipeline terms above carry the rank's own s/C tokens of each row; and per block and micro-batch the
      attention's own traffic (:mod:`plugin.context_parallel`), with n = s/C tokens
      per rank and the block's kv width h g/a over t: ring attention sends its keys and values (2nbhg/(at)
      values) C-1 times forward and C-1 times backward, plus the gradient accumulators of both, in fp32, C times;
      Ulysses all-to-alls q, k, v and the output, forward and backward, each sending (C-1)/C of the rank's tensor.
      Full and selective recompute repeat the forward's (selective checkpoints the whole context attention).
    - expert parallel (``ep`` > 1, :mod:`plugin.expert_parallel`): the data terms above cover the parameters but the
      experts, whose gradients run over the expert-data group instead (the same formulas with its size); and per MoE
      block and micro-batch, the dispatch's two all-to-alls (tokens there, outputs back) forward and two backward,
      each sending (ep-1)/ep of top_k x the rank's tokens x h values (a uniform routing; full recompute repeats the
      forward two), plus one exchange of counts per forward.
    """
    t, dp, m = setup.tp, setup.replicas, setup.micro_batches
    p_bytes, g_bytes, _ = setup.state_bytes()
    etp = t if setup.etp is None else setup.etp
    experts = spec.stage_expert_params(stage, setup.pp, setup.ep, etp)
    psi = spec.stage_params(stage, setup.pp, t, setup.ep, etp) - experts
    w = setup.bytes_per_value
    # A context rank holds seq_len / cp tokens of each row: its tensor all-reduces and pipeline sends carry only those.
    sbh = spec.seq_len // setup.cp * setup.micro_batch * spec.hidden
    out: list[CommTerm] = []
    if experts and setup.ep == 1:  # no expert axis: the experts are reduced with the rest
        psi, experts = psi + experts, 0.0
    out += _data_terms(psi, dp, setup, "data", "")
    if experts:
        out += _data_terms(experts, setup.expert_replicas, setup, "expert_data", "expert_")
        moe = spec.moe_blocks_on_stage(stage, setup.pp)
        forwards = 2 if setup.recompute == "full" else 1
        tokens = spec.seq_len // setup.cp * setup.micro_batch
        per = ring_factor(setup.ep) * spec.moe_top_k * tokens * spec.hidden * setup.bytes_per_value
        out.append(CommTerm("expert_all_to_all", "expert", m * moe * 2 * (forwards + 1) * per,
                            m * moe * (2 * (forwards + 1) + forwards)))
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
    if setup.cp > 1:
        out.append(_context_term(spec, setup, stage, w))
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


def _data_terms(psi: float, dp: int, setup: Setup, group: str, prefix: str) -> list[CommTerm]:
    """Gradient and parameter traffic of ``psi`` parameters replicated over ``dp`` ranks (ZeRO paper 7.1-7.2)."""
    if dp <= 1 or not psi:
        return []
    p_bytes, g_bytes, _ = setup.state_bytes()
    r, m = ring_factor(dp), setup.micro_batches
    if setup.zero_stage == 0:
        return [CommTerm(f"{prefix}gradient_allreduce", group, 2 * r * psi * g_bytes, 1)]
    if setup.zero_stage == 1:
        return [CommTerm(f"{prefix}gradient_reduce_scatter", group, r * psi * g_bytes, 1),
                CommTerm(f"{prefix}parameter_allgather", group, r * psi * p_bytes, 1)]
    if setup.zero_stage == 2:
        return [CommTerm(f"{prefix}gradient_reduce_scatter", group, m * r * psi * g_bytes, m),
                CommTerm(f"{prefix}parameter_allgather", group, r * psi * p_bytes, 1)]
    return [CommTerm(f"{prefix}zero3_parameter_allgather_forward", group, m * r * psi * p_bytes, m),
            CommTerm(f"{prefix}zero3_parameter_allgather_backward", group, m * r * psi * p_bytes, m),
            CommTerm(f"{prefix}gradient_reduce_scatter", group, m * r * psi * g_bytes, m)]


def _context_term(spec: ModelSpec, setup: Setup, stage: int, w: float) -> CommTerm:
    """The context attention's bytes per step on one rank (see :func:`communication_per_rank`)."""
    c, t, m = setup.cp, setup.tp, setup.micro_batches
    layers = spec.layers_on_stage(stage, setup.pp)
    forwards = 2 if setup.recompute in ("full", "selective") else 1  # selective checkpoints the context attention whole
    n_b = spec.seq_len // c * setup.micro_batch
    kv = 2 * n_b * spec.hidden * spec.kv / spec.heads / t  # keys and values of this rank, kv heads
    if setup.cp_method == "ring":
        per_block = (forwards + 1) * (c - 1) * kv * w + c * kv * 4
        calls = (forwards + 1) * (c - 1) + c
        return CommTerm("context_ring_kv", "context", m * layers * per_block, m * layers * calls)
    q = n_b * spec.hidden / t  # queries and the output: all heads
    per_block = (forwards + 1) * ring_factor(c) * (2 * q + kv) * w
    return CommTerm("context_all_to_all", "context", m * layers * per_block, m * layers * 4 * (forwards + 1))
