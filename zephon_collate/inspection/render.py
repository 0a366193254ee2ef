"""See a collated batch token by token, as text (:func:`render_batch`) or a PNG (``docs/demo.md``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zephon_collate.core.keys import LABELS
from zephon_collate.inspection.rows import RowView, batch_rows, batch_warnings
from zephon_collate.inspection.tree_render import render_tree, render_tree_png
from zephon_collate.inspection.trees import is_tree_batch
from zephon_collate.inspection.values import is_special, paint, percent, plural, token_text, warning_lines

__all__ = ["render_batch", "render_batch_png", "token_text"]

_LEGEND = "legend: | starts a segment; mask + supervised, . ignored, _ padding, ! supervised padding"


@dataclass(frozen=True)
class _Cell:
    texts: dict[str, tuple[str, str | None]]  # line name -> (text, style)
    start: bool

    @property
    def width(self) -> int:
        return max(len(text) for text, _ in self.texts.values())


def _cells(row: RowView, tokenizer: Any, shown: int) -> list[_Cell]:
    starts = set(row.starts)
    cells = []
    for t in range(shown):
        texts: dict[str, tuple[str, str | None]] = {}
        if row.positions is not None:
            texts["pos"] = (str(row.positions[t]), "dim")
        target = row.labels is not None and t > 0 and bool(row.supervised and row.supervised[t - 1])
        style = "dim" if row.padding[t] else "green" if target else None
        texts["in"] = (token_text(tokenizer, row.input_ids[t]), style)
        supervised = bool(row.supervised and row.supervised[t])
        if row.labels is not None:
            texts["label"] = (token_text(tokenizer, row.labels[t]), "green") if supervised else ("-", "dim")
        if row.padding[t]:  # marked even without a mask
            texts["mask"] = ("!", "red") if supervised else ("_", "dim")
        elif row.supervised is not None:
            texts["mask"] = ("+", "green") if supervised else (".", "dim")
        cells.append(_Cell(texts, t in starts))
    return cells


def _header(row: RowView) -> str:
    length = len(row.input_ids)
    sample = f" (sample {row.sample_id})" if row.sample_id is not None else ""
    parts = [f"{length} tokens", plural(len(row.starts), "segment")]
    parts.append(f"{row.num_padding} padding ({percent(row.num_padding, length)})")
    if row.supervised is not None:
        parts.append(f"{row.num_supervised} supervised ({percent(row.num_supervised, length)})")
    return f"row {row.index}{sample}: " + ", ".join(parts)


def _render_row(
    row: RowView, tokenizer: Any, color: bool, width: int, max_tokens: int | None, collapse: int | None
) -> list[str]:
    shown = len(row.input_ids) if max_tokens is None else min(max_tokens, len(row.input_ids))
    total = shown
    start = shown  # where the run of padding that ends the shown tokens begins
    while start > 0 and row.padding[start - 1]:
        start -= 1
    if collapse is not None and shown - start > collapse:
        shown = start + collapse
    cells = _cells(row, tokenizer, shown)
    names = [name for name in ("pos", "in", "label", "mask") if any(name in cell.texts for cell in cells)]
    lines = [paint(_header(row), "bold", color)]
    bands: list[list[_Cell]] = []
    used = 0
    for cell in cells:
        if not bands or used + 1 + cell.width > width:
            bands.append([])
            used = 8  # the line name's column
        bands[-1].append(cell)
        used += 1 + cell.width
    for number, band in enumerate(bands):
        if number:
            lines.append("")
        for name in names:
            parts = [f"  {name:<6}"]
            for cell in band:
                text, style = cell.texts.get(name, ("", None))
                parts.append(paint("|", "magenta", color) if cell.start else " ")
                parts.append(paint(text, style, color) + " " * (cell.width - len(text)))
            lines.append("".join(parts).rstrip())
    if shown < total:
        lines.append(f"  ... {total - shown} more padding tokens")
    if total < len(row.input_ids):
        lines.append(f"  ... {len(row.input_ids) - total} more tokens{_hidden_starts(row, total)}")
    return lines


def _hidden_starts(row: RowView, shown: int, listed: int = 8) -> str:
    """Where segments start beyond the ``shown`` tokens, in words (``""`` if none do)."""
    hidden = [t for t in row.starts if t >= shown]
    if not hidden:
        return ""
    more = f", ... ({len(hidden)} in all)" if len(hidden) > listed else ""
    return f"; segments start there at tokens {', '.join(map(str, hidden[:listed]))}{more}"


def render_batch(
    batch: Mapping[str, Any],
    tokenizer: Any = None,
    *,
    color: bool = False,
    width: int = 100,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    ignore_index: int = -100,
    pad_token_id: int | None = None,
    collapse_padding: int | None = 4,
) -> str:
    """A collated batch as text: a summary, every row token by token, the legend and the warnings.

    Parameters:
        batch: the dict ``to_training`` or a ``Collator`` returned (``input_ids`` at least).
        tokenizer: anything with ``decode(list_of_ids) -> str``, or a callable ``id -> str``; ``None``: ids.
        color: ANSI colours (supervised text green, padding dim, segment starts magenta).
        width: wrap each row's columns at this many characters.
        max_rows, max_tokens: show only the first rows / tokens of each row (the summary covers all).
        ignore_index: the label of ignored tokens.
        pad_token_id: finds trailing padding when the batch has no ``padding_mask``.
        collapse_padding: show at most this many tokens of a row's trailing padding (``None``: all).

    Example:
        >>> batch = {"input_ids": [[1, 7, 2]], "labels": [[7, 2, -100]], "positions": [[0, 1, 2]]}
        >>> print("\\n".join(render_batch(batch).splitlines()[2:7]))  # doctest: +NORMALIZE_WHITESPACE
        row 0: 3 tokens, 1 segment, 0 padding (0%), 2 supervised (67%)
          pos   |0 1 2
          in    |1 7 2
          label |7 2 -
          mask  |+ + .
    """
    if is_tree_batch(batch):
        return render_tree(
            batch, tokenizer, color=color, width=width, max_rows=max_rows, max_node_tokens=max_tokens,
            ignore_index=ignore_index,
        )  # fmt: skip
    rows = batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    total = sum(len(row.input_ids) for row in rows)
    padding = sum(row.num_padding for row in rows)
    lengths = sorted({len(row.input_ids) for row in rows})
    summary = [f"{plural(len(rows), 'row')} x {'/'.join(map(str, lengths)) or 0} tokens"]
    if rows and rows[0].supervised is not None:
        supervised = sum(row.num_supervised for row in rows)
        what = LABELS if rows[0].labels is not None else "tokens"
        summary.append(f"{supervised} of {total} {what} supervised ({percent(supervised, total)})")
    summary.append(f"{padding} of {total} tokens padding ({percent(padding, total)})")
    lines = [paint("batch: " + "; ".join(summary), "bold", color), ""]
    for row in rows[:max_rows]:
        lines += _render_row(row, tokenizer, color, width, max_tokens, collapse_padding)
        lines.append("")
    if max_rows is not None and len(rows) > max_rows:
        lines += [f"... {len(rows) - max_rows} more rows", ""]
    # the batch, not its rows: where flattened records meet is no crossing
    warnings = batch_warnings(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    lines += [_LEGEND, *warning_lines(warnings, color)]
    return "\n".join(lines)


_PNG_COLORS = {
    "supervised": "#9be3b0",
    "ignored": "#eceff1",
    "input": "#ffffff",
    "padding": "#b0b7bf",
    "special": "#bbdefb",
    "bad": "#ff6b6b",
    "start": "#8e24aa",
}


def _font_size(text: str) -> float:
    """Points for a token's text in a one-unit cell: smaller for longer tokens."""
    return 6.5 if len(text) <= 1 else 5.5 if len(text) == 2 else max(3.2, 12.5 / len(text))


