"""The columnar type every input is read into: :class:`Ragged` fields in a :class:`Batch`; :func:`to_row`."""

from __future__ import annotations

import array
import itertools
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import torch

from zephon_collate.core.keys import INT64_MAX, POSITION_IDS, POSITIONS, TOKEN_FIELD_CANDIDATES
from zephon_collate.core.records import SampleMeta
from zephon_collate.core.text import shown, shown_fields

__all__ = [
    "MISSING",
    "PLAIN_DTYPES",
    "Batch",
    "Kind",
    "Names",
    "Ragged",
    "Row",
    "Spread",
    "Values",
    "as_numpy",
    "as_tensor",
    "concat",
    "filled",
    "gather_spans",
    "host_dtype",
    "host_view",
    "joined_ints",
    "numpy_dtype",
    "places",
    "restarted",
    "row_any",
    "row_of",
    "sequence_of",
    "to_row",
    "tokens_field_of",
]

Row: TypeAlias = "np.ndarray | torch.Tensor"
Values: TypeAlias = "np.ndarray | torch.Tensor"
Kind = Literal["ids", "values"]
"""``"ids"``: integers only (token ids, positions); ``"values"``: bool, integer or float."""
Names: TypeAlias = Callable[[int], str]
"""How errors name the row at a batch index: ``record 3 (sample_id (0, 0, 7))``, ``example 3``."""
MISSING: Any = object()
"""An absent field (compare with ``is``)."""


class Ragged:
    """One field of a batch: every row's values end to end (``[N, ...]``), and where each row starts.

    Example:
        >>> field = concat([np.array([5, 6, 7]), np.array([8])], "input_ids", str)
        >>> field.values.tolist(), field.offsets.tolist(), field.lengths.tolist()
        ([5, 6, 7, 8], [0, 3, 4], [3, 1])
    """

    __slots__ = ("lengths", "offsets", "values")  # a plain class: several are made per field and call

    def __init__(self, values: Values, offsets: np.ndarray, lengths: np.ndarray | None = None) -> None:
        self.values = values
        self.offsets = offsets
        # ``lengths``: those of a field these offsets come from, not computed again (np.diff costs more)
        self.lengths: np.ndarray = offsets[1:] - offsets[:-1] if lengths is None else lengths

    def __repr__(self) -> str:
        return f"Ragged(values={self.values!r}, offsets={self.offsets!r})"

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def host(self) -> np.ndarray:
        return as_numpy(self.values)

    def row(self, index: int) -> Values:
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    @staticmethod
    def of_row(values: Values) -> Ragged:
        """``values`` (``[T, ...]``) as a one-row :class:`Ragged`."""
        return Ragged(values, np.array([0, values.shape[0]], dtype=np.int64))

    def take(self, index: int) -> Ragged:
        """Row ``index`` alone, as a one-row :class:`Ragged` (a view)."""
        return Ragged.of_row(self.row(index))

    def select(self, keep: np.ndarray) -> Ragged:
        """The values where the ``[N]`` boolean ``keep`` is True, each row keeping its own."""
        kept = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=kept[1:])
        mask = keep if isinstance(self.values, np.ndarray) else torch.from_numpy(keep).to(self.values.device)
        return Ragged(self.values[mask], kept[self.offsets])

    def cast(self, dtype: torch.dtype) -> Ragged:
        """The values in ``dtype``; a copy where the dtype changes or they are read-only (columnar input)."""
        if isinstance(self.values, np.ndarray):
            copy = not self.values.flags.writeable
            return Ragged(self.values.astype(numpy_dtype(dtype), copy=copy), self.offsets, self.lengths)
        return Ragged(self.values.to(dtype), self.offsets, self.lengths)


