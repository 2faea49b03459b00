"""Peak memory growth of building a model + ``initialize``, per rank, four ways side by side (issue 12).

The model: the reference GPT at GPT-2 small's shape (hidden 768, 12 layers, 12 heads, vocab 50304, untied head,
seq_len 128): 162.4M parameters, 0.65 GB in fp32. Four processes (gloo, CPU), one fresh set of processes per
(layout, way), so no way inherits another's allocator or module state.

Ways:
* ``whole``: ``GPT(cfg)`` built whole on every rank, then ``plugin.initialize(model, recipe)``;
* ``meta``: ``plugin.initialize(lambda: GPT(cfg), recipe)``: built on meta, each rank materialises its part;
* ``zero.Init`` (DeepSpeed's own, ZeRO-3): ``with deepspeed.zero.Init(config_dict_or_path=cfg): GPT(cfg)``, then
  ``deepspeed.initialize`` with the same ds_config and torch AdamW (the values are torch's module defaults: the
  GPT's own init runs after zero.Init partitioned each module, on empty partitions; memory is what counts here);
* ``fsdp2-meta`` (torchtitan's way, ZeRO-3 native): built on meta, ``fully_shard`` per block and the root on the
  data mesh, ``to_empty``, each parameter's local shard filled in place (``init_module`` on DTensors), AdamW.

Layouts: ZeRO-3 dp4 on DeepSpeed (whole, meta, zero.Init), ZeRO-3 dp4 native FSDP2 (whole, meta, fsdp2-meta),
tp2 x pp2 native and DeepSpeed (whole, meta).

What is measured, per process: the resident set's high-water mark (``VmHWM`` of /proc/self/status), reset to the
current RSS (``echo 5 > /proc/self/clear_refs``) once torch, deepspeed and the plugin with its back ends' engine
modules are imported (``plugin.initialize`` would load those inside the window: 0.05 GB of code and data for the
native FSDP2 engine, the same for every way and not model memory) and the process group exists; ``init`` = HWM
after building + initialize minus the RSS at the reset. ``model``: the same HWM read
once the model's own tensors exist, before the engine allocates its own buffers (built whole; the plugin's
materialisation returned; zero.Init's constructor returned; the torchtitan-style init done). ``pre-opt`` (JSON
only): read when the first AdamW step starts; DeepSpeed 0.19.8's ZeRO-3 no longer steps at ``initialize`` (Adam's
moments come at the first real step, as under FSDP2), so in every row measured here pre-opt = init: the optimizer's
moments are outside the window. The worst rank is reported.
Bytes held after initialize (``Engine.state_bytes``: parameters, gradients, optimizer states incl. fp32 masters,
other) say where the growth goes. RSS counts what glibc keeps, page-granular; shared pages count in every process.

``--largest``: also ZeRO-0 dp4 and ZeRO-3 dp4 on DeepSpeed through the meta path + one training step (micro 1,
seq 128); bytes per parameter per rank measured there give the largest reference GPT that initialises and trains
one step on this machine (MemTotal, 4 ranks, each rank's baseline RSS counted): computed, not searched.

Usage: python bench/init_memory.py [--largest] [--only LAYOUT]   (spawns its own 4 processes per row)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORLD = 4
DIMS = {"hidden": 768, "layers": 12, "heads": 12, "ffn_hidden": 3072, "vocab": 50304, "seq_len": 128}
ROWS = [  # (layout, base recipe, zero stage, back end, way)
    ("ZeRO-3 dp4, DeepSpeed", "cpu_zero3_dp4", 3, "deepspeed", "whole"),
    ("ZeRO-3 dp4, DeepSpeed", "cpu_zero3_dp4", 3, "deepspeed", "meta"),
    ("ZeRO-3 dp4, DeepSpeed", "cpu_zero3_dp4", 3, "deepspeed", "zero.Init"),
    ("ZeRO-3 dp4, native", "cpu_zero3_dp4", 3, "native", "whole"),
    ("ZeRO-3 dp4, native", "cpu_zero3_dp4", 3, "native", "meta"),
    ("ZeRO-3 dp4, native", "cpu_zero3_dp4", 3, "native", "fsdp2-meta"),
    ("tp2 x pp2, native", "cpu_tp2_pp2", None, "native", "whole"),
    ("tp2 x pp2, native", "cpu_tp2_pp2", None, "native", "meta"),
    ("tp2 x pp2, DeepSpeed", "cpu_tp2_pp2", None, "deepspeed", "whole"),
    ("tp2 x pp2, DeepSpeed", "cpu_tp2_pp2", None, "deepspeed", "meta"),
]
LARGEST = [("ZeRO-0 dp4, DeepSpeed (+1 step)", "cpu_dp4", 0, "deepspeed", "meta"),
           ("ZeRO-3 dp4, DeepSpeed (+1 step)", "cpu_zero3_dp4", 3, "deepspeed", "meta")]


def recipe_for(base: str, stage, dims: dict):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe(base).to_dict()
    data["model"] = {**data["model"], **dims}
    data["batch"] = {"global": 4, "micro": 1} if "dp4" in base else {"global": 2, "micro": 1}
    if stage is not None:
        data["zero"] = {**data["zero"], "stage": stage}
    return Recipe.from_dict(data)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_hwm() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _watch_first_adamw_step(marks: dict, base: int):
    import torch

    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        marks.setdefault("pre_opt", _status("VmHWM") - base)
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step


def _watch_model_made(marks: dict, base: int) -> None:
    """``marks["model"]``: the HWM once the model's own tensors exist (built whole; or the plugin's
    materialisation done: each rank's part made, partitioned or sharded), before the engine allocates its own."""
    import plugin.materialize as package

    original = package.materialize

    def materialize(*args, **kwargs):
        made = original(*args, **kwargs)
        marks.setdefault("model", _status("VmHWM") - base)
        return made

    package.materialize = materialize


