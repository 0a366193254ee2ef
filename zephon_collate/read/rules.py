"""The checks of a batch read at the door, each written once and vectorised, naming the row and the fix."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from zephon_collate.core.checks import scalar
from zephon_collate.core.keys import (
    ACTION_MASK,
    ASSISTANT_MASK,
    ASSISTANT_MASKS,
    ATTENTION_MASK,
    CHOSEN_ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INPUT_IDS,
    COMPLETION_IDS,
    COMPLETION_MASK,
    KL_COMPLETION_IDS,
    LABEL,
    LABEL_IDS,
    LABELS,
    MARGIN,
    MEDIA,
    MM_TOKEN_TYPE_IDS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    PROMPT_MASK,
    RAW_MEDIA,
    REF_CHOSEN_LOGPS,
    REF_KL_LOGPS,
    REF_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_ATTENTION_MASK,
    REJECTED_IDS,
    REJECTED_INPUT_IDS,
    RESPONSE_MASK,
    SEQ_LENGTHS,
    SHIFT_LABELS,
    SUPERVISION_MASKS,
    TOKEN_FIELD_CANDIDATES,
    TOKEN_TYPE_IDS,
    TOOL_MASKS,
)
from zephon_collate.core.records import PADDING_LENGTH_TAG
from zephon_collate.core.text import shown
from zephon_collate.read.columns import (
    Batch,
    Names,
    Ragged,
    Spread,
    Values,
    as_numpy,
    filled,
    host_view,
    places,
    row_any,
    row_of,
)

__all__ = [
    "BOUNDARY_FIELDS",
    "FIELDS_OF_THEIR_OWN",
    "FOREIGN_SUPERVISION",
    "SUPERVISING_FIELDS",
    "SUPERVISION_NAMES",
    "EntryPoint",
    "aligned",
    "check_fits",
    "check_flat",
    "check_ids",
    "check_zero_one",
    "declared_padding",
    "group_id",
    "kept_by_mask",
    "misaligned",
    "misspelled",
    "near_miss",
    "positions_field",
    "refuse_media",
    "response_aligned",
    "row_shape",
    "unread_documents",
    "unread_message",
    "unread_supervision",
    "unstarted",
]

FOREIGN_SUPERVISION = (SHIFT_LABELS, LABEL_IDS, ACTION_MASK, *TOOL_MASKS, PROMPT_MASK)
"""Other stacks' fields that say what is trained, which no call here reads: transformers' pre-shifted
targets, the name ``default_data_collator`` renames to ``labels``, OpenRLHF's mask of the trained tokens,
TRL's masks of tool output and of a prompt's padding."""

SUPERVISING_FIELDS = (
    ATTENTION_MASK,
    LABELS,
    ASSISTANT_MASKS,
    ASSISTANT_MASK,
    COMPLETION_MASK,
    RESPONSE_MASK,
    *FOREIGN_SUPERVISION,
)
"""Fields that say what is trained under other names than ``loss_mask`` (Hugging Face's, TRL's, ...)."""

SUPERVISION_NAMES = (*SUPERVISION_MASKS, RESPONSE_MASK, LABELS, ATTENTION_MASK)
"""Every name a field that says what is trained goes by; a near miss of one is refused."""

FIELDS_OF_THEIR_OWN = (
    *TOKEN_FIELD_CANDIDATES,
    LABEL,
    *FOREIGN_SUPERVISION,
    POSITIONS,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    MM_TOKEN_TYPE_IDS,
    SEQ_LENGTHS,
    PADDING_MASK,
    PADDING_LENGTH,
    PADDING_LENGTH_TAG,
    "loss_weights",
    "response_ids",
    PROMPT_INPUT_IDS,
    CHOSEN_INPUT_IDS,
    REJECTED_INPUT_IDS,
    PROMPT_IDS,
    CHOSEN_IDS,
    REJECTED_IDS,
    "reject_ids",
    COMPLETION_IDS,
    KL_COMPLETION_IDS,
    PROMPT_ATTENTION_MASK,
    CHOSEN_ATTENTION_MASK,
    REJECTED_ATTENTION_MASK,
    "reject_attention_mask",
    "completion_attention_mask",
    "KL_attention_mask",
    "chosen_labels",
    "rejected_labels",
    REF_CHOSEN_LOGPS,
    REF_REJECTED_LOGPS,
    REF_LOGPS,
    REF_KL_LOGPS,
    MARGIN,
    *MEDIA,
)
"""Fields never taken for a near miss of a supervision name: fields of their own (``label``), and other
stacks' supervision (:data:`FOREIGN_SUPERVISION`, refused on its own terms)."""


