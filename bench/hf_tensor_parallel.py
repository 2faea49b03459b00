"""The plugin's tensor parallelism against transformers' own on the same Llama, tp=2 on gloo, side by side.

Both load one local ``save_pretrained`` directory (a Llama from a config, random weights): transformers through
``from_pretrained(dir, tp_plan="auto")`` (DTensor parameters), the plugin through ``plugin.initialize(model, recipe at
tensor 2, data 1, backend="native")`` and ``train_step`` on the dict batch ``{"input_ids", "labels"}`` (what users
get, the data contract's check included). Same ids on both ranks, AdamW, no clipping. Steps alternate between the
two (a round = one step of each, the order flipped every round), each timed between barriers; the table gives the
median after the warm-up rounds and the ratio plugin / transformers (goal <= 0.9). Losses of the first steps are
printed side by side (same model, same data: they agree).

Collectives per decoder layer (forward + backward): ``torch.profiler``'s ``gloo:*`` CPU events (where the
plugin's ``dist.all_reduce`` and DTensor's functional collectives both end), counted for one step at 2 and 4 layers;
per layer = (count at 4 - count at 2) / 2, so the embedding, head and per-step checks cancel.

Usage: python bench/hf_tensor_parallel.py [--rounds 10] [--hidden 256] [--layers 4] [--seq 128] [--batch 4]
(relaunches itself under torchrun with 2 processes)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast", "alltoall", "all_to_all")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dir", help="where the saved models go (default: a temporary directory)")
    return p.parse_args(argv)


def table(rows: list[tuple[str, float, float, float]]) -> str:
    """``rows``: (who, step ms, all_reduce per layer, all_gather per step); the ratio is against the first row."""
    base = rows[0][1]
    lines = [f"{'tp=2, gloo':<26} {'step ms':>9} {'all_reduce/layer':>17} {'all_gather/step':>16} {'ratio':>6}"]
    for who, ms, ar, ag in rows:
        lines.append(f"{who:<26} {ms:>9.1f} {ar:>17.1f} {ag:>16.1f} {ms / base:>6.2f}")
    return "\n".join(lines)


def _config(tf, args, layers):
    return tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=4, intermediate_size=args.hidden * 11 // 4,
                          max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)


def _recipe(args, layers):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_tp2_dp2").to_dict()
    data.update(name="bench_hf_tp2", parallelism={"data": 1, "tensor": 2, "pipeline": 1}, zero={"stage": 0},
                batch={"global": args.batch, "micro": args.batch}, gradient_clipping=0.0,
                model={"layers": layers, "hidden": args.hidden, "heads": 8, "kv_heads": 4,
                       "ffn_hidden": args.hidden * 11 // 4, "vocab": args.vocab, "seq_len": args.seq})
    data["optimizer"] = {**data["optimizer"], "weight_decay": 0.0}
    return Recipe.from_dict(data)


def _count(step) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    c = collections.Counter()
    for e in prof.events():
        # one collective shows up at several levels (c10d::allreduce_, _c10d_functional::all_reduce, the
        # backend's gloo:all_reduce): count the backend's event, where both TPs' collectives meet
        name = e.name.lower()
        if name.startswith("gloo:") and any(k in name for k in KEYS):
            c["all_gather" if "gather" in name else "all_reduce" if "reduce" in name and "scatter" not in name
              else e.name] += 1
    return c


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf

    import plugin

    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.dir)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def saved(layers):
        d = root / f"llama{layers}"
        if rank == 0 and not d.exists():
            torch.manual_seed(0)
            tf.LlamaForCausalLM(_config(tf, args, layers)).save_pretrained(d)
        dist.barrier()
        return d

    def pair(layers):
        d = saved(layers)
        hf = tf.AutoModelForCausalLM.from_pretrained(d, tp_plan="auto")
        opt = torch.optim.AdamW(hf.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

        def hf_step():
            loss = hf(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())

        engine = plugin.initialize(tf.AutoModelForCausalLM.from_pretrained(d), _recipe(args, layers),
                                   backend="native")
        return hf_step, lambda: engine.train_step(batch)

    counts = {}
    for layers in (2, 4):
        hf_step, pl_step = pair(layers)
        hf_step(), pl_step()  # warm
        counts["transformers", layers], counts["plugin", layers] = _count(hf_step), _count(pl_step)
    hf_step, pl_step = pair(args.layers)
    times = {"transformers": [], "plugin": []}
    losses = {"transformers": [], "plugin": []}
    steps = {"transformers": hf_step, "plugin": pl_step}
    for r in range(args.rounds):
        order = ["transformers", "plugin"] if r % 2 == 0 else ["plugin", "transformers"]
        for who in order:
            dist.barrier()
            t = time.perf_counter()
            losses[who].append(steps[who]())
            times[who].append(time.perf_counter() - t)
    if rank == 0:
        rows = []
        for who in ("transformers", "plugin"):
            per_layer = {k: (counts[who, 4][k] - counts[who, 2][k]) / 2 for k in ("all_reduce", "all_gather")}
            rows.append((f"{who}{' tp_plan=auto' if who == 'transformers' else ' initialize'}",
                         1e3 * statistics.median(times[who][args.warmup:]), per_layer["all_reduce"],
                         counts[who, args.layers if args.layers in (2, 4) else 4]["all_gather"]))
        print(f"Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}, AdamW; median of "
              f"{args.rounds - args.warmup} interleaved rounds")
        print(table(rows))
        print("losses (first 4 steps):", json.dumps({k: [round(x, 5) for x in v[:4]] for k, v in losses.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-hf-tp-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               *(argv if argv is not None else sys.argv[1:]), "--dir", args.dir or tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
