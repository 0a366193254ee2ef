"""The reference page's layout: records in, ``to_training``'s outputs out.

:class:`Native` is what ``to_training`` and the :class:`~zephon_collate.Collator`
run: it reads the fields the options use from the records (the one reader,
:mod:`zephon_collate._read`), checks them, stacks them (:mod:`._stack`) into the
mapping the chain runs on, and names and assembles the outputs. The
``Collator`` adds its safety on top (``padding``, ``boundary_safe``,
``refuse_unused``); ``to_training`` keeps the page's defaults.

The stacked mapping (the chain's input), for ``B`` records of ``S`` tokens:

- ``input_ids`` ``[B, S]`` (or ``[B, S, ...]``) in the options' dtype;
- ``positions``, ``loss_mask`` and each extra field, when read: ``[B, S]``
  per token (or ``[B, ...]``, one value per record);
- ``padding_length`` ``[B]`` int64: each record's trailing padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from zephon_collate._checks import warn_user
from zephon_collate._columns import Columns, columns_of, example_names, read_by_rows
from zephon_collate._read import (
    Names,
    Ragged,
    Row,
    as_numpy,
    as_record,
    as_tensor,
    check_fits,
    check_ids,
    check_payloads,
    check_zero_one,
    concat,
    host_view,
    misaligned,
    misspelled,
    read_field,
    read_ragged,
    record_names,
    resolve_tokens_field,
    row_any,
)
from zephon_collate._text import shown
from zephon_collate.collate import _host
from zephon_collate.collate._output import (
    assemble_outputs,
    empty_outputs,
    ids_and_texts,
    merge_row_outputs,
    output_names,
    per_record_outputs,
)
from zephon_collate.collate._plan import Plan, Plans
from zephon_collate.collate._stack import RowPadding, dense, stack_rows
from zephon_collate.collate.options import TrainingOptions
from zephon_collate.fields import FloatField, read_floats
from zephon_collate.functional.segments import segment_starts
from zephon_collate.keys import (
    ATTENTION_MASK,
    IDS,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    PADDING_LENGTH,
    POSITION_IDS,
    POSITIONS,
    SUPERVISION_MASKS,
    TEXT,
    TEXTS,
)
from zephon_collate.records import PADDING_LENGTH_TAG, SampleMeta, SampleRecord
from zephon_collate.transforms import Chain, Transform

__all__ = [
    "SUPERVISING_FIELDS",
    "Native",
    "Stacked",
    "as_records",
    "check_boundary_count",
    "read_padding_lengths",
]

SUPERVISING_FIELDS = (ATTENTION_MASK, LABELS, *SUPERVISION_MASKS[1:])
"""Payload fields that say what is trained (Hugging Face and TRL names); the native path reads none."""


def as_records(samples: Sequence[Any]) -> tuple[SampleRecord, ...]:
    """Records as given, or plain payloads (dicts or token arrays) wrapped (:func:`as_record`).

    Raises:
        TypeError: if ``samples`` is not a sequence, or an item is neither a record,
            a dict nor a token array.
    """
    if isinstance(samples, Mapping):
        pairs = [name for name, value in samples.items() if type(value) is tuple and len(value) == 2]
        hint = (
            f"; field {shown(pairs[0])} looks like a (values, offsets) pair: give both as NumPy arrays or "
            "tensors"
            if pairs
            else "; a batch of columns is a dict of Arrow columns or (values, offsets) pairs"
        )
        raise TypeError(f"Collator: expected a list of samples, got a {type(samples).__name__}{hint}")
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
        raise TypeError(f"Collator: expected a list of samples, got {type(samples).__name__}")
    return tuple(as_record(sample, index, "Collator") for index, sample in enumerate(samples))


def check_boundary_count(positions: torch.Tensor, flatten: bool, limit: int, names: Names) -> None:
    """``ValueError`` naming the first row whose segments do not fit a static ``num_boundaries``.

    Runs where the batch is stacked (a worker's CPU tensors), so the device-side
    assertion of :class:`~zephon_collate.CuSeqlens` never fires.
    """
    if not positions.numel():
        return
    needed = segment_starts(positions).sum(dim=1) + 1  # each row's starts, then its end
    if flatten:
        total = int(needed.sum()) - len(needed) + 1
        if total > limit:
            raise ValueError(
                f"Collator: the batch has {total - 1} segments, more than num_boundaries - 1 = {limit - 1}; "
                "raise num_boundaries, or send fewer segments per batch"
            )
    elif bool((needed > limit).any()):
        index = int((needed > limit).nonzero()[0, 0])
        raise ValueError(
            f"{names(index)}: has {int(needed[index]) - 1} segments, more than "
            f"num_boundaries - 1 = {limit - 1}; raise num_boundaries, or pack fewer documents per row"
        )


@dataclass
class Stacked:
    """A read, checked and stacked batch: the chain's input and what the outputs need besides.

    ``data`` maps field names to ``[B, ...]`` tensors on the payloads' device;
    ``per_record`` holds per-record outputs (``ids``, ``texts``); ``metas`` each
    record's metadata (for :class:`~zephon_collate.StackedBatch`).
    """

    data: dict[str, torch.Tensor]
    per_record: dict[str, list[Any]] = field(default_factory=dict)
    metas: tuple[SampleMeta, ...] = ()


def read_padding_lengths(records: Sequence[SampleRecord], lengths: np.ndarray, names: Names) -> np.ndarray:
    """``[B]`` int64: each record's ``meta.padding_length`` (0 where unset), checked against its row."""
    counts = [record.meta.tags.get(PADDING_LENGTH_TAG, 0) if record.meta.tags else 0 for record in records]
    for index, (count, length) in enumerate(zip(counts, lengths.tolist(), strict=True)):
        if type(count) is not int and (not isinstance(count, np.integer) or isinstance(count, np.bool_)):
            count = None  # a float, a bool, None...: refused below
        if count is None or not 0 <= count <= length:
            raise ValueError(
                f"{names(index)}: meta.padding_length is {shown(counts[index])} but must be an int from 0 to "
                f"the token row's length {length}"
            )
    return np.array(counts, dtype=np.int64)


def _aligned(rows: list[Row], lengths: np.ndarray, name: str, names: Names, *, required: bool) -> bool:
    """True if ``rows`` hold one entry per token; ``required``: else ``ValueError`` naming the record."""
    for index, (row, length) in enumerate(zip(rows, lengths.tolist(), strict=True)):
        if row.ndim == 0 or row.shape[0] != length:
            if not required:
                return False
            raise misaligned(names(index), name, None if row.ndim == 0 else row.shape[0], int(lengths[index]))
    return True


def _unused_supervision(
    payloads: Sequence[Any], tokens: Ragged, read: Mapping[str, Any], loss_mask: Ragged | None, names: Names
) -> str | None:
    """What is wrong with the first payload field that would change what gets supervised but is not read.

    An ``attention_mask`` with zeros (Hugging Face's padding), ``labels`` that
    differ from the tokens (``-100`` on a prompt), or ``assistant_masks`` /
    ``assistant_mask`` / ``completion_mask`` with zeros (a chat template's,
    TRL's) would be silently dropped: the padding or the prompt trained on.
    Harmless copies (an all-ones mask, labels equal to the tokens, a mask equal
    to the ``loss_mask``) pass; a field that is read (listed in
    ``extra_fields``) is used. Each field is read and compared in one vectorised
    pass (payloads without it read as harmless). Returns ``None`` when nothing
    is wrong, else the message, naming the record, the field and the fix.
    """
    found = []  # (first bad row, the field's rank, field)
    for rank, name in enumerate(SUPERVISING_FIELDS):
        if name in read or not any(isinstance(p, Mapping) and name in p for p in payloads):
            continue
        row = _first_unused_row(payloads, tokens, name, loss_mask, names)
        if row is not None:
            found.append((row, rank, name))
    if not found:
        return None
    row, _, name = min(found)
    where = names(row)
    if name == LABELS:
        return (
            f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), "
            "which are not read here: labels are made from the tokens. For Hugging Face "
            "examples use Collator.for_transformers(...); else give the supervision as a "
            "loss_mask (loss_mask = labels != -100) and drop 'labels'"
        )
    if name == ATTENTION_MASK:
        return (
            f"{where}: payload has an 'attention_mask' with zeros, which is not applied here: "
            "those tokens would be trained on as real ones. For Hugging Face examples use "
            "Collator.for_transformers(...); else give padding as meta.padding_length (pack_flat "
            "writes it) or pad with Collator(pad_token_id=...) and drop the mask"
        )
    return (
        f"{where}: payload has {shown(name)} with zeros, which are not read here: the "
        "prompt would be trained on. For Hugging Face examples use "
        "Collator.for_transformers(...); else give them as the loss_mask "
        f"(loss_mask = {name})"
    )


