"""Every invalid recipe under tests/data/invalid is rejected, at the JSON path its entry expects.

An entry of expected.json gives ``path`` (one error expected there) or ``paths`` (all of them, at once),
optionally ``world_size`` (as --world-size) and ``contains`` (text the errors must include).
"""
import json
from pathlib import Path

import pytest

from plugin.recipe.checks import validate

HERE = Path(__file__).resolve().parents[2] / "data" / "invalid"
EXPECTED = json.loads((HERE / "expected.json").read_text())


def test_there_are_at_least_forty():
    files = sorted(p.name for p in HERE.glob("*.json") if p.name != "expected.json")
    assert len(files) >= 40
    assert sorted(EXPECTED) == files, "every invalid recipe has an expectation, and only those"
    assert all(("path" in e) != ("paths" in e) for e in EXPECTED.values()), "path or paths, not both"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rejected_at_expected_path(name):
    entry = EXPECTED[name]
    recipe, problems = validate(HERE / name, entry.get("world_size"))
    errors = [p for p in problems if p.is_error]
    assert recipe is None and errors, f"{name} was accepted"
    paths = [p.path for p in errors]
    for expected in entry.get("paths", [entry.get("path")]):  # "paths": every one is reported, in one pass
        assert expected in paths, f"{name}: expected an error at {expected}, got {paths}"
    text = "\n".join(p.format() for p in errors)
    for p in errors:
        assert p.file.endswith(name), "every problem names its file"
        assert p.hint, f"{p.format()} says nothing about what to change"
        assert p.format().startswith(f"{p.file}: {p.path}: ")
    if "contains" in entry:
        assert entry["contains"] in text, text
