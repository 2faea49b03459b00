"""The dry run against real launches on 4 gloo processes (native back end, the one the dry run builds): rank by rank,
the parameters each rank holds, and the collectives of one training step on each group, in order, with their sizes.

The real step's collectives come from torch's flight recorder (gloo records every collective it enters, with its
group and its tensors' sizes and dtypes; no point-to-point ops), taken around one ``train_step`` with the data
contract's check off, as the dry run steps. Tensor x data (ZeRO-1) in the main suite; in the slow one (one launch),
tensor x pipeline and pipeline x context, and the parameters of every other 4-process cpu_* recipe.
"""
import json
import math
import os

import pytest

from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

CONTEXT = {"name": "cpu_pp2_cp2", "parallelism": {"data": 1, "tensor": 1, "pipeline": 2, "context": 2},
           "zero": {"stage": 0}, "pipeline_parallel": {"schedule": "1f1b", "partition": "uniform"},
           "batch": {"global": 8, "micro": 2}, "precision": "fp32",
           "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}, "gradient_clipping": 1.0,
           "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 128, "seq_len": 32,
                     "dropout": 0.0},
           "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4}, "launcher": "torchrun"}
DTYPE_BYTES = {"Float": 4, "Long": 8, "Int": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Byte": 1, "Bool": 1,
               "Char": 1}
ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather",
           "all_gather_into_tensor": "all_gather", "_reduce_scatter_base": "reduce_scatter",
           "reduce_scatter_tensor": "reduce_scatter", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all"}


def _op(entry) -> str:
    """The flight recorder's op name (``gloo:all_reduce``) in the dry run's words."""
    name = str(entry["profiling_name"]).rpartition(":")[2]
    return ALIASES.get(name, name)


def _recipe_ref(ref, tmp):
    if isinstance(ref, dict):
        path = os.path.join(tmp, ref["name"] + ".json")
        with open(path, "w") as f:
            json.dump(ref, f)
        return path
    return ref


def _held(engine) -> int:
    seen, total = set(), 0
    for p in engine.container.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += (p._local_tensor if hasattr(p, "_local_tensor") else p).numel()
    return total


def _entry_bytes(e) -> int:
    op = _op(e)
    sizes, dtypes = (e["output_sizes"], e["output_dtypes"]) if op == "reduce_scatter" else \
        (e["input_sizes"], e["input_dtypes"])
    return sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(sizes, dtypes, strict=True))


def _launch(rank, world, refs, step_refs):
    """Each recipe of ``refs`` built for real; those in ``step_refs`` also stepped, their collectives recorded."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import plugin
    from plugin.dryrun.ranks import compress
    from plugin.dryrun.simulate import build_model
    from plugin.recipe.checks import load_recipe

    out = {}
    for ref in refs:
        recipe = load_recipe(ref)
        engine = plugin.initialize(lambda r=recipe: build_model("gpt", r.model), recipe, backend="native", seed=0)
        got = {"parameters": _held(engine)}
        if ref in step_refs:
            names = {str(name): compress(dist.get_process_group_ranks(pg)) for pg, name in c10d._world.pg_names.items()}
            before = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])
            last = max((e["record_id"] for e in before), default=-1)
            engine.check_peer_rows = False  # as the dry run steps
            inputs = torch.zeros(engine.layout.global_batch, recipe.model.seq_len, dtype=torch.long)
            engine.train_step((inputs, torch.ones_like(inputs)))
            after = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])
            seq = {}
            for e in after:
                if e["record_id"] > last and not e.get("is_p2p"):
                    seq.setdefault(names[str(e["process_group"][0])], []).append([_op(e), _entry_bytes(e)])
            got["sequences"] = seq
        out[recipe.name] = got
        if engine.guard is not None:  # the next recipe builds in the same process group: no close()
            engine.guard.stop()
            dist.barrier()
            engine.guard.release()
    return out


def _compare(refs, step_refs, tmp):
    from plugin.dryrun.run import dry_run
    from plugin.recipe.checks import load_recipe

    paths = [_recipe_ref(r, tmp) for r in refs]
    steps = [_recipe_ref(r, tmp) for r in step_refs]
    real = run(_launch, 4, paths, steps, timeout_s=300)
    for path in paths:
        recipe = load_recipe(path)
        dry = {r["rank"]: r for r in dry_run(recipe, ranks=[0, 1, 2, 3])["ranks"]}
        for rank in range(4):
            mine = real[rank][recipe.name]
            assert dry[rank]["parameters"] == mine["parameters"], (recipe.name, rank)
            if path in steps:
                assert dry[rank]["sequences"] == mine["sequences"], (recipe.name, rank)


def test_the_dry_run_holds_and_says_what_a_launch_does_tensor_x_data(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "20000")
    _compare(["cpu_tp2_dp2"], ["cpu_tp2_dp2"], str(tmp_path))


@pytest.mark.slow
def test_every_4_process_cpu_recipe_and_pipeline_x_context_as_a_launch(tmp_path, monkeypatch):
    """Parameters per rank of every other 4-process cpu_* recipe; the collectives of tensor x pipeline and of
    pipeline x context."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "20000")
    _compare(["cpu_dp4", "cpu_pp2_dp2", "cpu_tp2_pp2", "cpu_tp2_sp_pp2", "cpu_zero3_dp4", CONTEXT],
             ["cpu_tp2_pp2", CONTEXT], str(tmp_path))
