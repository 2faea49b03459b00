"""initialize(weights=DIR)'s files against the model, before any process group: what is refused, by name; and a unit
filled from the files, whole or through a tensor-parallel cut, reading only what the cut keeps."""
import pytest
import torch

from plugin.errors import PluginError
from plugin.materialize.units import capture, twin

safetensors_torch = pytest.importorskip("safetensors.torch")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 2, bias=False)


def _units():
    with torch.device("meta"):
        return capture(Net())


def _save(directory, tensors):
    directory.mkdir(exist_ok=True)
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _tensors():
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in Net().state_dict().items()}


def test_missing_tensor_and_shape_mismatch_are_named(tmp_path):
    from plugin.materialize.weights import SafetensorsWeights

    tensors = _tensors()
    del tensors["a.bias"]
    tensors["b.weight"] = torch.zeros(3, 6)
    source = SafetensorsWeights(_save(tmp_path / "w", tensors))
    with pytest.raises(PluginError, match=r"2 tensor\(s\) do not fit the model: a.bias \(6,\) is not in the files; "
                                          r"b.weight: the files hold shape \(3, 6\), the model \(2, 6\)"):
        source.check(_units())


def test_pickle_files_are_refused(tmp_path):
    from plugin.materialize.weights import SafetensorsWeights

    d = tmp_path / "bin"
    d.mkdir()
    torch.save(_tensors(), d / "pytorch_model.bin")
    with pytest.raises(PluginError, match=r"pytorch_model.bin.*pickle files, which run code when loaded, are not read"):
        SafetensorsWeights(d)


def test_a_unit_reads_what_the_cut_keeps(tmp_path):
    """A cut keeping rows 2-3 of a.weight and a.bias: 2 x 4 + 2 floats read, the values the files hold."""
    from plugin.materialize.weights import SafetensorsWeights

    tensors = _tensors()
    source = SafetensorsWeights(_save(tmp_path / "w", tensors))
    units = _units()
    source.check(units)
    unit = next(u for u in units if u.name == "a")

    def cut(dense):
        out = torch.nn.Linear(4, 2)
        out.weight = torch.nn.Parameter(dense.weight[2:4].clone())
        out.bias = torch.nn.Parameter(dense.bias[2:4].clone())
        return out

    dense = twin(unit, torch.device("cpu"))
    source.fill(unit, dense, cut)
    assert source.bytes_read == (2 * 4 + 2) * 4
    piece = cut(dense)
    assert torch.equal(piece.weight, tensors["a.weight"][2:4]) and torch.equal(piece.bias, tensors["a.bias"][2:4])
    whole = twin(unit, torch.device("cpu"))
    source.fill(unit, whole)
    assert torch.equal(whole.weight, tensors["a.weight"]) and source.bytes_read == (2 * 4 + 2 + 6 * 4 + 6) * 4


def test_a_sink_reads_its_piece_rows_or_a_flat_range(tmp_path):
    """What FSDP2 (a box of rows) and ZeRO-3 (a flat range, read as the rows that cover it) ask the source for:
    the files' values, and only the rows asked for counted; ``skip`` leaves a tensor at its init."""
    from plugin.materialize.weights import SafetensorsWeights

    tensors = _tensors()
    source = SafetensorsWeights(_save(tmp_path / "w", tensors))
    unit = next(u for u in _units() if u.name == "a")
    assert source.holds(unit, "weight") and not source.holds(unit, "nothing")
    rows = source.read(unit, "weight", box=((3, 6), (0, 4)))
    assert torch.equal(rows, tensors["a.weight"][3:6]) and source.bytes_read == 3 * 4 * 4
    flat = source.read(unit, "weight", flat=(5, 14))  # elements 5..13 of a 6 x 4 tensor: rows 1-3
    assert torch.equal(flat, tensors["a.weight"].reshape(-1)[5:14]) and source.bytes_read == (12 + 12) * 4
    assert torch.equal(source.read(unit, "bias", flat=(3, 6)), tensors["a.bias"][3:6])
    assert source.bytes_read == (24 + 3) * 4
    assert source.read(unit, "weight", flat=(8, 8)).numel() == 0 and source.bytes_read == 27 * 4
    dense = twin(unit, torch.device("cpu"))
    with torch.no_grad():
        dense.weight.fill_(7.0)
    source.fill(unit, dense, skip={("param", "weight")})
    assert bool((dense.weight == 7.0).all()) and torch.equal(dense.bias, tensors["a.bias"])
