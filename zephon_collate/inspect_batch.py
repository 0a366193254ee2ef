"""See a collated batch token by token: in the terminal (:func:`render_batch`) or as a PNG.

A batch is what :meth:`SampleBatch.to_training` or :class:`Collator` returns
(``flatten=False`` rows, or a flattened batch as one row). The inspector reads
``input_ids`` and, where present, ``labels``, ``loss_mask``, ``positions``,
``cu_seqlens``, ``padding_mask`` and ``ids``, and shows for every token its
input, its label, whether that label is supervised, whether it is padding, its
position, and where each segment begins. :func:`batch_warnings` puts the usual
mistakes of chat-template masks and packing into words: a loss mask that is
all zero, rows that are mostly padding, positions that disagree with
``cu_seqlens``, supervised padding, and labels trained across a document
boundary.

The plain text layout, per row (columns wrap at ``width``): a chat example
(prompt not supervised), then the padding segment::

    row 0 (sample (1, 0, 0)): 8 tokens, 2 segments, 1 padding (12%), 3 supervised (38%)
      pos   |0     1 2 3  4 5     6    |0
      in    |<bos> H i \\n o k     <eos>|<pad>
      label |-     - - o  k <eos> -    |-
      mask  |.     . . +  + +     .    |_

``|`` starts a segment; under ``mask``, ``+`` is a supervised label, ``.`` an
ignored one, ``_`` padding and ``!`` padding with a supervised label. With
``color=True`` supervised text is green, padding dim, segment starts magenta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RowView", "batch_rows", "batch_warnings", "render_batch", "render_batch_png", "token_text"]

LEGEND = "legend: | starts a segment; mask + supervised, . ignored, _ padding, ! supervised padding"
PADDING_WARN_FRACTION = 0.5
MAX_TOKEN_CHARS = 16
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", " ": "␣"}
_ANSI = {
    "bold": "\x1b[1m",
    "dim": "\x1b[2m",
    "green": "\x1b[32m",
    "magenta": "\x1b[1;35m",
    "red": "\x1b[1;31m",
    "yellow": "\x1b[33m",
}
_RESET = "\x1b[0m"


@dataclass(frozen=True)
class RowView:
    """One row of a batch, as plain Python lists (``None`` where the batch lacks the field).

    ``supervised[t]`` says whether column ``t`` is trained on: its label is not
    ``ignore_index`` (or, in a batch without labels, its ``loss_mask`` is not
    0). ``starts`` are the segment starts that are drawn: from ``cu_seqlens``
    when present, else where ``positions`` are 0.
    """

    index: int
    sample_id: Any
    input_ids: list[int]
    labels: list[int] | None
    supervised: list[bool] | None
    padding: list[bool]
    positions: list[int] | None
    position_starts: list[int] | None
    cu_starts: list[int] | None
    loss_mask: list[float] | None

    @property
    def starts(self) -> list[int]:
        """The segment starts drawn: ``cu_starts``, else ``position_starts``, else ``[0]``."""
        found = self.cu_starts if self.cu_starts is not None else self.position_starts
        return found if found is not None else ([0] if self.input_ids else [])

    @property
    def num_padding(self) -> int:
        return sum(self.padding)

    @property
    def num_supervised(self) -> int:
        return sum(self.supervised) if self.supervised is not None else 0


def _as_lists(value: Any) -> Any:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist() if hasattr(value, "tolist") else value


def _as_rows(value: Any, name: str) -> list[list[Any]]:
    """A field as a list of per-row lists; a flat (1-D) field is one row."""
    data = _as_lists(value)
    if not isinstance(data, list):
        raise TypeError(
            f"inspect_batch: field {name!r} must be a tensor, array or list, got {type(value).__name__}"
        )
    if data and not isinstance(data[0], list):
        return [data]
    return data


def _trailing_pad(tokens: list[int], pad_token_id: int) -> list[bool]:
    count = 0
    while count < len(tokens) and tokens[len(tokens) - 1 - count] == pad_token_id:
        count += 1
    return [False] * (len(tokens) - count) + [True] * count


def batch_rows(
    batch: Mapping[str, Any], *, ignore_index: int = -100, pad_token_id: int | None = None
) -> list[RowView]:
    """The rows of a collated ``batch`` as :class:`RowView` (plain lists).

    Padding comes from ``padding_mask``; without one, with ``pad_token_id``
    given, from the trailing run of that id; otherwise no token is padding.

    Raises:
        KeyError: if ``batch`` has no ``input_ids``.
        ValueError: if a per-token field's rows do not match ``input_ids``.
    """
    if "input_ids" not in batch:
        raise KeyError(f"inspect_batch: the batch has no 'input_ids' (its keys: {sorted(batch)})")
    tokens = _as_rows(batch["input_ids"], "input_ids")
    fields: dict[str, list[list[Any]]] = {}
    for name in ("labels", "loss_mask", "positions", "padding_mask"):
        if name in batch and batch[name] is not None:
            fields[name] = _as_rows(batch[name], name)
            lengths = [len(row) for row in fields[name]]
            if lengths != [len(row) for row in tokens]:
                raise ValueError(
                    f"inspect_batch: field {name!r} has rows of lengths {lengths}, but input_ids has "
                    f"{[len(row) for row in tokens]}"
                )
    cu_rows = _as_rows(batch["cu_seqlens"], "cu_seqlens") if batch.get("cu_seqlens") is not None else None
    ids = list(batch.get("ids") or [])
    rows = []
    for index, row in enumerate(tokens):
        labels = fields.get("labels", [None] * len(tokens))[index]
        loss_mask = fields.get("loss_mask", [None] * len(tokens))[index]
        if labels is not None:
            supervised = [label != ignore_index for label in labels]
        elif loss_mask is not None:
            supervised = [bool(value) for value in loss_mask]
        else:
            supervised = None
        if "padding_mask" in fields:
            padding = [bool(value) for value in fields["padding_mask"][index]]
        elif pad_token_id is not None:
            padding = _trailing_pad(row, pad_token_id)
        else:
            padding = [False] * len(row)
        positions = fields.get("positions", [None] * len(tokens))[index]
        position_starts = None if positions is None else [t for t, p in enumerate(positions) if p == 0]
        cu_starts = None
        if cu_rows is not None and index < len(cu_rows):
            cu_starts = sorted({int(v) for v in cu_rows[index] if int(v) < len(row)})
        rows.append(
            RowView(
                index,
                tuple(ids[index]) if index < len(ids) and ids[index] is not None else None,
                [int(t) for t in row],
                None if labels is None else [int(label) for label in labels],
                supervised,
                padding,
                None if positions is None else [int(p) for p in positions],
                position_starts,
                cu_starts,
                None if loss_mask is None else [float(v) for v in loss_mask],
            )
        )
    return rows


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def _row_warnings(row: RowView, padding_fraction: float) -> list[str]:
    where = f"row {row.index}"
    found = []
    length = len(row.input_ids)
    if row.supervised is not None and length and not any(row.supervised):
        found.append(
            f"{where}: no supervised token: its loss mask is all zero (every label is ignored), "
            "so it adds nothing to the loss; check the chat template's assistant mask"
        )
    if length and row.num_padding / length > padding_fraction:
        found.append(
            f"{where}: {row.num_padding} of {length} tokens ({_percent(row.num_padding, length)}) are "
            "padding: pack more documents per row, or shorten seq_len"
        )
    if row.position_starts is not None and row.cu_starts is not None and row.position_starts != row.cu_starts:
        found.append(
            f"{where}: positions restart at 0 at tokens {row.position_starts} but cu_seqlens starts segments "
            f"at {row.cu_starts}: the model's positions and its attention boundaries disagree "
            "(position_mode='sequence' does this on purpose)"
        )
    if row.positions is not None:
        jumps = [
            t
            for t in range(1, length)
            if row.positions[t] != 0 and row.positions[t] != row.positions[t - 1] + 1
        ]
        if jumps:
            t = jumps[0]
            found.append(
                f"{where}: positions do not count up by one inside a segment at {len(jumps)} tokens "
                f"(first: token {t}, {row.positions[t - 1]} -> {row.positions[t]})"
            )
    if row.supervised is not None:
        padded = sum(s and p for s, p in zip(row.supervised, row.padding, strict=True))
        if padded:
            found.append(f"{where}: {padded} padding tokens have supervised labels; they train on padding")
        if row.labels is not None:
            crossing = [t for t in row.starts if t > 0 and row.supervised[t - 1]]
            if crossing:
                t = crossing[0]
                found.append(
                    f"{where}: {len(crossing)} supervised labels cross a segment boundary (first: token "
                    f"{t - 1} -> {t}): a segment's last token is trained to predict the next segment's "
                    "first token, which document-restricted attention cannot see; mask these labels "
                    "(eos_mask_loss=True with documents that end in EOS)"
                )
    if row.labels is not None and row.loss_mask is not None and row.supervised is not None:
        disagree = sum(bool(m) != s for m, s in zip(row.loss_mask, row.supervised, strict=True))
        if disagree:
            found.append(
                f"{where}: loss_mask and labels disagree at {disagree} tokens "
                "(loss_mask should be 1 exactly where the label is not ignore_index)"
            )
    return found


def batch_warnings(
    batch: Mapping[str, Any] | Sequence[RowView],
    *,
    ignore_index: int = -100,
    pad_token_id: int | None = None,
    padding_fraction: float = PADDING_WARN_FRACTION,
) -> list[str]:
    """What looks wrong in a collated batch, in words (an empty list when nothing does).

    Flags: no supervised token in the batch (or in a row); a row with more
    than ``padding_fraction`` padding; positions whose zeros disagree with
    ``cu_seqlens``; positions that skip inside a segment; supervised padding;
    supervised labels that cross a segment boundary; a ``loss_mask`` that
    disagrees with the labels.

    Example:
        >>> batch = {"input_ids": [[5, 0, 0, 0]], "labels": [[-100, -100, -100, -100]],
        ...          "padding_mask": [[False, True, True, True]]}
        >>> for warning in batch_warnings(batch):
        ...     print(warning)
        batch: no supervised token in any row: the loss is empty (NaN or 0); check the loss mask
        row 0: 3 of 4 tokens (75%) are padding: pack more documents per row, or shorten seq_len
    """
    rows = (
        list(batch)
        if isinstance(batch, Sequence) and not isinstance(batch, Mapping)
        else batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    )
    found = []
    none_supervised = bool(rows) and all(r.supervised is not None and not any(r.supervised) for r in rows)
    if none_supervised:
        found.append(
            "batch: no supervised token in any row: the loss is empty (NaN or 0); check the loss mask"
        )
    for row in rows:
        for warning in _row_warnings(row, padding_fraction):
            if none_supervised and "no supervised token" in warning:
                continue
            found.append(warning)
    return found


def token_text(tokenizer: Any, token: int) -> str:
    """A token as printable text: ``tokenizer.decode([token])`` or ``tokenizer(token)``, else the id.

    Spaces show as ``␣``, newlines, tabs and returns as ``\\n``, ``\\t``, ``\\r``,
    other control characters as ``\\xNN``; long tokens are cut with ``~``.
    """
    if tokenizer is None:
        return str(token)
    text = tokenizer.decode([token]) if hasattr(tokenizer, "decode") else str(tokenizer(token))
    shown = "".join(
        _ESCAPES.get(char, f"\\x{ord(char):02x}" if ord(char) < 32 or ord(char) == 127 else char)
        for char in text
    )
    if not shown:
        return "''"
    return shown if len(shown) <= MAX_TOKEN_CHARS else shown[: MAX_TOKEN_CHARS - 1] + "~"


def _paint(text: str, style: str | None, color: bool) -> str:
    return f"{_ANSI[style]}{text}{_RESET}" if color and style else text


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
        if row.labels is not None:
            label = row.labels[t]
            supervised = bool(row.supervised and row.supervised[t])
            texts["label"] = (
                "-" if not supervised else token_text(tokenizer, label),
                "green" if supervised else "dim",
            )
        if row.supervised is not None:
            supervised = row.supervised[t]
            if row.padding[t]:
                texts["mask"] = ("!", "red") if supervised else ("_", "dim")
            else:
                texts["mask"] = ("+", "green") if supervised else (".", "dim")
        elif row.padding[t]:
            texts["mask"] = ("_", "dim")
        cells.append(_Cell(texts, t in starts))
    return cells


def _header(row: RowView) -> str:
    length = len(row.input_ids)
    sample = f" (sample {row.sample_id})" if row.sample_id is not None else ""
    segments = len(row.starts)
    parts = [f"{length} tokens", f"{segments} segment{'' if segments == 1 else 's'}"]
    parts.append(f"{row.num_padding} padding ({_percent(row.num_padding, length)})")
    if row.supervised is not None:
        parts.append(f"{row.num_supervised} supervised ({_percent(row.num_supervised, length)})")
    return f"row {row.index}{sample}: " + ", ".join(parts)


def _padding_run_start(row: RowView, shown: int) -> int:
    """Where the run of padding that ends the shown tokens begins (``shown`` when there is none)."""
    start = shown
    while start > 0 and row.padding[start - 1]:
        start -= 1
    return start


def _render_row(
    row: RowView, tokenizer: Any, color: bool, width: int, max_tokens: int | None, collapse: int | None
) -> list[str]:
    shown = len(row.input_ids) if max_tokens is None else min(max_tokens, len(row.input_ids))
    total = shown
    start = _padding_run_start(row, shown)
    if collapse is not None and shown - start > collapse:
        shown = start + collapse
    cells = _cells(row, tokenizer, shown)
    names = [name for name in ("pos", "in", "label", "mask") if any(name in cell.texts for cell in cells)]
    lines = [_paint(_header(row), "bold", color)]
    band: list[_Cell] = []
    used = 8
    bands = []
    for cell in cells:
        if band and used + 1 + cell.width > width:
            bands.append(band)
            band, used = [], 8
        band.append(cell)
        used += 1 + cell.width
    if band:
        bands.append(band)
    for number, band in enumerate(bands):
        if number:
            lines.append("")
        for name in names:
            parts = [f"  {name:<6}"]
            for cell in band:
                text, style = cell.texts.get(name, ("", None))
                parts.append(_paint("|", "magenta", color) if cell.start else " ")
                parts.append(_paint(text, style, color) + " " * (cell.width - len(text)))
            lines.append("".join(parts).rstrip())
    if shown < total:
        lines.append(f"  ... {total - shown} more padding tokens")
    if total < len(row.input_ids):
        lines.append(f"  ... {len(row.input_ids) - total} more tokens")
    return lines


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
        batch: the dict ``to_training`` or ``Collator`` returned (``input_ids`` at least).
        tokenizer: shows tokens as text: anything with ``decode(list_of_ids) -> str``
            (a Hugging Face tokenizer, :class:`~zephon_collate.demo.ByteTokenizer`) or a
            callable ``id -> str``; ``None`` shows the ids.
        color: ANSI colours (supervised text green, padding dim, segment starts magenta).
        width: wrap each row's columns at this many characters.
        max_rows, max_tokens: show only the first rows / tokens of each row (the
            summary and warnings still cover the whole batch).
        ignore_index: the label of ignored tokens.
        pad_token_id: finds trailing padding when the batch has no ``padding_mask``.
        collapse_padding: show at most this many tokens of a row's trailing padding, then
            ``... N more padding tokens`` (``None``: show them all).

    Example:
        >>> batch = {"input_ids": [[1, 7, 2]], "labels": [[7, 2, -100]], "positions": [[0, 1, 2]]}
        >>> print(render_batch(batch, width=40))  # doctest: +NORMALIZE_WHITESPACE
        batch: 1 row x 3 tokens; 2 of 3 labels supervised (67%); 0 of 3 tokens padding (0%)
        <BLANKLINE>
        row 0: 3 tokens, 1 segment, 0 padding (0%), 2 supervised (67%)
          pos   |0 1 2
          in    |1 7 2
          label |7 2 -
          mask  |+ + .
        <BLANKLINE>
        legend: | starts a segment; mask + supervised, . ignored, _ padding, ! supervised padding
        warnings: none
    """
    rows = batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    total = sum(len(row.input_ids) for row in rows)
    padding = sum(row.num_padding for row in rows)
    lengths = sorted({len(row.input_ids) for row in rows})
    shape = f"{len(rows)} row{'s' if len(rows) != 1 else ''} x {'/'.join(map(str, lengths)) or 0} tokens"
    summary = [shape]
    if rows and rows[0].supervised is not None:
        supervised = sum(row.num_supervised for row in rows)
        what = "labels" if rows[0].labels is not None else "tokens"
        summary.append(f"{supervised} of {total} {what} supervised ({_percent(supervised, total)})")
    summary.append(f"{padding} of {total} tokens padding ({_percent(padding, total)})")
    lines = [_paint("batch: " + "; ".join(summary), "bold", color), ""]
    for row in rows[:max_rows]:
        lines += _render_row(row, tokenizer, color, width, max_tokens, collapse_padding)
        lines.append("")
    if max_rows is not None and len(rows) > max_rows:
        lines += [f"... {len(rows) - max_rows} more rows", ""]
    lines.append(LEGEND)
    warnings = batch_warnings(rows)
    if warnings:
        lines.append(_paint(f"warnings ({len(warnings)}):", "yellow", color))
        lines += [_paint(f"  - {warning}", "yellow", color) for warning in warnings]
    else:
        lines.append("warnings: none")
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