def aligned(field: Ragged, tokens: Ragged) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` of ``field`` hold one entry per token of row ``b``?"""
    return np.asarray(field.lengths == tokens.lengths)


def unstarted(positions: Ragged, counted: np.ndarray | None = None) -> tuple[int, int] | None:
    """``(row, first position)`` of the first row (of ``counted``) not starting at 0, or ``None``.

    Example:
        >>> unstarted(Ragged(np.array([0, 1, 3, 4]), np.array([0, 2, 2, 4])))
        (2, 3)
    """
    rows = positions.lengths > 0
    if counted is not None:
        rows &= counted
    found = np.flatnonzero(rows)
    first = positions.host[positions.offsets[found]]
    bad = np.flatnonzero(first != 0)
    return (int(found[bad[0]]), int(first[bad[0]])) if bad.size else None


def declared_padding(batch: Batch, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's declared trailing padding, and whether it declares one: ``([B] int64, [B] bool)``."""
    named = "meta.padding_length"
    if batch.metas:
        tags = [meta.tags or {} for meta in batch.metas]
        if PADDING_LENGTH_TAG in batch:  # a payload's own '_padding_length', as a column gives it
            named = f"meta.padding_length (or {PADDING_LENGTH_TAG!r})"
            tags = [  # the payload's, where the meta declares none (no tag, or None)
                {**tag, PADDING_LENGTH_TAG: _one_value(payload[PADDING_LENGTH_TAG])}
                if isinstance(payload, Mapping)
                and PADDING_LENGTH_TAG in payload
                and tag.get(PADDING_LENGTH_TAG) is None
                else tag
                for tag, payload in zip(tags, batch.payloads, strict=True)
            ]
        # meta.padding_length is the tag's value or None: None, as an absent tag, declares no padding
        declared = np.array([tag.get(PADDING_LENGTH_TAG) is not None for tag in tags], dtype=bool)
        given = [0 if tag.get(PADDING_LENGTH_TAG) is None else tag[PADDING_LENGTH_TAG] for tag in tags]
        valid = [
            (type(count) is int or (isinstance(count, np.integer) and not isinstance(count, np.bool_)))
            and abs(int(count)) < 2**62
            for count in given
        ]
        values = np.array([count if ok else -1 for count, ok in zip(given, valid, strict=True)], np.int64)
    elif PADDING_LENGTH_TAG in batch:
        values = np.asarray(batch.per_row(PADDING_LENGTH_TAG, "ids"), dtype=np.int64).reshape(-1)
        declared, given = np.ones(batch.rows, dtype=bool), values.tolist()
    else:
        return np.zeros(batch.rows, dtype=np.int64), np.zeros(batch.rows, dtype=bool)
    wrong = np.flatnonzero((values < 0) | (values > lengths))
    if wrong.size:
        index = int(wrong.min())
        raise ValueError(
            f"{batch.names(index)}: {named} is {shown(given[index])} but must be an int "
            f"from 0 to the token row's length {int(lengths[index])}"
        )
    return values, declared


def _one_value(value: object) -> object:
    """A 0-d array or tensor as its Python number (``datasets``' torch format gives one); else ``value``."""
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0:
        return value.item()
    return value


def unread_supervision(
    batch: Batch,
    tokens: Ragged,
    read: Iterable[str],
    loss_mask: Ragged | None,
    unreadable: list[str] | None = None,
) -> tuple[int, str] | None:
    """``(row, field)``: the first row whose unread supervising field changes what is trained, or ``None``.
    ``unreadable``: collects the refusal of a field whose values cannot be read, and the check goes on
    (``to_training``, whose result does not depend on it); ``None``: that refusal is raised."""
    found = []
    for rank, name in enumerate(SUPERVISING_FIELDS):
        if name not in batch or name in read:
            continue
        if name == PROMPT_MASK and ATTENTION_MASK in read and ATTENTION_MASK in batch:
            continue  # the row's attention_mask, read, says where its padding is
        if name in FOREIGN_SUPERVISION and (not batch.is_list(name) or batch.one_value_row(name) is not None):
            continue  # a value per example ('label_ids': a class), no token's supervision
        try:
            field = batch.get(name, "values", partial=True)
            assert field is not None
            bad = _changes_training(name, field, tokens, loss_mask) & batch.carried(name)
            if name == LABEL_IDS and LABELS in batch:  # a copy of the labels given loses nothing
                labels = batch.get(LABELS, "values", partial=True)
                assert labels is not None
                bad &= _rows_differing(field, labels) | ~batch.carried(LABELS)
        except (TypeError, ValueError) as error:
            if unreadable is None:
                raise
            unreadable.append(str(error))
            continue
        rows = np.flatnonzero(bad)
        if rows.size:
            found.append((int(rows[0]), rank, name))
    if not found:
        return None
    row, _, name = min(found)
    return row, name


EntryPoint = Literal["collator", "packer", "examples", "pairs"]
"""Who does not read a supervising field, for :func:`unread_message`."""

_HF = (
    "or pack Hugging Face examples with trl.pack_dataset and collate them with Collator.for_transformers(...)"
)
_PACKED = (
    "the packer reads supervision as 'loss_mask' only: packed as data, a cut (overflow='auto') would not "
    "keep the prompt with its answer, and the Collator refuses it"
)


BOUNDARY_FIELDS = {
    SEQ_LENGTHS: "lengths",  # TRL's packed rows
    "packed_seq_lens": "lengths",  # OpenRLHF's
    "cu_seqlens": "offsets",  # verl's, flash-attn's
    "cu_seq_lens_q": "offsets",  # transformers' flash kwargs
    "cu_seq_lens_k": "offsets",
    "seq_idx": "ids",  # a document number per token (Mamba's kernels)
}
"""Row fields other stacks mark a packed row's documents with, and how they mark them."""


def unread_documents(
    batch: Batch,
    read: Iterable[str],
    fix: str,
    *,
    positions: bool = True,
    unreadable: list[str] | None = None,
) -> str | None:
    """The refusal of the first row without positions whose :data:`BOUNDARY_FIELDS` entry (``seq_lengths``,
    ``cu_seqlens``, ...) marks several documents where it is not read (not in ``read``), with ``fix``;
    ``None`` if none (``positions``: the caller reads positions; ``unreadable``: as
    :func:`unread_supervision`'s). Taken for one document, the row's labels would cross between documents."""
    read = set(read)
    for name, kind in BOUNDARY_FIELDS.items():
        if name not in batch or name in read:
            continue
        try:
            given = batch.get(name, "ids", partial=True)
        except (TypeError, ValueError) as error:
            if unreadable is None:
                raise
            unreadable.append(str(error))
            continue
        assert given is not None
        unmarked = batch.carried(name)
        for marked in (POSITIONS, POSITION_IDS) if positions else ():  # positions read find the documents
            if marked in batch:
                unmarked &= ~batch.carried(marked)
        documents = _documents(np.reshape(given.host, -1), given.offsets, kind)
        several = np.flatnonzero((documents > 1) & unmarked)
        if several.size:
            row = int(several[0])
            return (
                f"{batch.names(row)}: carries {shown(name)} ({int(documents[row])} documents packed in one "
                "row), which is not read here: the row would be one document, its labels "
                f"crossing from each document into the next; {fix}"
            )
    return None


def _documents(values: np.ndarray, offsets: np.ndarray, kind: str) -> np.ndarray:
    """The documents each row's boundary field marks: its lengths above 0, its offsets' steps above 0,
    or its ids' runs."""
    rows = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    if kind == "lengths":
        marks = values > 0
    elif kind == "offsets":  # [0, a, a + b, ...]: a step after each row's first value
        marks = np.zeros(values.size, dtype=bool)
        marks[1:] = (np.diff(values) > 0) & (rows[1:] == rows[:-1])
    else:  # a new document where the id changes, and at each row's first token
        marks = np.ones(values.size, dtype=bool)
        marks[1:] = (values[1:] != values[:-1]) | (rows[1:] != rows[:-1])
    return np.bincount(rows, weights=marks, minlength=offsets.size - 1)


def unread_message(where: str, name: str, reader: EntryPoint) -> str:
    """The refusal of row ``where``'s supervising field ``name``, unread by ``reader``, with the fix.

    Example:
        >>> print(unread_message("record 0", "completion_mask", "packer"))  # doctest: +ELLIPSIS
        record 0: payload has 'completion_mask' with zeros, but the packer reads supervision as ...
    """
    if name in FOREIGN_SUPERVISION and reader != "pairs":
        return _foreign_message(where, name)
    if reader == "pairs":
        return (
            f"{where}: carries {shown(name)}, which this collator does not read: each side's tokens are "
            "trained whole, so what it leaves out would be trained; give each side (or completion) as the "
            "tokens to train, its padding in the side's own *_attention_mask, and drop the field"
        )
    if reader == "examples":  # response_mask: the other fields are read there
        return (
            f"{where}: carries {shown(name)} (verl's mask of the row's last tokens, the response), which "
            "this collator does not read: read as all trained, the prompt would be trained; collate "
            "rollouts with Collator.for_rollouts(...), which reads it, or give a completion_mask (0 on the "
            "prompt)"
        )
    packer = reader == "packer"
    if name == LABELS and packer:
        return (
            f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), but "
            f"{_PACKED}. Give the supervision as a loss_mask (loss_mask = [int(l != -100) for l in "
            f"labels]) and drop 'labels', {_HF}"
        )
    if name == LABELS:
        return (
            f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), which are "
            "not read here: labels are made from the tokens. For Hugging Face examples use "
            "Collator.for_transformers(...); else give the supervision as a loss_mask (loss_mask = labels "
            "!= -100) and drop 'labels'"
        )
    if name == ATTENTION_MASK and packer:
        return (
            f"{where}: payload has an 'attention_mask' with zeros (padding inside the document), which the "
            "packer would pack as real tokens, and the Collator refuses it. Give the documents without "
            f"their padding (drop the padded tokens and the mask: each row is padded when packed), {_HF}"
        )
    if name == ATTENTION_MASK:
        return (
            f"{where}: payload has an 'attention_mask' that is not all 1s (padding's zeros, or the sequence "
            "numbers of packed rows), which is not applied here: its tokens would be trained on as one "
            "sequence of real ones. For Hugging Face examples use Collator.for_transformers(...); "
            "else give padding as meta.padding_length (pack_flat writes it) or pad with "
            "Collator(pad_token_id=...) and drop the mask"
        )
    if name == RESPONSE_MASK and packer:
        return (
            f"{where}: payload has 'response_mask' (verl's mask of the row's last tokens), but {_PACKED}. "
            "Give it as the loss_mask (loss_mask = [0] * (len(input_ids) - len(response_mask)) + "
            "response_mask) and drop 'response_mask'"
        )
    if name == RESPONSE_MASK:
        return (
            f"{where}: payload has 'response_mask' (verl's mask of the row's last tokens, the response), "
            "which is not read here: the prompt would be trained on. Collate verl rows with "
            "Collator.for_rollouts(...), which reads it; else give the supervision as a loss_mask "
            "(loss_mask = [0] * (len(input_ids) - len(response_mask)) + response_mask)"
        )
    if packer:
        return (
            f"{where}: payload has {shown(name)} with zeros, but {_PACKED}. Give it as the loss_mask "
            f"(loss_mask = {name}) and drop {shown(name)}, {_HF}"
        )
    return (
        f"{where}: payload has {shown(name)} with zeros, which are not read here: the prompt would be "
        "trained on. For Hugging Face examples use Collator.for_transformers(...); else give them as the "
        f"loss_mask (loss_mask = {name})"
    )


def _changes_training(name: str, field: Ragged, tokens: Ragged, loss_mask: Ragged | None) -> np.ndarray:
    """``[B]`` booleans: would row ``b`` of supervising field ``name`` change what is trained?"""
    if name == SHIFT_LABELS:  # the targets themselves: lost whatever they hold
        return np.ones(field.rows, dtype=bool)
    if name in (LABELS, LABEL_IDS):
        return _rows_differing(field, tokens)
    bad = row_any(_any_entry(field.host != 1), field.offsets)
    if name in (RESPONSE_MASK, ACTION_MASK):  # response-aligned: shorter, it leaves the prompt untrained
        bad = np.asarray(bad | (field.lengths != tokens.lengths))
        if name == RESPONSE_MASK:
            return bad
    if name != ATTENTION_MASK and loss_mask is not None:
        bad &= _rows_differing(field, loss_mask)  # a copy of the loss_mask is harmless
    return bad


def _foreign_message(where: str, name: str) -> str:
    """The refusal of another stack's supervising field (:data:`FOREIGN_SUPERVISION`), with the fix."""
    what, fix = {
        SHIFT_LABELS: (
            "transformers' pre-shifted targets), which nothing here reads: labels are made here from the "
            "tokens and the supervision, so its targets would be lost",
            "give the unshifted labels as 'labels' (-100 where not trained; Collator.for_transformers reads "
            "them) or a loss_mask, and drop 'shift_labels'",
        ),
        LABEL_IDS: (
            "the name transformers' default_data_collator renames to 'labels') that differ from its tokens, "
            "which nothing here reads: every token would be trained",
            "rename it 'labels' (Collator.for_transformers reads them), or give a loss_mask "
            "(loss_mask = label_ids != -100) and drop it",
        ),
        ACTION_MASK: (
            "OpenRLHF's mask of the trained tokens) with zeros or fewer entries than tokens, which nothing "
            "here reads: the tokens it leaves out would be trained",
            "give it as a completion_mask or loss_mask (one entry per token, 1 = trained), or, aligned to "
            "the response, as verl's 'response_mask' to Collator.for_rollouts(...)",
        ),
        PROMPT_MASK: (
            "TRL's mask of a prompt's padding) with zeros, which nothing here reads: the padding would be "
            "read as tokens",
            "drop the padded tokens and the mask, or give the row's padding as its 'attention_mask' "
            "(prompt_mask followed by the completion's mask), which Collator.for_transformers(...) and "
            "Collator.for_rollouts(...) read",
        ),
        **dict.fromkeys(
            TOOL_MASKS,
            (
                "TRL's mask of a completion's tool output) with zeros, which nothing here reads: the tool's "
                "tokens would be trained",
                "multiply it into the supervision (completion_mask = completion_mask * tool_mask, aligned as "
                "the completion_mask is; or the loss_mask) and drop it",
            ),
        ),
    }[name]
    return f"{where}: carries {shown(name)} ({what}; {fix}"


def _rows_differing(field: Ragged, like: Ragged) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` of ``field`` differ from row ``b`` of ``like``?"""
    values, other = field.host, like.host
    if values.shape[1:] != other.shape[1:]:
        return np.ones(field.rows, dtype=bool)
    same_length = field.lengths == like.lengths
    differs: np.ndarray = ~same_length
    offsets = np.zeros(int(same_length.sum()) + 1, dtype=np.int64)
    np.cumsum(field.lengths[same_length], out=offsets[1:])
    mine = values[np.repeat(same_length, field.lengths)]
    theirs = other[np.repeat(same_length, like.lengths)]
    differs[same_length] = row_any(_any_entry(mine != theirs), offsets)
    return differs


def _any_entry(flags: np.ndarray) -> np.ndarray:
    """``[N]`` booleans from ``[N, ...]`` ones: is any entry of token ``n`` True?"""
    return flags if flags.ndim == 1 else np.asarray(flags.reshape(len(flags), -1).any(axis=1))


def _bad_at(field: Ragged, bad: np.ndarray | torch.Tensor, name: str) -> tuple[int, int, str] | None:
    """``(row, flat index, "name[t]")`` of the first True of ``bad`` (shaped like the values), or None."""
    found = bad.reshape(-1).nonzero()[:, 0] if isinstance(bad, torch.Tensor) else np.flatnonzero(bad)
    if not len(found):
        return None
    flat = int(found[0])
    token = flat // max(1, int(np.prod(field.values.shape[1:])))  # per-token fields of [N, ...]: whole rows
    row = row_of(field.offsets, token)
    return row, flat, f"{name}[{token - int(field.offsets[row])}]"


def _kind(values: Values) -> str:
    """NumPy's dtype kind of host values or a tensor: ``"b"``, ``"i"``, ``"u"``, ``"f"``."""
    if isinstance(values, np.ndarray):
        return str(values.dtype.kind)
    dtype = values.dtype
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point else "u" if dtype == torch.uint8 else "i"


