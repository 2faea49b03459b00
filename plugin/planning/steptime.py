"""A roofline estimate of one optimizer step's time for a layout (pure).

The model, term by term (all per optimizer step, on the slowest pipeline stage):

- compute: model FLOPs at ``Hardware.matmul_efficiency`` of the peak. Per token, a block costs
  2 x its matmul weights forward plus 4sh for attention (QK^T and attention x V), the output layer 2hV;
  backward costs twice the forward, so training is the usual 6 x params x tokens plus 12 L s h x tokens
  (Narayanan et al. 2021, Appendix, eq. 3). Tensor parallelism divides a rank's share by t.
- recompute: full recompute runs each block's forward again (x 8/6 on the blocks); selective recompute
  only the attention core, 4bs^2h per block (Korthikanti et al. 2022, Section 5), which a fused kernel without
  a context axis recomputes in its backward anyway (no extra); a context attention under selective recompute
  runs its whole forward again, core and K/V traffic (the reference GPT's :class:`plugin.models.gpt.Attention`
  checkpoints it).
- context communication (a context axis): the attention's K/V ring or all-to-alls of
  :func:`plugin.planning.traffic.communication_per_rank`; the ring's hidden under the attention core's compute
  (forward, backward, and the recompute's forward), the all-to-alls on the critical path. Compute, recompute
  and the data-parallel terms divide by the context degree as by the data degree (each context rank computes
  s/cp tokens).
- tensor communication: the all-reduces of :func:`plugin.planning.traffic.communication_per_rank`, on the
  critical path (Megatron does not overlap them), over NVLink when the tensor group is inside a node.
- pipeline bubble: (p-1)/m (or /v interleaved) of the pipelined time (Narayanan et al. 2021, 2.2), and
  the point-to-point sends, two per schedule slot, on the critical path.
- data-parallel communication, exposed part, as DeepSpeed runs it (the engine ``launcher: "auto"``
  picks where DeepSpeed is installed, except for a context axis, which the native back end trains: the same
  terms there, an upper bound) with the ``zero_optimization`` the plugin writes, where
  ``overlap_comm`` keeps DeepSpeed's default, off at ZeRO 0-2 and on at ZeRO-3 (``zero/config.py``,
  ``overlap_comm_valid``), DeepSpeed 0.19.8:
  ZeRO-0 all-reduces the gradients after the last backward (``engine.allreduce_gradients`` from
  ``_backward_epilogue``), all of it exposed; ZeRO-1 reduces them at the accumulation boundary in the same
  place (``reduce_gradients``), exposed; ZeRO-2 reduces each bucket from the gradient hooks during every
  micro-batch's backward, but without ``overlap_comm`` on the compute stream, so it waits for it: all m
  reductions exposed; the ZeRO-1/2 all-gather of the updated parameters after the step is exposed.
  ZeRO-3 (``overlap_comm`` on) prefetches its gathers and reduces on a side stream under each
  micro-batch's compute, except one module's worth per pass (the first gather has nothing to hide behind,
  the last bucket waits). With pp > 1 DeepSpeed's PipelineEngine reduces after the flush: exposed.
  torch DDP (the native engine under torchrun or accelerate) overlaps its bucketed all-reduce with the
  last backward instead: for it the ZeRO-0 term here is an upper bound.
- tied embeddings over pipeline stages: the embedding-gradient all-reduce between the first and the last
  stage, once per step after the flush, exposed.
- optimizer step: the sharded Adam update reads and writes about 28 bytes per parameter (fp32 master,
  two moments, the gradient, the new 16-bit weight), at HBM bandwidth.

A collective costs ``latency`` per call plus its bytes over the link bandwidth of its group: NVLink when
the whole group is inside one node, else the per-GPU InfiniBand share. Rank order is the plugin's (tensor
fastest, then context, then data, then pipeline), so placement follows from the degrees and ``gpus_per_node``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelSpec
from .schedule import bubble_fraction
from .setup import Setup
from .traffic import communication_per_rank


@dataclass(frozen=True)
class Hardware:
    """What the roofline assumes of one accelerator and its links (numbers are nominal, per GPU)."""

    name: str = "H100 SXM"
    peak_flops: float = 989e12  # dense 16-bit tensor-core FLOP/s (fp32 runs as TF32 at half of it)
    matmul_efficiency: float = 0.6  # fraction of the peak the matmuls reach
    intra_node_bw: float = 450e9  # B/s per GPU per direction: NVLink 4, 900 GB/s bidirectional
    inter_node_bw: float = 50e9  # B/s per GPU per direction: one 400 Gb/s InfiniBand NDR NIC per GPU
    intra_node_latency: float = 10e-6  # s per collective or send
    inter_node_latency: float = 30e-6
    hbm_bw: float = 3.35e12  # B/s, for the optimizer step

    def describe(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.0f} TFLOP/s 16-bit peak at "
                f"{self.matmul_efficiency:.0%}, NVLink {self.intra_node_bw / 1e9:.0f} GB/s and InfiniBand "
                f"{self.inter_node_bw / 1e9:.0f} GB/s per GPU")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


HARDWARE = {
    "h100": Hardware(),
    "a100": Hardware(name="A100 SXM", peak_flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9,
                     hbm_bw=2.0e12),
    "h200": Hardware(name="H200 SXM", hbm_bw=4.8e12),  # H100's compute and NVLink, faster HBM3e
}


# ------------------------------------------------------------------ placement
def _blocks_inside(block: int, count: int, gpus_per_node: int) -> bool:
    """Whether ``count`` consecutive blocks of ``block`` ranks (from rank 0) each lie inside one node."""
    if block <= 1:
        return True
    if block > gpus_per_node:
        return False
    if gpus_per_node % block == 0:
        return True
    return all((k * block) // gpus_per_node == (k * block + block - 1) // gpus_per_node for k in range(count))


def group_inside_node(axis: str, setup: Setup, gpus_per_node: int) -> bool:
    """Whether every ``axis`` ("tensor", "context", "data", "pipeline") group lies inside one node.

    Rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank (:mod:`plugin.distributed.topology`): a tensor
    group is a block of tp consecutive ranks, the context groups interleave in a block of tp x cp, the data groups
    of one pipeline stage (data x context with a context axis, the gradients' group) in a block of tp x cp x dp, and
    pipeline neighbours are tp x cp x dp apart, so they share a node only when the whole world does.
    """
    t, c, d, p = setup.tp, setup.cp, setup.dp, setup.pp
    if axis == "tensor":
        return _blocks_inside(t, c * d * p, gpus_per_node)
    if axis == "context":
        return c == 1 or _blocks_inside(t * c, d * p, gpus_per_node)
    if axis == "data":
        return d * c == 1 or _blocks_inside(t * c * d, p, gpus_per_node)
    if axis == "pipeline":
        return p == 1 or t * c * d * p <= gpus_per_node
    if axis == "expert":  # ep consecutive data x context coordinates of the expert tensor degree's ranks each
        etp = t if setup.etp is None else setup.etp
        return setup.ep == 1 or _blocks_inside(etp * setup.ep, t * c * d * p // (etp * setup.ep), gpus_per_node)
    if axis == "expert_data":  # spread over the stage, as the data groups
        return d * c == 1 or _blocks_inside(t * c * d, p, gpus_per_node)
    raise ValueError(f"unknown axis {axis!r}")


# ------------------------------------------------------------------ time
@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by term, and what follows from them."""

    terms: tuple[tuple[str, float], ...]
    tokens_per_step: int
    model_flops: float  # per step, all ranks, without recompute
    world_size: int
    peak_flops: float

    @property
    def total(self) -> float:
        return sum(v for _, v in self.terms)

    def get(self, name: str) -> float:
        return sum(v for k, v in self.terms if k == name)

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the peak of all GPUs."""
        return self.model_flops / self.total / (self.world_size * self.peak_flops)

    def to_json(self) -> dict:
        return {"total": self.total, "terms": dict(self.terms), "tokens_per_second_per_gpu":
                self.tokens_per_second_per_gpu, "mfu": self.mfu}


def forward_flops(spec: ModelSpec, setup: Setup, stage: int) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs of one micro-batch on one rank of ``stage``: a context rank computes
    1/cp of both (its s/cp tokens; the balanced chunks give it 1/cp of the causal core)."""
    s, b = spec.seq_len, setup.micro_batch
    tokens = s * b
    layers = spec.layers_on_stage(stage, setup.pp)
    matmul = 2 * tokens * layers * spec.layer_matmul_params()
    if stage == setup.pp - 1:
        matmul += 2 * tokens * spec.hidden * spec.vocab
    core = layers * 4 * b * s * s * spec.hidden
    return matmul / (setup.tp * setup.cp), core / (setup.tp * setup.cp)


def model_flops_per_step(spec: ModelSpec, setup: Setup) -> float:
    """6 x matmul params x tokens + 12 L s h x tokens: the FLOPs MFU counts (no recompute)."""
    tokens = setup.global_batch * spec.seq_len
    per_token = 6 * (spec.layers * spec.layer_matmul_params() + spec.hidden * spec.vocab) \
        + 12 * spec.layers * spec.seq_len * spec.hidden
    return per_token * tokens


def _comm_seconds(terms, setup: Setup, hw: Hardware, gpus_per_node: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for term in terms:
        inside = group_inside_node(term.group, setup, gpus_per_node)
        bw = hw.intra_node_bw if inside else hw.inter_node_bw
        latency = hw.intra_node_latency if inside else hw.inter_node_latency
        out[term.name] = term.bytes / bw + term.calls * latency
    return out


def _stage_time(spec: ModelSpec, setup: Setup, hw: Hardware, gpus_per_node: int, stage: int) -> dict[str, float]:
    """Per-micro-batch seconds of one stage: compute, recompute, tensor communication; plus its comm."""
    rate = hw.peak_flops * hw.matmul_efficiency * (0.5 if setup.precision == "fp32" else 1.0)
    matmul, core = forward_flops(spec, setup, stage)
    fwd = (matmul + core) / rate
    if setup.recompute == "full":
        layers_share = (2 * spec.seq_len * setup.micro_batch * spec.layers_on_stage(stage, setup.pp)
                        * spec.layer_matmul_params() / (setup.tp * setup.cp) + core)
        extra = layers_share / rate
    elif setup.recompute == "selective" and (setup.cp > 1 or not setup.fused_attention):
        # (a fused attention kernel recomputes its core in backward anyway; a checkpointed context attention runs
        # its whole forward again, its ring or all-to-alls included: traffic counts that forward twice)
        extra = core / rate
    else:
        extra = 0.0
    comm = _comm_seconds(communication_per_rank(spec, setup, stage), setup, hw, gpus_per_node)
    m = setup.micro_batches
    tensor = sum(v for k, v in comm.items() if k.startswith("tensor_parallel")) / m
    # Ring attention sends each block while it computes the one it holds: only what the core's compute (forward,
    # backward) does not cover is exposed; Ulysses's all-to-alls sit on the critical path.
    context = sum(v for k, v in comm.items() if k.startswith("context_")) / m
    if setup.cp_method == "ring":
        cores = 4 if setup.recompute in ("full", "selective") else 3  # forward, backward (2x), the recompute's forward
        context = max(0.0, context - cores * core / rate)
    expert = comm.get("expert_all_to_all", 0.0) / m  # on the critical path, as Ulysses's all-to-alls
    return {"forward": fwd, "backward": 2 * fwd, "recompute": extra, "tensor": tensor, "context": context,
            "expert": expert, "comm": comm}


def step_time(spec: ModelSpec, setup: Setup, hw: Hardware = HARDWARE["h100"], gpus_per_node: int = 8) -> StepTime:
    """The roofline step time of ``setup`` (see the module docstring for each term)."""
    p, m = setup.pp, setup.micro_batches
    stages = [0] if p == 1 else [0, p - 1]
    times = {st: _stage_time(spec, setup, hw, gpus_per_node, st) for st in stages}

    def slot(st: int) -> float:
        x = times[st]
        return x["forward"] + x["backward"] + x["recompute"] + x["tensor"] + x["context"] + x["expert"]

    worst = max(stages, key=slot)
    x = times[worst]
    per_mb = slot(worst)
    bubble = bubble_fraction(p, m, setup.virtual_stages if setup.schedule == "interleaved_1f1b" else 1)
    terms = [
        ("compute", m * (x["forward"] + x["backward"])),
        ("recompute", m * x["recompute"]),
        ("tensor_communication", m * x["tensor"]),
        ("pipeline_bubble", bubble * m * per_mb),
    ]
    if setup.cp > 1:
        terms.insert(3, ("context_communication", m * x["context"]))
    if x["expert"]:
        terms.insert(3, ("expert_communication", m * x["expert"]))
    comm = x["comm"]
    if p > 1:
        hops = comm.get("pipeline_send_activations", 0.0) or comm.get("pipeline_send_gradients", 0.0)
        # Two sends per schedule slot (an activation forward, a gradient backward), m + p - 1 slots.
        terms.append(("pipeline_p2p", 2 * (m + p - 1) * hops / m))
    if "tied_embedding_grad_allreduce" in comm:
        terms.append(("embedding_allreduce", comm["tied_embedding_grad_allreduce"]))
    module = _module_seconds(spec, setup, hw, gpus_per_node)
    terms.append(("data_parallel_exposed", _exposed_data_comm(setup, comm, x, module)))
    terms.append(("optimizer_step", _optimizer_seconds(spec, setup, hw)))
    return StepTime(tuple(terms), tokens_per_step=setup.global_batch * spec.seq_len,
                    model_flops=model_flops_per_step(spec, setup), world_size=setup.world_size,
                    peak_flops=hw.peak_flops)


def _module_seconds(spec: ModelSpec, setup: Setup, hw: Hardware, gpus_per_node: int) -> float:
    """One all-gather (or reduce-scatter) of the largest module over the data group: the part of each
    ZeRO-3 pass that no prefetch or bucketing can hide (the first gather, the last bucket)."""
    if setup.replicas == 1:
        return 0.0
    inside = group_inside_node("data", setup, gpus_per_node)
    bw = hw.intra_node_bw if inside else hw.inter_node_bw
    latency = hw.intra_node_latency if inside else hw.inter_node_latency
    value_bytes = setup.state_bytes()[0]
    return (setup.replicas - 1) / setup.replicas * spec.largest_layer_params() / setup.tp * value_bytes / bw + latency


def _exposed_data_comm(setup: Setup, comm: dict[str, float], x: dict, module: float) -> float:
    """Data-parallel seconds compute does not hide, as DeepSpeed runs each stage (module docstring)."""
    m = setup.micro_batches
    if setup.zero_stage == 0:
        return comm.get("gradient_allreduce", 0.0)
    if setup.zero_stage in (1, 2):  # ZeRO-2: the m reduce-scatters are summed in the one term
        return comm.get("gradient_reduce_scatter", 0.0) + comm.get("parameter_allgather", 0.0)
    # ZeRO-3: gathers prefetched under the compute of each pass, except the first module's.
    fwd, bwd = x["forward"], x["backward"] + x["recompute"]
    gather_f = comm.get("zero3_parameter_allgather_forward", 0.0) / m
    gather_b = comm.get("zero3_parameter_allgather_backward", 0.0) / m
    scatter = comm.get("gradient_reduce_scatter", 0.0) / m
    return m * (max(module, gather_f - fwd) + max(2 * module, gather_b + scatter - bwd))


def _optimizer_seconds(spec: ModelSpec, setup: Setup, hw: Hardware) -> float:
    params = spec.stage_params(0, setup.pp, setup.tp) / (setup.replicas if setup.zero_stage >= 1 else 1)
    return params * 28 / hw.hbm_bw
