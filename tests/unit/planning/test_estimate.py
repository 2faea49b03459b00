"""The estimates against the papers' published numbers and formulas.

ZeRO (Rajbhandari et al. 2020): Figure 1 and Table 1. Korthikanti et al. 2022: Table 2. Narayanan et al.
2021: the bubble and the Table 1 model sizes. Megatron-LM's theoretical_memory_usage.py: the activation
total with sequence parallelism. GB = 10^9 bytes throughout, as in the ZeRO paper.
"""
from __future__ import annotations

import dataclasses
import decimal

import pytest

from plugin.planning.activations import activation_bytes_per_layer, activation_terms_per_layer
from plugin.planning.dims import ModelSpec
from plugin.planning.memory import (
    expected_model_states,
    host_model_states,
    memory_per_rank,
    stage_memory,
    usable_memory,
)
from plugin.planning.model_states import model_state_bytes, model_state_terms, state_bytes_per_param
from plugin.planning.presets import get_preset
from plugin.planning.schedule import bubble_fraction, micro_batches_in_flight
from plugin.planning.setup import Setup
from plugin.planning.traffic import communication_per_rank

GB = 1e9


# ---------------------------------------------------------------- ZeRO, Figure 1
def test_zero_figure_1():
    """Psi = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB, with GB = 10^9 bytes."""
    exact = [model_state_bytes(7.5e9, dp=64, zero_stage=k) for k in range(4)]
    assert exact == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [round(x / GB, 1) for x in exact] == [120.0, 31.4, 16.6, 1.9]
    # In GiB the baseline would read 111.8: the paper's GB are 10^9 bytes.
    assert round(exact[0] / 2**30, 1) == 111.8


# ---------------------------------------------------------------- ZeRO, Table 1
# Per-device memory (GB) for P_os, P_os+g, P_os+g+p, as printed in the paper's Table 1.
TABLE_1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}


def _printed(value: float, like: str) -> set[str]:
    """The ways the paper prints ``value`` with the digits of ``like``: rounded half up, or truncated.

    The table mixes the two: 41.25 prints as 41.3 (rounded), 4187.5 as 4187 and 2218.75 as 2218 (truncated).
    """
    places = decimal.Decimal(like).as_tuple().exponent
    quantum = decimal.Decimal(1).scaleb(places)
    d = decimal.Decimal(repr(value))
    return {str(d.quantize(quantum, rounding=mode).normalize()) for mode in (decimal.ROUND_HALF_UP, decimal.ROUND_DOWN)}


@pytest.mark.parametrize("psi", sorted(TABLE_1))
@pytest.mark.parametrize("dp", [1, 4, 16, 64, 256, 1024])
def test_zero_table_1(psi, dp):
    for stage, printed in zip((1, 2, 3), TABLE_1[psi][dp], strict=True):
        value = model_state_bytes(psi, dp=dp, zero_stage=stage) / GB
        assert str(decimal.Decimal(printed).normalize()) in _printed(value, printed), (psi, dp, stage, value)
        assert abs(value - float(printed)) < 10 ** decimal.Decimal(printed).as_tuple().exponent


def test_model_state_terms_are_separate_and_split_over_model_ranks():
    states = model_state_terms(1e9, dp=4, zero_stage=2)
    assert (states.parameters, states.gradients, states.optimizer_states) == (2e9, 0.5e9, 3e9)
    assert states.total == model_state_bytes(1e9, dp=4, zero_stage=2)
    assert model_state_bytes(8e9, tp=2, pp=4, dp=1) == 16 * 1e9
    with pytest.raises(ValueError):
        model_state_terms(1, zero_stage=4)


def test_state_bytes_per_param():
    assert state_bytes_per_param("bf16") == (2, 2, 12)  # the paper's K = 12
    assert state_bytes_per_param("fp32") == (4, 4, 8)
    assert state_bytes_per_param("fp32", zero_stage=1) == (4, 4, 12)  # DeepSpeed's fp32 partition copy
    assert state_bytes_per_param("fp32", zero_stage=3) == (4, 4, 12)  # ZeRO-3 keeps one too (measured)
    assert state_bytes_per_param("bf16", "sgd", momentum=0.9) == (2, 2, 8)
    assert state_bytes_per_param("fp32", "sgd") == (4, 4, 0)