def _size(values: Values) -> int:
    return int(values.size) if isinstance(values, np.ndarray) else int(values.numel())


@functools.lru_cache(maxsize=64)
def _range_of(dtype: np.dtype | torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype) if isinstance(dtype, torch.dtype) else np.iinfo(dtype)
    return int(info.min), int(info.max)


def check_ids(field: Ragged, name: str, names: Names) -> None:
    """``ValueError`` naming the first payload with a negative id in ``field`` (an embedding would fail).

    Example:
        >>> check_ids(Ragged(np.array([1, 2, 3, -4]), np.array([0, 2, 4])), "input_ids",
        ...           lambda i: f"example {i}")
        Traceback (most recent call last):
        ...
        ValueError: example 1: field 'input_ids' token ids must be >= 0, found -4 at input_ids[1]
    """
    values = host_view(field.values)
    if not _size(values) or _kind(values) in "bu":
        return
    # One reduction on the common path (on the host the ufunc's: ndarray.min is a Python wrapper).
    if (np.minimum.reduce(values, axis=None) if isinstance(values, np.ndarray) else values.min()) >= 0:
        return
    found = _bad_at(field, values < 0, name)
    assert found is not None
    row, flat, token = found
    value = int(values.reshape(-1)[flat])
    raise ValueError(f"{names(row)}: field {shown(name)} token ids must be >= 0, found {value} at {token}")


