"""Per-rank memory of a training layout, from the published formulas (pure); its communication is
:mod:`plugin.planning.traffic`. Its parts: :mod:`.model_states` (ZeRO), :mod:`.activations` (per block),
:mod:`.schedule` (micro-batches in flight), on the layout of :mod:`.setup`.

Units: bytes throughout; the CLI prints GB = 10^9 bytes. Symbols follow the papers: s sequence length,
b micro-batch, h hidden, a heads, t tensor size, p pipeline size, m micro-batches per step, v virtual
stages, N_d data-parallel size, Psi parameters, K optimizer bytes per parameter.

Sources:
- ZeRO: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  Section 5 and Figure 1 (model states per device at each stage).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Section 4 and Table 2 (activation bytes per layer), Section 4.2.3 (pipeline: the first stage holds p
  micro-batches under 1F1B), Section 4.3 (embedding and output-layer terms).
- Pipeline bubble: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", Section 2.2 ((p-1)/m, and (1/v)(p-1)/m interleaved).

Not counted (the fit verdict keeps a reserve for them, see :func:`usable_memory`): the CUDA context,
NCCL and cuBLAS workspaces, DeepSpeed's communication buckets (``reduce_bucket_size``, 5e8 elements by
default), temporary buffers and allocator fragmentation.
"""
from __future__ import annotations

import math

from .activations import activation_bytes_per_layer
from .dims import ModelSpec
from .model_states import ModelStates, model_state_terms
from .schedule import micro_batches_in_flight
from .setup import Breakdown, Setup


def expected_model_states(spec: ModelSpec, setup: Setup, stage: int = 0) -> ModelStates:
    """Parameters, gradients and optimizer states one rank of ``stage`` holds on the accelerator.

    The quantity to compare with what an engine's ranks really allocate (issue 6, item 5): the stage's
    parameters on one tensor rank (:meth:`ModelSpec.stage_params`), sharded by ZeRO over ``dp``. What is
    offloaded counts 0 here (see :func:`host_model_states`): optimizer states with ``offload_optimizer``,
    and with them the gradient partitions at stages 2 and 3 (ZeRO-Offload, Ren et al. 2021, Section 4.1:
    gradients go to the CPU after the reduce-scatter); parameters with ``offload_param`` (ZeRO-Infinity).

    This is the steady state of the backward pass. DeepSpeed's ZeRO-1/2 step also converts the gradient
    partition to fp32 (4 Psi / N_d), but only after the 16-bit gradients and the activations are freed
    (``stage_1_and_2.py``, ``step``), so it does not raise the peak; DeepSpeed's own estimator adds it.
    """
    states = _all_model_states(spec, setup, stage)
    grads_away = setup.offload_optimizer and setup.zero_stage >= 2
    return ModelStates(parameters=0.0 if setup.offload_param else states.parameters,
                       gradients=0.0 if grads_away else states.gradients,
                       optimizer_states=0.0 if setup.offload_optimizer else states.optimizer_states)


def host_model_states(spec: ModelSpec, setup: Setup, stage: int = 0) -> ModelStates:
    """The part of one rank's model states offloaded to host memory (zeros without offload)."""
    states = _all_model_states(spec, setup, stage)
    grads_away = setup.offload_optimizer and setup.zero_stage >= 2
    return ModelStates(parameters=states.parameters if setup.offload_param else 0.0,
                       gradients=states.gradients if grads_away else 0.0,
                       optimizer_states=states.optimizer_states if setup.offload_optimizer else 0.0)


def _all_model_states(spec: ModelSpec, setup: Setup, stage: int) -> ModelStates:
    """The stage's parameters sharded by ZeRO over data x context; with an expert axis its experts (1/ep of them on
    each rank) over the expert-data group instead."""
    p, g, k = setup.state_bytes()
    etp = setup.tp if setup.etp is None else setup.etp
    experts = spec.stage_expert_params(stage, setup.pp, setup.ep, etp)
    dense = model_state_terms(spec.stage_params(stage, setup.pp, setup.tp, setup.ep, etp) - experts,
                              dp=setup.replicas, zero_stage=setup.zero_stage, param_bytes=p, grad_bytes=g,
                              optimizer_bytes=k)
    if not experts:
        return dense
    moe = model_state_terms(experts, dp=setup.expert_replicas, zero_stage=setup.zero_stage, param_bytes=p,
                            grad_bytes=g, optimizer_bytes=k)
    return ModelStates(parameters=dense.parameters + moe.parameters, gradients=dense.gradients + moe.gradients,
                       optimizer_states=dense.optimizer_states + moe.optimizer_states)


