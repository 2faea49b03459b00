"""The rank map as a picture (``python -m plugin show RECIPE --svg FILE``): which GPU of which node holds which tensor
shard, pipeline stage and data replica. Pure: the SVG is written here, no torch, no drawing library.

One panel per parallel axis of size > 1 (tensor, then any further axis such as context, then data, then pipeline: the
rank order, fastest first), each the same grid of nodes (rows) x GPUs (cells), each cell coloured by the rank's
coordinate on that axis, each panel in its own colour family (tensor blues, context purples, data greens, pipeline
oranges: shades of one hue, so that t0 is never mistaken for d0). Where an axis's groups are runs of consecutive
ranks (tensor groups; a further axis when every faster one has size 1) each group is outlined by one line around all
its cells, in red and dashed where it crosses a node boundary (a group over two nodes is one box over two rows).
Axes are read from the topology generically (:func:`axes_of`): every ``Coord`` field with a ``<field>_size``, ordered
by its stride in the rank, so an axis added to the topology appears without a change here. The expert axis, carved
out of data x context rather than a factor of the world, is drawn as one more panel (a rank's expert coordinate, from
:meth:`~plugin.distributed.topology.Topology.expert_coord`) and named apart in the layout line.

Up to 64 ranks each cell shows its rank and coordinate; up to 1024 the cells shrink (ranks on hover, as SVG titles);
above 1024, each cell is a block of whole nodes (a block holding several coordinates of an axis is grey there).
"""
from __future__ import annotations

import colorsys
from dataclasses import dataclass
from html import escape

AXIS_NAMES = {"tp": "tensor", "cp": "context", "ep": "expert", "dp": "data", "pp": "pipeline"}
AXIS_WORDS = {"tensor": "tensor rank", "context": "context rank", "expert": "expert rank", "data": "data replica",
              "pipeline": "pipeline stage"}
# each panel's colour family, by the axis's recipe word: a hue (degrees) its shades keep within TURN of; the hues lie
# at least 45 degrees apart, so that no two families share a colour
FAMILIES = {"tensor": 215, "context": 270, "expert": 170, "data": 125, "pipeline": 25}
SPARE_HUES = (325, 70)  # an axis without a family of its own (a later one): the first hue no panel uses
TURN = 18
MIXED = "#d9d9d9"
MAX_CELLS = 1024


@dataclass(frozen=True)
class Axis:
    field: str  # the Coord field: tp, dp, pp, cp...
    name: str  # the recipe's word: tensor, data, pipeline, context...
    size: int
    stride: int  # rank distance between neighbours on this axis


def axes_of(topology) -> list[Axis]:
    """Every axis of ``topology`` (a :class:`plugin.distributed.topology.Topology`), fastest first.

    >>> from plugin.distributed.topology import Topology
    >>> [(a.name, a.size, a.stride) for a in axes_of(Topology(pp_size=2, dp_size=4, tp_size=2))]
    [('tensor', 2, 1), ('data', 4, 2), ('pipeline', 2, 8)]
    """
    fields = _fields(topology)
    out = []
    for f in fields:
        size = getattr(topology, f"{f}_size", 1)
        stride = next((r for r in range(1, topology.world_size) if getattr(_coord(topology, r), f) == 1), 0) \
            if size > 1 else 0
        out.append(Axis(f, AXIS_NAMES.get(f, f), size, stride))
    return sorted(out, key=lambda a: (a.stride if a.size > 1 else 1 << 60, fields.index(a.field)))


def _fields(topology) -> tuple[str, ...]:
    """The rank's coordinate fields: ``Coord``'s, then ``ep`` when the topology has an expert axis."""
    fields = type(topology.coord(0))._fields
    return fields + ("ep",) if getattr(topology, "ep_size", 1) > 1 else fields


def _coord(topology, rank: int):
    """``topology.coord(rank)``, with its expert coordinate as ``ep`` when the topology has an expert axis."""
    c = topology.coord(rank)
    if getattr(topology, "ep_size", 1) == 1:
        return c
    from types import SimpleNamespace

    return SimpleNamespace(**c._asdict(), ep=topology.expert_coord(rank)[1])