# ---------------------------------------------------------------- Korthikanti et al., Table 2
POINTS = [(2048, 1, 12288, 96), (2048, 4, 2048, 16), (4096, 2, 4096, 32), (8192, 1, 8192, 64), (512, 8, 1024, 16)]


@pytest.mark.parametrize("s,b,h,a", POINTS)
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_table_2(s, b, h, a, t):
    sbh = s * b * h

    def act(**kw):
        return activation_bytes_per_layer(s, b, h, a, tp=t, **kw)

    if t == 1:
        assert act() == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert act() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert act(sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert act(recompute="selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert act(sequence_parallel=True, recompute="selective") == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert act(recompute="full") == 2 * sbh
    assert act(recompute="full", sequence_parallel=True) == 2 * sbh / t


def test_table_2_gpt3_175b():
    """GPT-3 175B (s=2048, b=1, h=12288, a=96) at t=8: 5as/(ht) = 10, so sbh(10 + 3 + 10) per layer;
    sequence parallelism and selective recompute together cut it to sbh(34/8), 5.4x less."""
    sbh = 2048 * 12288
    assert activation_bytes_per_layer(2048, 1, 12288, 96, tp=8) == sbh * 23
    both = activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True, recompute="selective")
    assert both == sbh * 34 / 8
    assert round(sbh * 23 / both, 1) == 5.4


def test_activation_generalisations():
    s, b, h, a = 2048, 2, 4096, 32
    base = activation_bytes_per_layer(s, b, h, a)
    assert activation_bytes_per_layer(s, b, h, a, kv_heads=a, ffn_hidden=4 * h) == base
    assert activation_bytes_per_layer(s, b, h, a, kv_heads=8) == base - 2 * s * b * h * (1 - 8 / a) * 2
    assert activation_bytes_per_layer(s, b, h, a, fused_attention=True) == \
        activation_bytes_per_layer(s, b, h, a, recompute="selective")
    swiglu = activation_bytes_per_layer(s, b, h, a, mlp="swiglu")
    assert swiglu - base == 2 * s * b * 4 * h  # gate and up (4sbf) instead of the GELU input (2sbf)
    # eager PyTorch also keeps silu(gate) for the product's backward: 8sbf in the MLP instead of 6sbf
    eager = activation_bytes_per_layer(s, b, h, a, mlp="swiglu", fused_swiglu=False)
    assert eager - swiglu == 2 * s * b * 4 * h
    assert activation_bytes_per_layer(s, b, h, a, fused_swiglu=False) == base  # GELU: nothing to fuse
    eager_setup = memory_per_rank(get_preset("llama2-7b"), Setup(fused_swiglu=False)).get("activations")
    assert eager_setup > memory_per_rank(get_preset("llama2-7b"), Setup()).get("activations")
    masks = sum(v for k, v in activation_terms_per_layer(s, b, h, a) if k.endswith("mask"))
    fp32 = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4)
    assert fp32 == 2 * base - masks  # 2-byte values double, 1-byte masks do not
    # the CPU's dropout keeps its mask in the input's dtype: mask_bytes scales the three masks only
    cpu = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4, mask_bytes=4)
    assert cpu == fp32 + 3 * masks
    assert activation_bytes_per_layer(s, b, h, a, recompute="selective", mask_bytes=2) == \
        activation_bytes_per_layer(s, b, h, a, recompute="selective") + 2 * s * b * h  # the two residual masks
    # without dropout: no masks, no separate post-dropout probabilities: sbh(32 + 2as/h)
    assert activation_bytes_per_layer(s, b, h, a, dropout=False) == s * b * h * (32 + 2 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, dropout=False, fused_attention=True) == s * b * h * 32
    with pytest.raises(ValueError):
        activation_bytes_per_layer(s, b, h, a, recompute="some")


# ---------------------------------------------------------------- pipeline
@pytest.mark.parametrize("p,m,v,expected", [(1, 8, 1, 0.0), (2, 8, 1, 1 / 8), (4, 16, 1, 3 / 16),
                                            (8, 8, 1, 7 / 8), (4, 16, 2, 3 / 32), (8, 64, 4, 7 / 256)])
def test_bubble_fraction(p, m, v, expected):
    assert bubble_fraction(p, m, v) == expected


