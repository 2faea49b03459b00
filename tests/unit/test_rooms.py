"""The house's rules, held by tests rather than documented only (docs/architecture.md, "Layout of the code"):

* the pure rooms import no torch, deepspeed, accelerate or transformers: at import time (every module of them,
  in a fresh interpreter), and anywhere in their code, inside functions too (read with ``ast``);
* no import cycle among the plugin's modules, counting the imports inside functions;
* a room imports only from the rooms above it in :data:`ROOMS` or from its own folder (``plugin/errors.py`` is
  shared by all);
* every name ``plugin/__init__.py`` exports resolves.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import plugin

pytestmark = pytest.mark.nods  # also without deepspeed: no room needs deepspeed or accelerate to import

PLUGIN = Path(plugin.__file__).resolve().parent

# Rooms in data-flow order, then the two front doors (launch.sh's brain and python -m plugin), which may use any
# room above them; a room imports only from rooms above it or from itself.
ROOMS = ["recipe", "interop", "planning", "distributed", "tensor_parallel", "context_parallel", "expert_parallel",
         "pipeline_parallel",
         "materialize", "models", "data", "checkpoint", "monitor", "watchdog", "engines", "elastic", "job", "launch",
         "dryrun", "cli"]
SHARED = {"plugin.errors"}
PURE_PACKAGES = ["plugin.recipe", "plugin.interop", "plugin.planning", "plugin.elastic", "plugin.job", "plugin.launch",
                 "plugin.cli"]
PURE_MODULES = ["plugin.errors", "plugin.distributed.topology", "plugin.distributed.env", "plugin.engines.choose",
                "plugin.engines.model_checks", "plugin.expert_parallel", "plugin.expert_parallel.checks",
                "plugin.dryrun", "plugin.dryrun.ranks", "plugin.dryrun.args", "plugin.dryrun.checks",
                "plugin.dryrun.report",
                "plugin.checkpoint.directory", "plugin.checkpoint.manifest", "plugin.checkpoint.writeback",
                "plugin.checkpoint.verify", "plugin.checkpoint.checksum",
                "plugin.monitor", "plugin.monitor.record", "plugin.monitor.console", "plugin.monitor.metrics",
                "plugin.monitor.quiet", "plugin.monitor.rank_map", "plugin.monitor.plot",
                "plugin.watchdog", "plugin.watchdog.settings", "plugin.watchdog.ledger", "plugin.watchdog.verdict"]
HEAVY = ("torch", "deepspeed", "accelerate", "transformers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PLUGIN.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PLUGIN.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in module ``name``, at any depth (inside functions too). ``from X
    import y`` counts as an import of ``X.y`` when that is a module of the plugin, else of ``X``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name.split(".") if _is_package(name) else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                target = ".".join(base)
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def _plugin_edges() -> dict[str, set[str]]:
    """Module -> the plugin modules it imports, with the packages whose ``__init__`` such an import runs (those
    outside the importer's own package chain: a module importing its own package's sibling does not re-run it)."""
    edges: dict[str, set[str]] = {}
    for name in MODULES:
        ancestors = {".".join(name.split(".")[:k]) for k in range(1, len(name.split(".")) + 1)}
        found = set()
        for target, _ in _imports(name):
            parts = target.split(".")
            if parts[0] != "plugin":
                continue
            for k in range(2, len(parts) + 1):
                mod = ".".join(parts[:k])
                if mod in MODULES and mod not in ancestors:
                    found.add(mod)
        edges[name] = found - {name}
    return edges


def _room(name: str):
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_package(name)) else None


def _pure_modules() -> list[str]:
    return [m for m in MODULES if any(m == p or m.startswith(p + ".") for p in PURE_PACKAGES)] + PURE_MODULES


def test_the_pure_rooms_import_no_torch_in_a_fresh_interpreter():
    # __main__ modules are doors, not rooms: importing plugin.launch.__main__ would start a launch
    pure = [m for m in _pure_modules() if not m.endswith(".__main__")]
    code = ("import importlib, json, sys\n"
            f"for m in {pure!r}:\n"
            "    importlib.import_module(m)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PLUGIN.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert not heavy, f"importing the pure rooms loaded {heavy[:8]}"
    assert len(pure) > 40, pure  # the walk found the rooms' modules


def test_the_pure_rooms_name_no_torch_anywhere_in_their_code():
    """Also inside functions, which the fresh-interpreter test does not run; and only pure plugin modules."""
    pure = set(_pure_modules())
    bad = []
    for name in sorted(pure):
        for target, line in _imports(name):
            top = target.split(".")[0]
            if top in HEAVY:
                bad.append(f"{name}:{line} imports {target}")
            elif top == "plugin" and target in MODULES and target not in pure and target != "plugin":
                bad.append(f"{name}:{line} imports {target}, which is not a pure module")
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_plugins_modules():
    cycles = _cycles(_plugin_edges())
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_found_when_there_is_one():
    """The detector itself: a <-> b, and a longer ring."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_room_imports_only_from_rooms_above_it():
    rooms_found = {_room(m) for m in MODULES} - {None}
    assert rooms_found == set(ROOMS), f"rooms on disk {sorted(rooms_found)} differ from ROOMS: update ROOMS"
    bad = []
    for name, targets in _plugin_edges().items():
        room = _room(name)
        if room is None:  # plugin/__init__.py (the lazy public API), __main__.py, errors.py
            continue
        for target in targets:
            if target in SHARED:
                continue
            other = _room(target)
            if other is None:
                bad.append(f"{name} imports {target}, the top level (only errors.py is shared)")
            elif other != room and ROOMS.index(other) > ROOMS.index(room):
                bad.append(f"{name} ({room}) imports {target} ({other}), a room below it")
    assert not bad, "\n".join(sorted(bad))


