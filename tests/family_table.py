"""docs/models-and-data.md's table of transformers families and layouts, generated from the tests' own lists.

Each family test under tests/dist (tensor 2, pipeline 2, the layouts combining axes) names its ``LAYOUTS`` and the
``FAMILIES`` it trains in each, on both back ends unless its ``BACK_ENDS`` says otherwise, against one process;
this module turns those lists into the table, and tests/unit/test_family_table.py holds the docs to it. After
changing a list: ``python -m tests.family_table`` rewrites the table in place.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "models-and-data.md"
TESTS = ("test_tp_families", "test_pp_families", "test_family_matrix")  # under tests/dist, in the table's order
START, END = "<!-- family table: python -m tests.family_table -->", "<!-- end of the family table -->"
_NAMES = {"tp2": "tensor 2", "tp2_dp2": "tensor 2 x data 2", "pp2": "pipeline 2", "pp2_dp2": "pipeline 2 x data 2",
          "tp2_pp2": "tensor 2 x pipeline 2", "zero3_dp2": "ZeRO-3, data 2"}


def tested() -> dict[str, list[str]]:
    """layout -> the families its test trains (both back ends each), in the tests' order."""
    out: dict[str, list[str]] = {}
    for name in TESTS:
        module = importlib.import_module(f"tests.dist.{name}")
        ends = getattr(module, "BACK_ENDS", {})
        for layout in module.LAYOUTS:
            only = ends.get(layout, ("native", "deepspeed"))
            name = _NAMES.get(layout, layout) + ("" if len(only) == 2 else f" ({only[0]})")
            out[name] = list(module.FAMILIES)
    return out


def table() -> str:
    layouts = tested()
    families = list(dict.fromkeys(f for fams in layouts.values() for f in fams))
    lines = ["| family | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for family in families:
        lines.append(f"| `{family}` | " + " | ".join("yes" if family in fams else "" for fams in layouts.values())
                     + " |")
    return "\n".join(lines)


_SECTION = re.compile(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), flags=re.S)


def section(text: str) -> str:
    """The table as it stands between the markers in ``text``."""
    match = _SECTION.search(text)
    if match is None:
        raise ValueError(f"{DOC}: no family table between {START!r} and {END!r}")
    return match.group(1)


def main() -> None:
    text = DOC.read_text()
    section(text)  # the markers are there
    DOC.write_text(_SECTION.sub(lambda _: f"{START}\n{table()}\n{END}", text, count=1))
    print(f"{DOC}: {len(tested())} layouts")


if __name__ == "__main__":
    main()