def test_bubble_fraction_rejects_nonsense():
    for args in [(0, 1), (1, 0), (2, 2, 0)]:
        with pytest.raises(ValueError):
            bubble_fraction(*args)


def test_micro_batches_in_flight():
    assert micro_batches_in_flight(0, 4, 16) == 4  # 1F1B: the first stage holds p
    assert micro_batches_in_flight(3, 4, 16) == 1
    assert micro_batches_in_flight(0, 4, 2) == 2  # never more than m
    assert micro_batches_in_flight(0, 4, 16, "gpipe") == 16
    assert micro_batches_in_flight(0, 4, 16, "interleaved_1f1b", 2) == 4 + 3 / 2
    assert micro_batches_in_flight(0, 1, 16) == 1


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (8, 2), (2, 4), (4, 4), (8, 4)])
def test_interleaved_in_flight_per_stage(p, v):
    """Rank i holds (v-1)p + 2(p-1-i) + 1 chunks of 1/v stage each (Megatron / torch warm-up + one)."""
    m = 4 * p
    got = [micro_batches_in_flight(i, p, m, "interleaved_1f1b", v) for i in range(p)]
    assert got == [((v - 1) * p + 2 * (p - 1 - i) + 1) / v for i in range(p)]
    assert got[0] == p + (p - 1) / v  # Megatron's theoretical_memory_usage.py: p (1 + (p-1)/(pv))
    assert got[-1] == p - (p - 1) / v  # not 1 + (p-1)/v: the last stage keeps most of a round too
    # and never more than all m micro-batches
    assert micro_batches_in_flight(0, p, 2, "interleaved_1f1b", v) <= 2


def _megatron_interleaved_order(rank, p, v, m):
    """One rank's (op, micro-batch, chunk) order, written from Megatron-LM's interleaved schedule
    (``forward_backward_pipelining_with_interleaving``: warm-up 2(p-rank-1) + (v-1)p, then 1F1B, then
    cool-down; chunk of the k-th op ``(k % pv) // p``, reversed for backward; micro-batch ``(k // pv) p + k % p``)."""
    total = m * v
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)

    def chunk(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def mb(k):
        return (k // (p * v)) * p + k % p

    ops = [("F", mb(k), chunk(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", mb(k + warmup), chunk(k + warmup, True)), ("B", mb(k), chunk(k, False))]
    return ops + [("B", mb(k), chunk(k, False)) for k in range(total - warmup, total)]


def _simulate_peaks(p, v, m):
    """Run every rank's order under the schedule's dependencies (a forward needs the previous virtual
    stage's forward, a backward its own forward and the next virtual stage's backward), one op per rank per
    tick; return each rank's peak of chunk activations held. Fails on a deadlock."""
    orders = [_megatron_interleaved_order(r, p, v, m) for r in range(p)]
    done, pos, held, peak = set(), [0] * p, [0] * p, [0] * p
    last = p * v - 1
    for _ in range(10 * m * v * p):
        if all(pos[r] == len(orders[r]) for r in range(p)):
            return peak
        ready = []
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            op, mb, c = orders[r][pos[r]]
            vs = c * p + r  # virtual stage, the "loop" placement
            if op == "F":
                ok = vs == 0 or ("F", mb, vs - 1) in done
            else:
                ok = ("F", mb, vs) in done and (vs == last or ("B", mb, vs + 1) in done)
            if ok:
                ready.append((r, (op, mb, vs)))
        assert ready, "the schedule deadlocked"
        for r, key in ready:  # what became possible this tick runs this tick
            done.add(key)
            pos[r] += 1
            held[r] += 1 if key[0] == "F" else -1
            peak[r] = max(peak[r], held[r])
    raise AssertionError("the schedule did not finish")


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 16), (2, 4, 8), (4, 4, 8), (4, 4, 12), (8, 2, 16)])
def test_interleaved_in_flight_against_a_simulated_schedule(p, v, m):
    peaks = _simulate_peaks(p, v, m)
    assert [micro_batches_in_flight(i, p, m, "interleaved_1f1b", v) for i in range(p)] == [k / v for k in peaks]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 4, 16), (4, 2, 4), (4, 2, 10), (4, 4, 3)])
