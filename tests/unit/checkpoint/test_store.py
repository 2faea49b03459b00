"""The checkpoint room in one process (no process group): resharding on read, the directory protocol, and
checkpoints that are truncated, corrupted or planted with a pickle that would run code."""
from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch

from plugin.checkpoint.boxes import (
    Entry,
    LocalState,
    Piece,
    TensorLayout,
    box,
    compose,
    flat_held,
    tp_segments,
    whole_held,
)
from plugin.checkpoint.checksum import digest
from plugin.checkpoint.dcp_io import CheckpointError, read_metadata_file
from plugin.checkpoint.directory import MANIFEST, resolve, settle
from plugin.checkpoint.manifest import model_problems
from plugin.checkpoint.store import load, open_checkpoint, save
from plugin.errors import PluginError
from plugin.tensor_parallel.sharding import shard

warnings.filterwarnings("ignore", message=".*process group.*")


def _tp_state(full: dict[str, torch.Tensor], tp: int, layout: TensorLayout) -> LocalState:
    """What `tp` tensor ranks would write, all from this one process (DCP takes several chunks per tensor)."""
    entries = {}
    for name, t in full.items():
        pieces = []
        for r in range(tp):
            local = shard(t, layout.dim, tp, r, pad=bool(layout.padding))
            pieces += compose(whole_held(local), tp_segments(local.shape, t.shape, layout, r, tp))
        entries[name] = Entry(tuple(t.shape), t.dtype, pieces)
    return LocalState(entries)


PADDED = TensorLayout(True, 0, 1, 1)


def _save(tmp_path, full, tp=2, layout=PADDED, step=4, keep=None):
    return save(_tp_state(full, tp, layout), tmp_path, step, {"layout": {"global_batch": 8}}, keep=keep)


@pytest.fixture
def full():
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(7, 5, generator=g), "w": torch.randn(3, 4, 2, generator=g)}