def _is_special(text: str) -> bool:
    return len(text) > 2 and text.startswith("<") and text.endswith(">")


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

    Each token is a column of two boxes: its input on top (white; grey for
    padding; a small position number above) and its label below (green when
    supervised, light grey with ``-`` when ignored, red for supervised
    padding). A purple bar marks each segment start. Row headers and the
    warnings of :func:`batch_warnings` are written in.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("render_batch_png needs matplotlib: pip install matplotlib") from error
    rows = batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    warnings = batch_warnings(rows)
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
    mono = {"family": "DejaVu Sans Mono", "ha": "center", "va": "center"}
    for row, shown, lines in layout:
        axes.text(0, y + 0.2, _header(row), fontsize=8, fontweight="bold", va="top")
        y += header_height
        starts = set(row.starts)
        for t in range(shown):
            x = t % tokens_per_line
            top = y + (t // tokens_per_line) * line_height + 0.6
            padded = row.padding[t]
            text = token_text(tokenizer, row.input_ids[t])
            special = _is_special(text)
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
                    label = label[1:-1] if _is_special(label) else label
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
    handles = [
        Patch(facecolor=_PNG_COLORS["supervised"], label="label supervised"),
        Patch(facecolor=_PNG_COLORS["ignored"], label="label ignored"),
        Patch(facecolor=_PNG_COLORS["special"], label="special token"),
        Patch(facecolor=_PNG_COLORS["padding"], label="padding"),
        Patch(facecolor=_PNG_COLORS["bad"], label="supervised padding"),
        Patch(facecolor=_PNG_COLORS["start"], label="segment start"),
    ]
    axes.legend(handles=handles, loc="lower right", ncol=6, fontsize=7, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
