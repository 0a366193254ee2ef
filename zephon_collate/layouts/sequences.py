"""The post-training layout: sequences (a prompt, then a response) to a ``transformers`` batch, exactly.

``Collator.for_preference`` and ``Collator.for_rollouts`` read their examples
into a :class:`SequenceBatch` (each sequence's tokens, what is supervised, its
prompt length, its float fields) and :class:`Sequences`, a
:class:`~zephon_collate.layouts.transformers.Transformers` layout, lays it out: the
``for_transformers`` keys (padded ``[R, L]`` or padding-free ``[1, N]``,
labels unshifted, -100 where no loss is taken) and the sequence map that makes
every loss exact (:mod:`zephon_collate.losses`):

- ``document_ids``, ``branch_ids`` ``[R, L]`` int32: each token's document and
  branch (-1 on padding). Unshared, every sequence is a document of its own,
  branch 1. With a shared prompt, consecutive sequences whose prompts are equal
  form one document: the prompt once (branch 0), then each response (branch
  ``k``), which attends to the prompt and to itself, never to a sibling
  (:func:`~zephon_collate.functional.attention.branch_mask_mod`)::

      unshared   [p p a a] [p p b b b]       positions 0 1 2 3 | 0 1 2 3 4
      shared     [p p a a b b b]             positions 0 1 2 3 2 3 4
                  0 0 1 1 2 2 2  branch      (each response continues from the prompt)

- ``logits_index`` ``[R, L]`` int64: for every token, the place in its row of
  the position whose logits predict it (a response's first token is predicted
  from the prompt's last one), -1 where none does (a document's first token,
  padding);
- ``sequence_index`` ``[R, L]`` int64: the sequence a token belongs to, -1 on
  padding and on a shared prompt; ``num_sequences`` (an int).

A shared-prompt batch has no ``attention_mask`` (a padding mask would let a
response attend to its sibling): build the attention from the ids
(:func:`~zephon_collate.functional.attention.dense_branch_mask` for SDPA,
:func:`~zephon_collate.functional.attention.branch_block_mask` for FlexAttention).

Prompt tokens are never supervised, so every supervised token belongs to one
sequence. A prompt is shared only when it and the responses are not empty,
and the sequences agree on it token for token (float fields included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from zephon_collate.core.checks import Keywords, check_bool
from zephon_collate.core.keys import (
    BRANCH_IDS,
    DOCUMENT_IDS,
    INPUT_IDS,
    LOGITS_INDEX,
    LOSS_MASK,
    NUM_SEQUENCES,
    POSITIONS,
    SEQUENCE_INDEX,
)
from zephon_collate.layouts.base import Settings, Stacked
from zephon_collate.layouts.transformers import Transformers, TransformersOptions, in_float
from zephon_collate.read.columns import Names, Ragged, Spread, gather_spans, places, sequence_of
from zephon_collate.transforms import AttentionMask, PaddingMask, Transform

__all__ = [
    "SEQUENCE_MAP",
    "SequenceBatch",
    "SequenceOptions",
    "Sequences",
    "prompt_lengths",
    "share_groups",
]

SEQUENCE_MAP = (DOCUMENT_IDS, BRANCH_IDS, LOGITS_INDEX, SEQUENCE_INDEX)
"""The per-token keys of the sequence map (each stored + 1 until stacked, so that padding reads -1)."""


@dataclass(frozen=True, kw_only=True)
class SequenceOptions(Keywords):
    """The layout options the post-training presets share, checked once; errors name ``OWNER``.

    A shared prompt needs ``position_ids`` (they continue from the prompt) and
    cannot be described by ``cu_seq_lens``/``seq_idx``. A preset adds its own
    fields after these; every field is an option of the underlying
    :class:`~zephon_collate.TransformersOptions` but ``shared_prompt``.

    Raises:
        TypeError, ValueError: for a value of the wrong type, or options that do not fit each other
            or the layout.
    """

    OWNER: ClassVar[str] = "Collator.for_transformers"
    OWN: ClassVar[tuple[str, ...]] = ("shared_prompt", "tokenizer")
    """The options the preset reads itself (not the underlying layout's)."""
    tokenizer: Any = field(default=None, kw_only=False, compare=False, repr=False)
    padding_free: bool = False
    shared_prompt: bool = False
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    return_position_ids: bool | None = None
    return_flash_attn_kwargs: bool = False
    return_seq_idx: bool = False

    def __post_init__(self) -> None:
        if self.pad_token_id is None and self.tokenizer is not None:
            object.__setattr__(self, "pad_token_id", getattr(self.tokenizer, "pad_token_id", None))
        object.__setattr__(self, "tokenizer", None)  # read once: the options hold plain values only
        for name in ("padding_free", "shared_prompt", "return_flash_attn_kwargs", "return_seq_idx"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name), owner=self.OWNER))
        self.transformers()  # checks the rest, naming the preset

    def transformers(self) -> TransformersOptions:
        """The :class:`~zephon_collate.TransformersOptions` of the underlying layout."""
        owner = self.OWNER
        layout = {name: getattr(self, name) for name in self.names() if name not in self.OWN}
        if self.shared_prompt:
            if self.return_flash_attn_kwargs or self.return_seq_idx:
                raise ValueError(
                    f"{owner}: shared_prompt=True puts several responses after one prompt, which cu_seq_lens "
                    "and seq_idx cannot describe (a varlen kernel would let a response attend to its "
                    "sibling); build the attention from document_ids and branch_ids "
                    "(attention.branch_block_mask or dense_branch_mask), or pass shared_prompt=False"
                )
            if self.return_position_ids is False:
                raise ValueError(
                    f"{owner}: shared_prompt=True needs position_ids (each response's positions continue "
                    "from the prompt); drop return_position_ids=False"
                )
            layout["return_position_ids"] = True
        try:
            return TransformersOptions(**layout)
        except (TypeError, ValueError) as error:
            raise type(error)(str(error).replace("Collator.for_transformers", owner)) from None