def check_zero_one(field: Ragged, name: str, names: Names, meaning: str) -> None:
    """``ValueError`` naming the first payload whose ``field`` is not 0/1 (``meaning``: what 1 means)."""
    values = host_view(field.values)
    kind = _kind(values)
    if kind == "b" or not _size(values):
        return
    # As unsigned, 0 and 1 are the only values <= 1: one reduction on the common path.
    if (
        kind in "iu"
        and isinstance(values, np.ndarray)
        and values.view(values.dtype.str.replace("i", "u")).max() <= 1
    ):
        return
    bad = (values != 0) & (values != 1)
    found = _bad_at(field, bad, name)
    if found is None:
        return
    row, flat, token = found
    raise ValueError(
        f"{names(row)}: field {shown(name)} must hold only 0 and 1 (or booleans), {meaning}; found "
        f"{shown(values.reshape(-1)[flat].item())} at {token}"
    )


def check_fits(field: Ragged, dtype: torch.dtype, name: str, names: Names) -> None:
    """``ValueError`` naming the first payload whose ``field`` values the integer ``dtype`` cannot hold."""
    values = host_view(field.values)
    kind = _kind(values)
    if kind == "b" or not _size(values):
        return
    smallest, largest = _range_of(dtype)
    if kind in "iu":
        low, high = _range_of(values.dtype)
        if smallest <= low and high <= largest:
            return  # every value of the source dtype fits
        if smallest <= values.min() and values.max() <= largest:
            return
        problems = [((values < smallest) | (values > largest), f"values outside the {dtype} range")]
    else:  # compared in float64, where -2**63 and 2**63 are exact (in float16 they overflow)
        values = values.astype(np.float64) if isinstance(values, np.ndarray) else values.double()
        finite = np.isfinite(values) if isinstance(values, np.ndarray) else torch.isfinite(values)
        rounded = np.round(values) if isinstance(values, np.ndarray) else values.round()
        problems = [
            (~finite | (values != rounded), "non-integral or non-finite values"),
            (
                (values < float(smallest)) | (values >= float(largest) + 1),
                f"values outside the {dtype} range",
            ),
        ]
    for bad, problem in problems:
        found = _bad_at(field, bad, name)
        if found is not None:
            row, flat, token = found
            floats = (
                "; float data (log-probs, advantages) keeps a float dtype of its own in "
                f"Collator(float_fields=[{shown(name)}])"
                if problem.startswith("non-integral")
                else ""
            )
            raise ValueError(
                f"{names(row)}: field {shown(name)} holds {problem} (e.g. "
                f"{shown(values.reshape(-1)[flat].item())} at {token}), which {dtype} "
                f"cannot represent exactly; fix the data or pick a wider dtype{floats}"
            )


