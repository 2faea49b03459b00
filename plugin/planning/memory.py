"""Per-rank memory of a training layout, from the published formulas (pure); its communication is
:mod:`plugin.communication`.

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
from dataclasses import dataclass
from typing import Optional

from ..dims import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


# ============================================================== model states (ZeRO paper)
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


# ============================================================== activations (Korthikanti et al. 2022)
def activation_terms_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               kv_heads: Optional[int] = None, ffn_hidden: Optional[int] = None,
                               mlp: str = "gelu", bytes_per_value: float = 2,
                               fused_attention: bool = False, dropout: bool = True,
                               fused_swiglu: bool = True) -> list[tuple[str, float]]:
    """The stored activations of one transformer block for one micro-batch, each tensor named, in bytes.

    Korthikanti et al. 2022, Section 4.1, tensor by tensor (16-bit values, 1-byte dropout masks). With
    kv_heads = heads, ffn_hidden = 4h and a GELU MLP the sums are the paper's Table 2; ``kv_heads``,
    ``ffn_hidden`` and ``mlp="swiglu"`` generalise the same count. SwiGLU, silu(x W_gate) * (x W_up), stores
    the gate and up outputs (4sbf) and the down projection's input (2sbf), 6sbf in all: a fused kernel
    (Megatron's ``bias_swiglu_impl``, which recomputes silu in backward). Eager PyTorch (``F.silu(gate) * up``,
    as in transformers' ``LlamaMLP``) also keeps silu(gate) for the multiplication's backward, 2sbf more
    (8sbf): ``fused_swiglu=False`` counts it (``bench/activations_vs_torch.py`` measures both).
    Tensor parallelism divides the tensors inside the attention and MLP regions by t; sequence
    parallelism divides the rest (norm inputs, the QKV and fc1 inputs, dropout masks) by t as well.
    Selective recompute drops the attention core (softmax, its dropout, the 5as^2b terms); full recompute
    keeps only the block's input, 2sbh (sequence-sharded, so 2sbh/t, under sequence parallelism).
    Dropout is on, as in the paper; ``dropout=False`` (probability 0) drops the three masks and the
    separate post-dropout attention probabilities. ``fused_attention`` (FlashAttention, or torch's
    ``scaled_dot_product_attention`` on its fused kernels) never stores the softmax: the 5as^2b terms go,
    as under selective recompute, at no recompute cost of its own.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    g = kv_heads if kv_heads is not None else heads
    f = ffn_hidden if ffn_hidden is not None else 4 * hidden
    w = bytes_per_value / 2  # the paper's 2-byte terms scale with the value size; masks stay 1 byte
    rep = t if sequence_parallel else 1  # the regions tensor parallelism leaves whole
    sbh = s * b * h
    if recompute == "full":
        return [("layer_input", 2 * w * sbh / rep)]
    terms = [
        ("attn_norm_input", 2 * w * sbh / rep),
        ("qkv_input", 2 * w * sbh / rep),
        ("q_and_k", 2 * w * sbh * (1 + g / a) / t),
    ]
    if recompute == "none" and not fused_attention:
        terms.append(("softmax_output", 2 * w * a * s * s * b / t))
        if dropout:
            terms += [
                ("softmax_dropout_mask", a * s * s * b / t),
                ("attention_probs_after_dropout", 2 * w * a * s * s * b / t),
            ]
    terms += [
        ("v", 2 * w * sbh * (g / a) / t),
        ("attn_proj_input", 2 * w * sbh / t),
        ("attn_dropout_mask", sbh / rep if dropout else 0.0),
        ("mlp_norm_input", 2 * w * sbh / rep),
        ("fc1_input", 2 * w * sbh / rep),
    ]
    if mlp == "swiglu":
        terms.append(("gate_and_up_outputs", 4 * w * s * b * f / t))
        if not fused_swiglu:
            terms.append(("silu_output", 2 * w * s * b * f / t))
    else:
        terms.append(("gelu_input", 2 * w * s * b * f / t))
    terms += [
        ("fc2_input", 2 * w * s * b * f / t),
        ("mlp_dropout_mask", sbh / rep if dropout else 0.0),
    ]
    return [(k, v) for k, v in terms if v or dropout]


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               kv_heads: Optional[int] = None, ffn_hidden: Optional[int] = None,
                               mlp: str = "gelu", bytes_per_value: float = 2,
                               fused_attention: bool = False, dropout: bool = True,
                               fused_swiglu: bool = True) -> float:
    """Activation bytes of one transformer block for one micro-batch: Korthikanti et al. 2022, Table 2.

    ==========================================  =========================
    no parallelism                              sbh(34 + 5as/h)
    tensor parallel                             sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel                  sbh/t (34 + 5as/h)
    tensor parallel + selective recompute       sbh(10 + 24/t)
    tensor + sequence + selective recompute     sbh(34/t)
    full recompute                              2sbh  (2sbh/t under sequence parallelism)
    ==========================================  =========================

    The extra keywords (GQA ``kv_heads``, ``ffn_hidden``, ``mlp="swiglu"``, ``bytes_per_value=4`` for fp32)
    generalise the count; left at their defaults the result is the table's formula exactly.
    ``fused_attention=True`` drops the 5as/h terms (FlashAttention stores no softmax); ``dropout=False``
    the dropout masks (and 3as/h of the 5as/h); ``fused_swiglu=False`` counts eager SwiGLU (8sbf, not 6sbf).
    See :func:`activation_terms_per_layer` for the tensors.
    """
    return sum(v for _, v in activation_terms_per_layer(
        seq_len, micro_batch, hidden, heads, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
        kv_heads=kv_heads, ffn_hidden=ffn_hidden, mlp=mlp, bytes_per_value=bytes_per_value,
        fused_attention=fused_attention, dropout=dropout, fused_swiglu=fused_swiglu))


