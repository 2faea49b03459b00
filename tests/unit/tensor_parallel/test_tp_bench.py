"""bench/tensor_parallel.py's guard around megatron-core, without processes: only a missing megatron reads
"not installed"; any other failure (at import, or of a phase on any rank) is reported with its reason."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_tensor_parallel", ROOT / "bench" / "tensor_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_megatron(tmp_path, monkeypatch, core_body: str) -> None:
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core" / "__init__.py").write_text(core_body)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    # the fake package the test imports must not outlive it: a later importorskip("megatron.core...") found it in
    # sys.modules and failed with its error (seen when test_topology ran after this file)
    monkeypatch.setitem(sys.modules, "megatron", None)  # undone first: removes whatever "megatron" is then
    del sys.modules["megatron"]
    monkeypatch.syspath_prepend(str(tmp_path))


def test_missing_megatron_is_not_installed(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron raises ImportError(name="megatron")
    assert bench.import_mcore().startswith("not installed")


def test_a_broken_megatron_is_a_failure_with_its_reason(bench, tmp_path, monkeypatch):
    fake_megatron(tmp_path, monkeypatch, "raise RuntimeError('Torch not compiled with CUDA enabled')\n")
    assert bench.import_mcore() == "failed at import: RuntimeError: Torch not compiled with CUDA enabled"


def test_a_missing_dependency_of_megatron_is_not_called_not_installed(bench, tmp_path, monkeypatch):
    fake_megatron(tmp_path, monkeypatch, "import no_such_dependency_of_megatron\n")
    reason = bench.import_mcore()
    assert reason.startswith("failed at import: ModuleNotFoundError") and "no_such_dependency_of_megatron" in reason


def test_guarded_reports_a_phase_that_failed_here_or_on_another_rank(bench):
    seen = []

    def agree(ok):
        seen.append(ok)
        return ok

    def boom():
        raise ValueError("shapes do not match\nsecond line")

    assert bench.guarded("build", lambda: 7, agree) == (7, None)
    assert bench.guarded("timing", boom, agree) == (None, "failed in timing: ValueError: shapes do not match")
    assert seen == [True, False], "every rank reaches the agreement, failed or not"
    assert bench.guarded("counting", lambda: 7, lambda ok: False) == (None, "failed in counting on another rank")
    with pytest.raises(KeyboardInterrupt):  # only errors are reported; an interrupt still stops the run
        bench.guarded("timing", lambda: (_ for _ in ()).throw(KeyboardInterrupt()), agree)


def test_counts_match_the_targets_only_when_they_are_exact(bench):
    block = {"plugin": ({"AR": 2}, {"AR": 2}),
             "plugin, sequence parallel": ({"AG": 2, "RS": 2}, {"AG": 2, "RS": 2, "grad-AR": 1})}
    embedding = {"plugin": ({"AR": 1}, {}), "plugin, sequence parallel": ({"RS": 1}, {"AG": 1})}
    assert bench.counts_match(block, embedding)
    assert not bench.counts_match({**block, "plugin": ({"AR": 2}, {"AR": 3})}, embedding)
    assert not bench.counts_match(block, {**embedding, "plugin, sequence parallel": ({"AR": 1}, {"AG": 1})})