def row_shape(field: Ragged) -> tuple[int, tuple[int, ...]]:
    """The first non-empty row of ``field`` (else row 0) and its shape, for a message."""
    nonempty = np.flatnonzero(field.lengths)
    index = int(nonempty[0]) if nonempty.size else 0
    return index, (int(field.lengths[index]), *field.values.shape[1:])


def check_flat(field: Ragged, name: str, names: Names) -> None:
    """``ValueError`` unless ``field`` holds one value per token (1-D values), naming the row."""
    if field.values.ndim != 1:
        index, shape = row_shape(field)
        raise ValueError(
            f"{names(index)}: field {shown(name)} must be 1-D (one entry per token), got shape {shape}"
        )


def misaligned(where: str, name: str, entries: int | None, length: int) -> ValueError:
    """The refusal of a per-token field without one entry per token (``entries=None``: one value)."""
    got = "a scalar" if entries is None else f"{entries} entries"
    return ValueError(
        f"{where}: field {shown(name)} has {got} but the token row has {length}; per-token fields must "
        "match the tokens one to one"
    )


def group_id(value: object, where: str, key: str) -> int | str:
    """A group field's value as its id: an int (NumPy and 0-d integer tensors included) or a str.

    Refused otherwise, a bool and a float included: ``True``, ``1`` and ``1.0`` are equal as Python
    keys, and would merge groups the user kept apart.
    """
    value = scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{where}: group key {shown(key)} must be an int or a str (the id its group shares), got "
            f"{shown(value)}"
        )
    return value


