"""Packer input: the packing options (:class:`PackOptions`) and the documents (:class:`Reader`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, MISSING, dataclass
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch

from zephon_collate.core.checks import Keywords, check_int, check_option_names, is_zero_d
from zephon_collate.core.keys import (
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    POSITION_IDS,
    POSITIONS,
    SUPERVISION_MASKS,
)
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read import rules
from zephon_collate.read.arrow import Columns, read_by_rows
from zephon_collate.read.columns import Batch, Names, Ragged, Spread, as_numpy, places, row_any, to_row
from zephon_collate.read.fields import TensorField, check_float_fields, read_floats, value_rows
from zephon_collate.read.rows import example_names, is_array_payload, records_of
from zephon_collate.read.rules import (
    SUPERVISING_FIELDS,
    check_flat,
    check_ids,
    check_zero_one,
    misaligned,
    unstarted,
)

__all__ = [
    "OVERFLOWS",
    "PACK_OPTION_NAMES",
    "PROMPT_FIELDS",
    "REQUIRED",
    "STRATEGIES",
    "STREAM_BUFFER_SIZE",
    "Document",
    "PackOptions",
    "Reader",
    "StreamOptions",
    "as_array",
    "candidates",
    "check_loss_mask",
    "prompt_entries",
]

STRATEGIES = ("greedy", "best_fit")
OVERFLOWS = ("auto", "split", "truncate")


STREAM_BUFFER_SIZE = 1024
"""``FlatPacker``'s default ``buffer_size`` (``pack_flat``'s is the whole list)."""

PROMPT_FIELDS = (LABELS, *SUPERVISION_MASKS[1:])
"""Supervising fields that mark a prompt (``labels`` -100, a mask's 0s), as a ``loss_mask``'s 0s do."""


@dataclass(frozen=True, kw_only=True)
class PackOptions(Keywords):
    """The packing options: the one home of the keywords (and defaults) of :func:`pack_flat`,
    ``FlatPacker`` and ``PackedStream``, checked by :meth:`create`."""

    seq_len: int = dataclasses.field(kw_only=False)
    pad_token_id: int
    emit_positions: bool = True
    tokens_field: str = "auto"
    strategy: Literal["greedy", "best_fit"] = "greedy"
    overflow: Literal["auto", "split", "truncate"] = "auto"
    buffer_size: int | None = None
    fields: Sequence[str] | None = None
    float_fields: Sequence[str | TensorField] = ()
    group_key: str | None = None

    @classmethod
    def create(cls, owner: str, *args: Any, **given: Any) -> PackOptions:
        """Check every option, raising ``TypeError``/``ValueError`` that names it (``args``: ``seq_len``)."""
        given = {**dict(zip(("seq_len",), args, strict=False)), **given}
        check_option_names(owner, given, PACK_OPTION_NAMES)
        if "pad_token_id" not in given:
            raise TypeError(f"{owner}: pad_token_id is required: {REQUIRED['pad_token_id']}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not MISSING}
        options = {**defaults, **given}
        checked = dict(options)
        checked["seq_len"] = check_int(owner, "seq_len", options["seq_len"], 1, INT32_MAX)  # int32 offsets
        checked["pad_token_id"] = check_int(owner, "pad_token_id", options["pad_token_id"], 0)
        if options["buffer_size"] is not None or owner not in ("pack_flat", "pack_columns", "PackBatches"):
            checked["buffer_size"] = check_int(owner, "buffer_size", options["buffer_size"], 1)
        if not isinstance(options["emit_positions"], bool):
            raise TypeError(f"{owner}: emit_positions must be a bool, got {shown(options['emit_positions'])}")
        tokens_field = options["tokens_field"]
        if not isinstance(tokens_field, str) or not tokens_field:
            raise TypeError(
                f"{owner}: tokens_field must be 'auto' or a field name, got {shown(tokens_field)}"
            )
        for name, allowed in (("strategy", STRATEGIES), ("overflow", OVERFLOWS)):
            if not isinstance(options[name], str) or options[name] not in allowed:
                choices = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise ValueError(f"{owner}: {name} must be {choices}, got {shown(options[name])}")
        fields = options["fields"]
        if fields is not None:
            zero_d = is_zero_d(fields)
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable) or zero_d:
                raise TypeError(
                    f"{owner}: fields must be None or a sequence of field names, got {shown(fields)}"
                )
            checked["fields"] = fields = tuple(fields)
            for name in fields:
                if not isinstance(name, str):
                    raise TypeError(f"{owner}: fields must hold str field names, got {shown(name)}")
                if name == tokens_field or (name in (POSITIONS, POSITION_IDS) and options["emit_positions"]):
                    does = "reads as the documents' positions" if name == POSITION_IDS else "writes"
                    hint = (
                        "; pass emit_positions=False to pack input positions" if name != tokens_field else ""
                    )
                    raise ValueError(
                        f"{owner}: fields may not list {shown(name)}, which the packer {does}{hint}"
                    )
            if len(set(fields)) != len(fields):
                raise ValueError(f"{owner}: fields lists a name twice: {shown(fields)}")
        reserved = (
            *(fields or ()),
            POSITIONS,
            *([POSITION_IDS] if options["emit_positions"] else []),  # read as the positions
            LOSS_MASK,
            *([tokens_field] if tokens_field != "auto" else []),
        )
        specs = check_float_fields(owner, options["float_fields"], reserved)
        for spec in specs:
            if not spec.per_token:
                raise ValueError(
                    f"{owner}: float field {shown(spec.name)} holds one value per document, but a packed row "
                    "holds several documents: declare FloatField(name, align='sequence', broadcast=True) to "
                    "repeat each document's value over its tokens"
                )
        checked["float_fields"] = specs
        group = options["group_key"]
        if group is not None:
            if not isinstance(group, str) or not group:
                raise TypeError(
                    f"{owner}: group_key must be None or a payload field name, got {shown(group)}"
                )
            if group in (*reserved, *(spec.name for spec in specs)):
                raise ValueError(
                    f"{owner}: group_key {shown(group)} names a field that is packed beside the tokens; name "
                    "the payload field that holds each record's group id"
                )
        return cls(**checked)

    def check_columnar(self, owner: str) -> None:
        """Refuse ``group_key`` for a columnar batch (groups are read record by record)."""
        if self.group_key is not None:
            raise read_by_rows(owner, "group_key groups")

    @property
    def floats(self) -> tuple[TensorField, ...]:
        """The float fields, as specs (checked by :meth:`create`)."""
        return cast(tuple[TensorField, ...], self.float_fields)

    def plain(self) -> dict[str, Any]:
        """The options as plain data (float fields as tuples), for a state that ``torch.load`` reads back."""
        values = dict(vars(self))
        values["float_fields"] = [
            [spec.name, spec.align, str(spec.dtype), spec.broadcast]  # a float field as states saved it
            + ([] if (spec.fill, spec.shape) == (0, ()) else [_plain_fill(spec.fill), list(spec.shape)])
            for spec in self.floats
        ]
        if values["fields"] is not None:
            values["fields"] = list(values["fields"])
        return values


PACK_OPTION_NAMES = PackOptions.names()
"""The packing keywords, in the order ``pack_flat``, ``FlatPacker`` and ``PackedStream`` spell them."""
REQUIRED = {"pad_token_id": "the token id of the padding, an int >= 0"}
"""The packing keyword without a default, and what it is (for the error naming it)."""


@dataclass(frozen=True, kw_only=True)
class StreamOptions(PackOptions):
    """The packing keywords of ``FlatPacker`` and ``PackedStream``: a stream packs a buffer at a time."""

    buffer_size: int | None = STREAM_BUFFER_SIZE


def as_array(value: object, where: str, name: str, *, ids: bool, flat: bool = True) -> np.ndarray:
    """A payload value as a NumPy array, 1-D unless ``flat=False``; token ids as int64 ``>= 0``."""
    if not isinstance(value, (torch.Tensor, np.ndarray, list, tuple)):
        raise TypeError(
            f"{where}: field {shown(name)} must be a list, tuple, NumPy array or torch tensor of numbers, "
            f"got {type(value).__name__}"
        )
    row = as_numpy(to_row(value, where, name, "ids" if ids else "values"))
    if row.ndim != 1 and (flat or ids or row.ndim == 0):
        raise ValueError(
            f"{where}: field {shown(name)} must be 1-D (one entry per token), got shape {row.shape}"
        )
    if not ids:
        return row
    row = row.astype(np.int64, copy=False)
    check_ids(Ragged.of_row(row), name, lambda _: where)
    return row


def check_loss_mask(values: np.ndarray, where: str) -> None:
    """``ValueError`` unless a packed ``loss_mask`` holds only 0 and 1 (NaN included)."""
    field = Ragged.of_row(values)
    check_zero_one(field, LOSS_MASK, lambda _: where, "1 for supervised tokens, 0 for the rest")


def prompt_entries(name: str, values: np.ndarray) -> np.ndarray:
    """Entry-wise: does a supervising field (:data:`PROMPT_FIELDS`) mark a prompt token (-100, or a mask's 0)?

    Example:
        >>> prompt_entries("labels", np.array([-100, 5, 6])).tolist()
        [True, False, False]
    """
    flags: np.ndarray = values == IGNORE_INDEX if name == LABELS else values == 0
    return flags


class Document(NamedTuple):
    """One record as the packer reads it: tokens, packed fields, its own segments, its group."""

    tokens: np.ndarray
    fields: dict[str, np.ndarray]
    positions: np.ndarray | None  # the payload's segment-restarting positions, or None (one segment)
    group: Any  # the group key's value (an int or a str), or None without group_key


def _aligned_rows(field: Ragged, tokens: Ragged) -> np.ndarray:
    """``[B]`` booleans: does each document with tokens hold one entry of ``field`` per token?"""
    aligned: np.ndarray = (field.lengths == tokens.lengths) | (tokens.lengths == 0)
    return aligned


def _check_one_segment(positions: Ragged, tokens: Ragged, names: Names, name: str) -> None:
    """Each columnar document's ``positions`` (or ``position_ids``) must count 0, 1, ... (one segment)."""
    aligned = _aligned_rows(positions, tokens)
    if positions.values.ndim != 1 or not aligned.all():
        bad = ~aligned | (positions.values.ndim != 1)
    else:
        if not np.array_equal(positions.offsets, tokens.offsets):  # entries of documents without tokens
            positions = positions.select(np.repeat(tokens.lengths > 0, positions.lengths))
        bad = row_any(positions.host != places(tokens.offsets), tokens.offsets)
    found = np.flatnonzero(bad)
    if found.size:
        raise ValueError(
            f"{names(int(found[0]))}: field {shown(name)} does not count 0, 1, ... over the document's "
            "tokens (it restarts: segments, or is misaligned); packing keeps a document's segments for "
            "records only: give these documents as records or payload dicts (pack_flat), drop the column "
            f"for one segment per document, or pass emit_positions=False with fields=(..., {shown(name)}) "
            "to pack it as data"
        )


@dataclass(eq=False)
class Reader:
    """Reads documents through the door (:mod:`zephon_collate.read`): records as one batch, or columns.

    Parameters:
        tokens_name: the token field; ``None``: fixed by the first document with tokens.
        fields: the packed per-token fields; ``None``: fixed by the first document with tokens.
        strict: with found fields, refuse a later record with a ``loss_mask`` the first lacked.
        floats: the float fields, read by their specs.
        segments: read ``positions`` (else ``position_ids``) as each document's segments.
        group_key: the field read as each document's group.
    """

    tokens_name: str | None
    fields: tuple[str, ...] | None
    _: KW_ONLY
    strict: bool
    floats: tuple[TensorField, ...] = ()
    segments: bool = False
    group_key: str | None = None

    @classmethod
    def of(cls, options: PackOptions) -> Reader:
        """The reader of ``options``: token field and fields fixed by the first document unless given."""
        fields = None if options.fields is None else tuple(options.fields)
        return cls(
            None if options.tokens_field == "auto" else options.tokens_field,
            fields,
            strict=fields is None,
            floats=options.floats,
            segments=options.emit_positions,
            group_key=options.group_key,
        )

    @property
    def packed(self) -> tuple[str, ...]:
        """Every field packed beside the tokens: the per-token fields, then the float fields."""
        return (*(self.fields or ()), *(spec.name for spec in self.floats))

    @property
    def _listed(self) -> tuple[str, ...]:
        """The fields read as the user listed them: packed ones and the group key (never supervision)."""
        return (*self.packed, *([self.group_key] if self.group_key is not None else []))

    def read(self, record: SampleRecord, index: int) -> Document | None:
        """The :class:`Document` of one record named by its place ``index`` (``None`` without tokens)."""
        batch = records_of(
            [record], self.tokens_name or INPUT_IDS, "FlatPacker", places=[index], resolve=False
        )
        documents = self._documents(batch)
        assert documents is not None  # a record alone has one dtype per field
        return documents[0]

    def read_all(
        self, records: Sequence[SampleRecord], places: Sequence[int]
    ) -> list[Document | None] | None:
        """The documents of a call's records read as one batch, or ``None`` (then read them one by one).

        Example:
            >>> from zephon_collate.core.records import SampleMeta
            >>> docs = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": [i, i]}) for i in range(2)]
            >>> [doc.tokens.tolist() for doc in Reader("input_ids", (), strict=False).read_all(docs, [0, 1])]
            [[0, 0], [1, 1]]
        """
        if self.tokens_name is None or self.fields is None:
            return None
        try:
            batch = records_of(records, self.tokens_name, "FlatPacker", places=places, resolve=False)
            return self._documents(batch)
        except Exception:  # read one at a time, each raises what it raises
            return None

    def _documents(self, batch: Batch) -> list[Document | None] | None:
        """Each row's :class:`Document`; ``None`` where a field's rows differ in dtype."""
        arrays = [is_array_payload(payload) for payload in batch.payloads]
        if any(arrays):  # the token field an array payload's row is, and its fields: none
            self.tokens_name = self.tokens_name or INPUT_IDS
            self.fields = () if self.fields is None else self.fields
        tokens, fields = self.read_batch(batch)
        uniform = batch.one_dtype(self.tokens_name or INPUT_IDS, "ids") and all(
            batch.one_dtype(name, "values") for name in fields
        )
        if not uniform:
            return None
        offsets = tokens.offsets.tolist()
        read = [not array and offsets[row + 1] > offsets[row] for row, array in enumerate(arrays)]
        source = rules.positions_field(batch) if self.segments and any(read) else None
        positions = None if source is None else batch.get(source, "ids", partial=True)
        segmented = None if source is None else batch.carried(source)
        key = self.group_key
        groups = None if key is None else (batch.objects(key), batch.carried(key))
        documents: list[Document | None] = []
        for row, (start, end) in enumerate(itertools.pairwise(offsets)):
            if not read[row]:  # no tokens, or an array payload: its token row only
                documents.append(Document(tokens.host[start:end], {}, None, None) if end > start else None)
                continue
            values = {name: field.host[start:end] for name, field in fields.items()}
            segments = None
            if positions is not None and segmented is not None and segmented[row]:
                segments = self._segments(batch.names(row), positions, str(source), row, end - start)
            group = None if groups is None else self._group(batch, row, groups[0][row], groups[1][row])
            documents.append(Document(tokens.host[start:end], values, segments, group))
        return documents

    def read_columns(self, columns: Columns, first: int) -> tuple[Ragged, dict[str, Ragged]]:
        """Every document of a columnar batch: ``(tokens, {field: values})``, rows named from ``first``."""
        columns.names = lambda row: example_names(first + row)  # the rows are named by their place
        return self.read_batch(columns, columnar=True)

    def tokens(self, batch: Batch) -> Ragged:
        """The documents' token rows: 1-D ids >= 0, on the host."""
        return self._tokens(batch)[1]

    def _tokens(self, batch: Batch) -> tuple[str, Ragged]:
        """The token field (:meth:`Batch.tokens_field`) and :meth:`tokens`."""
        names = batch.names
        name = batch.tokens_field(self.tokens_name or "auto", packer=True)
        read = batch.get(name, "ids")
        assert read is not None
        tokens = Ragged(read.host, read.offsets)  # the packer works on the host
        check_flat(tokens, name, names)
        check_ids(tokens, name, names)
        if self.fields and name in self.fields:
            raise ValueError(
                f"{names(0)}: the tokens field {shown(name)} is also listed in fields; drop it from fields"
            )
        return name, tokens

    def read_batch(self, batch: Batch, *, columnar: bool = False) -> tuple[Ragged, dict[str, Ragged]]:
        """The tokens and the packed fields of every document of ``batch`` (records or columns alike)."""
        names = batch.names
        arrays = [is_array_payload(payload) for payload in batch.payloads]
        only_arrays = bool(arrays) and all(arrays)  # an array payload holds only its token row
        if not only_arrays:
            rules.refuse_media(batch, "the packer")
        name, tokens = self._tokens(batch)
        if any(arrays) and (self.packed or self.group_key is not None):
            bad = np.flatnonzero(np.array(arrays) & (tokens.lengths > 0))
            if bad.size:
                listed = list(self.packed) or [str(self.group_key)]
                raise ValueError(
                    f"{names(int(bad[0]))}: an array payload holds only its token row, but fields {listed} "
                    "are read beside the tokens; give it a dict payload with them, or pass fields=()"
                )
        if only_arrays:
            return tokens, {}
        source = rules.positions_field(batch) if self.segments and columnar else None
        if source is not None:  # a record's are read by _segments
            _check_one_segment(cast(Ragged, batch.get(source, "ids")), tokens, names, source)
        has_tokens = tokens.lengths > 0
        if not has_tokens.any():
            return tokens, {}
        self.tokens_name = name
        self._check_names(batch, name)
        if self.fields is None:
            skipped = [spec.name for spec in self.floats] + ([self.group_key] if self.group_key else [])
            self.fields = candidates(batch, name, tokens, skipped)
        else:
            self._check_present(batch)
        self._check_supervision(batch, tokens)
        values = {}
        for field_name in self.fields:
            read = batch.get(field_name, "values")
            assert read is not None
            field = Ragged(read.host, read.offsets)
            check_flat(field, field_name, names)
            bad = np.flatnonzero(~_aligned_rows(field, tokens))
            if bad.size:
                row = int(bad[0])
                raise misaligned(names(row), field_name, int(field.lengths[row]), int(tokens.lengths[row]))
            if not np.array_equal(field.offsets, tokens.offsets):  # entries of documents without tokens
                field = field.select(np.repeat(has_tokens, field.lengths))
            if field_name == LOSS_MASK:
                check_zero_one(field, LOSS_MASK, names, "1 for supervised tokens, 0 for the rest")
            values[field_name] = field
        for spec in self.floats:  # by their specs, one path for records and columns
            lacking = batch.lacking(spec.name)
            if lacking is not None:
                fields = dict.fromkeys(batch.order)
                raise ValueError(
                    f"{names(lacking)}: payload lacks float field {shown(spec.name)} (its fields: "
                    f"{shown_fields(fields)}); give every record this field, or drop it from float_fields"
                )
            floats = cast(Ragged, read_floats(value_rows(batch, spec), tokens.lengths, spec, names))
            if not np.array_equal(floats.offsets, tokens.offsets):  # documents without tokens hold none
                floats = floats.select(np.repeat(has_tokens, floats.lengths))
            values[spec.name] = floats
        return tokens, values

    def _check_present(self, batch: Batch) -> None:
        """A later document has every packed field, and no ``loss_mask`` the earlier ones lacked."""
        assert self.fields is not None
        where = batch.names(0)
        if self.strict and LOSS_MASK in batch and LOSS_MASK not in self.fields:
            raise ValueError(
                f"{where}: payload has a 'loss_mask' but earlier records have none; give every record a "
                "loss_mask (1 = supervised), or pass fields=(...) to choose the packed fields"
            )
        for field_name in self.fields:
            if field_name not in batch:
                raise ValueError(
                    f"{where}: payload lacks field {shown(field_name)}, which is packed beside the tokens "
                    f"(fields {self.fields}); give every record this field, or pass fields=(...) without it"
                )

    def _check_names(self, batch: Batch, tokens_name: str) -> None:
        """Refuse a near miss of a supervision field (``loss_maks``) that is not listed."""
        read = (*self._listed, tokens_name, POSITIONS, POSITION_IDS)
        near = rules.misspelled(batch.fields, rules.SUPERVISION_NAMES, read)
        if near is not None:
            name, meant = near
            where = batch.names(int(np.flatnonzero(batch.carried(name))[0]))
            raise ValueError(
                rules.near_miss(where, name, meant, ", or list it in fields=(...) to pack it as data")
            )

    def _check_supervision(self, batch: Batch, tokens: Ragged) -> None:
        """Refuse supervision spelled otherwise than ``loss_mask`` where it would change what is trained."""
        names = batch.names
        for name in SUPERVISING_FIELDS:
            if name in batch and name not in self._listed:
                carried = np.flatnonzero(batch.carried(name))
                if batch.one_value_row(name) is not None and name not in rules.FOREIGN_SUPERVISION:
                    raise ValueError(
                        f"{names(int(carried[0]))}: field {shown(name)} holds one value per document, "
                        "not one per token, so what it supervises cannot be checked; give it one value per "
                        "token (as a loss_mask: 1 = supervised), or drop it (a per-example label, as for "
                        "sequence classification, is not a token field)"
                    )
        loss_mask = (
            batch.get(LOSS_MASK, "values")
            if LOSS_MASK in batch and batch.one_value_row(LOSS_MASK) is None
            else None
        )
        found = rules.unread_supervision(batch, tokens, self._listed, loss_mask)
        if found is not None:
            raise ValueError(rules.unread_message(names(found[0]), found[1], "packer"))
        problem = rules.unread_documents(
            batch, self._listed, "give each document as a record of its own", positions=self.segments
        )
        if problem is not None:
            raise ValueError(problem)

    def _segments(self, where: str, positions: Ragged, name: str, row: int, length: int) -> np.ndarray | None:
        """Row ``row``'s ``positions`` as its segments; ``None`` for one segment."""
        if positions.values.ndim != 1:
            raise ValueError(
                f"{where}: field {shown(name)} must be 1-D (one entry per token), got shape "
                f"{tuple(positions.values.shape)}"
            )
        values = positions.host[positions.offsets[row] : positions.offsets[row + 1]]
        start = unstarted(Ragged.of_row(values)) if values.size == length else None
        if values.size != length or start is not None:
            problem = f"starts at {start[1]}" if start else f"has {values.size} entries for {length} tokens"
            raise ValueError(
                f"{where}: field {shown(name)} {problem}; the packer keeps a document's segments (a "
                "segment starts wherever positions are 0), so they must start at 0 and give one per token. "
                "Drop them for one segment per document, or pass emit_positions=False to pack them as data"
            )
        if np.array_equal(values, np.arange(values.size)):
            return None  # one segment counted 0, 1, ...: what the packer writes anyway
        return np.asarray(values, dtype=np.int64)

    def _group(self, batch: Batch, row: int, value: Any, carried: bool) -> int | str:
        """Row ``row``'s group key: an int or a str."""
        key = cast(str, self.group_key)
        where = batch.names(row)
        if not carried:
            raise ValueError(
                f"{where}: payload lacks the group key {shown(key)} (its fields: "
                f"{shown_fields(batch.payloads[row])}); "
                "give every record its group id (e.g. the index of its prompt)"
            )
        return rules.group_id(value, where, key)


def candidates(
    batch: Batch, tokens_name: str, tokens: Ragged, skipped: Sequence[str] = ()
) -> tuple[str, ...]:
    """The per-token fields: ``loss_mask``, then each field of numbers with one entry per token.

    Parameters:
        batch: the documents.
        tokens_name: their token field.
        tokens: their token rows (:meth:`Reader.tokens`).
        skipped: fields read otherwise (float fields, the group key).

    Example:
        >>> from zephon_collate.read.rows import examples_of
        >>> batch = examples_of([{"input_ids": [1, 2], "w": [3, 4], "loss_mask": [1, 1], "t": "x"}], "pack")
        >>> candidates(batch, "input_ids", batch.get("input_ids", "ids"))
        ('loss_mask', 'w')
    """
    names = batch.names
    found = []
    if LOSS_MASK in batch and batch.carried(LOSS_MASK)[tokens.lengths > 0].any():  # empty records are skipped
        mask = batch.get(LOSS_MASK, "values")
        assert mask is not None
        bad = np.flatnonzero(~_aligned_rows(mask, tokens))
        if bad.size:
            row = int(bad[0])
            raise ValueError(
                f"{names(row)}: field 'loss_mask' does not have one entry per token "
                f"({int(tokens.lengths[row])})"
            )
        found.append(LOSS_MASK)
    excluded = {tokens_name, POSITIONS, POSITION_IDS, LOSS_MASK, *SUPERVISING_FIELDS, *skipped}
    excluded.update(rules.BOUNDARY_FIELDS)  # another stack's document marks: refused (several), never data
    for name in batch.order:
        if not isinstance(name, str) or name in excluded or not batch.carried(name)[tokens.lengths > 0].all():
            continue
        if rules.misspelled([name], rules.SUPERVISION_NAMES, excluded) is not None:
            continue  # a near miss of a supervision field ('loss_masks'): refused by name, never data
        if not batch.is_list(name):
            continue
        try:
            field = batch.get(name, "values")
        except (TypeError, ValueError):
            continue
        if field is not None and field.values.ndim == 1 and bool(_aligned_rows(field, tokens).all()):
            found.append(name)
    return tuple(found)


def _plain_fill(fill: int | float | Spread) -> int | float | list[object]:
    """A fill as plain data: a number, or ``["spread", count]``."""
    return ["spread", fill.count] if isinstance(fill, Spread) else fill