def _first_unused_row(
    payloads: Sequence[Any], tokens: Ragged, name: str, loss_mask: Ragged | None, names: Names
) -> int | None:
    """The first payload whose ``name`` would change what is trained (see :func:`_unused_supervision`).

    ``labels`` must equal the tokens; a mask must be all ones, or equal the ``loss_mask``
    (``attention_mask``: all ones). A row of another length than its tokens differs.
    """
    fill: Callable[[int], Row] = (
        tokens.row if name == LABELS else (lambda i: np.ones(int(tokens.lengths[i]), dtype=np.int64))
    )
    field = read_ragged(payloads, name, "", "values", names, required=False, fill=fill)
    assert field is not None  # some payload has it
    if name == LABELS:
        bad = _rows_differing(field, tokens)
    else:
        bad = row_any(_flat(field.host != 1), field.offsets)  # a zero (or any other value)
        if name != ATTENTION_MASK and loss_mask is not None:
            bad &= _rows_differing(field, loss_mask)  # a copy of the loss_mask is harmless
    found = np.flatnonzero(bad)
    return int(found[0]) if found.size else None


def _rows_differing(field: Ragged, like: Ragged) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` of ``field`` differ from row ``b`` of ``like`` (in length, shape
    or a value)?"""
    aligned = field.lengths == like.lengths
    values, other = field.host, like.host
    if values.shape[1:] != other.shape[1:]:
        return np.ones(field.rows, dtype=bool)
    differs: np.ndarray = ~aligned
    offsets = np.zeros(int(aligned.sum()) + 1, dtype=np.int64)
    np.cumsum(field.lengths[aligned], out=offsets[1:])
    mine = values[np.repeat(aligned, field.lengths)]
    theirs = other[np.repeat(aligned, like.lengths)]
    differs[aligned] = row_any(_flat(mine != theirs), offsets)
    return differs


def _flat(flags: np.ndarray) -> np.ndarray:
    """``[N]`` booleans from ``[N, ...]`` ones: is any entry of token ``n`` True?"""
    return flags if flags.ndim == 1 else np.asarray(flags.reshape(len(flags), -1).any(axis=1))


def _harmless(name: str, field: Ragged, tokens: Ragged, loss_mask: Ragged | None) -> bool:
    """True if an unread supervising column passes :func:`_unused_supervision` at every row, tested on
    the whole column at once: labels equal to the tokens, a mask of ones, or one equal to the
    ``loss_mask``. False leaves the verdict, and the naming of the row, to that row-wise rule."""
    values = field.host
    if name == LABELS:
        return np.array_equal(field.offsets, tokens.offsets) and np.array_equal(values, tokens.host)
    if bool((values == 1).all()):
        return True
    return (
        name != ATTENTION_MASK
        and loss_mask is not None
        and np.array_equal(field.offsets, loss_mask.offsets)
        and np.array_equal(values, loss_mask.host)
    )


@dataclass(frozen=True)
class Native:
    """The page's layout over records: see the module doc.

    Parameters:
        options: the checked ``to_training`` arguments.
        padding: pad ragged rows on the right (the Collator's ``pad_token_id``), or ``None``.
        boundary_safe: mask labels whose target starts a segment (the Collator's
            ``boundary_safe_labels``); reads the positions whenever labels are made.
        refuse_unused: refuse a supervising field the call does not read (the Collator);
            else, when labels are made, warn once (``to_training``).
        num_boundaries: a static ``cu_seqlens`` width, or ``None``.
        check_padding: read and check ``meta.padding_length`` even when the options use no padding.
        float_fields: float fields (the Collator's ``float_fields``), each in its own float dtype,
            shifted with the labels as its alignment says (:mod:`zephon_collate.fields`).
    """

    options: TrainingOptions
    padding: RowPadding | None = None
    boundary_safe: bool = False
    refuse_unused: bool = False
    num_boundaries: int | None = None
    check_padding: bool = False
    float_fields: tuple[FloatField, ...] = ()
    _plans: Plans = field(default_factory=Plans, init=False, repr=False, compare=False)

    def plan(self, keys: tuple[str, ...]) -> Plan:
        """The plan of this layout on a stacked batch holding ``keys``, built once."""
        found = self._plans.get(keys)
        if found is None:
            found = self._plans[keys] = Plan(self, keys)
        return found

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The built-in transforms for a stacked batch holding ``keys``."""
        like_labels, unshifted = self._float_shifts
        return self.options.chain(
            keys,
            boundary_safe=self.boundary_safe,
            num_boundaries=self.num_boundaries,
            like_labels=like_labels,
            unshifted=unshifted,
        )

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`chain`'s output mapping computed by the fused host pass."""
        like_labels, unshifted = self._float_shifts
        return _host.native(
            self.options, self.boundary_safe, self.num_boundaries, data, like_labels, unshifted
        )

    @functools.cached_property
    def _float_shifts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The float fields a shift cuts like the labels, and those it leaves alone (one per sequence)."""
        like_labels = tuple(spec.name for spec in self.float_fields if spec.shifted_like_labels)
        unshifted = tuple(spec.name for spec in self.float_fields if not spec.per_token)
        return like_labels, unshifted

    def names(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """``(key, output name)`` of each output, from the chain's final ``keys``."""
        return output_names(self.options, keys)

    def empty(self, chain: Callable[[list[str]], Chain] | None = None) -> dict[str, Any]:
        """The outputs of an empty batch: each field the chain emits, empty.

        ``chain(keys)`` gives the chain run (a collator's, with your transforms); by default
        the built-in one of the options.
        """
        options = self.options
        keys = [INPUT_IDS, PADDING_LENGTH, *options.extra_fields, *(spec.name for spec in self.float_fields)]
        if options.return_cu_seqlens and POSITIONS not in keys:
            keys.append(POSITIONS)  # CuSeqlens reads them; emitted only as empty_outputs says
        steps = Chain(*self.chain(keys)) if chain is None else chain(keys)
        return empty_outputs(options, steps.output_keys(keys))

    def collate(
        self,
        samples: Sequence[Any],
        plan: Callable[[tuple[str, ...]], Plan],
        *,
        python_scalars: bool = True,
    ) -> dict[str, Any]:
        """The one-step path: read, stack, run ``plan(keys)``, assemble (ragged list rows one by one)."""
        batches = self._batches(samples)
        if not batches:
            return self.empty()
        if len(batches) == 1:
            batch = batches[0]
            chosen = plan(tuple(batch.data))
            result = chosen.run(batch.data)
            return assemble_outputs(
                batch.per_record, self.options, result, chosen.pairs, python_scalars=python_scalars
            )
        chosen = plan(tuple(batches[0].data))
        results = [chosen.run(batch.data) for batch in batches]
        per_record = {key: [v for batch in batches for v in batch.per_record[key]] for key in (IDS, TEXTS)}
        return merge_row_outputs(per_record, self.options, results, chosen.pairs)

    def stack(self, samples: Sequence[Any]) -> Stacked | None:
        """:meth:`read` for ``Collator.stack``: one batch (``None`` when empty), rows of one length."""
        batches = self._batches(samples)
        if not batches:
            return None
        if len(batches) > 1:
            raise ValueError(
                "Collator.stack: rows of unequal length cannot be stacked into one TensorDict, even for "
                "dtype=None (lists); call the collator itself (Collator(...)(samples)), which returns "
                "ragged lists, or pad the rows (Collator(pad_token_id=...)) or pack them (pack_flat)"
            )
        return batches[0]

    def assemble(
        self,
        per_record: Mapping[str, list[Any]],
        result: Mapping[str, Any],
        pairs: Sequence[tuple[str, str]],
        python_scalars: bool,
    ) -> dict[str, Any]:
        """The output dict of a stacked batch (:func:`~zephon_collate.collate._output.assemble_outputs`)."""
        return assemble_outputs(per_record, self.options, result, pairs, python_scalars=python_scalars)

    def _batches(self, samples: Any) -> list[Stacked]:
        """:meth:`read` of records or plain payloads, :meth:`read_columns` of a columnar batch; ``[]``
        for an empty batch."""
        ragged = self.options.output.kind == "list"
        columns = columns_of(samples)
        if columns is not None:
            return self.read_columns(columns, ragged=ragged) if columns.rows else []
        records = as_records(samples)
        return self.read(records, ragged=ragged) if records else []

    def _wanted(self) -> list[tuple[str, bool, bool]]:
        """``(field, required, aligned)`` of each field read besides the tokens: ``aligned`` fields must
        hold one entry per token, the others may hold one per record."""
        options = self.options
        labels = options.return_labels
        reads_positions = options.reads_positions or (self.boundary_safe and labels)
        must_align = labels or options.flatten
        wanted = [(LOSS_MASK, LOSS_MASK in options.extra_fields, True)]
        if reads_positions or POSITIONS in options.extra_fields or options.return_cu_seqlens:
            required = POSITIONS in options.extra_fields or options.return_cu_seqlens
            wanted.append((POSITIONS, required, True))
        wanted += [(name, True, must_align) for name in options.data_fields]
        return wanted

    def read(self, records: tuple[SampleRecord, ...], *, ragged: bool = False) -> list[Stacked]:
        """Read, check and stack ``records`` (non-empty): one :class:`Stacked` batch.

        With ``ragged`` (list output), rows of unequal length come back as one
        single-row batch each, every error still naming the record by its place.

        Raises:
            TypeError, ValueError: for every data error, naming the record, the field and the fix.
        """
        options = self.options
        check_payloads(records)
        names = record_names(records)
        payloads = [record.payload for record in records]
        tokens_field = resolve_tokens_field(payloads, options.tokens_field, names)
        tokens = read_ragged(payloads, tokens_field, tokens_field, "ids", names, required=True)
        assert tokens is not None  # required: a payload without it raised
        lengths = tokens.lengths
        per_token: dict[str, Ragged] = {INPUT_IDS: tokens}
        per_record: dict[str, Sequence[Row] | np.ndarray] = {}
        for name, required, aligned in self._wanted():
            kind: Literal["ids", "values"] = "ids" if name == POSITIONS else "values"
            source = self._positions_source(payloads, names) if name == POSITIONS else name
            rows = read_field(payloads, source, tokens_field, kind, names, required=required)
            if rows is None:
                continue
            if _aligned(rows, lengths, name, names, required=aligned):
                per_token[name] = concat(rows, name, names)
            else:
                per_record[name] = rows
        self._check_unused(payloads, tokens, per_token, per_record, names)
        self._check_values(per_token, names)
        for spec in self.float_fields:  # checked by read_floats: finite, one value per token or sequence
            rows = read_field(payloads, spec.name, tokens_field, "values", names, required=True) or []
            floats = read_floats(rows, lengths, spec, names)
            if isinstance(floats, Ragged):
                per_token[spec.name] = floats
            else:
                per_record[spec.name] = list(floats)
        padding_length = (
            read_padding_lengths(records, lengths, names)
            if options.needs_padding_lengths or self.check_padding
            else np.zeros(len(records), dtype=np.int64)
        )
        if self.padding is not None and options.needs_padding_lengths:
            undeclared = np.array([not (r.meta.tags and PADDING_LENGTH_TAG in r.meta.tags) for r in records])
            self._check_no_padding_given(tokens, undeclared, names)
        metas = tuple(record.meta for record in records)
        return self._stacked(
            per_token, per_record, padding_length, ids_and_texts(records), metas, names, ragged
        )

    def _check_no_padding_given(self, tokens: Ragged, undeclared: np.ndarray, names: Names) -> None:
        """Refuse a row that ends in ``pad_token_id`` without declaring padding (``meta.padding_length``):
        padding already in the row, which the labels (and the padding mask) would take for real tokens."""
        assert self.padding is not None
        pad = self.padding.pad_token_id
        values, offsets = tokens.host, tokens.offsets
        if values.ndim != 1 or not values.size:
            return
        ends = offsets[1:] - 1
        nonempty = tokens.lengths > 0
        bad = np.zeros(len(ends), dtype=bool)
        bad[nonempty] = values[ends[nonempty]] == pad
        found = np.flatnonzero(bad & undeclared)
        if found.size:
            index = int(found[0])
            raise ValueError(
                f"{names(index)}: ends in pad_token_id {pad} and declares no padding (meta.padding_length): "
                "padding already in the row, which the labels would train as real tokens. Give the rows "
                "without their padding (the Collator pads them), or declare it (meta.padding_length, as "
                "pack_flat writes it), or collate Hugging Face examples with their attention_mask through "
                "Collator.for_transformers(...). If that id is a real token here (an EOS), pad with another "
                "id: padding's id is never trained"
            )

    def read_columns(self, columns: Columns, *, ragged: bool = False) -> list[Stacked]:
        """:meth:`read` of a columnar batch (non-empty): the same fields, read column by column.

        Its rows are named ``example 3``; each has ``ids`` ``(0, 0, index)``,
        ``texts`` from a ``"text"`` column, and the trailing padding a
        ``"_padding_length"`` column gives (``meta.padding_length``'s tag, as
        :class:`~zephon_collate.packing.columns.PackedColumns` writes it), else
        none, as plain payloads have; a columnar batch carries no records, so the
        batch's ``metas`` are empty.

        Raises:
            TypeError, ValueError: as :meth:`read`; ImportError for Arrow data without ``pyarrow``.
        """
        options = self.options
        names = example_names
        if self.float_fields:
            raise read_by_rows("Collator", "float_fields")
        example = columns.example()
        tokens_field = resolve_tokens_field([example], options.tokens_field, names)
        tokens = columns.ragged(tokens_field, "ids", names)
        lengths = tokens.lengths
        per_token: dict[str, Ragged] = {INPUT_IDS: tokens}
        per_record: dict[str, Sequence[Row] | np.ndarray] = {}
        for name, required, aligned in self._wanted():
            kind: Literal["ids", "values"] = "ids" if name == POSITIONS else "values"
            if name == POSITIONS and self.refuse_unused and name not in columns and POSITION_IDS in columns:
                name = POSITION_IDS  # Hugging Face's spelling, read as the positions (see _positions_source)
            if name not in columns:
                if required:
                    read_field([example], name, tokens_field, kind, names, required=True)  # raises
                continue
            key = POSITIONS if name == POSITION_IDS else name
            if columns.is_list(name):
                field = columns.ragged(name, kind, names)
                if np.array_equal(field.offsets, tokens.offsets):
                    per_token[key] = field
                    continue
            rows = columns.per_record(name, kind, names)
            _aligned(list(rows), lengths, name, names, required=aligned)  # raises where they must align
            per_record[key] = rows
        read = {**per_token, **per_record}
        self._check_misspelled(columns.names, names)
        unread = [n for n in SUPERVISING_FIELDS if n in columns and n not in read]
        if unread and (self.refuse_unused or options.return_labels):
            for name in unread:
                if not columns.is_list(name):  # one value per example, or no column: it cannot be checked
                    raise TypeError(
                        f"field {shown(name)} is not a list column (one row of values per example) beside "
                        "the batch's columns, so what it supervises cannot be checked; give it as a list "
                        "column or a (values, offsets) pair, or drop it"
                    )
            loss_mask = per_token.get(LOSS_MASK)
            fields = {name: columns.ragged(name, "values", names) for name in unread}
            if not all(_harmless(name, field, tokens, loss_mask) for name, field in fields.items()):
                views = [{name: field.row(i) for name, field in fields.items()} for i in range(columns.rows)]
                self._check_unused(views, tokens, per_token, per_record, names)
        self._check_values(per_token, names)
        padding_length = np.zeros(columns.rows, dtype=np.int64)
        if PADDING_LENGTH_TAG in columns and (options.needs_padding_lengths or self.check_padding):
            padding_length = columns.values(PADDING_LENGTH_TAG, "ids", names).astype(np.int64)
            bad = np.flatnonzero((padding_length < 0) | (padding_length > lengths))
            if bad.size:
                index = int(bad[0])
                raise ValueError(
                    f"{names(index)}: field {shown(PADDING_LENGTH_TAG)} (the trailing padding) is "
                    f"{int(padding_length[index])} but must be from 0 to the token row's length "
                    f"{int(lengths[index])}"
                )
        if self.padding is not None and options.needs_padding_lengths and PADDING_LENGTH_TAG not in columns:
            self._check_no_padding_given(tokens, np.ones(columns.rows, dtype=bool), names)
        ids = [(0, 0, index) for index in range(columns.rows)]
        texts = columns.pylist(TEXT) if TEXT in columns else [None] * columns.rows
        per_record_out = per_record_outputs(ids, texts)
        return self._stacked(per_token, per_record, padding_length, per_record_out, (), names, ragged)

    def _stacked(
        self,
        per_token: dict[str, Ragged],
        per_record: dict[str, Sequence[Row] | np.ndarray],
        padding_length: np.ndarray,
        per_record_out: dict[str, list[Any]],
        metas: tuple[SampleMeta, ...],
        names: Names,
        ragged: bool,
    ) -> list[Stacked]:
        """The read and checked fields stacked: one :class:`Stacked`, or one per row (``ragged``)."""
        lengths = per_token[INPUT_IDS].lengths
        width = self._width(lengths, names, ragged)
        if width is None:  # ragged lists: each row a batch of its own, named by its place in the batch
            return [
                Stacked(
                    self._stack(
                        {name: f.take(index) for name, f in per_token.items()},
                        {name: rows[index : index + 1] for name, rows in per_record.items()},
                        padding_length[index : index + 1],
                        lengths[index : index + 1],
                        int(lengths[index]),
                        lambda _, index=index: names(index),  # type: ignore[misc]
                    ),
                    {key: values[index : index + 1] for key, values in per_record_out.items()},
                    metas[index : index + 1],
                )
                for index in range(len(lengths))
            ]
        if self.padding is not None:
            padding_length = padding_length + (width - lengths)
        data = self._stack(per_token, per_record, padding_length, lengths, width, names)
        return [Stacked(data, per_record_out, metas)]

    def _width(self, lengths: np.ndarray, names: Names, ragged: bool) -> int | None:
        """The stacked row length; ``None`` for ragged list output. Unequal rows without padding raise."""
        if self.padding is not None:
            return self.padding.width(lengths)
        if bool((lengths == lengths[0]).all()):
            return int(lengths[0])
        if ragged:
            return None
        index = int(np.flatnonzero(lengths != lengths[0])[0])
        raise ValueError(
            f"cannot stack token rows of unequal shape into a tensor: {names(0)} has shape "
            f"({int(lengths[0])},), {names(index)} has ({int(lengths[index])},); pad them "
            "(Collator(pad_token_id=...)) or pack them (pack_flat), or pass dtype=None for lists"
        )

    def _positions_source(self, payloads: Sequence[Any], names: Names) -> str:
        """The payload field the positions are read from: ``positions``, or, for the Collator, Hugging
        Face's ``position_ids`` where no payload has ``positions`` (dropped, the labels would cross the
        document boundaries it marks). A payload with both, disagreeing, is refused."""
        if not self.refuse_unused:
            return POSITIONS  # to_training reads the page's field only
        dicts = [(i, p) for i, p in enumerate(payloads) if isinstance(p, Mapping)]
        if not any(POSITION_IDS in p for _, p in dicts):
            return POSITIONS
        for index, payload in dicts:
            if POSITIONS in payload and POSITION_IDS in payload:
                where: Names = lambda _, index=index: names(index)  # type: ignore[misc]  # noqa: E731
                given, other = (
                    as_numpy((read_field([payload], name, "", "ids", where, required=True) or [])[0])
                    for name in (POSITIONS, POSITION_IDS)
                )
                if not np.array_equal(given, other):
                    raise ValueError(
                        f"{names(index)}: payload has both 'positions' and 'position_ids' (Hugging Face's "
                        "spelling), and they differ, so it is not clear where its documents start; keep one"
                    )
        return POSITIONS if any(POSITIONS in p for _, p in dicts) else POSITION_IDS

    def _check_misspelled(self, fields: Iterable[object], names: Names, index: int = 0) -> None:
        """A supervision mask under a near-miss name (``loss_masks``) is read by nothing: every token would
        be trained. The Collator refuses it, ``to_training`` warns (labels only, as for unread fields)."""
        if not (self.refuse_unused or self.options.return_labels):
            return
        found = misspelled(fields, SUPERVISION_MASKS)
        if found is None:
            return
        name, meant = found
        problem = (
            f"{names(index)}: payload has {shown(name)}, which nothing reads: did you mean "
            f"{shown(meant)}? Read under no name, every token would be trained; rename it {shown(meant)}"
            + (
                " (for Hugging Face examples, Collator.for_transformers reads it)"
                if meant != LOSS_MASK
                else ""
            )
        )
        if self.refuse_unused:
            raise ValueError(problem)
        warn_user(f"to_training: {problem}")

    def _check_unused(
        self,
        payloads: Sequence[Any],
        tokens: Ragged,
        per_token: Mapping[str, Ragged],
        per_record: Mapping[str, Any],
        names: Names,
    ) -> None:
        if not (self.refuse_unused or self.options.return_labels):
            return  # without labels nothing is supervised, so nothing is said
        for index, payload in enumerate(payloads):
            if isinstance(payload, Mapping) and any("mask" in str(key).lower() for key in payload):
                self._check_misspelled(list(payload), names, index)
        read = {**per_token, **per_record}
        problem = _unused_supervision(payloads, tokens, read, per_token.get(LOSS_MASK), names)
        if problem is None:
            return
        if self.refuse_unused:
            raise ValueError(problem)
        warn_user(f"to_training: {problem}; the labels are made from the tokens, as the reference page says")

    def _check_values(self, per_token: Mapping[str, Ragged], names: Names) -> None:
        """The data checks that need values: ids >= 0, 0/1 supervision, positions for ``cu_seqlens``."""
        options = self.options
        dtype = options.output.torch_dtype
        tokens = per_token[INPUT_IDS]
        check_ids(tokens, INPUT_IDS, names)
        for name, values in per_token.items():
            if name == LOSS_MASK and options.return_labels:
                check_zero_one(values, LOSS_MASK, names, "1 for supervised tokens, 0 for the rest")
            else:
                check_fits(values, dtype, name, names)
        if options.eos_mask_loss and tokens.values.ndim != 1:
            raise ValueError(
                f"to_training: eos_mask_loss needs scalar token rows ([B, S]), got rows of shape "
                f"{tuple(tokens.values.shape[1:])} per token"
            )
        if options.return_padding_mask and options.output.kind != "list" and tokens.values.ndim != 1:
            raise ValueError(
                "to_training: return_padding_mask needs 2-D scalar token rows for tensor/array output, "
                f"got rows of shape {tuple(tokens.values.shape[1:])} per token"
            )

    def _check_boundary_positions(self, positions: torch.Tensor, lengths: np.ndarray, names: Names) -> None:
        """``cu_seqlens`` needs ``[B, S]`` positions, starting at 0 in every row with an input token."""
        if positions.dim() != 2:
            raise ValueError(
                "to_training: return_cu_seqlens needs one position per token ([B, S]), got positions of "
                f"shape {tuple(positions.shape)}"
            )
        labels = self.options.return_labels
        rows, width = positions.shape
        input_width = width - 1 if labels and width else width
        if rows * input_width > INT32_MAX:
            raise ValueError(
                f"to_training: {rows} x {input_width} input tokens overflow the int32 cu_seqlens; "
                "use smaller batches"
            )
        if not input_width:
            return
        first = host_view(positions)[:, 0]
        bad = (first != 0) & ((lengths > 1) if labels else (lengths > 0))  # rows with an input token
        if bad.any():
            index = int(np.flatnonzero(as_numpy(bad))[0])
            raise ValueError(
                f"{names(index)}: positions must start at zero in every row to derive cu_seqlens, but this "
                f"row starts at {int(first[index])}"
            )

    def _stack(
        self,
        per_token: Mapping[str, Ragged],
        per_record: Mapping[str, Sequence[Row] | np.ndarray],
        padding_length: np.ndarray,
        lengths: np.ndarray,
        width: int,
        names: Names,
    ) -> dict[str, torch.Tensor]:
        """The chain's input mapping: each field cast to its dtype, then laid out ``[B, width, ...]``;
        then the checks that read the stacked positions (``cu_seqlens``, a static boundary count)."""
        options = self.options
        dtype = options.output.torch_dtype
        pad_id = 0 if self.padding is None else self.padding.pad_token_id
        data: dict[str, torch.Tensor] = {}
        if options.position_mode == "sequence":  # 0 .. count - 1 in every row, after the shift
            _check_position_count(width - 1 if options.return_labels else width, dtype, "numbered")
        floats = {spec.name: spec for spec in self.float_fields}
        for name, values in per_token.items():
            spec = floats.get(name)
            if spec is not None:  # a float field: its own dtype, 0.0 on padding
                data[name] = as_tensor(dense(values, width, 0.0)).to(spec.dtype)
                continue
            keep = name == LOSS_MASK and options.return_labels  # the supervision keeps its own dtype
            cast = values if keep else values.cast(dtype)
            if name == POSITIONS and self.padding is not None:
                _check_position_count(width, dtype, "padded to")
            fill = pad_id if name == INPUT_IDS else 0
            data[name] = as_tensor(dense(cast, width, fill, restart=name == POSITIONS))
        for name, rows in per_record.items():
            stacked = stack_rows(rows, name, names)
            if name in floats:
                data[name] = stacked.to(floats[name].dtype)
                continue
            check_fits(Ragged(stacked.reshape(-1), _flat_offsets(stacked)), dtype, name, names)
            data[name] = stacked.to(dtype)
        counts = torch.from_numpy(padding_length)
        device = data[INPUT_IDS].device
        data[PADDING_LENGTH] = counts if device.type == "cpu" else counts.to(device)
        if options.return_cu_seqlens:
            self._check_boundary_positions(data[POSITIONS], lengths, names)
            if self.num_boundaries is not None:
                positions = data[POSITIONS][:, :-1] if options.return_labels else data[POSITIONS]
                check_boundary_count(positions, options.flatten, self.num_boundaries, names)
        return data


def _check_position_count(count: int, dtype: torch.dtype, how: str) -> None:
    """``ValueError`` unless positions ``0 .. count - 1`` fit ``dtype`` (they would wrap around)."""
    if count - 1 > torch.iinfo(dtype).max:
        raise ValueError(
            f"to_training: positions {how} {count} tokens do not fit dtype {dtype} (at most "
            f"{torch.iinfo(dtype).max + 1}); pick a wider dtype"
        )


def _flat_offsets(stacked: torch.Tensor) -> np.ndarray:
    """Offsets of a ``[B, ...]`` stacked field read as ``B`` rows of equal size."""
    per_row = int(np.prod(stacked.shape[1:]))
    return np.arange(stacked.shape[0] + 1, dtype=np.int64) * per_row
