"""Row-wise input (records, payload dicts, Hugging Face examples, token rows) read into a ``Batch``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate.core.checks import is_zero_d
from zephon_collate.core.keys import INPUT_IDS
from zephon_collate.core.records import FLUSH_TAG, TOMBSTONE_TAG, SampleMeta, SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read.columns import (
    MISSING,
    PLAIN_DTYPES,
    Batch,
    Kind,
    Names,
    Ragged,
    Row,
    concat,
    host_dtype,
    joined_ints,
    to_row,
    tokens_field_of,
)

__all__ = [
    "Rows",
    "as_record",
    "as_record_tuple",
    "describe_record",
    "example_names",
    "examples_of",
    "is_array_payload",
    "payload_get",
    "records_of",
]


def describe_record(index: int, record: SampleRecord) -> str:
    """``record 3 (sample_id (0, 0, 7))``: how errors name a record known by its place."""
    return f"record {index} (sample_id {record.meta.sample_id})"


def example_names(index: int) -> str:
    """How errors name an example (a Hugging Face example, a pair, a row of columns): ``example 3``."""
    return f"example {index}"


def is_array_payload(payload: object) -> bool:
    """True for a payload that is the token row itself (a list, tuple, NumPy array or tensor)."""
    return isinstance(payload, (list, tuple, np.ndarray, torch.Tensor))


def payload_get(payload: Mapping[Any, Any], name: str, default: Any = None) -> Any:
    """``payload[name]`` if ``name in payload``, else ``default``: read through the mapping interface.

    Example:
        >>> class Doubled(dict):
        ...     def __getitem__(self, key):
        ...         return 2 * super().__getitem__(key)
        >>> payload_get(Doubled(x=1), "x"), payload_get({"x": 1}, "y", 0)
        (2, 0)
    """
    if type(payload) is dict:
        return payload.get(name, default)
    return payload[name] if name in payload else default  # noqa: SIM401 (a subclass may not route .get)


def as_record(sample: object, index: int, owner: str) -> SampleRecord:
    """``sample`` as a record: a record as given, a plain payload wrapped with sample id ``(0, 0, index)``.

    Example:
        >>> as_record({"input_ids": [5, 6]}, 3, "Collator").meta.sample_id
        (0, 0, 3)
    """
    if isinstance(sample, SampleRecord):
        return sample
    if isinstance(sample, Mapping) or is_array_payload(sample):
        return SampleRecord(SampleMeta((0, 0, index), 0, 0, index), sample)
    raise TypeError(
        f"{owner}: item {index} must be a SampleRecord, a payload dict or a token array, "
        f"got {type(sample).__name__}"
    )


def as_record_tuple(batch: object, owner: str) -> tuple[SampleRecord, ...]:
    """The records of a :class:`~zephon_collate.SampleBatch` or of a sequence of :class:`SampleRecord`."""
    records = getattr(batch, "records", None)
    if isinstance(records, tuple) and not isinstance(batch, Sequence):
        batch = records
    if isinstance(batch, (str, bytes, Mapping)) or not isinstance(batch, Iterable) or is_zero_d(batch):
        raise TypeError(
            f"{owner}: expected a SampleBatch or a list of SampleRecord, got {type(batch).__name__}"
        )
    found = tuple(batch)
    for index, record in enumerate(found):
        if not isinstance(record, SampleRecord):
            raise TypeError(
                f"{owner}: item {index} must be a SampleRecord, got {type(record).__name__}; wrap plain "
                "payloads in SampleRecord(meta, payload), or use Collator, which accepts them"
            )
    return found


class Rows(Batch):
    """A batch of payloads (dicts or token arrays), read field by field.

    Parameters:
        payloads: one per row.
        names: how errors name row ``i``.
        tokens: the field an array payload's row is (``None``: array payloads are not read).
        ids, metas, owner: as :class:`~zephon_collate.read.columns.Batch`.
        absent_if_none: fields for which a ``None`` value means the row lacks the field.
    """

    def __init__(
        self,
        payloads: Sequence[Any],
        names: Names,
        *,
        tokens: str | None,
        ids: list[Any],
        metas: tuple[SampleMeta, ...] = (),
        owner: str = "Collator",
        absent_if_none: frozenset[str] = frozenset(),
    ) -> None:
        dicts = [p for p in payloads if type(p) is dict]
        if len(dicts) == len(payloads):  # the common case: one C-level union of the keys
            fields: set[Any] = set().union(*dicts)
        else:
            fields = set()
            for payload in payloads:
                fields.update(
                    payload if isinstance(payload, Mapping) else () if tokens is None else (tokens,)
                )
        super().__init__(len(payloads), names, frozenset(fields), ids, metas, owner)
        self.payloads, self.tokens, self.absent_if_none = payloads, tokens, absent_if_none
        self._others = len(dicts) < len(payloads)  # mappings that answer ``in`` through their own methods
        self._found: dict[str, list[Any]] = {}  # each field's values, looked up once
        self._mixed: dict[tuple[str, Kind], bool] = {}  # fields whose rows differ in dtype

    def __contains__(self, name: object) -> bool:
        if name in self.fields:
            return True
        return self._others and any(
            isinstance(p, Mapping) and type(p) is not dict and name in p for p in self.payloads
        )

    def _value(self, payload: Any, name: str) -> Any:
        if type(payload) is dict:  # isinstance against Mapping is an ABC check, slower
            value = payload.get(name, MISSING)
        elif isinstance(payload, Mapping):
            value = payload_get(payload, name, MISSING)
        else:
            return payload if name == self.tokens else MISSING
        return MISSING if value is None and name in self.absent_if_none else value

    def _values(self, name: str) -> list[Any]:
        found = self._found.get(name)
        if found is None:
            if self._others:
                found = [self._value(payload, name) for payload in self.payloads]
            else:  # plain dicts only (the common case): one comprehension, no method call per row
                found = [payload.get(name, MISSING) for payload in self.payloads]
                if name in self.absent_if_none:
                    found = [MISSING if value is None else value for value in found]
            self._found[name] = found
        return found

    def carried(self, name: str) -> np.ndarray:
        return np.array([value is not MISSING for value in self._values(name)], dtype=bool)

    def lacking(self, name: str) -> int | None:
        return next((index for index, value in enumerate(self._values(name)) if value is MISSING), None)

    def _named_rows(self) -> Sequence[Any]:
        return self.payloads

    def one_dtype(self, name: str, kind: Kind) -> bool:
        return not self._mixed.get((name, kind), False)

    def _lacks(self, index: int, name: str) -> str:
        payload = self.payloads[index]
        holds = (
            f"its fields: {shown_fields(payload)}"
            if isinstance(payload, Mapping)
            else "an array payload holds only its token row"
        )
        return f"payload lacks field {shown(name)} ({holds})"

    def _rows(self, values: list[Any], name: str, kind: Kind, names: Names | None = None) -> list[Row]:
        """Every value checked (:func:`to_row`), named by ``names`` (default: the batch's); plain tensors
        pass as they are."""
        plain = PLAIN_DTYPES[kind]
        names = names or self.names
        return [
            value
            if type(value) is torch.Tensor
            and value.dtype in plain
            and (value.ndim == 1 or (value.ndim > 1 and kind == "values"))
            and value.layout is torch.strided
            and not value.is_meta
            else to_row(value, names(index), name, kind)
            for index, value in enumerate(values)
        ]

    def _read(self, name: str, kind: Kind) -> Ragged:
        values = self._values(name)
        present = [value for value in values if value is not MISSING]
        joined = joined_ints(present)
        if joined is None:
            names = self._names_of(values)  # of the rows that carry it, by their place among those
            rows = self._rows(present, name, kind, names)
            self._mixed[name, kind] = len({host_dtype(row) for row in rows}) > 1
            joined = concat(rows, name, names)
        if len(present) == len(values):
            return joined
        carried = self.carried(name)
        lengths = np.zeros(len(values), dtype=np.int64)  # the rows without the field: empty
        lengths[carried] = joined.lengths
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(joined.values, offsets)

    def _names_of(self, values: list[Any]) -> Names:
        """The names of the rows that carry the field, by their place among those."""
        if all(value is not MISSING for value in values):
            return self.names
        places = [index for index, value in enumerate(values) if value is not MISSING]
        return lambda index: self.names(places[index])

    def _per_row(self, name: str, kind: Kind) -> list[Row]:
        return self._rows(self._values(name), name, kind)

    def objects(self, name: str) -> list[Any]:
        return [None if value is MISSING else value for value in self._values(name)]


def _check_records(records: Sequence[SampleRecord], names: Names) -> None:
    """Refuse the first sentinel record (``ValueError``) or non-dict, non-array payload (``TypeError``)."""
    for index, record in enumerate(records):
        tags = record.meta.tags
        if tags and (tags.get(TOMBSTONE_TAG) or tags.get(FLUSH_TAG)):
            tag = "tombstone" if record.meta.tombstone else "flush sentinel"
            raise ValueError(
                f"{names(index)}: is a {tag}, a control record that carries no training "
                "data; drop sentinels before collating (pack_flat and FlatPacker consume them), e.g. "
                "[r for r in records if not r.meta.is_sentinel]"
            )
        payload = record.payload
        if type(payload) is not dict and not isinstance(payload, Mapping) and not is_array_payload(payload):
            raise TypeError(
                f"{names(index)}: payload must be a dict of fields or a token array "
                f"(list, tuple, NumPy array or torch tensor), got {type(payload).__name__}"
            )


def records_of(
    records: Sequence[SampleRecord],
    tokens_field: str,
    owner: str,
    *,
    places: Sequence[int] | None = None,
    resolve: bool = True,
) -> Rows:
    """The :class:`Rows` of records (sentinels and payloads of other types refused).

    Parameters:
        records: the records.
        tokens_field: their token field, or ``"auto"`` (:func:`~zephon_collate.read.columns.tokens_field_of`).
        owner: the entry point errors name.
        places: each record's place, which errors name (default: its index).
        resolve: resolve ``tokens_field``; ``False`` takes it as given.

    Example:
        >>> from zephon_collate.core.records import SampleMeta
        >>> rows = records_of([SampleRecord(SampleMeta((0, 0, 7), 0, 0, 7), [5, 6])], "auto", "x", places=[7])
        >>> rows.tokens, rows.names(0)
        ('input_ids', 'record 7 (sample_id (0, 0, 7))')
    """

    def names(index: int) -> str:
        return describe_record(index if places is None else places[index], records[index])

    _check_records(records, names)
    payloads = [record.payload for record in records]
    tokens = tokens_field_of(payloads, tokens_field, names) if resolve else tokens_field
    metas = tuple(record.meta for record in records)
    return Rows(payloads, names, tokens=tokens, ids=[m.sample_id for m in metas], metas=metas, owner=owner)


def examples_of(
    features: object, owner: str, *, key: str = INPUT_IDS, keep: Sequence[str] | None = None
) -> Rows:
    """The :class:`Rows` of Hugging Face examples: a list of dicts, a batched dict of lists, or token rows.

    Parameters:
        features: the examples.
        owner: the entry point errors name.
        key: the field every batched dict has (its rows tell the batch size).
        keep: the fields a batched dict is read for (``None``: all).
    """
    examples: list[Any]
    if type(features) is list:  # the common case, known without the ABC checks below
        examples = _listed(features)
    elif isinstance(features, Mapping):
        examples = _unbatched(features, owner, key, keep)
    elif isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise TypeError(
            f"{owner}: expected a list of example dicts or a batched dict of lists, got "
            f"{type(features).__name__}"
        )
    else:
        examples = _listed(features)
    ids = [(0, 0, index) for index in range(len(examples))]
    return Rows(
        examples, example_names, tokens=None, ids=ids, owner=owner, absent_if_none=frozenset(("labels",))
    )


def _listed(features: Sequence[Any]) -> list[Any]:
    """A sequence of examples as a list of its own; raw token rows as examples of ``input_ids`` alone."""
    examples = list(features)
    if examples and type(examples[0]) is not dict and all(is_array_payload(row) for row in examples):
        return [{INPUT_IDS: row} for row in examples]
    return examples


def _rows_like(value: object) -> bool:
    """A list-like of rows: sized, not a string, a mapping or a 0-d array or tensor."""
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping)) and not is_zero_d(value)


def _unbatched(features: Mapping[str, Any], owner: str, key: str, keep: Sequence[str] | None) -> list[Any]:
    """A batched dict of lists as one dict per example (the fields of ``keep``, or all)."""
    if key not in features:
        raise ValueError(
            f"{owner}: the batch has no {shown(key)} (its fields: {shown_fields(features)}); "
            "tokenize the examples first"
        )
    ids = features[key]
    if not _rows_like(ids):
        raise TypeError(f"{owner}: {shown(key)} must be a list of token rows, got {type(ids).__name__}")
    if len(ids) and getattr(ids[0], "ndim", 0 if isinstance(ids[0], (int, np.integer)) else 1) == 0:
        raise ValueError(
            f"{owner}: got one example (a dict whose {shown(key)} is a row of ints), not a batch; "
            "pass a list of examples ([example]) or a batched dict of lists"
        )
    count = len(ids)
    fields = [name for name in features if keep is None or name in keep or name == key]
    for name in fields:
        if not _rows_like(features[name]) or len(features[name]) != count:
            raise ValueError(
                f"{owner}: the batched field {shown(name)} does not hold one entry per example "
                f"({shown(key)} holds {count}); give every field as a list with one row per example"
            )
    return [{name: features[name][index] for name in fields} for index in range(count)]
