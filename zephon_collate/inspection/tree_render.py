"""See a tree batch node by node, as text (:func:`render_tree`) or a PNG (``docs/demo.md``)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zephon_collate.inspection.trees import TreeNode, TreeRow, TreeView, batch_tree, tree_warnings
from zephon_collate.inspection.values import is_special, paint, percent, plural, token_text, warning_lines

__all__ = ["render_tree", "render_tree_png", "spans"]

_LEGEND = (
    "legend: nK a node, indented by depth; + a trained token (in the loss of every path through its node);\n"
    "        xN: N paths share the node; sees: the nodes its tokens attend to"
)
_MIN_TOKEN_ROOM = 16
_MAX_LISTED = 8


def spans(numbers: Sequence[int], prefix: str = "", listed: int = _MAX_LISTED) -> str:
    """Sorted ``numbers`` as text, runs of three or more as ``a-b``, at most ``listed`` pieces.

    Example:
        >>> spans([0, 1, 2, 4, 5]), spans([0, 1, 3], "n"), spans(range(0, 40, 2), listed=3)
        ('0-2 4 5', 'n0 n1 n3', '0 2 4 ... (20 in all)')
    """
    pieces: list[str] = []
    values = sorted(numbers)
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and values[end + 1] == values[end] + 1:
            end += 1
        if end - start >= 2:
            pieces.append(f"{prefix}{values[start]}-{prefix}{values[end]}")
        else:
            pieces += [f"{prefix}{value}" for value in values[start : end + 1]]
        start = end + 1
    if len(pieces) > listed:
        return " ".join(pieces[:listed]) + f" ... ({len(values)} in all)"
    return " ".join(pieces)


def _range(first: int | None, last: int | None) -> str:
    return "-" if first is None else str(first) if first == last else f"{first}-{last}"


def _node_tokens(
    view: TreeView, node: TreeNode, tokenizer: Any, room: int, most: int | None, color: bool
) -> tuple[str, str]:
    """The node's tokens as ``(plain, painted)`` text, trained ones marked ``+``, cut to fit."""
    line = view.rows[node.row]
    plain: list[str] = []
    painted: list[str] = []
    used = 0
    for place in range(node.start, node.end):
        trained = bool(line.trained and line.trained[place])
        text = token_text(tokenizer, line.input_ids[place]) + ("+" if trained else "")
        rest = node.end - place
        mark = f"... +{rest}"
        full = most is not None and len(plain) == most
        if plain and (full or used + 1 + len(text) > room - (0 if rest == 1 else len(mark) + 1)):
            plain.append(mark)
            painted.append(paint(mark, "dim", color))
            break
        plain.append(text)
        painted.append(paint(text, "green" if trained else None, color))
        used += len(text) + (1 if used else 0)
    return " ".join(plain), " ".join(painted)


def _node_meta(view: TreeView, node: TreeNode) -> list[str]:
    """The node's columns after its tokens: sharing, paths, places, positions, what it sees."""
    positions = view.rows[node.row].positions
    first = None if positions is None else positions[node.start]
    last = None if positions is None else positions[node.end - 1]
    sees = view.node_sees(node.index)
    seen = spans([n for n in sees if n >= 0], "n") + (" padding" if -1 in sees else "")
    return [
        f"x{node.shared}",
        _paths(node.sequences),
        f"places {_range(node.start, node.end - 1)}",
        f"pos {_range(first, last)}",
        f"sees {seen}",
    ]


def _row_header(view: TreeView, row: TreeRow) -> str:
    length = len(row.input_ids)
    nodes = [node for node in view.nodes if node.row == row.index]
    trees = len({node.document for node in nodes})
    parts = [f"{length} tokens", plural(trees, "tree"), plural(len(nodes), "node")]
    if row.trained is not None:
        trained = sum(row.trained)
        parts.append(f"{trained} trained ({percent(trained, length)})")
    parts.append(f"{sum(row.padding)} padding")
    return f"row {row.index}: " + ", ".join(parts)


def _tree_header(view: TreeView, nodes: list[TreeNode]) -> str:
    """A tree's line: its paths and how many path tokens its places hold."""
    sequences = sorted({s for node in nodes for s in node.sequences})
    laid = sum(node.end - node.start for node in nodes)
    path_tokens = sum((node.end - node.start) * node.shared for node in nodes)
    ratio = f" ({path_tokens / laid:.2f}x)" if laid else ""
    return (
        f"  tree {nodes[0].document}: {_paths(tuple(sequences))}, {path_tokens} path tokens laid out in "
        f"{laid}{ratio}"
    )