class Batch:
    """A batch at the door: its rows, how errors name them, and each field read once, on demand.

    Parameters:
        rows: the number of rows (records, examples, pairs).
        names: how errors name row ``i``.
        fields: every field some row carries.
        ids: each row's sample id (``(0, 0, i)`` for rows without a record).
        metas: each row's ``SampleMeta`` (records only; ``()`` otherwise).
        owner: the entry point errors name when no row is at fault.
    """

    def __init__(
        self,
        rows: int,
        names: Names,
        fields: frozenset[str],
        ids: list[Any],
        metas: tuple[SampleMeta, ...] = (),
        owner: str = "Collator",
    ) -> None:
        self.rows, self.names, self.fields = rows, names, fields
        self.ids, self.metas, self.owner = ids, metas, owner
        self._cache: dict[tuple[str, str, bool], Ragged | None] = {}

    tokens: str | None = None
    """The field an array payload's row is: the token field resolved at the door (records), else ``None``."""
    payloads: Sequence[Any] = ()
    """Each row's payload (row-wise input; ``()`` for columns)."""

    @property
    def order(self) -> tuple[str, ...]:
        """The fields in the input's order (sorted, for input without one)."""
        return tuple(sorted(self.fields))

    def is_list(self, name: str) -> bool:
        """Does ``name`` hold a row of values per row (row-wise input: always; columns: a list column)?"""
        return True

    def stored_dtype(self, name: str) -> np.dtype[Any] | None:
        """The dtype a column stores ``name``'s numbers in, where :meth:`objects` gives them as Python
        numbers (``None``: row-wise input, whose rows keep their own)."""
        return None

    def one_dtype(self, name: str, kind: Kind) -> bool:
        """Did every row of field ``name`` (read by :meth:`get`) hold one host dtype?"""
        return True

    def tokens_field(self, requested: str, *, packer: bool = False) -> str:
        """The token field: ``requested``, or for ``"auto"`` the first candidate every row has."""
        return tokens_field_of(self._named_rows(), requested, self.names, packer=packer)

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def lacking(self, name: str) -> int | None:
        """The first row that does not carry ``name``, or ``None`` (read nothing)."""
        lacking = np.flatnonzero(~self.carried(name))
        return int(lacking[0]) if lacking.size else None

    def get(self, name: str, kind: Kind, *, partial: bool = False) -> Ragged | None:
        """Field ``name`` as a :class:`Ragged` (read once), or ``None`` (``partial``: lacking rows empty)."""
        key = (name, kind, partial)
        if key not in self._cache:
            if name in self and not partial:
                self.require(name)
            self._cache[key] = self._read(name, kind) if name in self else None
        return self._cache[key]

    def require(self, name: str) -> None:
        index = self.lacking(name)
        if index is not None:
            some = self.carried(name).any()
            reason = "some payloads have it and others lack it" if some else "it is required"
            raise ValueError(f"{self.names(index)}: {self._lacks(index, name)}; {reason}")

    def per_row(self, name: str, kind: Kind) -> list[Row]:
        """Field ``name`` of every row (required), one array or tensor each (a per-record field)."""
        self.require(name)
        return self._per_row(name, kind)

    def one_value_row(self, name: str) -> int | None:
        """The first row giving ``name`` as one value instead of a row of values, or ``None``."""
        for index, value in enumerate(self.objects(name)):
            if isinstance(value, (int, float, np.generic)) or getattr(value, "ndim", None) == 0:
                return index
        return None

    # -- what a reader implements --------------------------------------------------------------

    def carried(self, name: str) -> np.ndarray:
        """``[B]`` booleans: does row ``b`` carry ``name`` (read nothing)."""
        raise NotImplementedError  # pragma: no cover

    def _read(self, name: str, kind: Kind) -> Ragged:
        raise NotImplementedError  # pragma: no cover

    def _per_row(self, name: str, kind: Kind) -> list[Row]:
        raise NotImplementedError  # pragma: no cover

    def objects(self, name: str) -> list[Any]:
        """Each row's raw value of ``name`` (``None`` where it has none): texts, group keys."""
        raise NotImplementedError  # pragma: no cover

    def _lacks(self, index: int, name: str) -> str:
        """What to say of row ``index`` lacking ``name``."""
        return f"payload lacks field {shown(name)}"

    def _named_rows(self) -> Sequence[Any]:
        """The rows' fields, for :meth:`tokens_field`: one for input whose every row has the same."""
        return [dict.fromkeys(self.order)]


