"""How error messages show a value: its repr, cut to a few dozen characters.

Every error that quotes a value the caller gave (an argument, a payload field, a
saved state) quotes it through :func:`shown`, so a message stays a few hundred
characters long whatever was passed: a 100,000-token list, a record given where
a list of records belongs, a 10,000-character field name.
"""

from __future__ import annotations

import reprlib

__all__ = ["shown", "shown_fields"]

_LIMIT = 80
"""The longest a shown value gets, in characters."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _LIMIT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8
_REPR.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)``, cut to at most :data:`_LIMIT` characters.

    Example:
        >>> shown("input_ids"), shown(list(range(100)))
        ("'input_ids'", '[0, 1, 2, 3, 4, 5, 6, 7, ...]')
        >>> len(shown("x" * 10_000)) <= 80
        True
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
