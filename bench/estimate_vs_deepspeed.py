"""Our model-state estimates next to DeepSpeed's own estimators, on the same inputs.

    python bench/estimate_vs_deepspeed.py

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``
(the functions behind ``*_all_cold``, which only print) count per GPU:

- ZeRO-2: 2 Psi + 18 Psi / N  (16-bit params; 16-bit grads, fp32 grads, fp32 params, two fp32 moments
  on the partition), or 2 Psi with the optimizer offloaded;
- ZeRO-3: 4 x largest_layer + 18 Psi / N, or 4 x largest_layer + 2 Psi / N offloading the optimizer.

Ours (:func:`plugin.planning.model_states.model_state_bytes`) is the ZeRO paper's 2 Psi + (2 + K) Psi / N with K = 12:
it leaves out the fp32 gradient partition DeepSpeed creates in the optimizer step (4 Psi / N, the whole
difference): DeepSpeed frees the 16-bit gradients and the activations before it, so it is a transient
that does not add to the backward peak we count. At ZeRO-3 :func:`plugin.planning.memory.memory_per_rank` adds
the same 4 x largest-module working set DeepSpeed assumes.
Both are printed in GB = 10^9 bytes (DeepSpeed's own printout divides by 2^30). A benchmark, not
plugin code: it imports deepspeed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from plugin.planning.memory import memory_per_rank  # noqa: E402
from plugin.planning.model_states import model_state_bytes  # noqa: E402
from plugin.planning.presets import get_preset  # noqa: E402
from plugin.planning.setup import Setup  # noqa: E402

MODELS = ["llama2-7b", "gpt3-13b", "llama2-70b", "gpt3-175b"]
GPUS = [8, 64, 512]
GPUS_PER_NODE = 8


def deepspeed_numbers(psi: float, largest: float, gpus: int) -> dict[str, float]:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes, per_node = max(1, gpus // GPUS_PER_NODE), min(gpus, GPUS_PER_NODE)
    common = dict(num_gpus_per_node=per_node, num_nodes=nodes)
    _, z2 = estimate_zero2_model_states_mem_needs(int(psi), cpu_offload=False, **common)
    _, z2_off = estimate_zero2_model_states_mem_needs(int(psi), cpu_offload=True, **common)
    _, z3, _ = estimate_zero3_model_states_mem_needs(int(psi), int(largest), cpu_offload=False, **common)
    _, z3_off, _ = estimate_zero3_model_states_mem_needs(int(psi), int(largest), cpu_offload=True,
                                                         cpu_offload_params=False, **common)
    return {"zero2": z2, "zero2 offload_optimizer": z2_off, "zero3": z3, "zero3 offload_optimizer": z3_off}


def our_numbers(spec, gpus: int) -> dict[str, float]:
    psi = spec.total_params()

    def zero3(offload: bool) -> float:
        mem = memory_per_rank(spec, Setup(dp=gpus, zero_stage=3, offload_optimizer=offload))
        return sum(mem.get(k) for k in ("parameters", "gradients", "optimizer_states", "zero3_gathered_module"))

    def zero2_offload() -> float:
        mem = memory_per_rank(spec, Setup(dp=gpus, zero_stage=2, offload_optimizer=True))
        return mem.get("parameters") + mem.get("gradients") + mem.get("optimizer_states")

    return {"zero2": model_state_bytes(psi, dp=gpus, zero_stage=2), "zero2 offload_optimizer": zero2_offload(),
            "zero3": zero3(False), "zero3 offload_optimizer": zero3(True)}


def main() -> None:
    rows = []
    for name in MODELS:
        spec = get_preset(name)
        psi, largest = spec.total_params(), spec.largest_layer_params()
        for gpus in GPUS:
            ds = deepspeed_numbers(psi, largest, gpus)
            ours = our_numbers(spec, gpus)
            for key in ds:
                rows.append((name, gpus, key, ours[key] / 1e9, ds[key] / 1e9, ours[key] / ds[key]))
    header = f"{'model':<11} {'GPUs':>5}  {'ZeRO':<24} {'ours GB':>9} {'DeepSpeed GB':>13} {'ours/DS':>8}"
    print("Model states per GPU (params + grads + optimizer; ZeRO-3 adds the gathered largest module)")
    print(header)
    print("-" * len(header))
    for name, gpus, key, ours, ds, ratio in rows:
        print(f"{name:<11} {gpus:>5}  {key:<24} {ours:>9.2f} {ds:>13.2f} {ratio:>8.3f}")
    print("\nThe gap without offload is DeepSpeed's fp32 gradient partition of the optimizer step (4 Psi / N),"
          "\nwhich the ZeRO paper's K = 12 leaves out; with the optimizer offloaded both count the same bytes.")


if __name__ == "__main__":
    main()