def misspelled(
    fields: Iterable[object], known: Sequence[str] = SUPERVISION_NAMES, read: Iterable[str] = ()
) -> tuple[str, str] | None:
    """``(field, meant)``: the first field (sorted) that is a near miss of a name of ``known``, or ``None``.

    A field in ``read`` or :data:`FIELDS_OF_THEIR_OWN`, or as near to one of them, is never one.

    Example:
        >>> misspelled(["input_ids", "loss_maks"]), misspelled(["label", "action_mask"])
        (('loss_maks', 'loss_mask'), None)
    """
    names = sorted(name for name in fields if isinstance(name, str))
    if not names:
        return None
    chosen, others = tuple(known), _others(frozenset(read))
    for name in names:
        meant = _meant(name, chosen, others)
        if meant is not None:
            return name, meant
    return None


def near_miss(where: str, name: str, meant: str, fix: str = "") -> str:
    """The refusal of field ``name``, a near miss of ``meant``, for ``where`` (``fix`` appended).

    Example:
        >>> print(near_miss("example 1", "lables", "labels"))  # doctest: +NORMALIZE_WHITESPACE
        example 1: has 'lables', which nothing reads: did you mean 'labels'? Read under no name,
        every token would be trained; rename it 'labels'
    """
    lost = (
        "its padding would be trained as tokens"
        if meant.endswith(ATTENTION_MASK)
        else "every token would be trained"
    )
    if name == "attention_masks":  # open-instruct's packed rows number their sequences in it
        fix += "; if it numbers the sequences packed in its row (open-instruct), give one example each"
    return (
        f"{where}: has {shown(name)}, which nothing reads: did you mean {shown(meant)}? Read under no "
        f"name, {lost}; rename it {shown(meant)}{fix}"
    )