# ============================================================== pipeline
def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle time over ideal time of a pipeline flush: (p-1)/m, or (1/v)(p-1)/m interleaved.

    Narayanan et al. 2021, Section 2.2.1 (GPipe and 1F1B have the same bubble) and 2.2.2 (interleaved
    schedule with v model chunks per device).
    """
    if pp < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pp, micro_batches and virtual_stages must be >= 1, got {pp}, {micro_batches}, "
                         f"{virtual_stages}")
    return (pp - 1) / (virtual_stages * micro_batches)


def micro_batches_in_flight(stage: int, pp: int, micro_batches: int, schedule: str = "1f1b",
                            virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of one micro-batch through the
    whole stage (all its layers).

    - 1F1B: stage i warms up with p - i forward passes before its first backward (Korthikanti et al.
      2022, 4.2.3: the first stage holds p); never more than m.
    - GPipe: all m forwards before any backward.
    - interleaved 1F1B (v model chunks per rank, each 1/v of the stage): rank i runs
      W_i = (v - 1) g + 2(p - 1 - i) chunk forwards before its first backward, then one forward before each
      backward, so it holds W_i + 1 chunks (all m v when W_i reaches m v): (W_i + 1)/v micro-batches.
      g is the micro-batches per round: torch.distributed.pipelining's ``ScheduleInterleaved1F1B``
      (``_get_warmup_ops``, torch 2.13) takes g = m / max(1, m // p), which is p when p divides m; Megatron-LM
      (``get_pp_rank_microbatches``) takes g = ``microbatch_group_size_per_vp_stage``, p by default. The
      first stage holds p + (p-1)/v, Megatron's ``theoretical_memory_usage.py`` factor p(1 + (p-1)/(pv));
      the last holds p - (p-1)/v, not 1: every rank keeps (v-1)/v of a round in flight. (Megatron runs
      m = p entirely as warm-up, p micro-batches on every stage; torch caps W_i at m v as above.)
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "interleaved_1f1b":
        v = virtual_stages
        per_round = micro_batches // max(1, micro_batches // pp)
        chunks = micro_batches * v
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - stage), chunks)
        return min(warmup + 1, chunks) / v
    return float(min(micro_batches, pp - stage))


# ============================================================== a layout
@dataclass(frozen=True)
class Setup:
    """A layout as the estimates see it: degrees, batch, memory savers, precision."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
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
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp

    @property
    def bytes_per_value(self) -> float:
        return 4.0 if self.precision == "fp32" else 2.0

    def state_bytes(self) -> tuple[float, float, float]:
        return state_bytes_per_param(self.precision, self.optimizer, self.momentum, self.zero_stage)

    def label(self) -> str:
        """``tp2 pp1 dp4 zero1 mb4x8 sp full``: a layout in one short line."""
        out = f"tp{self.tp} pp{self.pp} dp{self.dp} zero{self.zero_stage} mb{self.micro_batch}x{self.micro_batches}"
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


# ============================================================== memory per rank
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
    p, g, k = setup.state_bytes()
    return model_state_terms(spec.stage_params(stage, setup.pp, setup.tp), dp=setup.dp,
                             zero_stage=setup.zero_stage, param_bytes=p, grad_bytes=g, optimizer_bytes=k)


def stage_memory(spec: ModelSpec, setup: Setup, stage: int) -> Breakdown:
    """Peak accelerator bytes of one rank on pipeline stage ``stage``, term by term."""
    s, b, h, t = spec.seq_len, setup.micro_batch, spec.hidden, setup.tp
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
    if setup.zero_stage == 3 and setup.dp > 1:
        # ZeRO-3 gathers each module whole (over dp) before use: the largest one's parameters and
        # gradients, DeepSpeed's own estimate (4 x largest_layer_params at 16 bits).
        terms.append(("zero3_gathered_module", (p_bytes + g_bytes) * spec.largest_layer_params() / t))

    layers = spec.layers_on_stage(stage, setup.pp)
    in_flight = micro_batches_in_flight(stage, setup.pp, setup.micro_batches, setup.schedule, setup.virtual_stages)

    def per_layer(mode: str) -> float:
        return activation_bytes_per_layer(s, b, h, spec.heads, tp=t, sequence_parallel=sp, recompute=mode,
                                          kv_heads=spec.kv, ffn_hidden=spec.ffn, mlp=spec.mlp,
                                          bytes_per_value=setup.bytes_per_value,
                                          fused_attention=setup.fused_attention, dropout=setup.dropout,
                                          fused_swiglu=setup.fused_swiglu)

    if setup.recompute == "full":
        k = max(1, min(setup.checkpoint_interval, layers or 1))
        checkpoints = math.ceil(layers / k)
        terms.append(("activations", in_flight * checkpoints * per_layer("full")))
        # Backward recomputes one checkpointed span at a time: its full activations live meanwhile.
        terms.append(("recompute_working_set", k * per_layer("none") if layers else 0.0))
    else:
        terms.append(("activations", in_flight * layers * per_layer(setup.recompute)))

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


# The rest of the estimate lives in modules of its own, reachable from here too (loaded on first use: they
# import this module): bytes sent per rank, and the whole per-rank estimate of a recipe.
_ELSEWHERE = {"communication_per_rank": "communication", "CommTerm": "communication", "ring_factor": "communication",
              "estimate_recipe": "recipe_estimate", "RecipeEstimate": "recipe_estimate"}


def __getattr__(name: str):
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(f"plugin.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module 'plugin.planning.memory' has no attribute {name!r}")
