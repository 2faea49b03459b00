"""``python -m plugin checkpoint inspect|check`` on a manifest alone (no torch): what it reports, and every problem
at once with exit 2."""
from __future__ import annotations

import json

from plugin.checkpoint.directory import MANIFEST
from plugin.cli.main import main


def _checkpoint(root, hidden=64, files=None):
    d = root / "step-00000004"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x" * 10)
    manifest = {"format": "plugin-checkpoint", "version": 1, "complete": True, "step": 4,
                "written_by": {"backend": "deepspeed", "torch": "2.13.0"},
                "layout": {"data": 2, "tensor": 2, "pipeline": 1, "zero": 1, "precision": "fp32", "global_batch": 16},
                "recipe": {"name": "cpu_tp2_dp2", "model": {"layers": 4, "hidden": hidden, "heads": 4, "vocab": 128,
                                                            "seq_len": 64}},
                "optimizer": {"name": "adamw"},
                "tensors": {"embed.weight": {"role": "param", "shape": [128, hidden], "dtype": "float32"}},
                "files": files or {".metadata": {"size": 10, "crc32": 0}}}
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d


def test_inspect_names_step_back_end_layout_and_bytes(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 4, written by deepspeed" in out and "data 2 x tensor 2 x pipeline 1, ZeRO-1" in out
    assert "param: 1 tensors, 32,768 bytes" in out


def test_check_names_every_model_difference_and_exits_2(tmp_path, capsys):
    _checkpoint(tmp_path, hidden=32)
    assert main(["checkpoint", "check", str(tmp_path), "cpu_single"]) == 2
    err = capsys.readouterr().err
    assert "$.model.hidden: checkpoint 32, recipe 64" in err
    assert main(["checkpoint", "check", str(tmp_path / "step-00000004"), "cpu_single"]) == 2


def test_check_accepts_another_layout_and_names_a_truncated_file(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["checkpoint", "check", str(tmp_path), "cpu_pp2_dp2"]) == 0
    (tmp_path / "step-00000004" / ".metadata").write_bytes(b"x" * 3)
    assert main(["checkpoint", "check", str(tmp_path), "cpu_pp2_dp2"]) == 2
    assert ".metadata: 3 bytes, the manifest recorded 10" in capsys.readouterr().err