def test_every_public_name_resolves():
    for name in plugin.__all__:
        assert getattr(plugin, name) is not None, name


@pytest.mark.parametrize("module, expected", [
    ("plugin.engines.native.build", {"plugin.distributed.groups", "plugin.engines.native.data_parallel"}),
    ("plugin.cli.show", {"plugin.distributed.topology", "plugin.cli.common"}),  # a lazy import inside run()
])
def test_the_import_reader_sees_imports_inside_functions(module, expected):
    assert expected <= _plugin_edges()[module]


CODE_MAP = PLUGIN.parent / "docs" / "architecture.md"  # the code map ("Layout of the code"), linked from the README


def _readme_rows() -> dict[str, str]:
    """The code map: room -> the text of its row."""
    text = CODE_MAP.read_text(encoding="utf-8")
    section = text[text.index("## Layout of the code"):]
    import re

    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `plugin/([a-z_]+)/`[^|]*\|(.*)\|$", section, re.M)}


def test_the_readme_code_map_lists_every_room_and_module_and_nothing_else():
    import re

    rows = _readme_rows()
    assert list(rows) == [r for r in ROOMS if r in rows] and set(rows) == set(ROOMS), \
        f"the code map's rows ({CODE_MAP.name}) {list(rows)} differ from the rooms {ROOMS}"
    problems = []
    for room, row in rows.items():
        named = set(re.findall(r"`([a-z_]+\.py)`", row))
        on_disk = {p.name for p in (PLUGIN / room).rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        if room == "cli":  # one module per command: the row names the shared ones
            on_disk = {"main.py", "common.py"}
        problems += [f"{room}: the code map names {n}, which is not there" for n in sorted(named - on_disk)]
        problems += [f"{room}: {n} is missing from the code map ({CODE_MAP.name})" for n in sorted(on_disk - named)]
    assert not problems, "\n".join(problems)


def test_every_path_the_docs_name_exists():
    """Every repository path the README or a guide under docs/ names in backticks, and every relative link between
    them (a file, and a heading's anchor as GitHub makes it), exists."""
    import re

    root = PLUGIN.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        paths = set(re.findall(r"`((?:plugin|tests|bench|examples|schemas|recipes|docs)/[A-Za-z0-9_./-]*)`", text))
        missing += [f"{page.name}: {p}" for p in sorted(paths) if not (root / p).exists()]
        for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]+))?\)", text):
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                missing += [f"{page.name}: link to {target}"]
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text(encoding="utf-8")):
                missing += [f"{page.name}: link to {target or page.name}#{anchor}"]
    assert not missing, missing
    section = CODE_MAP.read_text(encoding="utf-8")
    section = section[section.index("## Layout of the code"):]
    chain = re.findall(r"`([a-z_]+/[a-z_/]+\.py)`", section[section.index("in reading order"):])  # under plugin/
    missing = [p for p in chain if not (PLUGIN / p).exists()]
    assert len(chain) > 5 and not missing, missing


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces to -."""
    import re

    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)  # a "# comment" in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}