def prompt_lengths(supervised: Ragged) -> np.ndarray:
    """``[S]``: each sequence's tokens before its first supervised one (all of them where none is).

    Example:
        >>> prompt_lengths(Ragged(np.array([0, 0, 1, 1, 0, 0]), np.array([0, 4, 6]))).tolist()
        [2, 2]
    """
    offsets = supervised.offsets
    prompt = np.diff(offsets).astype(np.int64)
    trained = np.flatnonzero(np.asarray(supervised.values))
    if trained.size:
        rows = sequence_of(offsets)[trained]
        np.minimum.at(prompt, rows, places(offsets)[trained])
    return prompt


@dataclass
class SequenceBatch:
    """Sequences to lay out, each a prompt then a response, all per-token fields end to end.

    ``tokens`` (int64) and ``supervised`` (bool) are per token, their offsets
    the sequences'; ``prompt_lengths`` ``[S]``; ``floats`` per-token float fields
    (already placed with the unshifted labels), ``per_sequence`` one float per
    sequence; ``extras`` batch-level outputs (``chosen_index``, ...).
    """

    tokens: Ragged
    supervised: Ragged
    prompt_lengths: np.ndarray
    floats: dict[str, Ragged] = field(default_factory=dict)
    per_sequence: dict[str, np.ndarray] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    broadcast: tuple[str, ...] = ()  # float fields holding one value per sequence (see _differs_in_group)
    numbering: np.ndarray | None = None  # [S]: the sequence index of each (default: its place)

    @property
    def count(self) -> int:
        return len(self.prompt_lengths)