def _canonical(name: str) -> str:
    """``name`` lower-cased, with every character but letters and digits dropped."""
    return "".join(char for char in name.lower() if char.isalnum())


def _limit(canonical: str) -> int:
    """The edits a near miss of a canonical supervision name may be away: 1 up to 6 characters, else 2."""
    return 1 if len(canonical) <= 6 else 2


def _edits(a: str, b: str, limit: int) -> int:
    """The optimal string alignment distance of ``a`` and ``b``, or ``limit + 1`` beyond ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    before: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            value = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                value = min(value, before[j - 2] + 1)
            current[j] = value
        if min(current) > limit:  # a row's least never falls: the distance is more than limit
            return limit + 1
        before, previous = previous, current
    return min(previous[-1], limit + 1)


@functools.lru_cache(maxsize=256)
def _others(read: frozenset[str]) -> frozenset[str]:
    """The names of fields of their own (:func:`misspelled`): ``read``, and :data:`FIELDS_OF_THEIR_OWN`."""
    return read.union(FIELDS_OF_THEIR_OWN)


@functools.lru_cache(maxsize=4096)
def _meant(name: str, known: tuple[str, ...], others: frozenset[str]) -> str | None:
    """The supervision name of ``known`` that ``name`` is a near miss of, or ``None`` (cached)."""
    if name in known or name in others:
        return None
    words = sorted(re.split(r"[^a-z0-9]+", name.lower()))
    for candidate in known:  # the same words in another order: "mask_loss", "attention_mask_chosen"
        if len(words) > 1 and words == sorted(re.split(r"[^a-z0-9]+", candidate.lower())):
            return candidate
    given = _canonical(name)
    best, meant = 0, None
    for candidate in known:
        target = _canonical(candidate)
        most = _limit(target) if meant is None else min(_limit(target), best - 1)
        if most >= 0 and (distance := _edits(given, target, most)) <= most:
            best, meant = distance, candidate
    if meant is None:
        return None
    for other in others:
        if other not in known and _edits(given, _canonical(other), best) <= best:
            return None  # as near to a field of its own
    return meant


def kept_by_mask(mask: Ragged, name: str, names: Names) -> np.ndarray:
    """``[N]`` booleans: the tokens a padding mask keeps (its 1s, with 0s only before or after them).

    Example:
        >>> mask = Ragged(np.array([0, 1, 1, 1, 0]), np.array([0, 3, 5]))
        >>> kept_by_mask(mask, "attention_mask", str).tolist()
        [False, True, True, True, False]
    """
    check_zero_one(mask, name, names, "1 on tokens, 0 on padding")
    keep = mask.host != 0
    opens = keep.copy()  # the first 1 of each run
    opens[1:] &= ~keep[:-1]
    firsts = mask.offsets[:-1][mask.lengths > 0]
    opens[firsts] = keep[firsts]
    runs = np.bincount(np.repeat(np.arange(mask.rows), mask.lengths), weights=opens, minlength=mask.rows)
    if (runs > 1).any():
        raise ValueError(
            f"{names(int(np.flatnonzero(runs > 1)[0]))}: {shown(name)} must be 1 on the tokens, with 0s only "
            "on padding before or after them; it has 0s between 1s (a hole): give each example's "
            "tokens without holes"
        )
    return np.asarray(keep)


def response_aligned(
    field: Ragged,
    lengths: np.ndarray,
    name: str,
    names: Names,
    fill: int | float | Spread = 0,
    *,
    flat: bool = True,
) -> Ragged:
    """``field`` on the last tokens of the rows (``lengths`` as given, padding included), ``fill`` before.

    Example:
        >>> field = Ragged(np.array([0.5, 0.25, 0.75]), np.array([0, 2, 3]))
        >>> response_aligned(field, np.array([4, 2]), "old_log_probs", str).values.tolist()
        [0.0, 0.0, 0.5, 0.25, 0.0, 0.75]
    """
    if flat:
        check_flat(field, name, names)
    longer = np.flatnonzero(field.lengths > lengths)
    if longer.size:
        index = int(longer[0])
        raise ValueError(
            f"{names(index)}: field {shown(name)} holds {int(field.lengths[index])} values, but the token "
            f"row has {int(lengths[index])}; a response-aligned field covers the row's last tokens (verl's "
            "[batch, response_length] beside input_ids = prompts + responses): give at most one value per "
            "token"
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    given = field.host
    values = filled((int(offsets[-1]), *given.shape[1:]), fill, given.dtype, at=places(offsets))
    values[np.repeat(offsets[1:] - field.lengths, field.lengths) + places(field.offsets)] = given
    return Ragged(values, offsets)


def positions_field(batch: Batch) -> str | None:
    """The rows' positions field: ``positions``, else ``position_ids``, else ``None`` (both: must agree)."""
    if POSITION_IDS not in batch:
        return POSITIONS if POSITIONS in batch else None
    if POSITIONS not in batch:
        return POSITION_IDS
    page, hf = batch.carried(POSITIONS), batch.carried(POSITION_IDS)
    if (hf & ~page).any():  # read as 'positions', this row's own would be lost
        one, two = int(np.flatnonzero(page)[0]), int(np.flatnonzero(hf & ~page)[0])
        raise ValueError(
            f"{batch.names(two)}: gives its positions as 'position_ids', {batch.names(one)} as 'positions'; "
            "read under one name, the other's documents would merge: give every row the same field"
        )
    given, other = batch.get(POSITIONS, "ids", partial=True), batch.get(POSITION_IDS, "ids", partial=True)
    assert given is not None and other is not None
    for index in np.flatnonzero(batch.carried(POSITIONS) & batch.carried(POSITION_IDS)).tolist():
        if not np.array_equal(as_numpy(given.row(index)), as_numpy(other.row(index))):
            raise ValueError(
                f"{batch.names(index)}: payload has both 'positions' and 'position_ids' (Hugging Face's "
                "spelling), and they differ, so it is not clear where its documents start; keep one"
            )
    return POSITIONS


_VISION_LANGUAGE = (
    "collate vision-language examples with Collator.for_transformers(padding_free=True, "
    "mrope=MRope.from_config(model.config))"
)


def refuse_media(
    batch: Batch,
    owner: str,
    fix: str = _VISION_LANGUAGE,
    names: Sequence[str] = (*RAW_MEDIA, *MEDIA, MM_TOKEN_TYPE_IDS),
) -> None:
    """``ValueError`` naming the first example with vision-language fields (``names``), which ``owner`` does
    not read."""
    carried = next((name for name in names if name in batch), None)
    if carried is not None:
        index = int(np.flatnonzero(batch.carried(carried))[0])
        first = " (run the model's processor on them first)" if carried in RAW_MEDIA else ""
        raise ValueError(
            f"{batch.names(index)}: carries {shown(carried)}, a vision-language example's, which {owner} "
            f"does not read: collated as text its images would be dropped and its positions wrong; {fix}"
            f"{first}"
        )
