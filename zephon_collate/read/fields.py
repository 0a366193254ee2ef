"""Value fields beside the tokens (:class:`TensorField`, :class:`FloatField`), declared once."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import torch

from zephon_collate.core.text import shown
from zephon_collate.read.columns import (
    Batch,
    Names,
    Ragged,
    Row,
    Spread,
    as_numpy,
    concat,
    filled,
    numpy_dtype,
    places,
    row_of,
)
from zephon_collate.read.rules import response_aligned

__all__ = [
    "FLOAT_DTYPES",
    "Alignment",
    "FloatField",
    "FloatFields",
    "Spread",
    "TensorField",
    "check_float_fields",
    "read_floats",
    "refilled",
    "spread_starts",
    "to_label_positions",
    "value_rows",
]

Alignment: TypeAlias = Literal["token", "input", "label", "response", "sequence"]
"""What a field's values belong to: a token scored, a token read, a prediction, the row's last tokens, a
whole sequence."""
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_ALIGNMENTS = ("token", "input", "label", "response", "sequence")


@dataclass(frozen=True)
class TensorField:
    """One value field beside the tokens: its name, alignment, dtype, value shape and fill.

    Parameters:
        name: the payload field (and output key).
        align: ``"token"`` (the default), ``"input"`` (beside the input ids in every layout: MoE routes),
            ``"label"``, ``"response"`` or ``"sequence"``.
        dtype: a float dtype (float32 by default) or an integer one (uint8, int8, int16, int32, int64).
        broadcast: with ``align="sequence"``, repeat the value over the sequence's tokens.
        shape: each token's value shape: ``()`` (the default), ``(K,)``, ``(layers, k)``; ``None``: by batch.
        fill: the value of every place given none (padding): 0, ``float("-inf")``, ``Spread(experts)``.

    Example:
        >>> TensorField("teacher_logprobs", align="label", fill=float("-inf"), shape=(4,)).dtype
        torch.float32
    """

    name: str
    align: Alignment = "token"
    dtype: torch.dtype = torch.float32
    broadcast: bool = False
    fill: int | float | Spread = 0
    shape: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        owner = f"{type(self).__name__} {shown(self.name)}"
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{type(self).__name__}: name must be a non-empty str, got {shown(self.name)}")
        if self.align not in _ALIGNMENTS:
            raise ValueError(
                f"{owner}: align must be 'token', 'input', 'label', 'response' or 'sequence', got "
                f"{shown(self.align)}"
            )
        if self.dtype not in (*FLOAT_DTYPES, *_INT_DTYPES):
            raise ValueError(
                f"{owner}: dtype must be a torch float dtype (float16, bfloat16, float32, float64) "
                f"or integer dtype (uint8, int8, int16, int32, int64), got {shown(self.dtype)}"
            )
        if not isinstance(self.broadcast, bool):
            raise TypeError(f"{owner}: broadcast must be a bool, got {shown(self.broadcast)}")
        if self.broadcast and self.align != "sequence":
            raise ValueError(
                f"{owner}: broadcast=True repeats one value per sequence over its tokens; it needs "
                "align='sequence'"
            )
        if not isinstance(self.shape, tuple) or not all(
            size is None or (type(size) is int and size > 0) for size in self.shape
        ):
            raise TypeError(
                f"{owner}: shape must be a tuple of sizes (ints > 0, or None for any size), got "
                f"{shown(self.shape)}"
            )
        if self.shape and self.align == "sequence":
            raise ValueError(
                f"{owner}: a value per sequence is one number; shape needs a per-token alignment"
            )
        fill = self.fill
        if isinstance(fill, Spread):
            self._check_spread(owner, fill)
            return
        if isinstance(fill, bool) or not isinstance(fill, (int, float)):
            raise TypeError(f"{owner}: fill must be an int, a float or a Spread, got {shown(fill)}")
        if self.dtype.is_floating_point:
            largest = torch.finfo(self.dtype).max
            if math.isnan(fill) or (fill != -math.inf and abs(fill) > largest):
                raise ValueError(
                    f"{owner}: fill must be a number within {self.dtype} (largest {largest:.6g}) or "
                    f"float('-inf') (a log-prob of probability 0), got {fill}: a NaN or an infinity would "
                    "reach the loss"
                )
        elif not float(fill).is_integer() or not _fits(int(fill), self.dtype):
            info = torch.iinfo(self.dtype)
            raise ValueError(
                f"{owner}: fill must be an integer from {info.min} to {info.max} for dtype {self.dtype}, "
                f"got {fill}"
            )

    def _check_spread(self, owner: str, fill: Spread) -> None:
        count, last = fill.count, self.shape[-1] if self.shape else None
        if self.dtype.is_floating_point or last is None:
            raise ValueError(
                f"{owner}: fill=Spread(...) spreads integer ids (MoE routes) over the last dim of a value: "
                "declare an integer dtype and shape=(..., k) with k fixed (a jagged token's missing routes "
                "are not padding)"
            )
        if type(count) is not int or count < 1 or (last is not None and count < last):
            raise ValueError(
                f"{owner}: Spread(count) needs an int count >= the {last} entries of a token, got "
                f"{shown(count)}"
            )
        if not _fits(count - 1, self.dtype):
            raise ValueError(f"{owner}: Spread({count}) holds ids beyond {self.dtype}")

    @property
    def per_token(self) -> bool:
        """True when the output holds one value per token (all but an unbroadcast sequence)."""
        return self.align != "sequence" or self.broadcast

    @property
    def shifted_like_labels(self) -> bool:
        """True when a shift of the tokens cuts this field like the labels (``[:, 1:]``); a ``"label"`` or
        ``"input"`` field is cut like the inputs (``[:, :-1]``)."""
        return self.per_token and self.align not in ("label", "input")

    @property
    def host_dtype(self) -> np.dtype:
        """The NumPy dtype the values are read in (float32 for bfloat16, which NumPy lacks)."""
        return np.dtype(np.float32) if self.dtype == torch.bfloat16 else numpy_dtype(self.dtype)


@dataclass(frozen=True)
class FloatField(TensorField):
    """A :class:`TensorField` of a float dtype (another dtype is a ``ValueError``): log-probs, advantages.

    Example:
        >>> FloatField("advantages", align="sequence", broadcast=True).per_token
        True
    """

    def __post_init__(self) -> None:
        if isinstance(self.name, str) and self.name and self.dtype in _INT_DTYPES:
            raise ValueError(
                f"FloatField {shown(self.name)}: dtype must be a torch float dtype (float16, bfloat16, "
                f"float32, float64), got {shown(self.dtype)}; declare TensorField({shown(self.name)}, "
                f"dtype={shown(self.dtype)}) for integer values"
            )
        super().__post_init__()


def _fits(value: int, dtype: torch.dtype) -> bool:
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


FloatFields: TypeAlias = "Sequence[str | TensorField]"
"""Value fields: names (token-aligned float32) or :class:`TensorField` specs."""


def check_float_fields(owner: str, value: object, reserved: Sequence[str] = ()) -> tuple[TensorField, ...]:
    """The value fields ``value`` names, as specs (a str is ``FloatField(name)``), checked.

    Example:
        >>> [f.name for f in check_float_fields("Collator", ["old_logprobs", FloatField("adv", "sequence")])]
        ['old_logprobs', 'adv']
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{owner}: float_fields must be a list of field names or FloatField / TensorField specs, got "
            f"{shown(value)}"
        )
    specs: list[TensorField] = []
    for item in value:
        if isinstance(item, str):
            specs.append(FloatField(item))
        elif isinstance(item, TensorField):
            specs.append(item)
        else:
            raise TypeError(
                f"{owner}: float_fields items must be names or FloatField / TensorField specs, got "
                f"{shown(item)}"
            )
    names = [spec.name for spec in specs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{owner}: float_fields names {shown(name)} twice")
        if name in reserved:
            raise ValueError(
                f"{owner}: float field {shown(name)} collides with a field this collator reads or writes "
                "under that name; rename it in the payloads"
            )
    return tuple(specs)


def _first_bad(field: Ragged, bad: np.ndarray, names: Names, name: str) -> tuple[str, str, Any]:
    """``(where, index, value)`` of the first True of ``bad`` (``[N, ...]``): ``record 3 ...``, ``t``."""
    flat = np.flatnonzero(bad)[0]
    place = np.unravel_index(flat, bad.shape)
    row = row_of(field.offsets, int(place[0]))
    token = ", ".join(str(int(i)) for i in (place[0] - int(field.offsets[row]), *place[1:]))
    return f"{names(row)}: float field {shown(name)}", token, np.asarray(field.values)[place]


def _checked(source: Ragged, spec: TensorField, names: Names) -> Ragged:
    """``source`` in ``spec.host_dtype``, each value checked to be one the dtype holds exactly."""
    values, name = np.asarray(source.values), spec.name
    if not spec.dtype.is_floating_point:
        return Ragged(_checked_ints(source, spec, names), source.offsets)
    allowed = np.isfinite(values) | (values == spec.fill) if spec.fill == -math.inf else np.isfinite(values)
    if values.size and values.dtype.kind == "f" and not allowed.all():
        where, token, value = _first_bad(source, ~allowed, names, spec.name)
        raise ValueError(
            f"{where} holds {value} at {name}[{token}]; give finite values (a NaN or an infinity would make "
            "the loss NaN)"
            + ("" if spec.fill == -math.inf else "; for absent log-probs declare fill=float('-inf')")
        )
    with np.errstate(over="ignore"):
        cast = values.astype(spec.host_dtype, copy=False)
    kept = cast if spec.dtype != torch.bfloat16 else torch.from_numpy(cast).to(torch.bfloat16).float().numpy()
    overflow = ~(np.isfinite(kept) | (kept == values))
    if values.size and overflow.any():
        where, token, value = _first_bad(source, overflow, names, spec.name)
        largest = torch.finfo(spec.dtype).max
        raise ValueError(
            f"{where} holds {value} at {name}[{token}], beyond {spec.dtype} (largest {largest:.6g}): it "
            f"would overflow to an infinity; rescale it, or declare a wider dtype (FloatField({shown(name)}, "
            "dtype=torch.float32 or torch.float64))"
        )
    return Ragged(cast, source.offsets)


def _checked_ints(source: Ragged, spec: TensorField, names: Names) -> np.ndarray:
    """An integer field's values in its dtype: whole numbers (bools read as 0 and 1) within it."""
    values = np.asarray(source.values)
    if values.dtype.kind == "f":
        whole = np.isfinite(values) & (values == np.round(values))
        if not whole.all():
            where, token, value = _first_bad(source, ~whole, names, spec.name)
            raise ValueError(
                f"{where} holds {value} at {spec.name}[{token}], but it is declared {spec.dtype}; give whole "
                "numbers"
            )
    info = torch.iinfo(spec.dtype)
    outside = (values < info.min) | (values > info.max)
    if values.size and outside.any():
        where, token, value = _first_bad(source, outside, names, spec.name)
        raise ValueError(
            f"{where} holds {value} at {spec.name}[{token}], beyond {spec.dtype} ({info.min} to {info.max}); "
            "declare a wider dtype"
        )
    return values.astype(spec.host_dtype, copy=False)


def _check_shapes(arrays: list[np.ndarray], spec: TensorField, names: Names) -> None:
    """Every row holds values of the declared shape (a ``None`` size: the first row's, in every row)."""
    declared = spec.shape
    first = next((array.shape[1:] for array in arrays if array.ndim == len(declared) + 1), None)
    for index, array in enumerate(arrays):
        given = array.shape[1:]
        fits = array.ndim == len(declared) + 1 and all(
            size == (want if want is not None else first[k] if first is not None else size)
            for k, (size, want) in enumerate(zip(given, declared, strict=True))
        )
        if not fits:
            what = "a number" if not declared else f"shape {_shown_shape(declared)}"
            raise ValueError(
                f"{names(index)}: float field {shown(spec.name)} holds shape {tuple(array.shape)}, but it "
                f"is declared one value of {what} per {'response ' if spec.align == 'response' else ''}"
                f"token (align={shown(spec.align)}, shape={_shown_shape(declared)}); give "
                + ("a 1-D row" if not declared else f"rows of [tokens, {_sizes(declared)}]")
                + (
                    f" (pad a ragged K with the fill, {spec.fill}, and mask it)"
                    if declared and first is not None and array.ndim == len(declared) + 1
                    else ""
                )
            )


def _sizes(shape: tuple[int | None, ...]) -> str:
    return ", ".join("K" if size is None else str(size) for size in shape)


def _shown_shape(shape: tuple[int | None, ...]) -> str:
    return f"({_sizes(shape)},)" if len(shape) == 1 else f"({_sizes(shape)})"


def value_rows(batch: Batch, spec: TensorField) -> list[Row]:
    """Each row's values of ``spec``; a jagged ``shape=(None,)`` field's tokens padded with the fill.

    Example:
        >>> from zephon_collate.read.rows import examples_of
        >>> batch = examples_of([{"input_ids": [1, 2], "lp": [[-0.5], [-0.25, -2.0]]}], "Collator")
        >>> value_rows(batch, TensorField("lp", shape=(None,), fill=float("-inf")))[0].tolist()
        [[-0.5, -inf], [-0.25, -2.0]]
    """
    try:
        given = batch.per_row(spec.name, "values")
    except ValueError:
        if spec.shape != (None,) or batch.lacking(spec.name) is not None:
            raise  # a row lacking the field, or one that no jagged top-k explains: as it was named
    else:
        if spec.shape != (None,):
            return given
        full = [row for row in given if row.ndim and row.shape[0]]  # an empty row takes any width
        widths = {row.shape[1] for row in full if row.ndim == 2}
        if len(widths) < 2 or any(row.ndim != 2 for row in full):
            return given
    rows: list[list[np.ndarray]] = []
    for index, value in enumerate(batch.objects(spec.name)):
        where = f"{batch.names(index)}: float field {shown(spec.name)}"
        if not isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
            raise ValueError(
                f"{where} is {shown(value)}, not a list of each token's entries; give every example its list"
            )
        for token, entry in enumerate(value):
            if entry is None or np.ndim(cast(Any, _host(entry))) != 1:
                raise ValueError(
                    f"{where} gives token {token} {shown(entry)}, not a list of numbers; give each token the "
                    f"list of its entries (an absent entry is the fill, {spec.fill})"
                )
            if isinstance(entry, (list, tuple)) and any(item is None for item in entry):
                place = [item is None for item in entry].index(True)
                raise ValueError(
                    f"{where} holds a null at {spec.name}[{token}, {place}]; give numbers only (an absent "
                    f"entry is the fill, {spec.fill})"
                )
        try:
            rows.append([np.asarray(_host(entry), dtype=float) for entry in value])
        except (TypeError, ValueError):
            raise ValueError(f"{where} is not a list of number lists (one per token)") from None
    width = max((entry.size for row in rows for entry in row), default=0)
    out: list[Row] = []
    for row in rows:
        sizes = np.array([entry.size for entry in row], dtype=np.int64)
        padded = filled((len(row), width), spec.fill, np.dtype(np.float64))
        if row:
            padded[np.arange(width) < sizes[:, None]] = np.concatenate(row)
        out.append(padded)
    return out


def _host(entry: object) -> object:
    return as_numpy(entry) if isinstance(entry, torch.Tensor) else entry


def read_floats(
    rows: Sequence[Row], lengths: np.ndarray, spec: TensorField, names: Names
) -> Ragged | list[np.ndarray]:
    """A value field's checked rows in the spec's layout: a host ``Ragged`` per token, a 0-d array per row.

    Example:
        >>> spec = FloatField("adv", align="sequence", broadcast=True)
        >>> read_floats([np.array(1.5), np.array(-2.0)], np.array([2, 1]), spec, str).values.tolist()
        [1.5, 1.5, -2.0]
    """
    name = spec.name
    arrays = [as_numpy(row) for row in rows]
    if spec.align == "sequence":
        for index, array in enumerate(arrays):
            if array.ndim != 0:
                raise ValueError(
                    f"{names(index)}: float field {shown(name)} holds shape {tuple(array.shape)}, but it is "
                    "declared one value per sequence (align='sequence'); give one number, or declare it "
                    "FloatField(name) for one value per token"
                )
        offsets = np.arange(len(arrays) + 1, dtype=np.int64)
        given = np.array([array.item() for array in arrays])
        values = np.asarray(_checked(Ragged(given, offsets), spec, names).values)
        if not spec.broadcast:
            return [values[index] for index in range(len(arrays))]
        repeated = np.repeat(values, lengths)
        return Ragged(repeated, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    arrays = _shaped(arrays, spec)
    if spec.align == "response":  # checked as given (errors name its own index), then placed
        _check_shapes(arrays, spec, names)
        checked = _checked(concat(arrays, name, names), spec, names)
        return response_aligned(checked, lengths, name, names, spec.fill, flat=False)
    for index, (array, length) in enumerate(zip(arrays, lengths.tolist(), strict=True)):
        if array.ndim == 0 or array.shape[0] != length:
            got = "one number" if array.ndim == 0 else f"shape {tuple(array.shape)}"
            hint = (
                "; declare FloatField(name, align='sequence') for one value per sequence"
                if array.ndim == 0
                else "; a field of the response's tokens only (verl's old_log_probs, advantages) is "
                "FloatField(name, align='response')"
                if array.shape[0] < length
                else ""
            )
            raise ValueError(
                f"{names(index)}: float field {shown(name)} holds {got}, but the token row has {length} "
                f"tokens; give one value per token{hint}"
            )
    _check_shapes(arrays, spec, names)
    return _checked(concat(arrays, name, names), spec, names)


def _shaped(arrays: list[np.ndarray], spec: TensorField) -> list[np.ndarray]:
    """The rows, an empty one (``[]``, shape ``(0,)``) given the declared value shape."""
    if not spec.shape:
        return arrays
    trailing = next((array.shape[1:] for array in arrays if array.ndim == len(spec.shape) + 1), None)
    if trailing is None:
        return arrays
    return [array.reshape(0, *trailing) if array.shape == (0,) else array for array in arrays]


def to_label_positions(field: Ragged, starts: np.ndarray, fill: int | float | Spread = 0) -> Ragged:
    """A label-aligned field, unshifted: each value moved one token right, ``fill`` on the ``starts``.

    Example:
        >>> field = Ragged(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.array([0, 3, 5]))
        >>> to_label_positions(field, np.array([True, False, False, True, False])).values.tolist()
        [0.0, 1.0, 2.0, 0.0, 4.0]
    """
    values = np.asarray(field.values)
    moved = np.empty_like(values)
    moved[1:] = values[:-1]
    first = np.flatnonzero(starts)
    if isinstance(fill, Spread):  # numbered by the place in its example
        at = places(field.offsets)[first]
        moved[first] = filled((first.size, *moved.shape[1:]), fill, moved.dtype, at=at)
    else:
        moved[first] = fill
    return Ragged(moved, field.offsets)


def refilled(field: Ragged, where: np.ndarray, fill: Spread, at: np.ndarray) -> Ragged:
    """``field`` with the places ``where`` holding ``fill``, numbered by their place ``at``; a copy.

    Example:
        >>> field = Ragged(np.full((4, 2), 9), np.array([0, 2, 4]))
        >>> refilled(field, np.array([True, False, True, False]), Spread(5), np.arange(4)).values.tolist()
        [[0, 1], [9, 9], [4, 0], [9, 9]]
    """
    values = np.array(field.values)
    first = np.flatnonzero(where)
    values[first] = filled((first.size, *values.shape[1:]), fill, values.dtype, at=at[first])
    return Ragged(values, field.offsets, field.lengths)


def spread_starts(
    fields: dict[str, Ragged],
    specs: Sequence[TensorField],
    starts: Callable[[], np.ndarray],
    at: Callable[[], np.ndarray],
) -> dict[str, Ragged]:
    """``fields`` with each label-aligned :class:`Spread` fill on the ``starts()`` numbered by their ``at()``.

    Example:
        >>> spec = TensorField("routes", align="label", dtype=torch.int64, shape=(2,), fill=Spread(5))
        >>> fields = {"routes": Ragged(np.array([[0, 1], [9, 9], [0, 1]]), np.array([0, 2, 3]))}
        >>> starts = np.array([True, False, True])
        >>> spread_starts(fields, [spec], lambda: starts, lambda: np.arange(3))["routes"].values.tolist()
        [[0, 1], [9, 9], [4, 0]]
    """
    spread = [spec.name for spec in specs if spec.align == "label" and isinstance(spec.fill, Spread)]
    if not spread:
        return fields
    first, place = starts(), at()
    out = dict(fields)
    for spec in specs:
        if spec.name in spread and spec.name in out:
            out[spec.name] = refilled(out[spec.name], first, cast(Spread, spec.fill), place)
    return out
