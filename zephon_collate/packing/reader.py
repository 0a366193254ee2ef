"""Packer input: check the packing options and read each document's tokens and per-token fields.

:class:`PackOptions` checks the options of :func:`zephon_collate.packing.pack_flat`
and :class:`zephon_collate.packing.packer.FlatPacker`. :class:`Reader` reads one
record at a time (a :class:`Document`): its token row as int64 ids >= 0, the
per-token fields packed beside it (``loss_mask`` holding only 0 and 1), each a
1-D NumPy view of the payload, its float fields (:mod:`zephon_collate.read.fields`),
its own segment structure (payload ``positions``, else Hugging Face's
``position_ids`` as the Collator reads them, restarting at 0 where a segment
starts; neither is packed as data unless listed) and its group key, with a
``TypeError``/``ValueError`` that names the record, the field and the fix.
Nothing here writes into a payload.

Supervision is read as ``loss_mask`` only. The fields that spell it otherwise
(:data:`SUPERVISING_FIELDS`: ``labels`` with -100 on a prompt, ``assistant_masks``,
``assistant_mask``, ``completion_mask``, a padding ``attention_mask``) follow the
native Collator's rule, written once here for records and columns
(:func:`unread_supervision`): one that would change what is trained is refused
unless ``fields`` lists it (then it is a data field, whose prompt
``overflow="auto"`` still keeps whole: :func:`prompt_entries`); a harmless copy
is accepted and never packed. A near miss of any of them (``loss_maks``,
``Completion_Mask``: :func:`~zephon_collate.read.rules.misspelled`) is refused
unless ``fields`` lists it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch

from zephon_collate.core.checks import Keywords, check_int, check_option_names
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    POSITION_IDS,
    POSITIONS,
    RESPONSE_MASK,
    SUPERVISION_MASKS,
    TOKEN_FIELD_CANDIDATES,
)
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read import rules
from zephon_collate.read.arrow import Columns, read_by_rows
from zephon_collate.read.columns import Batch, Names, Ragged, Spread, as_numpy, places, row_any, to_row
from zephon_collate.read.fields import TensorField, check_float_fields, read_floats, value_rows
from zephon_collate.read.rows import Rows, describe_record, example_names, is_array_payload
from zephon_collate.read.rules import SUPERVISING_FIELDS, check_flat, check_ids, check_zero_one, misaligned

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
    "unread_supervision",
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
        """Check every option, raising ``TypeError``/``ValueError`` that names it and says what to pass
        (``args``: ``seq_len``, given by position)."""
        given = {**dict(zip(("seq_len",), args, strict=False)), **given}
        check_option_names(owner, given, PACK_OPTION_NAMES)
        if "pad_token_id" not in given:
            raise TypeError(f"{owner}: pad_token_id is required: the token id of the padding, an int >= 0")
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not MISSING}
        options = {**defaults, **given}
        checked = dict(options)
        checked["seq_len"] = check_int(owner, "seq_len", options["seq_len"], 1, INT32_MAX)  # int32 offsets
        checked["pad_token_id"] = check_int(owner, "pad_token_id", options["pad_token_id"], 0)
        if options["buffer_size"] is not None or owner not in ("pack_flat", "pack_columns"):  # None: all
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
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
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
        """Refuse the options a columnar batch cannot serve: groups are read record by record (a group
        key per record, which the columns do not carry)."""
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


@dataclass(frozen=True, kw_only=True)
class StreamOptions(PackOptions):
    """The packing keywords of ``FlatPacker`` and ``PackedStream``: a stream packs a buffer at a time."""

    buffer_size: int | None = STREAM_BUFFER_SIZE


"""The packing keyword without a default, and what it is (for the error naming it)."""


def as_array(value: object, where: str, name: str, *, ids: bool, flat: bool = True) -> np.ndarray:
    """A 1-D NumPy array of a payload value (``flat=False``: ``[T, ...]``, a tensor field's), read by the
    one payload reader.

    :func:`~zephon_collate.read.columns.to_row` checks the value; token ids come back
    as int64 and ``>= 0``; an int64 ndarray is not copied.
    """
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
    check_ids(Ragged(row, np.array([0, row.size], dtype=np.int64)), name, lambda _: where)
    return row


def check_loss_mask(values: np.ndarray, where: str) -> None:
    """``ValueError`` unless a packed ``loss_mask`` holds only 0 and 1 (NaN included)."""
    field = Ragged(values, np.array([0, values.shape[0]], dtype=np.int64))
    check_zero_one(field, LOSS_MASK, lambda _: where, "1 for supervised tokens, 0 for the rest")


def prompt_entries(name: str, values: np.ndarray) -> np.ndarray:
    """Entry-wise booleans: does a packed supervising field (one of :data:`PROMPT_FIELDS`, listed in
    ``fields``) mark a prompt token here, as a ``loss_mask``'s 0 does? ``labels``: -100; a mask: 0.
    ``overflow="auto"`` never cuts a document holding one.

    Example:
        >>> prompt_entries("labels", np.array([-100, 5, 6])).tolist()
        [True, False, False]
    """
    flags: np.ndarray = values == IGNORE_INDEX if name == LABELS else values == 0
    return flags


def unread_supervision(where: str, name: str) -> ValueError:
    """The refusal of a supervising field that would change what is trained but is not packed, naming
    the document, the field and the fix (:func:`~zephon_collate.read.rules.unread_supervision`)."""
    unread = (
        "the packer reads supervision as 'loss_mask' only: packed as data, a cut (overflow='auto') "
        "would not keep the prompt with its answer, and the Collator refuses it"
    )
    hf = (
        "or pack Hugging Face examples with trl.pack_dataset and collate them with "
        "Collator.for_transformers(...)"
    )
    if name == LABELS:
        return ValueError(
            f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), but "
            f"{unread}. Give the supervision as a loss_mask (loss_mask = [int(l != -100) for l in "
            f"labels]) and drop 'labels', {hf}"
        )
    if name == ATTENTION_MASK:
        return ValueError(
            f"{where}: payload has an 'attention_mask' with zeros (padding inside the document), which the "
            "packer would pack as real tokens, and the Collator refuses it. Give the documents without "
            f"their padding (drop the padded tokens and the mask: each row is padded when packed), {hf}"
        )
    if name == RESPONSE_MASK:
        return ValueError(
            f"{where}: payload has 'response_mask' (verl's mask of the row's last tokens), but {unread}. "
            "Give it as the loss_mask (loss_mask = [0] * (len(input_ids) - len(response_mask)) + "
            "response_mask) and drop 'response_mask'"
        )
    return ValueError(
        f"{where}: payload has {shown(name)} with zeros, but {unread}. Give it as the loss_mask "
        f"(loss_mask = {name}) and drop {shown(name)}, {hf}"
    )


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
    """A ``positions`` (or ``position_ids``: ``name``) column beside columnar documents: each must count
    0, 1, ... over its tokens (one segment), for columns carry no per-document segments into the packer
    (records do)."""
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


class Reader:
    """Reads documents through the door (:mod:`zephon_collate.read`): one record at a time (a batch of
    one), or a columnar batch, by one rule.

    ``tokens_name``/``fields`` set to ``None`` are fixed by the first document
    with tokens (its per-token fields: ``loss_mask``, then every field of
    numbers with one entry per token; ``strict``: later records must then agree
    on ``loss_mask``). ``floats`` are read by their specs, ``positions`` (with
    ``segments``, the packer's ``emit_positions``) as the document's segment
    structure (else ``position_ids``, Hugging Face's spelling, as the Collator
    reads them; both, differing: ``ValueError``), and ``group_key`` as its
    group. Supervision spelled otherwise than ``loss_mask`` is refused where it
    would change what is trained.
    """

    def __init__(
        self,
        tokens_name: str | None,
        fields: tuple[str, ...] | None,
        *,
        strict: bool,
        floats: tuple[TensorField, ...] = (),
        segments: bool = False,
        group_key: str | None = None,
    ) -> None:
        self.tokens_name = tokens_name
        self.fields = fields
        self.strict = strict
        self.floats = floats
        self.segments = segments
        self.group_key = group_key

    @property
    def packed(self) -> tuple[str, ...]:
        """Every field packed beside the tokens: the per-token fields, then the float fields."""
        return (*(self.fields or ()), *(spec.name for spec in self.floats))

    @property
    def _listed(self) -> tuple[str, ...]:
        """The fields read as the user listed them: packed ones and the group key (never supervision)."""
        return (*self.packed, *([self.group_key] if self.group_key is not None else []))

    def read(self, record: SampleRecord, index: int) -> Document | None:
        """The :class:`Document` of a record, or ``None`` for a document without tokens."""
        payload, where = record.payload, describe_record(index, record)
        if not isinstance(payload, Mapping) and not is_array_payload(payload):
            raise TypeError(
                f"{where}: payload must be a dict of fields or a token array (list, tuple, NumPy array "
                f"or torch tensor), got {type(payload).__name__}"
            )
        batch = Rows(
            [payload], lambda _: where, tokens=self.tokens_name or INPUT_IDS, ids=[record.meta.sample_id]
        )
        if not isinstance(payload, Mapping):
            self.tokens_name = self.tokens_name or INPUT_IDS
            self.fields = () if self.fields is None else self.fields
            tokens = self.tokens(batch)
            if tokens.values.size and (self.packed or self.group_key is not None):
                read = list(self.packed) or [str(self.group_key)]
                raise ValueError(
                    f"{where}: an array payload holds only its token row, but fields {read} are "
                    "read beside the tokens; give it a dict payload with them, or pass fields=()"
                )
            return Document(tokens.host, {}, None, None) if tokens.values.size else None
        tokens, fields = self.read_batch(batch)
        if not tokens.values.size:
            return None
        values = {name: field.host for name, field in fields.items()}
        positions = self._segments(batch, tokens) if self.segments else None
        group = self._group(batch) if self.group_key is not None else None
        return Document(tokens.host, values, positions, group)

    def read_columns(self, columns: Columns, first: int) -> tuple[Ragged, dict[str, Ragged]]:
        """:meth:`read` of every document of a columnar batch at once: ``(tokens, {field: values})``, the
        tokens ids >= 0 (in their stored dtype) and each field holding one entry per token of its
        document (documents without tokens hold none). Row ``b`` is named ``example {first + b}``.
        """
        columns.names = lambda row: example_names(first + row)  # the rows are named by their place
        return self.read_batch(columns)

    def tokens(self, batch: Batch) -> Ragged:
        """The documents' token rows: 1-D ids >= 0, on the host."""
        names = batch.names
        name = self.tokens_name or next((c for c in TOKEN_FIELD_CANDIDATES if c in batch), None)
        if name is None or name not in batch:
            wanted = repr(name) if name else f"any of {', '.join(TOKEN_FIELD_CANDIDATES)}"
            fields = dict.fromkeys(getattr(batch, "order", None) or sorted(batch.fields))
            raise ValueError(
                f"{names(0)}: payload has no tokens field {wanted} (its fields: {shown_fields(fields)}); "
                "pass the right tokens_field"
            )
        read = batch.get(name, "ids")
        assert read is not None
        tokens = Ragged(read.host, read.offsets)  # the packer works on the host
        check_flat(tokens, name, names)
        check_ids(tokens, name, names)
        if self.fields and name in self.fields:
            raise ValueError(
                f"{names(0)}: the tokens field {shown(name)} is also listed in fields; drop it from fields"
            )
        self._name = name
        return tokens

    def read_batch(self, batch: Batch) -> tuple[Ragged, dict[str, Ragged]]:
        """The tokens and the packed fields of every document of ``batch`` (records or columns alike)."""
        names = batch.names
        rules.refuse_media(batch, "the packer")
        tokens = self.tokens(batch)
        name = self._name
        source = rules.positions_field(batch) if self.segments and not isinstance(batch, Rows) else None
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
                fields = dict.fromkeys(getattr(batch, "order", None) or sorted(batch.fields))
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
        """A document after the first: it has every packed field, and no ``loss_mask`` the earlier ones
        lacked (found fields, ``strict``), which would go unpacked."""
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
        """A near miss of a supervision field (:func:`~zephon_collate.read.rules.misspelled`: ``loss_maks``)
        not listed: refused, naming the document, before the fields are found (read under no name, or
        packed as data, what it leaves untrained would be trained)."""
        read = (*self._listed, tokens_name, POSITIONS, POSITION_IDS)
        near = rules.misspelled(batch.fields, rules.SUPERVISION_NAMES, read)
        if near is not None:
            name, meant = near
            where = batch.names(int(np.flatnonzero(batch.carried(name))[0]))
            raise ValueError(
                rules.near_miss(where, name, meant, ", or list it in fields=(...) to pack it as data")
            )

    def _check_supervision(self, batch: Batch, tokens: Ragged) -> None:
        """Supervision spelled otherwise than ``loss_mask`` and not listed: refused where it would change
        what is trained (the Collator's rule, :func:`~zephon_collate.read.rules.unread_supervision`)."""
        names = batch.names
        for name in SUPERVISING_FIELDS:
            if name in batch and name not in self._listed:
                carried = np.flatnonzero(batch.carried(name))
                if batch.one_value_row(name) is not None:
                    raise ValueError(
                        f"{names(int(carried[0]))}: field {shown(name)} holds one value per document, "
                        "not one "
                        "per token, so what it supervises cannot be checked; give it one value per "
                        "token (as a "
                        "loss_mask: 1 = supervised), or drop it (a per-example label, as for sequence "
                        "classification, is not a token field)"
                    )
        loss_mask = (
            batch.get(LOSS_MASK, "values")
            if LOSS_MASK in batch and batch.one_value_row(LOSS_MASK) is None
            else None
        )
        found = rules.unread_supervision(batch, tokens, self._listed, loss_mask)
        if found is not None:
            raise unread_supervision(names(found[0]), found[1])

    def _segments(self, batch: Batch, tokens: Ragged) -> np.ndarray | None:
        """A record's ``positions`` (or ``position_ids``): its segments (a segment starts wherever they
        are 0)."""
        name = rules.positions_field(batch)
        if name is None:
            return None
        where = batch.names(0)
        positions = batch.get(name, "ids")
        assert positions is not None
        values = positions.host.reshape(-1) if positions.values.ndim else positions.host
        length = int(tokens.lengths[0])
        if positions.values.ndim != 1:
            raise ValueError(
                f"{where}: field {shown(name)} must be 1-D (one entry per token), got shape "
                f"{tuple(positions.values.shape)}"
            )
        if values.size != length or values[0] != 0:
            problem = (
                f"has {values.size} entries for {length} tokens"
                if values.size != length
                else f"starts at {int(values[0])}"
            )
            raise ValueError(
                f"{where}: field {shown(name)} {problem}; the packer keeps a document's segments (a "
                "segment starts wherever positions are 0), so they must start at 0 and give one per token. "
                "Drop them for one segment per document, or pass emit_positions=False to pack them as data"
            )
        if not (values[1:] == 0).any():
            return None  # one segment: what the packer writes anyway
        return np.asarray(values, dtype=np.int64)

    def _group(self, batch: Batch) -> Any:
        """The group key's value: an int or a str (a 0-d integer array or tensor reads as an int)."""
        key = cast(str, self.group_key)
        where = batch.names(0)
        if key not in batch:
            payload = cast(Rows, batch).payloads[0]
            raise ValueError(
                f"{where}: payload lacks the group key {shown(key)} (its fields: {shown_fields(payload)}); "
                "give every record its group id (e.g. the index of its prompt)"
            )
        value = batch.objects(key)[0]
        if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
            value = int(value)
        elif isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point:
            value = int(value) if value.dtype != torch.bool else value
        elif isinstance(value, np.integer):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(
                f"{where}: group key {shown(key)} must be an int or a str (records with equal keys in a row "
                f"form a group), got {shown(value)}"
            )
        return value


def candidates(
    batch: Batch, tokens_name: str, tokens: Ragged, skipped: Sequence[str] = ()
) -> tuple[str, ...]:
    """The per-token fields of the documents of ``batch``: ``loss_mask`` (one entry per token in every
    document with tokens, else ``ValueError``), then each field of numbers with one entry per token in
    every such document, in the input's order. The tokens, input ``positions`` and ``position_ids`` (the
    segments), the ``skipped`` names (float fields, the group key) and the supervising fields (refused or
    harmless) are never candidates."""
    names = batch.names
    found = []
    if LOSS_MASK in batch:
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
    order = getattr(batch, "order", None) or sorted(batch.fields)
    for name in order:
        if not isinstance(name, str) or name in excluded or not batch.carried(name)[tokens.lengths > 0].all():
            continue
        if isinstance(batch, Columns) and not batch.is_list(name):
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