def test_interleaved_in_flight_against_torch_schedule(p, v, m):
    """torch.distributed.pipelining's own ScheduleInterleaved1F1B order (what the native engine runs),
    including its rounds for m not a multiple of p and its cap for m <= p."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    rounds = max(1, m // p)
    fake = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m)
    for rank in range(p):
        held = peak = 0
        for action in schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank):
            if action is not None:
                held += {"FORWARD": 1, "FULL_BACKWARD": -1}.get(action.computation_type.name, 0)
                peak = max(peak, held)
        assert micro_batches_in_flight(rank, p, m, "interleaved_1f1b", v) == peak / v, rank


# ---------------------------------------------------------------- a whole rank
GPT = ModelSpec(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=2048, name="gpt-1.3b")


def test_activations_agree_with_megatron_theoretical_memory_usage():
    """Megatron-LM's compute_activation_memory (sequence parallel, selective recompute; Table 2 based):
    sbhL(18 + 4f/h) + (8sbp + sbhp) in flight, x min(1, m/p), + 4sbh(1 + V/h) with p = 1, all / t.
    (We keep the 8sb token ids whole on every tensor rank; Megatron divides them by t too.)"""
    s, b, h, L = GPT.seq_len, 2, GPT.hidden, GPT.layers
    for t, p, m in [(2, 1, 8), (4, 1, 1), (2, 4, 16), (2, 4, 2)]:
        setup = Setup(tp=t, pp=p, micro_batch=b, micro_batches=m, sequence_parallel=True, recompute="selective",
                      fused_attention=False)
        ours = stage_memory(GPT, setup, 0)
        ours_total = ours.get("activations") + ours.get("embedding_activations") + ours.get("output_layer_activations")
        scale = min(1, m / p) if p > 1 else 1
        theirs = (s * b * h * L * (18 + 4 * 4) + 8 * s * b * p * t + s * b * h * p) * scale / t
        if p == 1:
            theirs += s * b * h * 4 * (1 + GPT.padded_vocab(t) / h) / t
        assert ours_total == pytest.approx(theirs, rel=1e-12), (t, p, m)


def test_rank_memory_terms():
    setup = Setup(tp=2, pp=2, dp=2, zero_stage=1, micro_batch=1, micro_batches=8, fused_attention=False)
    first, last = stage_memory(GPT, setup, 0), stage_memory(GPT, setup, 1)
    assert first.get("output_layer_activations") == 0 and last.get("embedding_activations") == 0
    # 1F1B: the first stage holds p = 2 micro-batches, the last one
    one = activation_bytes_per_layer(2048, 1, 2048, 16, tp=2)
    assert first.get("activations") == 2 * 12 * one
    assert last.get("activations") == 1 * 12 * one
    assert memory_per_rank(GPT, setup).total == max(first.total, last.total)
    states = expected_model_states(GPT, setup, 0)
    psi = GPT.stage_params(0, 2, 2)
    assert states.total == pytest.approx(2 * psi + 2 * psi + 12 * psi / 2)


def test_full_recompute_keeps_inputs_and_one_span():
    setup = Setup(recompute="full", micro_batch=2)
    mem = stage_memory(GPT, setup, 0)
    assert mem.get("activations") == 24 * 2 * 2048 * 2 * 2048
    assert mem.get("recompute_working_set") == activation_bytes_per_layer(2048, 2, 2048, 16, fused_attention=True)
    wider = stage_memory(GPT, Setup(recompute="full", micro_batch=2, checkpoint_interval=4), 0)
    assert wider.get("activations") == 6 * 2 * 2048 * 2 * 2048
    assert wider.get("recompute_working_set") == 4 * mem.get("recompute_working_set")


def test_zero3_and_offload():
    setup = Setup(dp=8, zero_stage=3, offload_optimizer=True, offload_param=True)
    on_gpu, host = expected_model_states(GPT, setup), host_model_states(GPT, setup)
    assert on_gpu.total == 0  # ZeRO-Infinity: parameters, gradients and optimizer states on the CPU
    assert host.total == pytest.approx(16 * GPT.stage_params(0) / 8)
    zero1 = Setup(dp=8, zero_stage=1, offload_optimizer=True)
    assert expected_model_states(GPT, zero1).gradients == 2 * GPT.stage_params(0)  # stage 1 keeps them
    assert memory_per_rank(GPT, setup).get("zero3_gathered_module") == 4 * GPT.largest_layer_params()


def test_usable_memory():
    assert usable_memory(80e9) == (75e9, 5e9)


# ---------------------------------------------------------------- communication
def _bytes(terms, name):
    return sum(t.bytes for t in terms if t.name == name)


def test_data_parallel_volumes():
    """ZeRO paper 7.2: all-reduce 2(N-1)/N Psi; ZeRO-1/2 the same; ZeRO-3 3(N-1)/N Psi (one micro-batch)."""
    psi = GPT.stage_params(0)
    base = communication_per_rank(GPT, Setup(dp=8, zero_stage=0))
    assert _bytes(base, "gradient_allreduce") == pytest.approx(2 * 7 / 8 * psi * 2)
    for stage in (1, 2):
        assert sum(t.bytes for t in communication_per_rank(GPT, Setup(dp=8, zero_stage=stage))) == \
            pytest.approx(sum(t.bytes for t in base))
    z3 = communication_per_rank(GPT, Setup(dp=8, zero_stage=3))
    assert sum(t.bytes for t in z3) == pytest.approx(1.5 * sum(t.bytes for t in base))


def test_tensor_and_pipeline_volumes():
    s, b, h, L, m = 2048, 4, 2048, 24, 2
    sbh2 = s * b * h * 2
    plain = communication_per_rank(GPT, Setup(tp=4, micro_batch=b, micro_batches=m))
    assert _bytes(plain, "tensor_parallel_blocks") == pytest.approx(m * L * 4 * 2 * 3 / 4 * sbh2)
    sp = communication_per_rank(GPT, Setup(tp=4, micro_batch=b, micro_batches=m, sequence_parallel=True))
    assert _bytes(sp, "tensor_parallel_blocks") == _bytes(plain, "tensor_parallel_blocks")
    ends = {name: {t.name: t for t in terms}["tensor_parallel_embedding_and_output"] for name, terms in
            (("plain", plain), ("sp", sp))}
    assert ends["sp"].bytes == ends["plain"].bytes  # all-reduce vs reduce-scatter + all-gather: same bytes
    assert (ends["plain"].calls, ends["sp"].calls) == (2 * m, 4 * m)  # one stage holds both ends: 2 ops vs 4
    full = communication_per_rank(GPT, Setup(tp=4, micro_batch=b, micro_batches=m, recompute="full"))
    assert _bytes(full, "tensor_parallel_blocks") == pytest.approx(1.5 * _bytes(plain, "tensor_parallel_blocks"))
    pipe = Setup(pp=4, micro_batch=b, micro_batches=m)
    middle = communication_per_rank(GPT, pipe, stage=1)
    assert _bytes(middle, "pipeline_send_activations") == m * sbh2 == _bytes(middle, "pipeline_send_gradients")
    assert _bytes(communication_per_rank(GPT, pipe, stage=0), "pipeline_send_gradients") == 0



def test_a_context_rank_sends_tensor_and_pipeline_traffic_of_its_own_tokens():
    """A context rank holds s/C tokens of each row: its tensor all-reduces and pipeline sends are 1/C of one
    rank's without the axis (they once counted the whole sequence, so every context layout with tensor or
    pipeline parallelism was timed as sending C times what it sends)."""
    for c in (2, 4):
        for name in ("tensor_parallel_blocks", "tensor_parallel_embedding_and_output"):
            one = communication_per_rank(GPT, Setup(tp=4, micro_batch=2, micro_batches=2))
            split = communication_per_rank(GPT, Setup(tp=4, cp=c, micro_batch=2, micro_batches=2))
            assert _bytes(split, name) == pytest.approx(_bytes(one, name) / c), (c, name)
        one = communication_per_rank(GPT, Setup(pp=4, micro_batch=2, micro_batches=4), stage=1)
        split = communication_per_rank(GPT, Setup(pp=4, cp=c, micro_batch=2, micro_batches=4), stage=1)
        for name in ("pipeline_send_activations", "pipeline_send_gradients"):
            assert _bytes(split, name) == pytest.approx(_bytes(one, name) / c), (c, name)


def test_selective_recompute_of_a_context_attention_runs_its_forward_again():
    """The reference GPT checkpoints the whole context attention under selective recompute: backward runs its core
    and its K/V traffic again, even on a fused kernel (without the axis a fused kernel recomputes its core anyway,
    at no extra cost), and the attention's kept outputs are dropped."""
    from plugin.planning.steptime import HARDWARE, forward_flops, step_time

    hw = HARDWARE["h100"]
    rate = hw.peak_flops * hw.matmul_efficiency
    for method in ("ring", "all_to_all"):
        base = Setup(tp=2, cp=2, cp_method=method, micro_batch=1, micro_batches=2)
        sel = dataclasses.replace(base, recompute="selective")
        _, core = forward_flops(GPT, base, 0)
        assert step_time(GPT, sel).get("recompute") == pytest.approx(2 * core / rate)  # a core per micro-batch
        kv = {"ring": "context_ring_kv", "all_to_all": "context_all_to_all"}[method]
        full = dataclasses.replace(base, recompute="full")
        assert _bytes(communication_per_rank(GPT, sel), kv) == _bytes(communication_per_rank(GPT, full), kv) > \
            _bytes(communication_per_rank(GPT, base), kv)
        assert memory_per_rank(GPT, base).get("context_attention_outputs") > 0
        assert memory_per_rank(GPT, sel).get("context_attention_outputs") == 0
    one = Setup(tp=2, micro_batch=1, micro_batches=2, recompute="selective")
    assert step_time(GPT, one).get("recompute") == 0  # fused, no context axis: nothing extra

