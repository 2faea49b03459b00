"""``checkpoint inspect DIR`` / ``checkpoint check DIR RECIPE [--world-size N]`` / ``checkpoint verify DIR`` /
``checkpoint export DIR -o OUT``.

``inspect`` and ``check`` read the checkpoint's JSON manifest only (no torch, nothing unpickled); ``verify`` reads
every byte of the files too, against the manifest's checksums (:mod:`plugin.checkpoint.verify`, also pure).
``export`` needs torch: it runs ``python -m plugin.checkpoint.export`` in a child process, so this module stays pure.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ..checkpoint.directory import complete_steps, resolve
from ..checkpoint.manifest import check_files, read_manifest, recipe_problems, tensor_bytes
from ..checkpoint.verify import verify
from ..errors import PluginError
from .common import EXIT_INVALID, EXIT_OK, add_world_size, load_or_report


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect, check, verify or export a checkpoint written by --save",
                       description="Inspect a checkpoint, check whether a recipe can load it, verify every byte "
                                   "against its checksums, or export one safetensors model from it.")
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND")
    cmds.required = True
    i = cmds.add_parser("inspect", help="step, layout, back end, tensors and bytes (no torch)")
    i.add_argument("directory", metavar="DIR")
    i.add_argument("--tensors", action="store_true", help="every tensor's name, shape and dtype")
    i.add_argument("--json", action="store_true")
    i.set_defaults(run=run_inspect)
    c = cmds.add_parser("check", help="can RECIPE load it? every problem at once (exit 2)")
    c.add_argument("directory", metavar="DIR")
    c.add_argument("recipe", metavar="RECIPE")
    add_world_size(c)
    c.set_defaults(run=run_check)
    v = cmds.add_parser("verify", help="every file read once, every item against its checksum; every damaged "
                                       "file and item at once (exit 2)")
    v.add_argument("directory", metavar="DIR", help="a step directory, or a --save directory (its highest complete "
                                                    "step)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(run=run_verify)
    e = cmds.add_parser("export", help="one consolidated safetensors model, streamed tensor by tensor")
    e.add_argument("directory", metavar="DIR")
    e.add_argument("-o", "--out", required=True)
    e.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    e.add_argument("--max-shard-size", metavar="SIZE", help="largest safetensors file (default 5GB; e.g. 500MB, "
                   "2GiB, or bytes); a split export gets model.safetensors.index.json")
    e.set_defaults(run=run_export)


def summary(step_dir: Path, manifest: dict) -> dict:
    roles = Counter()
    bytes_by_role = Counter()
    for t in manifest["tensors"].values():
        roles[t["role"]] += 1
        bytes_by_role[t["role"]] += tensor_bytes(t)
    params = {n: t for n, t in manifest["tensors"].items() if t["role"] == "param"}
    largest = sorted(params, key=lambda n: -tensor_bytes(params[n]))[:5]
    root = step_dir.parent
    return {"directory": str(step_dir), "step": manifest["step"], "written_by": manifest.get("written_by"),
            "layout": manifest.get("layout"), "recipe": (manifest.get("recipe") or {}).get("name"),
            "model": (manifest.get("recipe") or {}).get("model"),
            "tensors": dict(roles), "bytes": dict(bytes_by_role),
            "largest": [{"name": n, "shape": params[n]["shape"], "bytes": tensor_bytes(params[n])} for n in largest],
            "files": {n: r["size"] for n, r in manifest.get("files", {}).items()},
            "damaged": check_files(step_dir, manifest),
            "other_steps": [d.name for _, d in complete_steps(root) if d != step_dir]}


def _open(directory):
    """(step directory, manifest) of ``directory``, or None once the reason is printed."""
    try:
        step_dir = resolve(directory)
        return step_dir, read_manifest(step_dir)
    except PluginError as e:
        print(e, file=sys.stderr)
        return None


def run_inspect(args) -> int:
    opened = _open(args.directory)
    if opened is None:
        return EXIT_INVALID
    step_dir, manifest = opened
    s = summary(step_dir, manifest)
    if args.tensors:
        s["all_tensors"] = {n: {"shape": t["shape"], "dtype": t["dtype"], "role": t["role"]}
                            for n, t in manifest["tensors"].items()}
    if args.json:
        print(json.dumps(s, indent=1))
        return EXIT_OK if not s["damaged"] else EXIT_INVALID
    lay, by = s["layout"] or {}, s["written_by"] or {}
    print(f"{s['directory']}: step {s['step']}, written by {by.get('backend')} (torch {by.get('torch')})")
    context = f" x context {lay['context']}" if lay.get("context", 1) > 1 else ""
    print(f"  layout: data {lay.get('data')} x tensor {lay.get('tensor')} x pipeline {lay.get('pipeline')}{context}, "
          f"ZeRO-{lay.get('zero')}, {lay.get('precision')}, global batch {lay.get('global_batch')}")
    print(f"  recipe: {s['recipe']}; model: {json.dumps(s['model'])}")
    for role in sorted(s["tensors"]):
        print(f"  {role}: {s['tensors'][role]} tensors, {s['bytes'][role]:,} bytes")
    print("  largest: " + ", ".join(f"{t['name']} {t['shape']}" for t in s["largest"]))
    print(f"  files: {len(s['files'])}, {sum(s['files'].values()):,} bytes")
    for bad in s["damaged"]:
        print(f"  damaged: {bad}")
    if s["other_steps"]:
        print("  other complete steps: " + ", ".join(s["other_steps"]))
    if args.tensors:
        for n, t in s["all_tensors"].items():
            print(f"    {n} {t['shape']} {t['dtype']} ({t['role']})")
    return EXIT_OK if not s["damaged"] else EXIT_INVALID


def run_check(args) -> int:
    opened = _open(args.directory)
    if opened is None:
        return EXIT_INVALID
    step_dir, manifest = opened
    recipe = load_or_report(args.recipe, args.world_size)
    if recipe is None:
        return EXIT_INVALID
    world = args.world_size
    try:
        global_batch = recipe.layout(world).global_batch
    except Exception:  # noqa: BLE001 - "data": "auto" without --world-size: the batch is not known
        global_batch = None
    problems = [p.with_file(str(step_dir)) for p in recipe_problems(manifest, recipe, global_batch)]
    damaged = check_files(step_dir, manifest)
    for p in problems:
        print(p.format(), file=sys.stderr)
    for bad in damaged:
        print(f"{bad} -> resume from another step directory", file=sys.stderr)
    if damaged or any(p.is_error for p in problems):
        return EXIT_INVALID
    print(f"{step_dir}: {recipe.source or recipe.name} can load it (step {manifest['step']})")
    return EXIT_OK


def run_verify(args) -> int:
    opened = _open(args.directory)
    if opened is None:
        return EXIT_INVALID
    step_dir, manifest = opened
    try:
        r = verify(step_dir, manifest)
    except PluginError as e:  # a checksum this machine cannot compute: not damage, but nothing verified
        print(e, file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        print(json.dumps({"directory": str(step_dir), "step": manifest["step"], "files": r.files, "items": r.items,
                          "bytes": r.bytes, "seconds": round(r.seconds, 6), "gb_per_s": round(r.gb_per_s, 3),
                          "checksums": r.algorithms, "damaged": r.damaged, "unrecorded": r.unrecorded}, indent=1))
    for name in r.unrecorded:
        print(f"{step_dir / name}: not recorded in the manifest, not verified (no load reads it)", file=sys.stderr)
    if r.damaged:
        if not args.json:
            for bad in r.damaged:
                print(bad, file=sys.stderr)
        print(f"{step_dir}: {len(r.damaged)} problem(s) found in {r.files} files ({r.items} items, {r.bytes:,} bytes "
              "read)", file=sys.stderr)
        return EXIT_INVALID
    if not args.json:
        print(f"{step_dir}: step {manifest['step']}: {r.files} files, {r.items} items, {r.bytes:,} bytes verified "
              f"({', '.join(r.algorithms)}) in {r.seconds:.3f} s, {r.gb_per_s:.2f} GB/s")
    return EXIT_OK


def run_export(args) -> int:
    if _open(args.directory) is None:  # said at once, before a child that imports torch
        return EXIT_INVALID
    cmd = [sys.executable, "-m", "plugin.checkpoint.export", args.directory, "-o", args.out]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.max_shard_size:
        cmd += ["--max-shard-size", args.max_shard_size]
    return subprocess.run(cmd).returncode
