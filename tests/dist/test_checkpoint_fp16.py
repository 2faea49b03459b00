"""DeepSpeed's fp16 in checkpoints (issue 13): at ZeRO-0, ZeRO-1 and ZeRO-3 (2 ranks, one spawn) the loss scaler's
state and the steps it skipped travel with the fp32 masters (ZeRO-0: FP16_UnfusedOptimizer's copies, torch's AdamW
steps them) or partitions. The initial scale overflows fp16 on the first steps, so by step 4 the scale has moved and
steps were skipped: a resume that restarted the scaler would overflow and skip again where the uninterrupted run did
not (at ZeRO-0 only since the engine applies the scale itself: DeepSpeed 0.19.8 leaves it out there, no step
ever overflowed). Train 4 steps, save, train 4 (the uninterrupted run), load, train the same 4 again: bit for bit, and
the scaler as it was at the save. Then the ZeRO-0 checkpoint loads into ZeRO-1 (another layout of DeepSpeed's state):
saved again there it holds the same tensors bit for bit, and it trains on close to ZeRO-0's losses. fp16 at ZeRO-0 with
a pipeline is refused by name (DeepSpeed's pipeline backward leaves the loss unscaled there).

DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on your device.") unless oneDNN has fp16
kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16 CPUs); torch's own CPU kernels
compute fp16 without them. On such a CPU the children lift that one gate (:func:`_allow_cpu_fp16`), so these checks
run on every machine; everything else (DeepSpeed's fp16 optimizers, its scaler, torch's fp16 arithmetic) is real."""
from __future__ import annotations

import json

import pytest

from plugin.engines.choose import importable

from . import spawn

# slow: fp16's loss scale across a resume; the README suite resumes DeepSpeed in fp32 (parity, checkpoint matrix)
pytestmark = [pytest.mark.dist, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.skipif(not importable("deepspeed"), reason="deepspeed not installed")]