def test_tied_embedding_gradient_allreduce_across_pipeline_stages():
    """The first and last stage each hold the tied embedding and all-reduce its gradient once per step."""
    tied, untied = GPT, dataclasses.replace(GPT, tied_embeddings=False)
    pipe = Setup(pp=4, tp=2, micro_batches=8)
    shard = GPT.padded_vocab(2) * GPT.hidden / 2
    for stage in (0, 3):
        terms = communication_per_rank(tied, pipe, stage=stage)
        assert _bytes(terms, "tied_embedding_grad_allreduce") == shard * 2  # ring of 2: the whole shard, bf16
        assert [t.calls for t in terms if t.name == "tied_embedding_grad_allreduce"] == [1]
    assert _bytes(communication_per_rank(tied, pipe, stage=1), "tied_embedding_grad_allreduce") == 0
    assert _bytes(communication_per_rank(untied, pipe, stage=0), "tied_embedding_grad_allreduce") == 0
    assert _bytes(communication_per_rank(tied, Setup(tp=2), stage=0), "tied_embedding_grad_allreduce") == 0
    from plugin.planning.steptime import step_time

    assert step_time(tied, pipe).get("embedding_allreduce") > 0
    assert step_time(untied, pipe).get("embedding_allreduce") == 0


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("name,published", [
    ("megatron-1.7b", 1.7), ("megatron-3.6b", 3.6), ("megatron-7.5b", 7.5), ("megatron-18b", 18.4),
    ("megatron-39b", 39.1), ("megatron-76b", 76.1), ("megatron-145b", 145.6), ("megatron-310b", 310.1),
    ("megatron-530b", 529.6), ("megatron-1t", 1008.0)])