def stage_memory(spec: ModelSpec, setup: Setup, stage: int) -> Breakdown:
    """Peak accelerator bytes of one rank on pipeline stage ``stage``, term by term."""
    # A context rank holds seq_len / cp tokens of every row: every activation term is linear in them. Ring attention
    # stores no score matrix (its backward recomputes each block from the log-sum-exp), so its core is counted as
    # fused; Ulysses runs the whole sequence on heads / cp: a*C heads over s/C tokens give its a s^2 / C core.
    s, b, h, t = spec.seq_len // setup.cp, setup.micro_batch, spec.hidden, setup.tp
    sp = setup.sequence_parallel
    w = setup.bytes_per_value / 2
    rep = t if sp else 1
    states = expected_model_states(spec, setup, stage)
    terms: list[tuple[str, float]] = [
        ("parameters", states.parameters),
        ("gradients", states.gradients),
        ("optimizer_states", states.optimizer_states),
    ]
    p_bytes, g_bytes, _ = setup.state_bytes()
    if setup.zero_stage == 3 and setup.replicas > 1:
        # ZeRO-3 gathers each module whole (over dp) before use: the largest one's parameters and
        # gradients, DeepSpeed's own estimate (4 x largest_layer_params at 16 bits).
        terms.append(("zero3_gathered_module", (p_bytes + g_bytes) * spec.largest_layer_params() / t))

    layers = spec.layers_on_stage(stage, setup.pp)
    in_flight = micro_batches_in_flight(stage, setup.pp, setup.micro_batches, setup.schedule, setup.virtual_stages)

    ulysses = setup.cp if setup.cp > 1 and setup.cp_method == "all_to_all" else 1
    fused = setup.fused_attention or (setup.cp > 1 and setup.cp_method == "ring")

    def per_layer(mode: str) -> float:
        return activation_bytes_per_layer(s, b, h, spec.heads * ulysses, tp=t, sequence_parallel=sp, recompute=mode,
                                          kv_heads=spec.kv * ulysses, ffn_hidden=spec.ffn, mlp=spec.mlp,
                                          bytes_per_value=setup.bytes_per_value,
                                          fused_attention=fused, dropout=setup.dropout,
                                          fused_swiglu=setup.fused_swiglu)

    if setup.recompute == "full":
        k = max(1, min(setup.checkpoint_interval, layers or 1))
        checkpoints = math.ceil(layers / k)
        terms.append(("activations", in_flight * checkpoints * per_layer("full")))
        # Backward recomputes one checkpointed span at a time: its full activations live meanwhile.
        terms.append(("recompute_working_set", k * per_layer("none") if layers else 0.0))
    else:
        terms.append(("activations", in_flight * layers * per_layer(setup.recompute)))
    if setup.cp > 1 and setup.recompute == "none":
        # What the context attention keeps beyond the block's count (bench/context_parallel.py measures it): its
        # output, which the projection's input is a copy of (the ring's is laid out by head; Ulysses's SDPA output
        # sits before the all-to-all back, and the all-to-all's result is copied again), and the fp32 log-sum-exp.
        copies = 1 if setup.cp_method == "ring" else 2
        kept = copies * 2 * w * s * b * h / t + 4 * spec.heads * s * b / t
        terms.append(("context_attention_outputs", in_flight * layers * kept))

    if stage == 0:
        # Korthikanti et al. 4.3: the embedding's dropout mask (sbh, 1 byte) per micro-batch in flight,
        # plus the int64 token ids (8sb) Megatron's theoretical_memory_usage.py adds.
        mask = s * b * h / rep if setup.dropout else 0.0
        terms.append(("embedding_activations", in_flight * (mask + 8 * s * b)))
    if stage == setup.pp - 1:
        # Korthikanti et al. 4.3: final norm input and output-projection input (2sbh each, /t with SP) and
        # the fp32 logits for the cross entropy, 4sbv/t (vocab-parallel); one micro-batch at a time.
        v = spec.padded_vocab(t)
        terms.append(("output_layer_activations", 4 * w * s * b * h / rep + 4 * s * b * v / t))
    return Breakdown(tuple(terms), stage=stage)


def memory_per_rank(spec: ModelSpec, setup: Setup) -> Breakdown:
    """The most loaded rank's memory: the larger of the first and last pipeline stage."""
    first = stage_memory(spec, setup, 0)
    if setup.pp == 1:
        return first
    last = stage_memory(spec, setup, setup.pp - 1)
    return first if first.total >= last.total else last


def usable_memory(gpu_memory: float) -> tuple[float, float]:
    """(usable bytes, reserve) of an accelerator with ``gpu_memory`` bytes.

    The reserve, 1 GB + 5 % of the memory, stands for what :func:`memory_per_rank` does not count: the
    CUDA context and NCCL/cuBLAS workspaces (about 1 GB) and allocator fragmentation and temporary
    buffers (the 5 %, the overhead Megatron's ``theoretical_memory_usage.py`` adds).
    """
    reserve = 1e9 + 0.05 * gpu_memory
    return gpu_memory - reserve, reserve
