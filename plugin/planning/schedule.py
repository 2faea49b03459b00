"""Pipeline schedules as the estimates see them: the bubble, and the micro-batches a stage holds at its peak (pure).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
Section 2.2 ((p-1)/m, and (1/v)(p-1)/m interleaved); Korthikanti et al. 2022, 4.2.3 (the first stage of 1F1B
holds p micro-batches).
"""
from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


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