def test_megatron_table_1_sizes(name, published):
    """Narayanan et al. 2021, Table 1 (to the 0.1B printed)."""
    assert round(get_preset(name).total_params() / 1e9, 1) == published


@pytest.mark.parametrize("name,count", [("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
                                        ("llama2-70b", 68_976_648_192), ("llama3-8b", 8_030_261_248),
                                        ("llama3-70b", 70_553_706_496)])
def test_llama_parameter_counts(name, count):
    """The parameter counts of the Hugging Face checkpoints."""
    assert get_preset(name).total_params() == count


def test_gpt3_175b_size():
    assert round(get_preset("gpt3-175b").total_params() / 1e9, 1) == 174.6  # Narayanan et al. Table 2


def test_stage_params_add_up():
    spec = get_preset("llama2-7b")
    assert sum(spec.stage_params(i, 4) for i in range(4)) == spec.total_params()
    tied = GPT
    # tied embeddings across a pipeline: a second copy on the last stage
    assert sum(tied.stage_params(i, 2) for i in range(2)) == tied.total_params() + tied.embedding_params()
    sharded, replicated = spec.layer_params_split()
    per_tp = spec.stage_params(0, 1, 2)
    assert per_tp == pytest.approx(32 * (sharded / 2 + replicated) + spec.embedding_params() / 2
                                   + spec.norm_params + spec.embedding_params() / 2)
    assert [GPT.layers_on_stage(i, 5) for i in range(5)] == [5, 5, 5, 5, 4]
