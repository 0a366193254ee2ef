"""Hugging Face examples read: ``input_ids`` and the fields that say what is trained, checked once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from zephon_collate.core.keys import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    INPUT_IDS,
    LABEL,
    LABELS,
    MEDIA,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    POSITIONS,
    RAW_MEDIA,
    RESPONSE_MASK,
    SEQ_LENGTHS,
    SUPERVISION_MASKS,
    TOKEN_TYPE_IDS,
)
from zephon_collate.core.records import PADDING_LENGTH_TAG, SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read.arrow import Columns
from zephon_collate.read.columns import Batch, Names, Ragged, places, row_of, to_row
from zephon_collate.read.fields import TensorField, read_floats, value_rows
from zephon_collate.read.rules import (
    FOREIGN_SUPERVISION,
    SUPERVISING_FIELDS,
    check_flat,
    check_ids,
    check_zero_one,
    misspelled,
    near_miss,
    positions_field,
    refuse_media,
    unread_documents,
    unread_message,
    unread_supervision,
)

__all__ = ["READ", "ExampleSpec", "Examples", "read_examples", "supervision"]

_SUPERVISION = (LABELS, *SUPERVISION_MASKS)
_PER_TOKEN: tuple[tuple[str, Literal["ids", "values"]], ...] = (
    (ATTENTION_MASK, "values"),
    *((name, "values") for name in SUPERVISION_MASKS),
    (LABELS, "ids"),
    (TOKEN_TYPE_IDS, "ids"),
    (POSITION_IDS, "ids"),
)
"""The per-token fields beside ``input_ids``, in the order they are read, and how."""
READ = (INPUT_IDS, *(name for name, _ in _PER_TOKEN), SEQ_LENGTHS)
"""The fields :func:`read_examples` reads by name."""
_DOCUMENTS_FIX = (
    "give each document as an example of its own, or (Collator.for_transformers(padding_free=True)) the "
    "documents' lengths as 'seq_lengths', TRL's name, or positions restarting at each as 'position_ids'"
)


@dataclass(frozen=True)
class ExampleSpec:
    """What a layout reads of its examples.

    Parameters:
        owner: how errors name the entry point.
        floats: the value fields (:class:`~zephon_collate.read.fields.TensorField`).
        supervision: the field every example must carry to say what is trained, or ``None``.
        vision: read ``mm_token_type_ids`` (a vision-language layout); else media are refused.
        media_fix: the fix a refusal of media names.
        response_mask: read verl's ``response_mask`` (the caller applies it); else it may be refused.
        uniform: refuse an example without a supervising field that another example carries.
    """

    owner: str
    floats: tuple[TensorField, ...] = ()
    supervision: str | None = None
    vision: bool = False
    media_fix: str | None = None
    response_mask: bool = False
    uniform: bool = False


@dataclass
class Examples:
    """The fields read: per-token ``fields`` (filled where absent), ``segments``, per-sequence floats."""

    fields: dict[str, Ragged]
    segments: Ragged | None = None
    per_sequence: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)


def read_examples(batch: Batch, spec: ExampleSpec) -> Examples:
    """The examples' fields as the layout of ``spec`` reads them; a bad example is named, with the fix."""
    names = batch.names
    _check_examples(batch, spec)
    tokens = batch.get(INPUT_IDS, "ids")
    assert tokens is not None
    check_flat(tokens, INPUT_IDS, names)
    check_ids(tokens, INPUT_IDS, names)
    tokens = tokens.cast(torch.int64)
    read = {field.name for field in spec.floats} | ({RESPONSE_MASK} if spec.response_mask else set())
    unread = [name for name in (*FOREIGN_SUPERVISION, RESPONSE_MASK) if name not in read]
    if any(name in batch for name in unread):  # refused where they would change training
        others = [name for name in SUPERVISING_FIELDS if name not in unread]
        found = unread_supervision(batch, tokens, others, None)
        if found is not None:
            raise ValueError(unread_message(names(found[0]), found[1], "examples"))
    problem = unread_documents(batch, READ, _DOCUMENTS_FIX)  # another stack's marks of packed documents
    if problem is not None:
        raise ValueError(problem)
    fields: dict[str, Ragged] = {INPUT_IDS: tokens}
    if spec.vision:  # text-only examples: all text; media a processor has not read are not
        fix = "mrope= reads a processor's outputs (pixel_values, image_grid_thw), not the media"
        refuse_media(batch, spec.owner, fix, RAW_MEDIA)
        fields[MM_TOKEN_TYPE_IDS] = (
            _filled(batch, MM_TOKEN_TYPE_IDS, "ids", tokens)
            if MM_TOKEN_TYPE_IDS in batch
            else Ragged(np.zeros(tokens.values.shape[0], np.int64), tokens.offsets, tokens.lengths)
        )
    elif spec.media_fix is not None:  # the layout that reads media, given mrope=
        refuse_media(batch, f"{spec.owner} without mrope=", spec.media_fix)
    else:
        refuse_media(batch, spec.owner)
    for name, kind in _PER_TOKEN:
        source = positions_field(batch) or name if name == POSITION_IDS else name  # the page's name too
        if source in batch:
            fields[name] = _filled(batch, source, kind, tokens, fields.get(ATTENTION_MASK))
    for name in (TOKEN_TYPE_IDS, MM_TOKEN_TYPE_IDS):  # int64 as transformers' collators give them (a
        if name in fields:  # datasets column stores them as int8)
            fields[name] = fields[name].cast(torch.int64)
    segments = None
    if SEQ_LENGTHS in batch:  # each example's document lengths, end to end
        given = batch.get(SEQ_LENGTHS, "ids", partial=True)
        assert given is not None
        rows = [
            np.reshape(given.host[given.offsets[i] : given.offsets[i + 1]], -1)
            if carried
            else np.array([length])
            for i, (carried, length) in enumerate(
                zip(batch.carried(SEQ_LENGTHS), tokens.lengths, strict=True)
            )
        ]
        lengths = np.array([row.size for row in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        segments = Ragged(np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64), offsets)
        _check_one_source(batch, fields)
    per_sequence: dict[str, list[np.ndarray]] = {}
    for field in spec.floats:
        floats = read_floats(value_rows(batch, field), tokens.lengths, field, names)
        if isinstance(floats, Ragged):
            fields[field.name] = floats
        else:
            per_sequence[field.name] = floats
    return Examples(fields, segments, per_sequence)


def _check_one_source(batch: Batch, fields: dict[str, Ragged]) -> None:
    """Refuse an example whose ``position_ids`` restart (several documents) beside examples carrying
    ``seq_lengths``: the batch's documents come from ``seq_lengths``, which would make it one document."""
    positions, mask = fields.get(POSITION_IDS), fields.get(ATTENTION_MASK)
    if positions is None:
        return
    for index in np.flatnonzero(~batch.carried(SEQ_LENGTHS)).tolist():
        start, end = int(positions.offsets[index]), int(positions.offsets[index + 1])
        row = positions.host[start:end]
        if mask is not None:  # left padding's positions say nothing (Hugging Face gives them any)
            row = row[mask.host[start:end] != 0]
        if (row[1:] == 0).any():
            raise ValueError(
                f"{batch.names(index)}: its position_ids restart (several documents) but it carries no "
                "'seq_lengths', beside examples that do; the batch reads its documents from seq_lengths, "
                "so this one would be one document: give seq_lengths for every example, or position_ids "
                "for every example"
            )


def _check_examples(batch: Batch, spec: ExampleSpec) -> None:
    """The refusals that look at which fields the examples carry, before any is read."""
    names = batch.names
    for index, payload in enumerate(batch.payloads):
        if type(payload) is dict:
            continue
        if isinstance(payload, SampleRecord):
            padded = payload.meta.padding_length  # padding only its meta records: the payload would train it
            raise TypeError(
                f"{names(index)}: is a SampleRecord; this collator takes Hugging Face example dicts: "
                + (
                    f"collate records (pack_flat's rows) with Collator(...), which reads the {padded} "
                    "tokens of padding their meta records (their payloads alone would train them)"
                    if padded
                    else "pass the payloads, or collate records (pack_flat's rows) with Collator(...)"
                )
            )
        if not hasattr(payload, "keys"):
            raise TypeError(
                f"{names(index)}: must be a dict of fields such as 'input_ids', got {type(payload).__name__}"
            )
    if PADDING_LENGTH_TAG in batch and isinstance(batch, Columns):
        raise ValueError(
            f"{spec.owner}: the batch has a {shown(PADDING_LENGTH_TAG)} column: packed rows (as pack_columns "
            "writes them), whose documents and padding this layout does not read; collate them with "
            "Collator(return_labels=True, return_cu_seqlens=True), or pack Hugging Face examples with "
            "trl.pack_dataset (seq_lengths)"
        )
    lacking = batch.lacking(INPUT_IDS)
    if lacking is not None:
        raise ValueError(
            f"{names(lacking)}: has no 'input_ids' ({_fields_of(batch, lacking)}); tokenize the "
            "examples first"
        )
    if "label" in batch:
        label = batch.objects("label")
        index = next(i for i, value in enumerate(label) if value is not None)
        if not _scalar(label[index]):
            raise ValueError(
                f"{names(index)}: carries 'label' of one value per token; this collator reads per-token "
                "labels from 'labels': rename the field 'labels'"
            )
        raise _sequence_classification(names(index))
    scalar = batch.one_value_row(LABELS) if LABELS in batch else None
    if scalar is not None:
        raise _sequence_classification(names(scalar))
    if "decoder_input_ids" in batch:
        index = int(np.flatnonzero(batch.carried("decoder_input_ids"))[0])
        raise ValueError(
            f"{names(index)}: carries 'decoder_input_ids' (an encoder-decoder target); this collator is "
            "for causal LMs, whose labels align with input_ids: "
            "use transformers.DataCollatorForSeq2Seq(tokenizer, model=model) for encoder-decoder models"
        )
    supervision = spec.supervision
    if supervision is not None:
        lacking = batch.lacking(supervision)
        if lacking is not None:
            raise ValueError(
                f"{names(lacking)}: lacks {shown(supervision)}, the field this collator was told carries the "
                f"supervision ({_fields_of(batch, lacking)}); transformers.Trainer drops dataset columns its "
                "model's forward does not name: pass TrainingArguments(remove_unused_columns=False), or "
                "build the collator without supervision=..."
            )
    else:
        # Every supervision name: read here (response_mask by rollouts), or refused where it changes
        # training; the float fields and what this layout reads are fields of their own.
        floats = (field.name for field in spec.floats)
        read = (*READ, LABEL, POSITIONS, MM_TOKEN_TYPE_IDS, *MEDIA, *floats)
        near = misspelled(batch.fields, read=read)  # the supervision names: SUPERVISION_NAMES
        if near is not None:
            name, meant = near
            index = int(np.flatnonzero(batch.carried(name))[0])
            fix = " (or name the field that carries the supervision with supervision=...)"
            raise ValueError(near_miss(names(index), name, meant, fix))
    if spec.uniform:
        for name in _SUPERVISION:
            if name not in batch:
                continue
            lacking = batch.lacking(name)
            if lacking is not None:
                carrier = int(np.flatnonzero(batch.carried(name))[0])
                raise ValueError(
                    f"{names(lacking)}: lacks {shown(name)}, which {names(carrier)} carries to say "
                    "which tokens are trained; read as all trained, its prompt would be trained. Give every "
                    f"example {shown(name)} (0 on the prompt), or drop it from every example ({spec.owner})"
                )


def _fields_of(batch: Batch, index: int) -> str:
    payloads = batch.payloads
    if payloads and hasattr(payloads[index], "keys"):
        return f"its fields: {shown_fields(payloads[index])}"
    return f"its fields: {shown_fields(dict.fromkeys(sorted(batch.fields)))}"


def _scalar(value: object) -> bool:
    """One value for the whole example: a number, a bool, a class name, a 0-d array (not ``None``)."""
    return isinstance(value, (int, float, str, bytes, np.generic)) or getattr(value, "ndim", None) == 0


def _sequence_classification(where: str) -> ValueError:
    return ValueError(
        f"{where}: carries one label for the whole example (sequence classification); this collator makes "
        "causal-LM labels, one per token: use transformers.DataCollatorWithPadding for a classifier, give "
        "per-token 'labels', or drop the column if it only describes the example"
    )


def _misfit(where: str, name: str, shape: tuple[int, ...], length: int) -> ValueError:
    """The refusal of a per-token row that is not one value per token."""
    hint = (
        " (labels of their own length: an encoder-decoder target; this collator is for causal LMs, "
        "use transformers.DataCollatorForSeq2Seq(tokenizer, model=model))"
        if name == LABELS
        else ""
    )
    return ValueError(
        f"{where}: field {shown(name)} has shape {shape}, but 'input_ids' has {length} tokens; give one "
        f"value per token{hint}"
    )


def _filled(
    batch: Batch, name: str, kind: Literal["ids", "values"], tokens: Ragged, mask: Ragged | None = None
) -> Ragged:
    """Per-token field ``name`` in every example; one without it reads as all trained, or as one document
    whose positions count the tokens ``mask`` keeps (as an example given no positions at all)."""
    try:
        field = batch.get(name, kind, partial=True)
    except ValueError as error:  # rows that differ beyond their length: name the first that does not fit
        for index, value in enumerate(batch.objects(name)):
            if value is not None:
                try:
                    row = to_row(value, batch.names(index), name, kind)
                except (TypeError, ValueError):  # not a row of numbers (a null in it): the reader's own words
                    raise error from None
                if row.ndim != 1 or row.shape[0] != tokens.lengths[index]:
                    raise _misfit(
                        batch.names(index), name, tuple(row.shape), int(tokens.lengths[index])
                    ) from None
        raise
    assert field is not None
    carried = None if batch.lacking(name) is None else batch.carried(name)
    values = field.host
    bad = field.lengths != tokens.lengths if values.ndim == 1 else np.ones(len(tokens.lengths), dtype=bool)
    if carried is not None:
        bad &= carried
    if np.logical_or.reduce(bad):  # the ufunc: ndarray.any is Python
        index = int(np.flatnonzero(bad)[0])
        shape = tuple(values[field.offsets[index] : field.offsets[index + 1]].shape)
        raise _misfit(batch.names(index), name, shape, int(tokens.lengths[index]))
    if carried is None:
        return Ragged(values, field.offsets, field.lengths)
    if name == LABELS:
        filled = tokens.host.copy()
    elif name in (POSITION_IDS, POSITIONS) and mask is not None:  # padding dropped: kept tokens count from 0
        counts = np.zeros(mask.host.size + 1, dtype=np.int64)
        np.cumsum(mask.host != 0, out=counts[1:])
        filled = np.maximum(counts[1:] - np.repeat(counts[mask.offsets[:-1]], mask.lengths) - 1, 0)
    elif name in (POSITION_IDS, POSITIONS):
        filled = places(tokens.offsets)
    elif name in (MM_TOKEN_TYPE_IDS, TOKEN_TYPE_IDS):  # an example without them: all text, one segment
        filled = np.zeros(tokens.values.shape[0], dtype=np.int64)
    else:
        filled = np.ones(tokens.values.shape[0], dtype=np.int64)
    filled = filled.astype(np.result_type(filled.dtype, values.dtype), copy=False)
    filled[np.repeat(carried, tokens.lengths)] = values
    return Ragged(filled, tokens.offsets, tokens.lengths)


def supervision(fields: dict[str, Ragged], names: Names) -> Ragged:
    """The boolean ``[N]`` supervision: labels not -100, every mask 1, and a text token (not media)."""
    tokens = fields[INPUT_IDS]
    trained: np.ndarray | None = None
    for name in SUPERVISION_MASKS:
        if name in fields:
            check_zero_one(fields[name], name, names, "1 where the token is trained")
            given = fields[name].host != 0
            trained = given if trained is None else trained & given
    if LABELS in fields:
        labels = fields[LABELS].host
        given = labels != IGNORE_INDEX
        wrong = labels != tokens.host
        wrong &= given  # in place: no [N] temporary
        if ATTENTION_MASK in fields:
            wrong &= fields[ATTENTION_MASK].host != 0  # labels under the padding are dropped, unread
        if np.logical_or.reduce(wrong):  # one reduction (the ufunc) on the common path; the search on failure
            index = int(wrong.nonzero()[0][0])  # the method: np.flatnonzero costs three Python calls
            row = row_of(tokens.offsets, index)
            t = index - int(tokens.offsets[row])
            raise ValueError(
                f"{names(row)}: labels[{t}] is {int(labels[index])}, neither -100 nor the token there "
                f"(input_ids[{t}] = {int(tokens.host[index])}); causal LMs take unshifted labels "
                "(input_ids, -100 where no loss is taken) and shift them in forward: unshift labels "
                "shifted already, or give a loss_mask; an encoder-decoder target needs "
                "transformers.DataCollatorForSeq2Seq(tokenizer, model=model)"
            )
        trained = given if trained is None else trained & given
    if MM_TOKEN_TYPE_IDS in fields:
        text = fields[MM_TOKEN_TYPE_IDS].host == 0
        trained = text if trained is None else trained & text
    if trained is None:
        trained = np.ones(tokens.values.shape[0], dtype=bool)
    return Ragged(trained, tokens.offsets, tokens.lengths)