def _row_lines(
    view: TreeView, row: TreeRow, tokenizer: Any, color: bool, width: int, max_node_tokens: int | None
) -> list[str]:
    """A row: its header, then per tree a header and its nodes, indented by depth, columns aligned."""
    nodes = [node for node in view.nodes if node.row == row.index]
    metas = [_node_meta(view, node) for node in nodes]
    columns = [max((len(meta[i]) for meta in metas), default=0) for i in range(5)]
    meta_width = sum(columns) + 2 * len(columns)
    lefts = []
    for node in nodes:
        indent = "    " + "  " * node.depth + f"n{node.index} "
        room = max(_MIN_TOKEN_ROOM, width - meta_width - len(indent))
        plain, painted = _node_tokens(view, node, tokenizer, room, max_node_tokens, color)
        lefts.append((indent + plain, _indent(indent, color) + painted))
    left_width = max((len(plain) for plain, _ in lefts), default=0)
    lines = [paint(_row_header(view, row), "bold", color)]
    for index, (node, meta, (plain, painted)) in enumerate(zip(nodes, metas, lefts, strict=True)):
        if index == 0 or nodes[index - 1].document != node.document:
            lines.append(_tree_header(view, [n for n in nodes if n.document == node.document]))
        cells = [painted + " " * (left_width - len(plain))]
        cells += [
            paint(text, "dim" if i > 1 else None, color) + " " * (columns[i] - len(text))
            for i, text in enumerate(meta)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _indent(indent: str, color: bool) -> str:
    name = indent.strip()
    return indent[: len(indent) - len(name) - 1] + paint(name, "magenta", color) + " "


def _path_lines(view: TreeView, tokenizer: Any, max_paths: int | None) -> list[str]:
    """Per path: its nodes, its length and the tokens it trains."""
    lines = ["paths:"]
    for sequence, path in enumerate(view.paths[:max_paths]):
        nodes: list[int] = []
        trained: list[str] = []
        for row, place in path:
            line = view.rows[row]
            if line.node[place] >= 0 and (not nodes or nodes[-1] != line.node[place]):
                nodes.append(line.node[place])
            if line.trained is not None and line.trained[place]:
                trained.append(token_text(tokenizer, line.input_ids[place]))
        more = f" ... ({len(trained)} in all)" if len(trained) > _MAX_LISTED else ""
        labelled = any(row.trained is not None for row in view.rows)
        trains = f", trains {' '.join(trained[:_MAX_LISTED])}{more}" if trained else ""
        trains = trains or (", trains nothing" if labelled else "")
        lines.append(
            f"  {sequence}: {' '.join(f'n{n}' for n in nodes) or '-'}, {plural(len(path), 'token')}{trains}"
        )
    if max_paths is not None and len(view.paths) > max_paths:
        lines.append(f"  ... {len(view.paths) - max_paths} more paths")
    return lines


def _token_lines(view: TreeView, token: tuple[int, int], tokenizer: Any) -> list[str]:
    """One token in full: its node, depth, position, paths, whether trained, and every token it sees."""
    row, place = token
    if not (0 <= row < len(view.rows) and 0 <= place < len(view.rows[row].input_ids)):
        raise ValueError(f"render_tree: token {token} is outside the batch (row, place)")
    found = view.token(row, place)
    line = view.rows[row]
    text = token_text(tokenizer, found.token)
    if found.node < 0:
        return [f"token {place} of row {row} ({text}): padding; sees places {spans(view.sees(row, place))}"]
    groups: dict[int, list[str]] = {}
    for key in view.sees(row, place):
        groups.setdefault(line.node[key], []).append(token_text(tokenizer, line.input_ids[key]))
    seen = ", ".join(
        f"{'n' + str(n) if n >= 0 else 'padding'} ({' '.join(texts)})" for n, texts in groups.items()
    )
    position = "" if found.position is None else f", position {found.position}"
    return [
        f"token {place} of row {row} ({text}): node n{found.node}, depth {found.depth}{position}, "
        f"{_paths(found.sequences)}{_trained(found.trained, found.trained_for)}",
        f"  sees places {spans(view.sees(row, place))}: {seen}",
    ]


def _paths(sequences: tuple[int, ...]) -> str:
    return f"path{'' if len(sequences) == 1 else 's'} {spans(sequences) or '-'}"


def _trained(trained: bool | None, sequences: tuple[int, ...]) -> str:
    """``, trained (in the loss of path 2)`` and the like; nothing without labels."""
    if trained is None:
        return ""
    if not trained:
        return ", not trained"
    return f", trained (in the loss of {_paths(sequences)})" if sequences else ", trained but on no path"


def _summary(view: TreeView) -> list[str]:
    total = sum(len(row.input_ids) for row in view.rows)
    padding = sum(sum(row.padding) for row in view.rows)
    trees = len({(node.row, node.document) for node in view.nodes})
    lengths = "/".join(str(length) for length in sorted({len(row.input_ids) for row in view.rows}))
    shape = f"{plural(len(view.rows), 'row')} x {lengths or 0} tokens"
    parts = [
        shape,
        f"{plural(trees, 'tree')}, {plural(len(view.nodes), 'node')}, {plural(len(view.paths), 'path')}",
    ]
    if view.rows and view.rows[0].trained is not None:
        trained = sum(sum(row.trained or []) for row in view.rows)
        parts.append(f"{trained} of {total} tokens trained ({percent(trained, total)})")
    parts.append(f"{padding} padding")
    return [
        "tree batch: " + "; ".join(parts),
        f"paths from {view.paths_from}, attention from {view.attention_from}",
    ]


def render_tree(
    batch: Mapping[str, Any] | TreeView,
    tokenizer: Any = None,
    *,
    color: bool = False,
    width: int = 100,
    max_rows: int | None = None,
    max_node_tokens: int | None = None,
    max_paths: int | None = 16,
    token: tuple[int, int] | None = None,
    ignore_index: int = -100,
) -> str:
    """A tree batch as text: a summary, each row's trees node by node, the paths, the legend, the warnings.

    Parameters:
        batch: a ``Collator.for_trees`` batch, a shared-prompt batch, or its :class:`TreeView`.
        tokenizer: shows tokens as text (as :func:`~zephon_collate.inspection.render.render_batch`).
        color: ANSI colours (trained tokens green, node names magenta).
        width: cut each node's tokens to fit lines of this many characters.
        max_rows, max_node_tokens, max_paths: show at most this many rows, tokens of a node, paths.
        token: ``(row, place)`` of a token to show in full: its node, paths, and every token it sees.
        ignore_index: the label of tokens that are not trained.

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_trees()([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...                               {"input_ids": [1, 2, 4], "completion_mask": [0, 1, 1]}])
        >>> print("\\n".join(render_tree(batch).splitlines()[4:8]))  # doctest: +NORMALIZE_WHITESPACE
          tree 0: paths 0 1, 6 path tokens laid out in 4 (1.50x)
            n0 1 2+  x2  paths 0 1  places 0-1  pos 0-1  sees n0
              n1 3+  x1  path 0     places 2    pos 2    sees n0 n1
              n2 4+  x1  path 1     places 3    pos 2    sees n0 n2
    """
    view = batch if isinstance(batch, TreeView) else batch_tree(batch, ignore_index=ignore_index)
    lines = [paint(text, "bold", color) for text in _summary(view)] + [""]
    for row in view.rows[:max_rows]:
        lines += [*_row_lines(view, row, tokenizer, color, width, max_node_tokens), ""]
    if max_rows is not None and len(view.rows) > max_rows:
        lines += [f"... {len(view.rows) - max_rows} more rows", ""]
    lines += [*_path_lines(view, tokenizer, max_paths), ""]
    if token is not None:
        lines += [*_token_lines(view, token, tokenizer), ""]
    lines += [_LEGEND, *warning_lines(tree_warnings(view), color)]
    return "\n".join(lines)


_SHARED_COLORS = ("#ffffff", "#e3f2fd", "#bbdefb", "#90caf9", "#64b5f6", "#42a5f5", "#1e88e5")
_TRAINED = "#2e7d32"
_UNIT = 0.22  # inches per token box
_LINE = 2.6  # box heights per drawn line (the box, the trained bar and the path ids under it)


def _shared_color(count: int) -> str:
    """A token's face: white for one path, bluer the more paths share it."""
    return _SHARED_COLORS[max(0, min(count, len(_SHARED_COLORS)) - 1)]


def _shared_label(count: int) -> str:
    more = "+" if count == len(_SHARED_COLORS) else ""
    return f"{count}{more} path{'' if count == 1 else 's'}"


def _layout(
    view: TreeView, rows: list[TreeRow], max_nodes: int, max_node_tokens: int
) -> list[tuple[Any, ...]]:
    """The drawn lines: ``("row", row)``, ``("node", node, x, shown, cut)`` or ``("more", count)``."""
    lines: list[tuple[Any, ...]] = []
    ends: dict[int, float] = {}  # node -> x where its drawn tokens end
    for row in rows:
        lines.append(("row", row))
        for node in (n for n in view.nodes if n.row == row.index):
            if len(ends) == max_nodes:
                lines.append(("more", len(view.nodes) - node.index))
                return lines
            start = ends[node.parent] + 0.6 if node.parent in ends else 0.0  # just after its parent
            shown = min(node.end - node.start, max_node_tokens)
            cut = shown < node.end - node.start
            ends[node.index] = start + shown + (1.6 if cut else 0)
            lines.append(("node", node, start, shown, cut))
    return lines


class _Sheet:
    """A figure laid out in inches from its top left corner."""

    def __init__(self, figure: Any, width: float, height: float) -> None:
        self.figure, self.width, self.height = figure, width, height

    def axes(self, left: float, top: float, width: float, height: float) -> Any:
        box = (left / self.width, 1 - (top + height) / self.height, width / self.width, height / self.height)
        return self.figure.add_axes(box)

    def text(self, left: float, top: float, text: str, **style: Any) -> None:
        self.figure.text(left / self.width, 1 - top / self.height, text, va="top", **style)


def render_tree_png(
    batch: Mapping[str, Any] | TreeView,
    path: str | Path,
    tokenizer: Any = None,
    *,
    max_rows: int | None = 4,
    max_nodes: int = 40,
    max_node_tokens: int = 24,
    max_matrix_tokens: int = 96,
    ignore_index: int = -100,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Draw a tree batch and each row's attention as a PNG image (needs matplotlib); return its path.

    Example:
        >>> import tempfile
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_trees()([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...                               {"input_ids": [1, 2, 4], "completion_mask": [0, 1, 1]}])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     render_tree_png(batch, Path(folder) / "tree.png").stat().st_size > 0
        True
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("render_tree_png needs matplotlib: pip install matplotlib") from error
    view = batch if isinstance(batch, TreeView) else batch_tree(batch, ignore_index=ignore_index)
    rows = view.rows[:max_rows]
    warnings = tree_warnings(view)
    lines = _layout(view, rows, max_nodes, max_node_tokens)
    units = max(
        [line[2] + line[3] + (1.6 if line[4] else 0) + 5 for line in lines if line[0] == "node"] + [26]
    )
    tree = (units * _UNIT, len(lines) * _LINE * _UNIT * 0.8)
    matrices = [row for row in rows if 0 < len(row.input_ids) <= max_matrix_tokens]
    sides = [min(4.0, max(2.4, 0.09 * len(row.input_ids) + 1.2)) for row in matrices]
    body = max(tree[1], sum(side + 0.3 for side in sides))
    width = tree[0] + (max(sides) + 0.6 if sides else 0) + 0.3
    columns = max(40, int((width - 0.5) / 0.052))  # characters of a warning line at 6.5 points
    wrapped = [textwrap.wrap(warning, columns, subsequent_indent="  ") for warning in warnings]
    height = 0.5 + body + 0.2 * sum(map(len, wrapped)) + (0.3 if warnings else 0) + 0.45
    figure = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(figure)
    sheet = _Sheet(figure, width, height)
    sheet.text(0.15, 0.12, title or "tree batch", fontsize=11, fontweight="bold")
    _draw_tree(sheet.axes(0.15, 0.5, *tree), view, lines, tokenizer, units)
    top = 0.5
    for row, side in zip(matrices, sides, strict=True):
        _draw_matrix(sheet.axes(tree[0] + 0.6, top + 0.25, side - 0.3, side - 0.3), view, row, tokenizer)
        top += side + 0.3
    top = 0.5 + body + 0.1
    if warnings:
        sheet.text(0.15, top, "warnings:", fontsize=8, color="#c62828", fontweight="bold")
        for piece in (piece for pieces in wrapped for piece in pieces):
            top += 0.2
            sheet.text(0.25, top, piece, fontsize=6.5, color="#c62828")
    shared = sorted({min(line[1].shared, len(_SHARED_COLORS)) for line in lines if line[0] == "node"})
    if len(shared) > 4:  # the fewest, two between, the most
        shared = [shared[0], shared[len(shared) // 3], shared[2 * len(shared) // 3], shared[-1]]
    handles = [
        Patch(facecolor=_shared_color(count), edgecolor="#90a4ae", label=_shared_label(count))
        for count in shared
    ]
    handles.append(Patch(facecolor=_TRAINED, label="trained (the ids of its paths below)"))
    figure.legend(handles=handles, loc="lower left", ncol=5, fontsize=7, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def _draw_tree(axes: Any, view: TreeView, lines: list[tuple[Any, ...]], tokenizer: Any, units: float) -> None:
    """The trees, a drawn line each (see :func:`render_tree_png`)."""
    axes.set_xlim(-0.1, units)
    axes.set_ylim(len(lines) * _LINE, 0)
    axes.axis("off")
    joints: dict[int, tuple[float, float]] = {}  # node -> (x, y) below the middle of its last drawn box
    for index, line in enumerate(lines):
        y = index * _LINE + 0.5
        if line[0] == "row":
            axes.text(0, y + 0.6, _row_header(view, line[1]), fontsize=8, fontweight="bold", va="center")
        elif line[0] == "more":
            axes.text(0, y + 0.5, f"... {line[1]} more nodes", fontsize=7, color="#607d8b", va="center")
        else:
            node, start = line[1], line[2]
            if node.parent in joints:  # an elbow down from the parent's last box, then across
                px, py = joints[node.parent]
                axes.plot([px, px, start], [py, y + 0.5, y + 0.5], color="#b0bec5", lw=0.8, zorder=0)
            joints[node.index] = _draw_node(axes, view.rows[node.row], line, y, tokenizer)


def _draw_node(
    axes: Any, row: TreeRow, line: tuple[Any, ...], y: float, tokenizer: Any
) -> tuple[float, float]:
    """One node's boxes at height ``y``; where its children's elbows leave from."""
    from matplotlib.patches import Rectangle

    _, node, start, shown, cut = line
    mono: dict[str, Any] = {"family": "DejaVu Sans Mono", "ha": "center", "va": "center"}
    trained = False
    for offset in range(shown):
        place, x = node.start + offset, start + offset
        face = _shared_color(len(row.sequences[place]))
        axes.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="#90a4ae", lw=0.3))
        text = token_text(tokenizer, row.input_ids[place])
        text = text[1:-1] if is_special(text) else text  # "<bos>" -> "bos": legible in a box
        axes.text(x + 0.5, y + 0.5, text, fontsize=_cell_font(text), **mono)
        trained = row.trained is not None and row.trained[place]
        if trained:
            axes.add_patch(Rectangle((x, y + 1), 1, 0.2, facecolor=_TRAINED, lw=0))
            ids = spans(row.sequences[place], listed=2).replace(" ", ",")
            small = 5.0 if len(ids) <= 3 else max(3.0, 15 / len(ids))
            axes.text(x + 0.5, y + 1.6, ids, fontsize=small, color=_TRAINED, **mono)
    end = start + shown
    if cut:
        axes.text(
            end + 0.8, y + 0.5, f"+{node.end - node.start - shown}", fontsize=5, color="#607d8b", **mono
        )
        end += 1.6
    axes.text(end + 0.3, y + 0.5, f"n{node.index} x{node.shared}", fontsize=6, color="#6a1b9a", va="center")
    return start + shown - 0.5, y + (1.9 if trained else 1.0)


def _cell_font(text: str) -> float:
    """Points for a token's text in a one-unit box: smaller for longer tokens."""
    return 7.0 if len(text) <= 1 else 6.0 if len(text) == 2 else max(3.0, 13.5 / len(text))


def _draw_matrix(axes: Any, view: TreeView, row: TreeRow, tokenizer: Any) -> None:
    """One row's attention: query down, key across; lines between nodes, red between trees."""
    mask = view.mask(row.index)
    size = mask.shape[0]
    image = np.where(mask, 1.0, 0.0)
    image[np.asarray(row.padding, dtype=bool)] *= 0.35  # padding drawn faint
    axes.imshow(image, cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest")
    for place in range(1, size):
        if row.node[place] != row.node[place - 1]:
            other = row.documents[place] != row.documents[place - 1]
            style = {"color": "#e53935" if other else "#b0bec5", "lw": 0.9 if other else 0.4}
            axes.axhline(place - 0.5, **style)
            axes.axvline(place - 0.5, **style)
    axes.set_title(f"row {row.index}: who sees whom (from {view.attention_from})", fontsize=7, pad=3)
    axes.set_xlabel("key", fontsize=6, labelpad=1)
    axes.set_ylabel("query", fontsize=6, labelpad=1)
    axes.tick_params(labelsize=5, length=1.5, pad=1)
    if size <= 40:  # few enough to name every token
        names = [f"{place}:{token_text(tokenizer, token)}" for place, token in enumerate(row.input_ids)]
        axes.set_xticks(range(size), names, rotation=90)
        axes.set_yticks(range(size), names)
