"""One consolidated safetensors model from a checkpoint, streamed tensor by tensor (``python -m plugin checkpoint
export`` runs ``python -m plugin.checkpoint.export``): peak memory is one assembled tensor plus one chunk, whatever
the model size.

safetensors has no incremental writer, so the files are written here in its format: an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}`` (padded with spaces to 8 bytes), then the data in
header order. The header is known before any data (names, dtypes and shapes are in DCP's metadata), so each tensor
is assembled from its chunks (read with ``weights_only=True``), written, and freed. Files of at most
``max_shard_size`` bytes (default 5 GB, ``--max-shard-size``; a tensor larger than the limit gets a file of its
own): ``model-0000i-of-0000N.safetensors`` + Hugging Face's ``model.safetensors.index.json`` when split.
``OUT.partial`` is renamed to ``OUT`` at the end. Tied aliases are written too (``GPT.load_state_dict`` wants them;
``from_pretrained`` re-ties them). A transformers model's ``config.json`` (and ``generation_config.json``), recorded
in the manifest at save time, are written beside the weights, so ``AutoModelForCausalLM.from_pretrained(OUT)``
loads the export; the reference GPT's recipe ``model`` block goes to ``recipe_model.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import PluginError
from .boxes import box
from .dcp_io import ROW_MAJOR, ItemReader, check_whole_file, chunk_table, read_metadata_file
from .store import open_checkpoint

MAX_FILE = 5_000_000_000
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
       torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _assemble(reader: ItemReader, step_dir: Path, md, chunks, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One whole tensor from its saved chunks, each chunk's bytes checked against the checksum written with them."""
    meta = md.state_dict_metadata[name]
    out = torch.empty(tuple(meta.size), dtype=dtype)
    for chunk in meta.chunks:
        index = MetadataIndex(name, chunk.offsets)
        info = md.storage_data[index]
        with reader.open(step_dir / info.relative_path, info.relative_path) as f:
            box(out, chunk.offsets, chunk.sizes).copy_(f.read(index, info, chunks[index]))
    return out


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not m:
        raise PluginError(f"--max-shard-size {text!r}: not a size -> write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    unit = (m.group(2) or "b").rstrip("b") or "b"
    scale = {"b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30,
             "ti": 2**40}[unit]
    n = int(float(m.group(1)) * scale)
    if n < 1:
        raise PluginError(f"--max-shard-size {text!r}: must be at least one byte")
    return n


def _hf_files(manifest: dict, dtype: str | None) -> dict[str, dict]:
    """``{file name: JSON}`` of the transformers config files the manifest recorded (none for other models)."""
    model = manifest.get("model") or {}
    out = {}
    if model.get("hf_config"):
        config = dict(model["hf_config"])
        if dtype:  # the exported weights' dtype, which from_pretrained(dtype="auto") takes
            config["dtype"] = str(_DTYPES[dtype]).split(".")[-1]
            config.pop("torch_dtype", None)
        out["config.json"] = config
    if model.get("hf_generation_config"):
        out["generation_config.json"] = model["hf_generation_config"]
    return out


def export(directory: str, out: str, dtype: str | None = None, max_shard_size: int = MAX_FILE) -> dict:
    step_dir, manifest = open_checkpoint(directory)  # then every chunk read is checked: a flipped bit is named
    check_whole_file(step_dir / ".metadata", manifest["files"].get(".metadata"))
    md = read_metadata_file(step_dir / ".metadata")
    chunks, reader = chunk_table(md), ItemReader(manifest["files"], manifest.get("item_format") == ROW_MAJOR)
    names = [n for n, t in manifest["tensors"].items() if t["role"] == "param"]
    aliases = {a: src for a, src in (manifest.get("model") or {}).get("tied", {}).items() if src in names}
    stored = {n: getattr(torch, manifest["tensors"][n]["dtype"]) for n in names}
    target = {n: (_DTYPES[dtype] if dtype and stored[n].is_floating_point else stored[n]) for n in names}
    order = names + sorted(aliases)
    sizes = {n: math.prod(manifest["tensors"][aliases.get(n, n)]["shape"]) * target[aliases.get(n, n)].itemsize
             for n in order}
    files, current, used = [], [], 0
    for n in order:
        if current and used + sizes[n] > max_shard_size:
            files.append(current)
            current, used = [], 0
        current.append(n)
        used += sizes[n]
    files.append(current)
    final, tmp = Path(out), Path(out + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    file_names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map = {}
    for fname, group in zip(file_names, files, strict=True):
        header, offset = {}, 0
        for n in group:
            src = aliases.get(n, n)
            header[n] = {"dtype": _ST[target[src]], "shape": manifest["tensors"][src]["shape"],
                         "data_offsets": [offset, offset + sizes[n]]}
            offset += sizes[n]
            weight_map[n] = fname
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":"))
        text += " " * (-len(text) % 8)
        with open(tmp / fname, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text.encode())
            for n in group:
                t = _assemble(reader, step_dir, md, chunks, aliases.get(n, n), target[aliases.get(n, n)])
                if t.numel():
                    f.write(t.contiguous().view(-1).view(torch.uint8).numpy())  # its memory, not a copy
                del t
            f.flush()
            os.fsync(f.fileno())
    if len(files) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=1) + "\n")
    for fname, data in _hf_files(manifest, dtype).items():
        (tmp / fname).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    model = (manifest.get("recipe") or {}).get("model")
    if model:
        (tmp / "recipe_model.json").write_text(json.dumps(model, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return {"files": file_names, "tensors": len(order), "bytes": sum(sizes.values()), "step": manifest["step"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugin checkpoint export")
    p.add_argument("directory")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--dtype", choices=sorted(_DTYPES))
    p.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB; 500MB, 2GiB, bytes)")
    args = p.parse_args(argv)
    try:
        done = export(args.directory, args.out, args.dtype, parse_size(args.max_shard_size))
    except PluginError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{args.out}: {done['tensors']} tensors, {done['bytes']:,} bytes in {', '.join(done['files'])} "
          f"(step {done['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
