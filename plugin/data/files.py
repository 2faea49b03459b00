"""Local documents for training: text, JSONL (a text field) and Parquet files read with the ``datasets`` library,
local files only, in a private cache that is removed after reading (nothing under ``~/.cache``, no races between
ranks, no network). A directory stands for its ``*.txt, *.md, *.jsonl, *.json, *.parquet`` files, sorted.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import PluginError

BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def expand(paths) -> list[Path]:
    """Files named by ``paths`` (directories expanded), each checked to exist and to have a known extension."""
    files = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in BUILDERS)
            if not found:
                raise PluginError(f"--data {raw}: the directory holds no {', '.join(BUILDERS)} file")
            files += found
        elif not p.exists():
            raise PluginError(f"--data {raw}: no such file or directory")
        elif p.suffix not in BUILDERS:
            raise PluginError(f"--data {raw}: unknown file type {p.suffix or '(none)'} -> use {', '.join(BUILDERS)}")
        else:
            files.append(p)
    return files


def read_documents(paths, text_field: str = "text") -> list[str]:
    """Every document of ``paths``: a text file is one document; each JSONL line / Parquet row is one, its
    ``text_field``. Raises :class:`PluginError` for a missing file, a missing field, non-text values or no text."""
    files = expand(paths)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise PluginError("--data needs the datasets library -> pip install 'parallel-recipe[data]'") from e
    datasets.disable_progress_bars()
    docs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="plugin-data-") as cache:
        for f in files:
            builder = BUILDERS[f.suffix]
            if f.stat().st_size == 0:  # datasets raises a bare StopIteration on an empty JSONL
                continue
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=str(f), split="train", cache_dir=cache, **kwargs)
            field = "text" if builder == "text" else text_field
            if field not in ds.column_names:
                raise PluginError(f"{f} has no field {field!r}; its fields: {', '.join(ds.column_names)} -> "
                                  f"--text-field {ds.column_names[0]}")
            for i, text in enumerate(ds[field]):
                if not isinstance(text, str):
                    raise PluginError(f"{f}: row {i}: {field!r} is {type(text).__name__}, not text")
                if text:
                    docs.append(text)
            del ds
    if not docs:
        raise PluginError(f"--data {' '.join(str(p) for p in paths)}: empty dataset (no document with text)")
    return docs