def test_tp2_padded_save_reads_back_into_flat_fragments_bit_exactly(tmp_path, full):
    _save(tmp_path, {"embed.weight": full["embed.weight"]})
    step_dir, manifest = open_checkpoint(tmp_path)
    target = torch.full((7, 5), float("nan"))
    flat = target.view(-1)
    pieces = [Piece(o, v) for part in (flat[:13], flat[13:]) for o, v in
              flat_held((7, 5), int(part.data_ptr() - flat.data_ptr()) // 4, part)]
    load(LocalState({"embed.weight": Entry((7, 5), torch.float32, pieces)}), step_dir, manifest)
    assert torch.equal(target, full["embed.weight"])
    assert manifest["tensors"]["embed.weight"]["shape"] == [7, 5]


def test_a_hole_in_what_is_asked_is_refused(tmp_path, full):
    partial = _tp_state({"w": full["w"]}, 1, TensorLayout())
    partial.entries["w"].pieces = [Piece((0, 0, 0), full["w"][:2])]  # row 2 never written (DCP 2.13 saves it)
    save(partial, tmp_path, 1, {})
    step_dir, manifest = open_checkpoint(tmp_path)
    target = LocalState({"w": Entry((3, 4, 2), torch.float32, [Piece((0, 0, 0), torch.zeros(3, 4, 2))])})
    with pytest.raises(CheckpointError, match=r"w: the checkpoint covers 16 of the 24 elements"):
        load(target, step_dir, manifest)  # DCP itself would leave row 2 as it was, silently


def test_directory_protocol_partial_latest_keep(tmp_path, full):
    for step in (2, 4, 6):
        _save(tmp_path, full, step=step, keep=2)
    settle()  # the dropped steps are deleted in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000006"]
    (tmp_path / "step-00000008.partial").mkdir()  # a save a crash interrupted
    (tmp_path / "latest").write_text("step-00000004\n")  # stale: a crash between the rename and latest
    assert resolve(tmp_path).name == "step-00000006"
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "step-00000002.partial").mkdir()
    with pytest.raises(PluginError, match=r"step-00000002.partial \(incomplete: no manifest\)"):
        resolve(empty)


def test_a_save_below_the_highest_step_drops_the_abandoned_timeline(tmp_path, full):
    """Steps 2-8 saved, then a run resumed from step 2 saves step 4 (--keep 2): the abandoned 6 and 8 (and the old
    4) go before the new 4 is committed, so --resume and --keep see one timeline: 2 and the new 4."""
    for step in (2, 4, 6, 8):
        _save(tmp_path, full, step=step)
    old4 = json.loads((tmp_path / "step-00000004" / MANIFEST).read_text())["save_seconds"]
    changed = {n: t * 2 for n, t in full.items()}
    _save(tmp_path, changed, step=4, keep=2)
    settle()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    assert (tmp_path / "latest").read_text() == "step-00000004\n" and resolve(tmp_path).name == "step-00000004"
    step_dir, manifest = open_checkpoint(tmp_path)
    got = torch.empty(3, 4, 2)
    load(LocalState({"w": Entry((3, 4, 2), torch.float32, [Piece((0, 0, 0), got)])}), step_dir, manifest)
    assert torch.equal(got, changed["w"]), f"the new step 4 (the old one took {old4} s) is what resumes"


def test_a_fresh_train_run_refuses_a_save_directory_holding_another_run(tmp_path, full, capsys):
    import train

    _save(tmp_path, full, step=6)
    assert train.main(["--recipe", "cpu_single", "--steps", "2", "--save", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds the complete checkpoints of another run (steps 6)" in err and f"--resume {tmp_path}" in err


def test_truncated_file_is_named_with_both_sizes(tmp_path, full):
    d = _save(tmp_path, full)
    data = next(d.glob("__0_*.distcp"))
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"{data.name}: {size - 100} bytes, the manifest recorded {size}"):
        open_checkpoint(tmp_path)


def test_flipped_byte_is_found_by_its_checksum(tmp_path, full):
    d = _save(tmp_path, full)
    data = next(d.glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # stock DCP loads this silently with one tensor wrong
    data.write_bytes(bytes(raw))
    step_dir, manifest = open_checkpoint(tmp_path)
    target = LocalState({n: Entry(tuple(t.shape), torch.float32, [Piece((0,) * t.dim(), torch.empty_like(t))])
                         for n, t in full.items()})  # a load that reads every byte of the file
    algo = manifest["files"][data.name]["checksum"]
    with pytest.raises(CheckpointError, match=rf"{data.name}: .* at byte \d+: {algo} \w+, the manifest recorded "
                                              r"\w+ \(corrupted\)"):
        load(target, step_dir, manifest)
    from plugin.checkpoint.export import export

    with pytest.raises(CheckpointError, match=rf"{data.name}: .* {algo} \w+, the manifest recorded \w+ \(corrupted\)"):
        export(str(tmp_path), str(tmp_path / "out"))  # not a consolidated file with one wrong weight
    assert not (tmp_path / "out").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, full):
    d = _save(tmp_path, full)
    marker = tmp_path / "pwned"
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="posix.system is not allowed|os.system is not allowed"):
        read_metadata_file(d / ".metadata")
    # through the whole load as well: whatever refuses it first, nothing ran
    manifest = json.loads((d / MANIFEST).read_text())
    size, algo = (d / ".metadata").stat().st_size, manifest["files"][".metadata"]["checksum"]
    manifest["files"][".metadata"] = {"size": size, "checksum": algo,
                                      "items": [[0, size, digest(algo, (d / ".metadata").read_bytes())]]}
    (d / MANIFEST).write_text(json.dumps(manifest))
    step_dir, manifest = open_checkpoint(tmp_path)
    target = LocalState({"w": Entry((3, 4, 2), torch.float32, [Piece((0, 0, 0), torch.empty(3, 4, 2))])})
    with pytest.raises(CheckpointError, match="is not allowed"):
        load(target, step_dir, manifest)
    assert not marker.exists()


def test_every_model_mismatch_is_named():
    manifest = {"tensors": {"a": {"role": "param", "shape": [2, 3]}, "b": {"role": "param", "shape": [4]},
                            "optim.a.exp_avg": {"role": "optim", "shape": [2, 3]}}}
    got = [p.format() for p in model_problems(manifest, {"a": (3, 3), "c": (1,)})]
    assert len(got) == 3
    assert any("this model has c" in g for g in got) and any("the checkpoint has b" in g for g in got)
    assert any("a: checkpoint shape [2, 3], this model [3, 3]" in g for g in got)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("parts,padding,n", [(1, 0, 12), (3, 0, 12), (1, 1, 11), (1, 3, 9)])
def test_tp_segments_place_every_shard_of_sharding_shard(tp, parts, padding, n):
    full = torch.arange(n * 5.0).view(n, 5)
    if parts > 1 and n % (parts * tp):
        pytest.skip("not divisible")
    pad = padding and n % tp
    out = torch.full_like(full, float("nan"))
    for r in range(tp):
        local = shard(full, 0, tp, r, parts=parts, pad=bool(pad))
        lay = TensorLayout(tp > 1, 0, parts, (-n) % tp if pad else 0)
        for p in compose(whole_held(local), tp_segments(local.shape, full.shape, lay, r, tp)):
            box(out, p.offsets, p.view.shape).copy_(p.view)
    assert torch.equal(out, full)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("parts,dim", [(3, 0), (1, 0), (1, 1)])
def test_a_transposed_conv1d_shard_lands_in_the_source_layout(tp, parts, dim):
    """GPT-2's Conv1D keeps [in, out]; the TP layer holds its shard of [out, in] (packed c_attn: parts 3; c_proj: a
    square row shard, which shapes alone would place wrongly)."""
    source = torch.arange(8 * 24.0).view(8, 24) if parts == 3 else torch.arange(64.0).view(8, 8)
    linear = source.t()
    out = torch.full_like(source, float("nan"))
    for r in range(tp):
        local = shard(linear, dim, tp, r, parts=parts)
        lay = TensorLayout(tp > 1, dim, parts, 0, transposed=True)
        for p in compose(whole_held(local), tp_segments(local.shape, source.shape, lay, r, tp)):
            box(out, p.offsets, p.view.shape).copy_(p.view)
    assert torch.equal(out, source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_an_items_bytes_are_viewed_without_unpickling(dtype):
    """What the load and the export take (:mod:`plugin.checkpoint.items`): the torch.save zip's data record, viewed;
    None (the torch.load fallback) for what is not a row-major chunk of that size."""
    import io

    from plugin.checkpoint.items import item_tensor

    t = (torch.arange(3 * 5 * 7) * 3).to(dtype).view(3, 5, 7)
    buf = io.BytesIO()
    torch.save(t, buf)
    raw = memoryview(bytearray(buf.getvalue()))
    got = item_tensor(raw, dtype, (3, 5, 7))
    assert got is not None and torch.equal(got, t)
    assert item_tensor(raw, dtype, (3, 5, 6)) is None  # a size that does not match
    assert item_tensor(raw[:-30], dtype, (3, 5, 7)) is None  # a damaged tail