def render_batch_png(
    batch: Mapping[str, Any],
    path: str | Path,
    tokenizer: Any = None,
    *,
    max_rows: int | None = 4,
    max_tokens: int | None = 128,
    tokens_per_line: int = 64,
    ignore_index: int = -100,
    pad_token_id: int | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Draw a collated batch as a PNG image (needs matplotlib) and return its path.

    Example:
        >>> import tempfile
        >>> batch = {"input_ids": [[1, 7, 2]], "labels": [[7, 2, -100]], "positions": [[0, 1, 2]]}
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     render_batch_png(batch, Path(folder) / "batch.png").stat().st_size > 0
        True
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("render_batch_png needs matplotlib: pip install matplotlib") from error
    if is_tree_batch(batch):
        return render_tree_png(
            batch, path, tokenizer, max_rows=max_rows, title=title, dpi=dpi, ignore_index=ignore_index
        )
    rows = batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    warnings = batch_warnings(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    shown_rows = rows[:max_rows]
    layout = []  # per row: (row, shown tokens, lines)
    for row in shown_rows:
        shown = len(row.input_ids) if max_tokens is None else min(max_tokens, len(row.input_ids))
        layout.append((row, shown, max(1, -(-shown // tokens_per_line))))
    line_height, header_height = 3.2, 1.6
    height = sum(header_height + lines * line_height for _, _, lines in layout) + 1.2 * len(warnings) + 3.5
    tokens_per_line = max(1, min(tokens_per_line, max((shown for _, shown, _ in layout), default=1)))
    width = max(tokens_per_line, 40) + 2
    figure = Figure(figsize=(width * 0.24, height * 0.2), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(-1, width - 1)
    axes.set_ylim(height, 0)
    axes.axis("off")
    y = 0.4
    axes.text(0, y, title or "collated batch", fontsize=11, fontweight="bold", va="top")
    y += 1.8
    mono: dict[str, Any] = {"family": "DejaVu Sans Mono", "ha": "center", "va": "center"}
    for row, shown, lines in layout:
        more = len(row.input_ids) - shown
        cut = f"; {more} more tokens{_hidden_starts(row, shown)}" if more else ""
        axes.text(0, y + 0.2, _header(row) + cut, fontsize=8, fontweight="bold", va="top")
        y += header_height
        starts = set(row.starts)
        for t in range(shown):
            x = t % tokens_per_line
            top = y + (t // tokens_per_line) * line_height + 0.6
            padded = row.padding[t]
            text = token_text(tokenizer, row.input_ids[t])
            special = is_special(text)
            text = text[1:-1] if special else text  # "<bos>" -> "bos": legible in a cell
            face = _PNG_COLORS["padding" if padded else "special" if special else "input"]
            axes.add_patch(Rectangle((x, top), 1, 1, facecolor=face, edgecolor="#cfd8dc", lw=0.3))
            axes.text(x + 0.5, top + 0.5, text, fontsize=_font_size(text), **mono)
            if row.positions is not None:
                axes.text(x + 0.5, top - 0.3, str(row.positions[t]), fontsize=4, color="#607d8b", **mono)
            if row.supervised is not None:
                supervised = row.supervised[t]
                key = ("bad" if padded else "supervised") if supervised else "ignored"
                axes.add_patch(
                    Rectangle((x, top + 1), 1, 1, facecolor=_PNG_COLORS[key], edgecolor="#cfd8dc", lw=0.3)
                )
                if row.labels is not None:
                    label = token_text(tokenizer, row.labels[t]) if supervised else "-"
                    label = label[1:-1] if is_special(label) else label
                    axes.text(x + 0.5, top + 1.5, label, fontsize=_font_size(label), color="#37474f", **mono)
            if t in starts:
                axes.plot(
                    [x, x], [top - 0.1, top + 2.1], color=_PNG_COLORS["start"], lw=2.2, solid_capstyle="butt"
                )
        y += lines * line_height
    if warnings:
        axes.text(0, y + 0.3, "warnings:", fontsize=8, color="#c62828", fontweight="bold", va="top")
        y += 1.2
        for warning in warnings:
            axes.text(0.5, y + 0.3, warning, fontsize=6.5, color="#c62828", va="top")
            y += 1.2
    legend = {
        "supervised": "label supervised",
        "ignored": "label ignored",
        "special": "special token",
        "padding": "padding",
        "bad": "supervised padding",
        "start": "segment start",
    }
    handles = [Patch(facecolor=_PNG_COLORS[key], label=label) for key, label in legend.items()]
    axes.legend(handles=handles, loc="lower right", ncol=6, fontsize=7, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