def tokens_field_of(payloads: Sequence[Any], requested: str, names: Names, *, packer: bool = False) -> str:
    """The payload field of token ids: ``requested``, or for ``"auto"`` the first candidate every dict has.

    Parameters:
        payloads: the rows' payloads (mappings of fields, or token arrays, which are their token row).
        requested: a field name, or ``"auto"`` (``input_ids``, ``tokens``, ``token_ids``, ``ids``, in order).
        names: how errors name row ``i``.
        packer: word the refusal as the packer does.

    Example:
        >>> tokens_field_of([{"tokens": [1]}, [2, 3]], "auto", str)
        'tokens'
    """
    if requested != "auto":
        for index, payload in enumerate(payloads):
            if (type(payload) is dict or isinstance(payload, Mapping)) and requested not in payload:
                quoted = repr(requested) if packer else shown(requested)
                raise ValueError(
                    f"{names(index)}: payload has no tokens field {quoted} (its fields: "
                    f"{shown_fields(payload)}); pass the right tokens_field"
                )
        return requested
    dicts = [(i, p) for i, p in enumerate(payloads) if type(p) is dict or isinstance(p, Mapping)]
    for candidate in TOKEN_FIELD_CANDIDATES:
        if all(candidate in payload for _, payload in dicts):
            return candidate
    first = {i: next((c for c in TOKEN_FIELD_CANDIDATES if c in p), None) for i, p in dicts}
    bare = next((i for i, field in first.items() if field is None), None)
    if bare is not None:
        raise ValueError(
            f"{names(bare)}: payload has no tokens field any of {', '.join(TOKEN_FIELD_CANDIDATES)} (its "
            f"fields: {shown_fields(payloads[bare])}); pass the right tokens_field"
            if packer
            else f"tokens_field='auto' found none of {', '.join(TOKEN_FIELD_CANDIDATES)} in every payload; "
            f"{names(bare)} has fields {shown_fields(payloads[bare])}; pass tokens_field='<name>'"
        )
    first_index, field = next(iter(first.items()))
    index = next(i for i, p in dicts if field not in p)
    raise ValueError(
        f"tokens_field='auto' found no token field that every payload has: {names(first_index)} "
        f"has {shown(field)}, {names(index)} has fields {shown_fields(payloads[index])}; "
        "give every payload the same token field, or pass tokens_field='<name>'"
    )


