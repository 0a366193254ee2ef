"""How error messages show a value: its repr, cut to a few dozen characters (:func:`shown`)."""

from __future__ import annotations

import reprlib

__all__ = ["shown", "shown_fields"]

_LIMIT = 80  # the longest a shown value gets, in characters

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _LIMIT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8
_REPR.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)``, cut to at most :data:`_LIMIT` characters.

    Example:
        >>> shown(list(range(100)))
        '[0, 1, 2, 3, 4, 5, 6, 7, ...]'
    """
    text = _REPR.repr(value)
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."


def shown_fields(payload: object) -> str:
    """A payload's field names, sorted and :func:`shown`.

    Example:
        >>> shown_fields({"tokens": [1], "input_ids": [2]})
        "['input_ids', 'tokens']"
    """
    return shown(sorted(map(str, payload)))  # type: ignore[call-overload]