def _spans_equal(
    values: np.ndarray, first: np.ndarray, second: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """``[K]`` booleans: do the ``lengths[k]`` values at ``first[k]`` equal those at ``second[k]``?"""
    if not len(lengths):
        return np.zeros(0, dtype=bool)
    differ = values[gather_spans(first, lengths)] != values[gather_spans(second, lengths)]
    if differ.ndim > 1:  # a value that is a tensor differs where any of its entries does
        differ = differ.reshape(differ.shape[0], -1).any(axis=1)
    counts = np.bincount(np.repeat(np.arange(len(lengths)), lengths), weights=differ, minlength=len(lengths))
    return np.asarray(counts == 0)


def share_groups(batch: SequenceBatch) -> np.ndarray:
    """``[S]`` int64: the group of sequences each shares its prompt with (consecutive), -1 for none.

    Consecutive sequences share when their prompts have the same length, hold
    the same tokens and the same float values there, and each sequence has a
    prompt and a response. A group of one still lays out as a prompt and one
    branch (the same attention and positions as unshared).
    """
    offsets = batch.tokens.offsets
    lengths = np.diff(offsets)
    prompt = batch.prompt_lengths
    eligible = (prompt > 0) & (lengths > prompt)
    link = np.zeros(max(batch.count - 1, 0), dtype=bool)
    if batch.count > 1:
        link = eligible[:-1] & eligible[1:] & (prompt[:-1] == prompt[1:])
        pairs = np.flatnonzero(link)
        starts_a, starts_b, sizes = offsets[pairs], offsets[pairs + 1], prompt[pairs]
        same = _spans_equal(np.asarray(batch.tokens.values), starts_a, starts_b, sizes)
        for name, values in batch.floats.items():
            if name not in batch.broadcast:
                same &= _spans_equal(np.asarray(values.values), starts_a, starts_b, sizes)
        link[pairs] = same
    opens = eligible & ~np.concatenate([[False], link])
    group = np.cumsum(opens) - 1
    return np.where(eligible, group, -1).astype(np.int64)


def _differs_in_group(values: np.ndarray, offsets: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``[S]`` booleans: does sequence ``s`` share its prompt with a sequence of another broadcast value
    (``values``: one per token, constant over each sequence)? Such a prompt belongs to sequences that
    disagree, and holds 0; where they agree (a group of one always does) it holds their value.

    Example:
        >>> values = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
        >>> _differs_in_group(values, np.array([0, 2, 4, 6, 8]), np.array([0, 0, 1, 1])).tolist()
        [False, False, True, True]
    """
    shared = group >= 0
    first = values[np.minimum(offsets[:-1], max(values.size - 1, 0))] if values.size else values
    differ = np.zeros(group.size, dtype=bool)
    if shared.any():
        ids = group[shared]
        lowest = np.full(int(ids.max()) + 1, np.inf)
        highest = np.full(int(ids.max()) + 1, -np.inf)
        np.minimum.at(lowest, ids, first[shared])
        np.maximum.at(highest, ids, first[shared])
        differ[shared] = (lowest != highest)[ids]
    return differ


class Sequences(Transformers):
    """The post-training layout over the ``transformers`` one: see the module doc.

    ``shared_prompt`` lays consecutive sequences with equal prompts out as one
    document (the prompt once). A preset reads its examples into a
    :class:`SequenceBatch` and lays it out with :meth:`sequences`.
    """

    def __init__(self, options: SequenceOptions, settings: Settings | None = None) -> None:
        self.shared_prompt = options.shared_prompt
        super().__init__(options.transformers(), settings)

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The ``transformers`` chain; with a shared prompt without ``attention_mask``: a 2-D padding mask
        would let a response attend to its sibling (the attention comes from ``document_ids`` and
        ``branch_ids``, padding is document -1)."""
        steps = super().chain(keys)
        if self.shared_prompt:
            steps = [step for step in steps if not isinstance(step, (PaddingMask, AttentionMask))]
        return steps

    def sequences(self, batch: SequenceBatch, names: Names) -> Stacked:
        """The chain's input for ``batch``: documents, their sequence map, padded or padding-free."""
        offsets = batch.tokens.offsets
        seq = sequence_of(offsets)
        place = places(offsets)
        prompt = batch.prompt_lengths[seq]
        group = share_groups(batch) if self.shared_prompt else np.full(batch.count, -1, dtype=np.int64)
        shared = group >= 0
        first = np.ones(batch.count, dtype=bool)  # does sequence s open a document?
        first[1:] = ~(shared[1:] & (group[1:] == group[:-1]))
        member = np.arange(batch.count) - np.maximum.accumulate(np.where(first, np.arange(batch.count), 0))
        in_prompt = place < prompt
        keep = ~(in_prompt & shared[seq] & ~first[seq])  # a shared prompt once, with its first sequence
        trunk = in_prompt & shared[seq]
        document = np.cumsum(first) - 1
        doc = document[seq]
        branch = np.where(trunk, 0, np.where(shared[seq], member[seq] + 1, 1))
        number = seq if batch.numbering is None else batch.numbering[seq]
        sequence_index = np.where(trunk, -1, number)
        # Documents as rows of the kept tokens: each token's place in its document.
        kept = np.flatnonzero(keep)
        doc_kept = doc[kept]
        doc_offsets = np.zeros(int(document[-1]) + 2 if batch.count else 1, dtype=np.int64)
        np.cumsum(np.bincount(doc_kept, minlength=len(doc_offsets) - 1), out=doc_offsets[1:])
        local = places(doc_offsets)
        predictor = np.where(
            place[kept] == 0,
            -1,
            np.where(shared[seq[kept]] & (place[kept] == prompt[kept]), prompt[kept] - 1, local - 1),
        )
        if self.options.padding_free:  # one row: the place of the predictor in it
            predictor = np.where(predictor >= 0, predictor + doc_offsets[doc_kept], -1)
        per_token: dict[str, Ragged] = {
            INPUT_IDS: Ragged(np.asarray(batch.tokens.values)[kept], doc_offsets),
            LOSS_MASK: Ragged(np.asarray(batch.supervised.values)[kept], doc_offsets),
        }
        if self.options.padding_free or self.options.positions_out:
            per_token[POSITIONS] = Ragged(place[kept], doc_offsets)
        fills = {spec.name: spec.fill for spec in self.options.floats}
        for name, values in batch.floats.items():
            kept_values = np.asarray(values.values)[kept]
            if name in batch.broadcast:  # one value per sequence: a shared prompt belongs to several
                differ = _differs_in_group(np.asarray(values.values), offsets, group)
                given = fills.get(name, 0)
                fill = 0 if isinstance(given, Spread) else given  # a broadcast value is one number
                kept_values = np.where(trunk[kept] & differ[seq[kept]], fill, kept_values).astype(
                    kept_values.dtype
                )
            per_token[name] = Ragged(kept_values, doc_offsets)
        # Each + 1: padding, filled with 0, reads -1 once stacked.
        per_token[DOCUMENT_IDS] = Ragged((doc_kept + 1).astype(np.int32), doc_offsets)
        per_token[BRANCH_IDS] = Ragged((branch[kept] + 1).astype(np.int32), doc_offsets)
        per_token[LOGITS_INDEX] = Ragged((predictor + 1).astype(np.int64), doc_offsets)
        per_token[SEQUENCE_INDEX] = Ragged((sequence_index[kept] + 1).astype(np.int64), doc_offsets)
        if POSITIONS in per_token and self.positions_key != POSITIONS:
            per_token[self.positions_key] = per_token.pop(POSITIONS)
        stacked = self.flat(per_token) if self.options.padding_free else self.padded(per_token, names)
        data = stacked.data
        for name in SEQUENCE_MAP:
            data[name] = data[name] - 1
        specs = {spec.name: spec for spec in self.options.floats}
        for name in batch.floats:
            if name in specs:
                data[name] = in_float(data[name], specs[name])
        for name, scalars in batch.per_sequence.items():
            data[name] = in_float(np.asarray(scalars), specs[name]) if name in specs else scalars
        for name, extra in batch.extras.items():
            data[name] = np.asarray(extra)
        data[NUM_SEQUENCES] = np.array(batch.count, dtype=np.int64)
        return stacked
