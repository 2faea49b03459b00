"""``python -m plugin checkpoint verify DIR`` (:mod:`plugin.checkpoint.verify`) on real checkpoints written by the
store (one process, no process group): every item read and checked, every damaged file and item named at once, exit
2; memory bounded by the read buffer, not by the files."""
from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from plugin.checkpoint.checksum import Hasher, digest
from plugin.checkpoint.dcp_io import read_metadata_file
from plugin.checkpoint.manifest import read_manifest
from plugin.checkpoint.verify import item_names, verify
from plugin.cli.main import main

from .test_store import _save


@pytest.fixture
def full():
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(7, 5, generator=g), "w": torch.randn(3, 4, 2, generator=g),
            "big": torch.randn(63, 33, generator=g)}  # odd rows: the helper pads by one


def _files(d):
    return sorted(d.glob("*.distcp"))


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_the_hash_is_the_one_the_save_takes(algorithm):
    data = bytes(range(256)) * 37
    h = Hasher(algorithm)
    for at in range(0, len(data), 1000):  # in pieces, as verify feeds it
        h.update(memoryview(data)[at: at + 1000])
    assert h.hexdigest() == digest(algorithm, data)


def _names_through_torch(d):
    """What DCP's own classes say (through the store's restricted unpickler): the items' tensors and chunks."""
    md = read_metadata_file(d / ".metadata")
    return {(i.relative_path, i.offset): f"{k.fqn} at {tuple(k.offset)}" for k, i in md.storage_data.items()}


def test_items_are_named_as_dcps_own_classes_name_them(tmp_path, full):
    d = _save(tmp_path, full)
    names = item_names(d / ".metadata")
    assert names == _names_through_torch(d) and len(names) == 6  # three tensors, two tensor-rank chunks each
    assert "embed.weight at (4, 0)" in names.values()
    (d / "evil").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would run code: refused, no names
    assert item_names(d / "evil") == {}


def test_an_intact_checkpoint_verifies_every_byte(tmp_path, full, capsys):
    d = _save(tmp_path, full)
    manifest = read_manifest(d)
    total = sum(r["size"] for r in manifest["files"].values())
    items = sum(len(r["items"]) for r in manifest["files"].values())
    for chunk in (7, 1 << 20):  # items cut into many reads, and each item in one
        r = verify(d, manifest, chunk=chunk)
        assert (r.damaged, r.files, r.items, r.bytes) == ([], len(manifest["files"]), items, total)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0  # the --save directory: its highest step
    out = capsys.readouterr().out
    assert f"{d}: step 4: {len(manifest['files'])} files, {items} items, {total:,} bytes verified" in out
    assert " s, " in out and "GB/s" in out
    assert main(["checkpoint", "verify", str(d), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["bytes"], got["items"], got["damaged"], got["step"]) == (total, items, [], 4)


def test_flipped_bytes_and_a_truncated_file_are_named_at_once(tmp_path, full, capsys):
    d = _save(tmp_path, full)
    manifest, names = read_manifest(d), _names_through_torch(d)
    data, meta = _files(d)[0], d / ".metadata"  # one process: one data file
    items = manifest["files"][data.name]["items"]
    assert len(items) >= 4, items
    raw = bytearray(data.read_bytes())
    size = len(raw)
    off0, n0, _ = items[0]
    raw[off0 + n0 // 2] ^= 0x01  # one bit, in the middle of the first item
    cut = items[2][0] + items[2][1] // 2  # then cut in the middle of the third
    data.write_bytes(bytes(raw[:cut]))
    m = bytearray(meta.read_bytes())
    m[-1] ^= 0x80
    meta.write_bytes(bytes(m))
    r = verify(d, manifest, chunk=64)
    algo = manifest["files"][data.name]["checksum"]
    assert len(r.damaged) == 4, r.damaged
    assert r.damaged[0].startswith(f"{meta}: item at byte 0 ({len(m)} bytes): {algo} ")
    assert r.damaged[1].startswith(f"{data}: {cut} bytes, the manifest recorded {size} (truncated or overwritten)")
    assert r.damaged[2].startswith(f"{data}: item at byte {off0} ({n0} bytes): {algo} ")  # .metadata is damaged:
    assert all("the manifest recorded" in p and "(corrupted)" in p for p in (r.damaged[0], r.damaged[2]))  # no names
    assert r.damaged[3].startswith(f"{data}: {len(items) - 2} item(s) from byte {items[2][0]} on are cut off: the "
                                   f"file ends at byte {cut} (truncated)")
    meta.write_bytes(bytes(m[:-1]) + bytes([m[-1] ^ 0x80]))  # .metadata mended: the items are named
    r = verify(d, manifest)
    assert len(r.damaged) == 3, r.damaged
    assert r.damaged[1].startswith(f"{data}: item at byte {off0} ({n0} bytes, {names[data.name, off0]}): {algo} ")
    cut_names = "; ".join(names[data.name, o] for o, _, _ in items[2:5]) + ("; ..." if len(items) > 5 else "")
    assert r.damaged[2].startswith(f"{data}: {len(items) - 2} item(s) from byte {items[2][0]} on are cut off "
                                   f"({cut_names}): the file ends at byte {cut} (truncated)")
    assert all("-> resume from an earlier step directory" in p for p in r.damaged)
    assert r.bytes == len(m) + items[2][0]  # the second item is read and passes; nothing past the cut is read
    assert main(["checkpoint", "verify", str(d)]) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in r.damaged) and f"{d}: 3 problem(s) found in 2 files" in err


def test_a_missing_file_and_a_damaged_item_table_are_named(tmp_path, full, capsys):
    d = _save(tmp_path, full)
    manifest = read_manifest(d)
    data = _files(d)[0]
    data.unlink()
    manifest["files"][".metadata"]["items"][0][1] -= 1  # the table no longer covers the file
    r = verify(d, manifest)
    assert r.damaged == [
        f"{d / '.metadata'}: the manifest's item table is inconsistent: the items end at byte "
        f"{manifest['files']['.metadata']['size'] - 1}, the recorded size is {manifest['files']['.metadata']['size']} "
        "(damaged manifest) -> resume from an earlier step directory (checkpoint inspect DIR lists them)",
        r.damaged[1],
        f"{data}: missing -> resume from an earlier step directory (checkpoint inspect DIR lists them)"]
    assert r.damaged[1].startswith(f"{d / '.metadata'}: item at byte 0 (") and "(corrupted)" in r.damaged[1]
    (d / "__9_0.distcp").write_bytes(b"stray")
    assert main(["checkpoint", "verify", str(d)]) == 2
    assert f"{d / '__9_0.distcp'}: not recorded in the manifest, not verified" in capsys.readouterr().err


def test_memory_is_the_read_buffer_not_the_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    d = _save(tmp_path, {"w": torch.randn(1024, 512, generator=g)}, tp=1)  # one 2 MiB item
    manifest = read_manifest(d)
    assert max(r["size"] for r in manifest["files"].values()) > 2 << 20
    tracemalloc.start()
    try:
        r = verify(d, manifest, chunk=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.damaged == [] and r.bytes > 2 << 20
    assert peak < 256 << 10, f"verify held {peak:,} bytes at its peak for a 64 KiB buffer"
