"""What the inspector's views share: values as lists and rows, tokens as printable text, colours."""

from __future__ import annotations

from typing import Any

from zephon_collate.core.text import shown

__all__ = ["as_lists", "as_rows", "is_special", "paint", "percent", "plural", "token_text", "warning_lines"]

_MAX_TOKEN_CHARS = 16
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


def token_text(tokenizer: Any, token: int) -> str:
    """A token as printable text: ``tokenizer.decode([token])`` or ``tokenizer(token)``, else the id."""
    if tokenizer is None:
        return str(token)
    text = tokenizer.decode([token]) if hasattr(tokenizer, "decode") else str(tokenizer(token))
    shown = "".join(
        _ESCAPES.get(char, f"\\x{ord(char):02x}" if ord(char) < 32 or ord(char) == 127 else char)
        for char in text
    )
    if not shown:
        return "''"
    return shown if len(shown) <= _MAX_TOKEN_CHARS else shown[: _MAX_TOKEN_CHARS - 1] + "~"


def paint(text: str, style: str | None, color: bool) -> str:
    return f"{_ANSI[style]}{text}{_RESET}" if color and style else text


def as_lists(value: Any) -> Any:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist() if hasattr(value, "tolist") else value


def as_rows(value: Any, name: str, like: list[list[Any]] | None = None) -> list[list[Any]]:
    """A field as a list of per-row lists (a flat field is one row), as long as ``like``'s rows if given."""
    data = as_lists(value)
    if not isinstance(data, list):
        raise TypeError(
            f"inspect_batch: field {shown(name)} must be a tensor, array or list, got {type(value).__name__}"
        )
    rows = [data] if data and not isinstance(data[0], list) else data
    if like is not None and [len(row) for row in rows] != [len(row) for row in like]:
        raise ValueError(
            f"inspect_batch: field {shown(name)} has rows of lengths {[len(row) for row in rows]}, but "
            f"input_ids has {[len(row) for row in like]}"
        )
    return rows


def warning_lines(warnings: list[str], color: bool) -> list[str]:
    """The warnings that close a rendered batch (``warnings: none`` when there are none)."""
    if not warnings:
        return ["warnings: none"]
    lines = [paint(f"warnings ({len(warnings)}):", "yellow", color)]
    return lines + [paint(f"  - {warning}", "yellow", color) for warning in warnings]


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def is_special(text: str) -> bool:
    return len(text) > 2 and text.startswith("<") and text.endswith(">")


def plural(count: int, word: str) -> str:
    """``count`` and ``word``, with an ``s`` unless ``count`` is 1."""
    return f"{count} {word}{'' if count == 1 else 's'}"