def family_hue(axis: Axis, axes: list[Axis]) -> int:
    """The hue of ``axis``'s colour family: its own (:data:`FAMILIES`), else the first spare hue no other axis of
    ``axes`` holds."""
    if axis.name in FAMILIES:
        return FAMILIES[axis.name]
    taken = {FAMILIES.get(a.name) for a in axes}
    unnamed = [a.name for a in axes if a.name not in FAMILIES]
    free = [h for h in SPARE_HUES if h not in taken]
    return free[unnamed.index(axis.name) % len(free)]


def _shade(index: int, size: int) -> tuple[float, float]:
    """(hue offset in degrees, lightness) of coordinate ``index`` of ``size``: up to 8 a ramp from dark to light with a
    small turn of hue; beyond that four lightness levels in turn, so that neighbours differ, over the whole turn."""
    t = index / max(1, size - 1)
    if size <= 8:
        return TURN * (t - 0.5), 0.30 + 0.50 * t
    return TURN * (2 * t - 1), (0.32, 0.70, 0.48, 0.84)[index % 4]


def colour(index: int, size: int, hue: int) -> str:
    """Coordinate ``index`` of an axis of ``size``, a shade of the family ``hue`` (degrees): every shade stays within
    :data:`TURN` degrees of it, so two families never share a colour."""
    turn, lightness = _shade(index, size)
    r, g, b = colorsys.hls_to_rgb(((hue + turn) % 360) / 360, lightness, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def ink(index: int, size: int) -> str:
    """The text colour on that shade: white on the dark ones."""
    return "#ffffff" if _shade(index, size)[1] < 0.5 else "#111111"


def _text_w(text: str, size: float, bold: bool = False) -> float:
    """A text's width, estimated (DejaVu Sans: about 0.6 em a character, bold 0.65): what the layout reserves."""
    return len(text) * size * (0.65 if bold else 0.6)


ROWS_PER_COLUMN = 16  # node rows stacked before the next column of rows starts
LABEL_W, GAP, COLUMN_GAP = 70, 4, 18


@dataclass(frozen=True)
class _Grid:
    """Where each cell goes: rows of ``cols`` cells (a node's GPUs, or blocks of nodes), stacked ``ROWS_PER_COLUMN``
    high, then side by side."""

    world: int
    per_node: int
    block: int  # ranks per cell
    cols: int  # cells per row
    rows: int
    cell: int  # pixels
    text: bool

    @property
    def label_w(self) -> int:
        return LABEL_W if self.block == 1 else LABEL_W + 34  # "nodes 176-183"

    @property
    def step(self) -> int:
        return self.cell + GAP

    @property
    def stack(self) -> int:
        return min(self.rows, ROWS_PER_COLUMN)

    @property
    def column_w(self) -> int:
        return self.label_w + self.cols * self.step + COLUMN_GAP

    @property
    def width(self) -> int:
        return -(-self.rows // ROWS_PER_COLUMN) * self.column_w

    @property
    def height(self) -> int:
        return self.stack * self.step

    def row_origin(self, row: int) -> tuple[int, int]:
        """(x of the row's label, y) of a row, relative to the panel's grid."""
        return (row // ROWS_PER_COLUMN) * self.column_w, (row % ROWS_PER_COLUMN) * self.step

    def place(self, rank: int) -> tuple[int, int]:
        """(x, y) of the cell holding ``rank``, relative to the panel's grid."""
        index = rank // self.block
        x, y = self.row_origin(index // self.cols)
        return x + self.label_w + (index % self.cols) * self.step, y


def _grid(world: int, per_node: int) -> _Grid:
    block = 1
    if world > MAX_CELLS:  # whole nodes per cell
        nodes_per_cell = -(-world // (MAX_CELLS * per_node))
        block = nodes_per_cell * per_node
    cells = -(-world // block)
    cols = per_node if block == 1 else min(8, cells)
    rows = -(-cells // cols)
    cell = 44 if world <= 64 else 24 if world <= 256 else 16
    return _Grid(world, per_node, block, cols, rows, cell, world <= 64)


def rank_map_svg(topology, *, gpus_per_node: int | None = None, title: str = "") -> str:
    """The SVG document (a string) of ``topology``'s rank map; ``gpus_per_node`` None assumes 8 (said in the title)."""
    world = topology.world_size
    assumed = gpus_per_node is None
    per_node = min(gpus_per_node or 8, world)
    axes = axes_of(topology)
    shown = [a for a in axes if a.size > 1] or axes[:1]
    grid = _grid(world, per_node)
    nodes = -(-world // per_node)
    pad = 16
    panel_h = 24 + grid.height + 6 + 22 + 18
    head = [title or "rank map",
            f"{_layout_words(axes)} = {world} rank{'s' if world > 1 else ''} on {nodes} node{'s' if nodes > 1 else ''}"
            f" x {per_node} GPU{'s' if per_node > 1 else ''}",
            "rank order: " + ", then ".join(a.name for a in axes if a.size > 1 and a.name != "expert")
            + " (fastest first)"
            if world > 1 else "one rank"]
    if assumed:
        head.append("8 GPUs per node assumed: the recipe has no cluster block")
    if grid.block > 1:
        head.append(f"aggregated: each cell is {grid.block // per_node} node(s), {grid.block} ranks")
    top = pad + 20 * len(head) + 8
    height = top + panel_h * len(shown) + pad
    body, right = [], 0.0
    for k, axis in enumerate(shown):
        parts, panel_right = _panel(topology, axis, axes, grid, pad, top + k * panel_h)
        body += parts
        right = max(right, panel_right)
    right = max([right] + [pad + _text_w(line, 16 if i == 0 else 12, i == 0) for i, line in enumerate(head)])
    width = max(pad * 2 + grid.width, 640, round(right) + pad)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           '<defs><pattern id="mixed" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eeeeee"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#bbbbbb" stroke-width="2"/></pattern></defs>']
    for i, line in enumerate(head):
        size, weight = (16, "bold") if i == 0 else (12, "normal")
        out.append(f'<text x="{pad}" y="{pad + 14 + 20 * i}" font-size="{size}" font-weight="{weight}">'
                   f"{escape(line)}</text>")
    out += body
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _layout_words(axes: list[Axis]) -> str:
    """The layout, slowest axis first as the rank order nests them ("pipeline 2 x data 2 x tensor 2"); axes of size 1
    have no place in that order and follow in brackets ("pipeline 2 x tensor 2 (data 1)"), the three every recipe has
    only: an optional axis (context) at 1 is not named."""
    carved = [f"expert {a.size} of data x context" for a in axes if a.name == "expert" and a.size > 1]
    axes = [a for a in axes if a.name != "expert"]
    sized = [f"{a.name} {a.size}" for a in reversed(axes) if a.size > 1]
    ones = [f"{a.name} 1" for a in axes if a.size == 1 and a.name in ("tensor", "data", "pipeline")]
    if not sized:
        return " x ".join(ones) + (f" ({carved[0]})" if carved else "")
    return " x ".join(sized) + (f" ({', '.join(ones + carved)})" if ones or carved else "")


def _coords(topology, ranks, axis: Axis) -> set[int]:
    return {getattr(_coord(topology, r), axis.field) for r in ranks}


def _panel(topology, axis: Axis, axes: list[Axis], grid: _Grid, x0: int, y0: int) -> tuple[list, float]:
    """The panel's SVG elements, and the right end of its widest text line (the picture is made at least that wide)."""
    word = AXIS_WORDS.get(axis.name, f"{axis.name} rank")
    contiguous = axis.size > 1 and axis.stride == 1 and grid.block == 1
    note = f"colour: {word}" + (f"; boxes: {axis.name} groups (red, dashed: across nodes)" if contiguous else "")
    heading = f"{axis.name} {axis.size}"
    note_x = x0 + round(_text_w(heading, 13, bold=True)) + 14
    out = [f'<text x="{x0}" y="{y0 + 14}" font-size="13" font-weight="bold">{escape(heading)}</text>',
           f'<text x="{note_x}" y="{y0 + 14}" font-size="11" fill="#555">{escape(note)}</text>']
    gx, gy = x0, y0 + 24
    hue = family_hue(axis, axes)
    for row in range(grid.rows):
        first = row * grid.cols * grid.block
        x, y = grid.row_origin(row)
        if grid.block == 1:
            label = f"node {first // grid.per_node}"
        else:
            last = min(grid.world, first + grid.cols * grid.block) // grid.per_node - 1
            label = f"nodes {first // grid.per_node}-{last}"
        out.append(f'<text x="{gx + x}" y="{gy + y + grid.cell / 2 + 4:.0f}" font-size="10" fill="#333">{label}</text>')
    for start in range(0, grid.world, grid.block):
        ranks = range(start, min(grid.world, start + grid.block))
        x, y = grid.place(start)
        x, y = gx + x, gy + y
        values = _coords(topology, ranks, axis)
        value = next(iter(values)) if len(values) == 1 else None
        fill = "url(#mixed)" if value is None else colour(value, axis.size, hue)
        text = "#111111" if value is None else ink(value, axis.size)
        coord = _coord(topology, start)
        if grid.block == 1:
            tip = f"rank {start}: " + ", ".join(f"{a.name} {getattr(coord, a.field)}" for a in reversed(axes)
                                                if a.size > 1)
        else:
            tip = f"ranks {start}-{ranks[-1]}: {axis.name} {_ranges(sorted(values))}"
        out.append(f'<rect x="{x}" y="{y}" width="{grid.cell}" height="{grid.cell}" rx="3" fill="{fill}" '
                   f'stroke="#666" stroke-width="0.5"><title>{escape(tip)}</title></rect>')
        if grid.text:
            out.append(f'<text x="{x + grid.cell / 2:.0f}" y="{y + 17}" font-size="12" text-anchor="middle" '
                       f'fill="{text}">{start}</text>')
            out.append(f'<text x="{x + grid.cell / 2:.0f}" y="{y + 33}" font-size="10" text-anchor="middle" '
                       f'fill="{text}">{axis.field[0]}{getattr(coord, axis.field)}</text>')
        elif grid.cell >= 24:
            out.append(f'<text x="{x + grid.cell / 2:.0f}" y="{y + grid.cell / 2 + 3:.0f}" font-size="8" '
                       f'text-anchor="middle" fill="{text}">{start}</text>')
    if contiguous:
        out += _group_boxes(axis, grid, gx, gy)
    legend, legend_right = _legend(axis, word, hue, x0, gy + grid.height + 6, grid.block > 1)
    return out + legend, max(legend_right, note_x + _text_w(note, 11))


def _ranges(values: list[int]) -> str:
    """``0-3, 6`` for [0, 1, 2, 3, 6]."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(out)


def _group_boxes(axis: Axis, grid: _Grid, gx: int, gy: int) -> list:
    """One outline around each group of consecutive ranks, whatever nodes it covers: a group over two whole nodes is
    one box over their two rows, a group that starts mid-node one line around its cells (several loops only where its
    cells do not touch: a group wrapped from the end of one node to the start of the next, or over two columns of
    rows). Red and dashed where the group crosses a node boundary; the group's ranks on hover."""
    out = []
    for g in range(0, grid.world, axis.size):
        ranks = range(g, g + axis.size)
        nodes = sorted({r // grid.per_node for r in ranks})
        style = 'stroke="#d62728" stroke-dasharray="5,3"' if len(nodes) > 1 else 'stroke="#222"'
        squares = set()
        for r in ranks:  # each cell with half the gap around it: neighbours' squares share their edges
            x, y = grid.place(r)
            squares.add((gx + x - GAP // 2, gy + y - GAP // 2))
        loops = [_inset(loop, 1.5) for loop in _outline(squares, grid.step)]
        path = " ".join("M" + " L".join(f"{x:g},{y:g}" for x, y in loop) + " Z" for loop in loops)
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {_ranges(nodes)}"
        out.append(f'<path d="{path}" fill="none" {style} stroke-width="2" stroke-linejoin="round">'
                   f'<title>{axis.name} group {g // axis.size}: ranks {g}-{g + axis.size - 1} ({where})</title></path>')
    return out


def _outline(squares: set[tuple[int, int]], side: int) -> list[list[tuple[int, int]]]:
    """The boundary of a union of ``side`` x ``side`` squares (top-left corners, on one lattice) as closed loops of
    corners, clockwise on the screen (the inside on the right): the edges two squares share cancel; where two loops
    touch at a corner, the sharpest right turn keeps them apart."""
    edges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for x, y in squares:
        corners = [(x, y), (x + side, y), (x + side, y + side), (x, y + side)]
        for a, b in zip(corners, corners[1:] + corners[:1], strict=True):
            if a in edges.get(b, []):  # the neighbour's edge, the other way round: inside the union
                edges[b].remove(a)
            else:
                edges.setdefault(a, []).append(b)
    loops = []
    while any(edges.values()):
        start = min(a for a, ends in edges.items() if ends)
        loop, a, came = [start], start, None
        while True:
            ends = edges[a]
            if came is None or len(ends) == 1:
                b = ends[0]
            else:  # a corner where two loops touch: turn right (clockwise), the inside's side
                b = next(e for e in ends if _turn(came, a, e) > 0)
            ends.remove(b)
            came, a = a, b
            if a == start:
                break
            loop.append(a)
        loops.append(_corners_only(loop))
    return loops


def _turn(a, b, c) -> int:
    """The sign of the turn a -> b -> c on the screen (y down): positive for a right turn."""
    return (b[0] - a[0]) * (c[1] - b[1]) - (b[1] - a[1]) * (c[0] - b[0])


def _corners_only(loop: list) -> list:
    """The loop without the points where it goes straight on."""
    n = len(loop)
    return [p for i, p in enumerate(loop) if _turn(loop[i - 1], p, loop[(i + 1) % n]) != 0]


def _inset(loop: list, d: float) -> list[tuple[float, float]]:
    """A clockwise loop of horizontal and vertical edges moved ``d`` inwards: neighbouring groups' outlines stay apart.
    Each edge's inside is on its right; a corner moves along both of its edges' inward normals."""
    out = []
    n = len(loop)
    for i, (x, y) in enumerate(loop):
        nx = ny = 0.0
        for a, b in ((loop[i - 1], loop[i]), (loop[i], loop[(i + 1) % n])):
            dx, dy = (b[0] - a[0]) / max(1, abs(b[0] - a[0]) + abs(b[1] - a[1])), \
                (b[1] - a[1]) / max(1, abs(b[0] - a[0]) + abs(b[1] - a[1]))
            nx, ny = nx - dy, ny + dx  # the right of (dx, dy) on the screen
        out.append((x + d * nx, y + d * ny))
    return out


def _legend(axis: Axis, word: str, hue: int, x0: int, y: int, aggregated: bool) -> tuple[list, float]:
    """The colour key under a panel, and where it ends on the right."""
    out = []
    shown = min(axis.size, 16)
    x = x0
    for i in range(shown):
        label = f"{axis.field[0]}{i}"
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" rx="2" fill="{colour(i, axis.size, hue)}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" font-size="10">{label}</text>')
        x += 22 + 7 * len(label)
    if axis.size > shown:
        rest = f"... {axis.field[0]}{axis.size - 1} ({axis.size} {word}s)"
        out.append(f'<text x="{x}" y="{y + 10}" font-size="10">{escape(rest)}</text>')
        x += round(_text_w(rest, 10)) + 10
    if aggregated:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" rx="2" fill="url(#mixed)" stroke="#999"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" font-size="10">several in one cell</text>')
        x += 16 + round(_text_w("several in one cell", 10))
    return out, x