def _allow_cpu_fp16() -> bool:
    """Lift DeepSpeed's CPU fp16 gate where oneDNN lacks fp16 kernels (see the module docstring); True if lifted."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if get_accelerator().device_name() != "cpu" or get_accelerator().is_fp16_supported():
        return False
    CPU_Accelerator.is_fp16_supported = lambda self: True
    return True


def _resume_fp16(rank, world, root, recipes):
    import torch

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe

    lifted = _allow_cpu_fp16()

    def engine(path):
        recipe = load_recipe(path)
        torch.manual_seed(0)
        e = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="deepspeed")
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=0)

        def steps(a, b):
            return [e.train_step(data.global_batch(s, e.layout.global_batch)) for s in range(a, b)]

        return recipe, e, steps

    out = {"lifted": lifted}
    for path in recipes[:3]:
        recipe, e, steps = engine(path)
        r = {"first": steps(0, 4), "initial": 2.0 ** recipe.fp16.initial_scale_power,
             "optimizer": type(e.ds.optimizer).__name__}
        r["saved"] = e.scaler.state_dict()
        r["stepped"] = bool(e.ds.optimizer.optimizer.state)
        e.save(f"{root}/{recipe.name}")
        r["cont"] = steps(4, 8)
        r["after_cont"] = e.scaler.state_dict()
        e.load(f"{root}/{recipe.name}")
        r["loaded"] = e.scaler.state_dict()
        r["again"] = steps(4, 8)
        r["manifest"] = json.loads(next((root / recipe.name).glob("step-*/plugin-checkpoint.json")).read_text())[
            "scalars"]["scaler"]
        out[recipe.name] = r
    # fp16 at ZeRO-0 with a pipeline: refused before any group (DeepSpeed's pipeline backward leaves the loss unscaled)
    from plugin.errors import PluginError

    try:
        engine(next(p for p in recipes if p.endswith("fp16_pp2_zero0.json")))
        out["pipeline_refused"] = ""
    except PluginError as e:
        out["pipeline_refused"] = str(e)
    # the ZeRO-0 checkpoint into ZeRO-1: loaded, saved again at once (compared in the test), then trained on
    recipe, e, steps = engine(next(p for p in recipes if p.endswith("fp16_zero1.json")))
    e.load(f"{root}/fp16_zero0")
    out["cross"] = {"loaded": e.scaler.state_dict()}
    e.save(f"{root}/cross")
    out["cross"]["again"] = steps(4, 8)
    return out


def _tensors(directory):
    """Every param and optim tensor of a checkpoint, whole (read as the export reads them)."""
    import torch

    from plugin.checkpoint.dcp_io import ROW_MAJOR, ItemReader, chunk_table, read_metadata_file
    from plugin.checkpoint.export import _assemble
    from plugin.checkpoint.store import open_checkpoint

    step_dir, manifest = open_checkpoint(directory)
    md = read_metadata_file(step_dir / ".metadata")
    chunks, reader = chunk_table(md), ItemReader(manifest["files"], manifest.get("item_format") == ROW_MAJOR)
    return {n: _assemble(reader, step_dir, md, chunks, n, getattr(torch, t["dtype"])).clone()
            for n, t in manifest["tensors"].items() if t["role"] in ("param", "optim")}


def test_deepspeed_fp16_resume_keeps_the_loss_scale(tmp_path):
    import torch

    from .runs import recipe_variant

    recipes = [str(recipe_variant("cpu_dp4", tmp_path, f"fp16_zero{z}", precision="fp16",
                                  fp16={"initial_scale_power": 18, "hysteresis": 1}, zero={"stage": z},
                                  parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                                  batch={"global": 16, "micro": 8}, launcher="deepspeed")) for z in (0, 1, 3)]
    recipes.append(str(recipe_variant("cpu_pp2_dp2", tmp_path, "fp16_pp2_zero0", precision="fp16",
                                      zero={"stage": 0}, parallelism={"data": 1, "tensor": 1, "pipeline": 2},
                                      launcher="deepspeed")))
    results = spawn.run(_resume_fp16, 2, tmp_path, recipes, timeout_s=300)
    res = dict(results[0])
    if res.pop("lifted"):
        print("this CPU has no oneDNN fp16: DeepSpeed's fp16 gate lifted in the children (torch computes fp16)")
    cross = res.pop("cross")
    refused = res.pop("pipeline_refused")
    assert "unscaled" in refused and '"zero": {"stage": 1}' in refused and "bf16" in refused, refused
    for name, r in res.items():
        print(f"{name} ({r['optimizer']}): scale at the save {r['saved']['cur_scale']:g} (initial "
              f"{r['initial']:g}), skipped {r['saved']['skipped_steps']}; steps 5-8 {r['cont']} / after the load "
              f"{r['again']}")
        assert r["saved"]["cur_scale"] < r["initial"] and r["saved"]["skipped_steps"] > 0, name  # the test bites
        assert r["stepped"] and r["saved"]["skipped_steps"] < 4, f"{name}: no step applied before the save: " \
                                                                 "lower initial_scale_power"
        assert r["after_cont"] != r["saved"], name  # the load had something to restore (cur_iter at least)
        assert r["manifest"] == r["saved"] and r["loaded"] == r["saved"], name
        assert r["again"] == r["cont"], name
        assert all(x == x for x in r["first"] + r["cont"]), name  # finite losses (a skipped step's is still one)
    assert res["fp16_zero0"]["optimizer"] == "FP16_UnfusedOptimizer", res["fp16_zero0"]["optimizer"]

    # ZeRO-0's checkpoint holds the fp32 masters, not the module's fp16 copies, under the names, shapes and dtype
    # every layout writes; ZeRO-1 reads all of it into its partitions and writes back the same bits
    zero0, again = _tensors(tmp_path / "fp16_zero0"), _tensors(tmp_path / "cross")
    zero1 = _tensors(tmp_path / "fp16_zero1")
    assert sorted(zero0) == sorted(again) == sorted(zero1)
    for n, t in zero0.items():
        assert t.shape == zero1[n].shape and t.dtype == zero1[n].dtype == again[n].dtype, n
        assert torch.equal(t, again[n]), n
    weights = [n for n in zero0 if not n.startswith("optim.") and zero0[n].dim() == 2]
    assert weights and all(not torch.equal(zero0[n], zero0[n].half().float()) for n in weights), \
        "a weight saved at ZeRO-0 is fp16-exact: the fp16 copy was written, not the fp32 master"
    assert cross["loaded"]["cur_scale"] == res["fp16_zero0"]["saved"]["cur_scale"], cross
    assert cross["loaded"]["skipped_steps"] == res["fp16_zero0"]["saved"]["skipped_steps"], cross
    base = res["fp16_zero0"]["cont"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(cross["again"], base, strict=True))
    print(f"ZeRO-0 checkpoint trained on at ZeRO-1: steps 5-8 {cross['again']} / at ZeRO-0 {base}: worst "
          f"relative difference {worst:.2e}")
    assert worst < 1e-5, (cross["again"], base)