def _zero_init(recipe, cfg, marks: dict, base: int):
    import deepspeed

    from plugin.engines.deepspeed.config import engine_config
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import GPT

    config = engine_config(recipe, WORLD, use_ds_optimizer=False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    marks["model"] = _status("VmHWM") - base
    optimizer = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    from plugin.engines.memory import deepspeed_state_bytes

    return deepspeed_state_bytes(ds)


def _fsdp2_meta(recipe, cfg, marks: dict, base: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plugin.engines.memory import held_bytes
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.materialize.run import seeded
    from plugin.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with seeded(0, torch.device("cpu")), torch.no_grad():
        for name, module in model.named_modules():  # torchtitan's init_weights: in place, on the local shards
            model.init_module(name, module)
    marks["model"] = _status("VmHWM") - base
    optimizer = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    return held_bytes(model, optimizer)


def _child(rank: int, port: int, row: tuple, step: bool, dims: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import deepspeed  # noqa: F401  imported by every way, before the baseline
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import plugin
    import plugin.engines.deepspeed.engine  # noqa: F401  the back ends' code, loaded once before the baseline:
    import plugin.engines.native.data_parallel  # noqa: F401  not model memory (0.05 GB of RSS, native's FSDP2)
    import plugin.engines.native.pipeline  # noqa: F401
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _layout, base, stage, backend, way = row
    recipe = recipe_for(base, stage, dims)
    cfg = GPTConfig.from_recipe_model(recipe.model)
    dist.barrier()
    base_rss = _reset_hwm()
    marks: dict = {}
    _watch_first_adamw_step(marks, base_rss)
    engine = None
    _watch_model_made(marks, base_rss)
    if way == "zero.Init":
        held = _zero_init(recipe, cfg, marks, base_rss)
    elif way == "fsdp2-meta":
        held = _fsdp2_meta(recipe, cfg, marks, base_rss)
    else:
        model = GPT(cfg) if way == "whole" else (lambda: GPT(cfg))
        if way == "whole":
            marks["model"] = _status("VmHWM") - base_rss
        engine = plugin.initialize(model, recipe, seed=0, backend=backend)
        held = engine.state_bytes()
    init = _status("VmHWM") - base_rss
    result = {"init": init, "pre_opt": marks.get("pre_opt", init), "model": marks.get("model", init), "held": held,
              "base_rss": base_rss}
    if step:
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        engine.train_step(data.global_batch(0, engine.layout.global_batch))
        result["step"] = _status("VmHWM") - base_rss
    dist.barrier()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_row(row: tuple, dims: dict, step: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="init-mem-") as out:
        mp.spawn(_child, args=(port, row, step, dims, out), nprocs=WORLD, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(WORLD)]


def _ratio(w: dict, other: dict | None) -> str:
    return f"{w['init'] / other['init']:.2f}" if other and other is not w else "-"


def gb(n) -> str:
    return f"{n / 1e9:.2f}"


def worst(results: list[dict], key: str) -> dict:
    return max(results, key=lambda r: r[key])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--largest", action="store_true", help="also the ZeRO-0 / ZeRO-3 step runs (largest model)")
    parser.add_argument("--only", help="run only the rows of this layout (a prefix, e.g. 'tp2')")
    parser.add_argument("--json", help="write every rank's figures to this file")
    parser.add_argument("--tiny", action="store_true", help="the recipes' own tiny model (a smoke run)")
    args = parser.parse_args(argv)
    import torch

    from plugin.models.gpt import GPT, GPTConfig

    dims = {} if args.tiny else DIMS
    cfg = GPTConfig.from_recipe_model(recipe_for("cpu_zero3_dp4", 3, dims).model)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"reference GPT {dims or 'of the recipes'}: {n_params / 1e6:.1f}M parameters, {gb(4 * n_params)} GB fp32; "
          f"{WORLD} processes")
    rows = [r for r in ROWS if args.only is None or r[0].startswith(args.only)]
    table = {}
    for row in rows:
        try:
            table[row] = run_row(row, dims)
        except Exception as e:  # one way failing must not hide the others' figures
            print(f"  FAILED {row[0]} {row[4]}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
            continue
        w = worst(table[row], "init")
        print(f"  measured {row[0]:24s} {row[4]:10s} init {gb(w['init'])} GB (pre-opt {gb(w['pre_opt'])})",
              flush=True)
    header = f"{'layout':24s} {'way':10s} {'init GB':>8s} {'model':>6s} {'/whole':>7s} {'/anchor':>8s}  " \
             "held after initialize (worst rank, GB): params grads opt-states other"
    print("\n" + header + "\n" + "-" * len(header))
    rows = [r for r in rows if r in table]
    for row in rows:
        layout, way = row[0], row[4]
        w = worst(table[row], "init")
        whole = next((worst(table[r], "init") for r in rows if r[0] == layout and r[4] == "whole"), None)
        anchor = next((worst(table[r], "init") for r in rows
                       if r[0] == layout and r[4] in ("zero.Init", "fsdp2-meta")), None)
        held = w["held"]
        held_s = " ".join(f"{gb(held.get(k, 0)):>5s}" for k in ("parameters", "gradients", "optimizer_states",
                                                                   "other"))
        print(f"{layout:24s} {way:10s} {gb(w['init']):>8s} {gb(w['model']):>6s} {_ratio(w, whole):>7s} "
              f"{_ratio(w, anchor):>8s}  {held_s}")
        if way == "meta" and whole:
            print(f"{'':24s} {'':10s} model/whole {w['model'] / whole['model']:.2f}"
                  + (f", model/anchor {w['model'] / anchor['model']:.2f}" if anchor else ""))
    if args.largest:
        print("\nlargest reference GPT that initialises and trains one step (4 ranks on this machine):")
        mem_total = _status_total()
        for row in LARGEST:
            results = run_row(row, dims, step=True)
            w = worst(results, "step")
            per_param = w["step"] / n_params
            base = max(r["base_rss"] for r in results)
            largest = (mem_total - WORLD * base) / (WORLD * per_param)
            print(f"  {row[0]:34s} peak growth {gb(w['step'])} GB per rank = {per_param:.2f} B/parameter; "
                  f"baseline RSS {gb(base)} GB/rank; MemTotal {gb(mem_total)} GB -> about {largest / 1e9:.2f}B "
                  "parameters (computed from the bytes per parameter at 162M, not searched)", flush=True)
            table[row] = results
    if args.json:
        Path(args.json).write_text(json.dumps({" | ".join(map(str, k)): v for k, v in table.items()}, indent=1))
    return 0


def _status_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemTotal not in /proc/meminfo")


if __name__ == "__main__":
    sys.exit(main())