def concat(rows: Sequence[Row], name: str, names: Names) -> Ragged:
    """A field's rows end to end (one copy) as a :class:`Ragged`; rows may differ in length and dtype only."""
    if not rows:
        return Ragged(np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    try:
        lengths = [row.shape[0] for row in rows]
    except IndexError:  # a 0-d row: named here, off the common path
        index = next(i for i, row in enumerate(rows) if row.ndim == 0)
        raise ValueError(
            f"{names(index)}: field {shown(name)} is one value ({rows[index].item()!r}), but it is read as "
            "a row of values, one per token; give it one value per token, or drop it (a per-example "
            "label, as for sequence classification, is not a token field)"
        ) from None
    if len(set(lengths)) == 1:  # rows of one length (packed rows): no running sum to take
        offsets = np.arange(len(rows) + 1, dtype=np.int64) * lengths[0]
    else:
        offsets = np.array(list(itertools.accumulate(lengths, initial=0)), dtype=np.int64)
    # Always a copy, even of one row: what the batch holds never shares memory with a payload.
    first = type(rows[0])
    if all(type(row) is first for row in rows):  # one kind of row: one concatenation, which checks shapes
        try:
            if first is np.ndarray:
                arrays = cast(Sequence[np.ndarray], rows)
                return Ragged(np.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy(), offsets)
            joined = torch.cat(list(cast(Sequence[torch.Tensor], rows)))
            if joined.is_cpu and not joined.requires_grad and joined.dtype != torch.bfloat16:
                return Ragged(joined.numpy(), offsets)  # the common case, a view of the fresh copy
            return Ragged(as_numpy(joined) if joined.is_cpu else joined, offsets)
        except (ValueError, RuntimeError):
            pass  # shapes or devices differ: the loop below names the row
    trailing = rows[0].shape[1:]
    for index, row in enumerate(rows):
        if row.ndim != 1 and rows[0].ndim == 1:
            raise ValueError(
                f"{names(index)}: field {shown(name)} must be 1-D (one entry per token), got shape "
                f"{tuple(row.shape)}"
            )
        if row.shape[1:] != trailing:
            raise ValueError(
                f"{names(index)}: field {shown(name)} has shape {tuple(row.shape)}, but {names(0)} has "
                f"{tuple(rows[0].shape)}; rows may differ in length only"
            )
    if all(isinstance(row, np.ndarray) or row.is_cpu for row in rows):
        return Ragged(np.concatenate([as_numpy(row) for row in rows]), offsets)
    _check_one_device(rows, name, names)
    return Ragged(torch.cat([torch.as_tensor(row) for row in rows]), offsets)


def row_any(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` (``flags[offsets[b]:offsets[b + 1]]``) hold a True? Empty rows: no.

    Example:
        >>> row_any(np.array([False, True, False, False]), np.array([0, 2, 2, 4])).tolist()
        [True, False, False]
    """
    counts = np.zeros(len(offsets) - 1, dtype=np.int64)
    nonempty = offsets[1:] > offsets[:-1]
    if flags.size:
        counts[nonempty] = np.add.reduceat(flags, offsets[:-1][nonempty])
    return counts > 0


def sequence_of(offsets: np.ndarray) -> np.ndarray:
    """``[N]``: the row of every value of a :class:`Ragged` with these offsets."""
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


@dataclass(frozen=True)
class Spread:
    """A fill spread over ``range(count)``: place ``p`` of a row gets ``(p * k + j) % count`` in entry ``j``.

    Example:
        >>> filled((3, 2), Spread(4), np.dtype(np.int64), at=np.array([1, 2, 3])).tolist()
        [[2, 3], [0, 1], [2, 3]]
    """

    count: int


def filled(
    shape: tuple[int, ...], fill: int | float | Spread, dtype: np.dtype, *, at: np.ndarray | None = None
) -> np.ndarray:
    """``shape`` of ``fill``: a number, or a :class:`Spread` of places at positions ``at`` (``0, 1, ...``)."""
    if not isinstance(fill, Spread):
        return np.full(shape, fill, dtype=dtype)
    ramp = (np.arange(shape[0], dtype=np.int64) if at is None else at.astype(np.int64)).reshape(
        -1, *([1] * (len(shape) - 1))
    )
    last = shape[-1] if len(shape) > 1 else 1
    entry = np.arange(last, dtype=np.int64)
    return np.broadcast_to((ramp * last + entry) % fill.count, shape).astype(dtype)


def places(offsets: np.ndarray) -> np.ndarray:
    """``[N]``: every value's place in its row.

    Example:
        >>> places(np.array([0, 3, 3, 5])).tolist()
        [0, 1, 2, 0, 1]
    """
    total, rows = int(offsets[-1]), len(offsets) - 1
    if rows > 1 and total > 512 * rows:
        # Long rows: each row's count is a slice of one ramp, written once by one concatenation (the
        # count below writes N three times: the ramp, the repeated starts and their difference).
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        ramp = np.arange(max(lengths), dtype=np.int64)
        return np.concatenate([ramp[:length] for length in lengths])
    count = np.arange(total, dtype=np.int64)
    if rows == 1:  # one row (padding-free): its count from 0
        count -= offsets[0]
        return count
    count -= offsets[:-1].repeat(offsets[1:] - offsets[:-1])  # in place: one [N] temporary fewer
    return count


def restarted(positions: Ragged, rows: np.ndarray) -> Ragged:
    """Positions of rows cut at their start (``rows``, ``[B]``): the segment cut into counts from 0 again.

    Example:
        >>> positions = Ragged(np.array([1, 2, 0, 1, 4, 5]), np.array([0, 4, 6]))
        >>> restarted(positions, np.array([True, True])).host.tolist()
        [0, 1, 0, 1, 0, 1]
    """
    values = positions.host.copy()
    for row in np.flatnonzero(rows).tolist():
        start, end = int(positions.offsets[row]), int(positions.offsets[row + 1])
        zeros = np.flatnonzero(values[start:end] == 0)
        stop = start + int(zeros[0]) if zeros.size else end
        if stop > start:
            values[start:stop] -= values[start]
    return Ragged(values, positions.offsets)


def gather_spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + lengths[i] - 1`` of every span, end to end.

    Example:
        >>> gather_spans(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist()
        [5, 6, 9, 10, 11]
    """
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.asarray(np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths))


def row_of(offsets: np.ndarray, flat_index: int) -> int:
    """The row holding flat token ``flat_index`` (empty rows hold none)."""
    return int(np.searchsorted(offsets, flat_index, side="right")) - 1


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype that has one (every integer, bool and float dtype but bfloat16)."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def as_tensor(values: Values) -> torch.Tensor:
    """``values`` as a tensor: a host array wrapped without a copy."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _check_one_device(rows: Sequence[Row], name: str, names: Names) -> None:
    """``ValueError`` naming the first row on another device than the first (NumPy rows: the CPU)."""
    devices = [row.device if isinstance(row, torch.Tensor) else torch.device("cpu") for row in rows]
    for index, here in enumerate(devices):
        if here != devices[0]:
            raise ValueError(
                f"{names(index)}: field {shown(name)} is on {here} while the first payload's is on "
                f"{devices[0]}; put all payload data on one device"
            )


def _sequence_array(value: Any, where: str, name: str) -> np.ndarray:
    """``np.array(value)``, with a ragged or unreadable sequence as a ``ValueError`` / ``TypeError``."""
    try:
        return np.array(value)
    except ValueError:
        raise ValueError(
            f"{where}: field {shown(name)} is a ragged nested sequence; give equal-length rows"
        ) from None
    except (TypeError, RuntimeError, NotImplementedError):  # e.g. a list of tensors on a device
        raise TypeError(
            f"{where}: field {shown(name)} holds items that cannot be read as plain numbers; give a list of "
            "numbers, or one array or tensor"
        ) from None


def _beyond_int64(where: str, name: str, dtype: object = None) -> ValueError:
    """The refusal of integers beyond int64 (``dtype``: the unsigned dtype that holds them)."""
    if dtype is None:
        return ValueError(
            f"{where}: field {shown(name)} holds values beyond int64; give integers from -2**63 to 2**63 - 1"
        )
    return ValueError(
        f"{where}: field {shown(name)} holds values beyond int64 (dtype {dtype}); give values up to 2**63 - 1"
    )


def _exact_integers(value: Any, row: np.ndarray, where: str, name: str) -> np.ndarray:
    """``value`` read as int64 where every entry is an integer, else ``row`` (what NumPy inferred)."""
    if not bool(np.all(np.isfinite(row) & (row == np.floor(row)))):  # a fraction: floats, as inferred
        return row
    try:
        items = np.array(value, dtype=object)
    except ValueError:
        return row
    if items.shape != row.shape or not all(
        isinstance(item, numbers.Integral) and not isinstance(item, (bool, np.bool_)) for item in items.flat
    ):
        return row
    try:
        return items.astype(np.int64)
    except OverflowError:
        raise _beyond_int64(where, name) from None


def _numpy_row(value: Any, where: str, name: str) -> np.ndarray:
    """A NumPy array of ``value``; a list or tuple gets the dtype NumPy infers for it (all bools: bool)."""
    if isinstance(value, (list, tuple)) and (not value or type(value[0]) is int):
        try:  # the fast, exact path for a flat sequence of Python ints
            return np.frombuffer(array.array("q", value), dtype=np.int64)
        except OverflowError:
            if all(type(item) is int for item in value):
                raise _beyond_int64(where, name) from None
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # floats, bools, nested rows, tensors: let NumPy tell which
    if isinstance(value, np.ndarray):  # no copy, unless strided (torch takes no negative strides)
        if type(value) is not np.ndarray:  # a subclass (np.memmap, ...): read as a plain view of its data
            if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
                raise ValueError(
                    f"{where}: field {shown(name)} is a masked array with masked entries, whose data would "
                    "be read as if unmasked; fill them (.filled(value)) or drop them"
                )
            value = value.view(np.ndarray)
        row = value if value.flags.c_contiguous else np.array(value)
    else:
        row = _sequence_array(value, where, name)
        if row.dtype.kind == "f":  # NumPy reads np.uint64 beside ints as float64: re-read exact integers
            row = _exact_integers(value, row, where, name)
    if row.dtype.kind == "O" and row.size == 0:  # datasets' NumPy format: an empty nested row, no values
        row = np.empty(row.shape, np.float64)
    if row.dtype.kind == "O":
        if not isinstance(value, np.ndarray) and all(
            isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in row.flat
        ):
            raise _beyond_int64(where, name)
        raise TypeError(
            f"{where}: field {shown(name)} holds Python objects that are not numbers (dtype object); "
            "give numbers only"
        )
    if not row.dtype.isnative:  # e.g. '>i4' on a little-endian machine: torch reads native order only
        row = row.astype(row.dtype.newbyteorder("="))
    if row.dtype.kind == "f" and row.dtype.itemsize > 8:
        raise TypeError(
            f"{where}: field {shown(name)} has dtype {row.dtype}, which torch cannot hold; cast it with "
            ".astype(np.float64)"
        )
    if row.dtype.kind == "u" and row.dtype.itemsize > 1:  # uint16/32/64: torch supports little on them
        if row.dtype.itemsize == 8 and row.size and row.max() > INT64_MAX:
            raise _beyond_int64(where, name, row.dtype)
        row = row.astype(np.int64)
    return row


def _tensor_row(value: torch.Tensor, where: str, name: str) -> torch.Tensor:
    """``value`` itself, or an exact int64 copy of a uint16/32/64 tensor."""
    if value.layout != torch.strided or value.is_nested or value.is_quantized:
        kind = "nested" if value.is_nested else "quantized" if value.is_quantized else str(value.layout)
        raise TypeError(
            f"{where}: field {shown(name)} is a {kind} tensor; give a plain dense tensor "
            "(.to_dense(), .dequantize())"
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{where}: field {shown(name)} is a tensor on the 'meta' device, which holds no data; give "
            "tensors with data (on the CPU or an accelerator)"
        )
    if value.dtype in (torch.uint16, torch.uint32, torch.uint64):
        if value.dtype == torch.uint64:
            as_signed = value.view(torch.int64)  # values beyond int64 read as negative
            if bool((as_signed < 0).any()):
                raise _beyond_int64(where, name, value.dtype)
            return as_signed
        return value.to(torch.int64)
    return value


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PLAIN_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "ids": frozenset(_INTEGER_DTYPES),
    "values": frozenset((*_INTEGER_DTYPES, torch.bool, *_FLOAT_DTYPES)),
}


def to_row(value: Any, where: str, name: str, kind: Kind) -> Row:
    """One payload value checked, as an array or tensor (a tensor not copied); else TypeError/ValueError."""
    if isinstance(value, torch.Tensor):
        row: Row = _tensor_row(value, where, name)
        if value.dtype.is_floating_point and value.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{where}: field {shown(name)} has dtype {value.dtype}, which collating cannot compute with; "
                "cast it with .float()"
            )
        bad = value.dtype.is_complex or (
            kind == "ids" and (value.dtype.is_floating_point or value.dtype == torch.bool)
        )
        dtype: object = value.dtype
        empty_float = value.dtype.is_floating_point and value.numel() == 0
    elif isinstance(value, (np.ndarray, list, tuple, int, float, np.generic)):
        row = _numpy_row(value, where, name)
        bad = row.dtype.kind not in ("iu" if kind == "ids" else "biuf")
        dtype = row.dtype
        empty_float = row.dtype.kind == "f" and row.size == 0
    else:
        raise TypeError(
            f"{where}: field {shown(name)} must be a list, tuple, NumPy array or torch tensor of numbers, "
            f"got {type(value).__name__}"
        )
    if bad and empty_float:  # torch.tensor([]) and np.array([]) are float: an empty row holds no float
        row = row.astype(np.int64) if isinstance(row, np.ndarray) else row.to(torch.int64)
    elif bad:
        ids = "integer positions" if name in (POSITIONS, POSITION_IDS) else "integer token ids"
        expected = ids if kind == "ids" else "bool, integer or float values"
        raise TypeError(f"{where}: field {shown(name)} has dtype {dtype}; it must hold {expected}")
    if kind == "ids" and row.ndim == 0:
        raise ValueError(f"{where}: field {shown(name)} must be a sequence, got a scalar")
    if kind == "ids" and row.ndim == 2 and row.shape[0] == 1:
        raise ValueError(
            f"{where}: field {shown(name)} has shape {tuple(row.shape)}: a batch of one row, as "
            "tokenizer(..., return_tensors='pt') returns; pass the row itself (value[0] or value.squeeze(0))"
        )
    return row


def host_dtype(row: Row) -> np.dtype:
    """The dtype :func:`as_numpy` gives ``row`` (bfloat16: float32), without reading it."""
    if isinstance(row, np.ndarray):
        return row.dtype
    return numpy_dtype(torch.float32 if row.dtype == torch.bfloat16 else row.dtype)


def as_numpy(row: Row) -> np.ndarray:
    """A row as a NumPy array: a tensor detached and on the CPU (bfloat16 read as float32), no copy else."""
    if not isinstance(row, torch.Tensor):
        return np.asarray(row)
    if row.is_cpu and not row.requires_grad and row.dtype != torch.bfloat16:
        return row.numpy()  # the common case, a view
    tensor = row.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def host_view(values: Values) -> Values:
    """What the checks compute on: host values, a CPU tensor as a NumPy view, a device tensor where it is."""
    if isinstance(values, np.ndarray) or values.device.type != "cpu":
        return values
    return as_numpy(values)


def joined_ints(values: list[Any]) -> Ragged | None:
    """Lists of Python ints end to end in one int64 buffer, or ``None`` for anything else."""
    buffer = array.array("q")
    ends = [0]  # the offsets, counted as the buffer grows: one conversion, no running sum in NumPy
    try:
        for value in values:
            if type(value) is not list or (value and type(value[0]) is not int):
                return None
            buffer.fromlist(value)
            ends.append(len(buffer))
    except (OverflowError, TypeError):
        return None  # beyond int64, or not ints after the first: the row-by-row read names it
    offsets = np.array(ends, dtype=np.int64)
    return Ragged(np.frombuffer(buffer, dtype=np.int64) if buffer else np.empty(0, np.int64), offsets)
