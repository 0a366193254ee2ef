"""PreferenceCollator: tokenized preference pairs in, one exact batch of their chosen and rejected sequences.

``Collator.for_preference(...)`` takes TRL-format pairs, ``prompt_input_ids``,
``chosen_input_ids`` and ``rejected_input_ids`` (or TRL 1.x's ``prompt_ids``,
``chosen_ids``, ``rejected_ids``), with optional per-side padding masks
(``prompt_attention_mask``, ``chosen_attention_mask``, ``rejected_attention_mask``:
1 on tokens, 0 on padding, which is dropped, on either end) and optional
precomputed reference log-probs (``ref_chosen_logps``, ``ref_rejected_logps``,
one number per pair), and returns the ``for_transformers`` keys of the
sequences ``prompt + chosen`` and ``prompt + rejected`` (labels -100 on the
prompt), ``chosen_index`` / ``rejected_index`` (int64 ``[num_pairs]``, each
side's sequence index) and the sequence map (:mod:`._sequences`).

The sequences are numbered in one order in every layout, TRL's
``DataCollatorForPreference`` order: every chosen sequence first, then every
rejected one (``chosen_index = [0 .. P-1]``, ``rejected_index = [P .. 2P-1]``),
so a per-sequence result (``sequence_logprobs(...).sums``, ``unpack``) splits
with ``.chunk(2)`` into chosen and rejected in any layout:

- **padded** (the default): ``[2 * num_pairs, L]``, a row per sequence, in that order;
- **padding-free** (``padding_free=True``): ``[1, N]``, the sequences end to end in
  that order, with ``position_ids`` (and ``cu_seq_lens_*``/``max_length_*``,
  ``seq_idx`` when asked);
- **shared prompt** (``shared_prompt=True``, either layout): each prompt once,
  both responses after it (laid out pair by pair, numbered as above),
  attending to the prompt and to themselves only; pass
  the attention from ``document_ids``/``branch_ids`` to the model
  (:func:`~zephon_collate.functional.attention.dense_branch_mask` for SDPA,
  :func:`~zephon_collate.functional.attention.branch_block_mask` for
  FlexAttention), and score tokens with :func:`zephon_collate.losses.token_logprobs`,
  which reads ``logits_index``: a model's own loss shifts by one position and
  cannot see that a rejected response follows the prompt, not the chosen one.

Every sequence is kept apart whatever the padding of either side: the
sequence map is built from each side's own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch

from zephon_collate._checks import suggest_options
from zephon_collate._read import (
    Ragged,
    as_numpy,
    check_ids,
    check_zero_one,
    concat,
    gather_spans,
    read_field,
    to_row,
)
from zephon_collate._text import shown, shown_fields
from zephon_collate.collate._native import Stacked
from zephon_collate.collate._plan import Plans
from zephon_collate.collate._sequences import SequenceBatch, SequenceOptions, Sequences
from zephon_collate.collate.collator import Collator, CollatorOptions
from zephon_collate.collate.hf import TRANSFORMERS_COLLATOR_OPTIONS, as_examples
from zephon_collate.fields import FloatField, read_floats
from zephon_collate.keys import (
    CHOSEN_ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INDEX,
    CHOSEN_INPUT_IDS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    REF_CHOSEN_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_ATTENTION_MASK,
    REJECTED_IDS,
    REJECTED_INDEX,
    REJECTED_INPUT_IDS,
)
from zephon_collate.records import SampleRecord
from zephon_collate.transforms import Transform

__all__ = ["PREFERENCE_OPTION_NAMES", "Preference", "PreferenceCollator", "PreferenceOptions"]

_OWNER = "Collator.for_preference"
_SIDES = (
    ("prompt", PROMPT_INPUT_IDS, PROMPT_IDS, PROMPT_ATTENTION_MASK),
    ("chosen", CHOSEN_INPUT_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK),
    ("rejected", REJECTED_INPUT_IDS, REJECTED_IDS, REJECTED_ATTENTION_MASK),
)
_REFERENCE = (REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS)
_FIELDS = (*(name for side in _SIDES for name in side[1:]), *_REFERENCE)


def _names(index: int) -> str:
    return f"example {index}"


@dataclass(frozen=True, kw_only=True)
class PreferenceOptions(SequenceOptions):
    """The layout options of :class:`PreferenceCollator`, checked once (see it for each one).

    Raises:
        TypeError, ValueError: for a value of the wrong type, or options that contradict each other.
    """

    OWNER: ClassVar[str] = _OWNER


PREFERENCE_OPTION_NAMES = PreferenceOptions.names()
""":class:`PreferenceCollator`'s layout keywords, in its signature's order."""


def _spelling(examples: Sequence[Mapping[str, Any]], side: str, new: str, old: str) -> str:
    """The name the examples give a side (``chosen_input_ids`` or TRL 1.x's ``chosen_ids``)."""
    first = examples[0]
    if new in first:
        return new
    if old in first:
        return old
    raise ValueError(
        f"{_names(0)}: has no {side} tokens: neither {shown(new)} nor {shown(old)} (its fields: "
        f"{shown_fields(first)}); tokenize the pairs first (prompt, chosen and rejected token ids)"
    )


_UNREAD_LABELS = ("chosen_labels", "rejected_labels")
"""open-instruct's packed-DPO labels (full sequences, -100 on the prompt), which this layout does not read."""


def _check_unread(examples: Sequence[Mapping[str, Any]]) -> None:
    """Refuse open-instruct's ``chosen_labels`` / ``rejected_labels``: this layout makes the labels from the
    sides (-100 on the prompt), so labels of their own would be dropped, and full-sequence ``chosen`` ids
    beside a prompt would lay the prompt out twice, its copy trained."""
    for index, example in enumerate(examples):
        for name in _UNREAD_LABELS:
            if name in example:
                raise ValueError(
                    f"{_names(index)}: carries {shown(name)} (open-instruct's packed DPO format: whole "
                    "sequences with -100 on the prompt), which this collator does not read: it lays out "
                    "prompt + chosen and prompt + rejected and makes the labels itself (-100 on the prompt). "
                    "Give the prompt, chosen and rejected token ids apart (TRL's format: the chosen and "
                    f"rejected ids without the prompt) and drop {shown(name)}"
                )


def _check_spellings_agree(examples: Sequence[Mapping[str, Any]], new: str, old: str) -> None:
    """Refuse a pair that spells a side both ways (``prompt_input_ids`` and TRL 1.x's ``prompt_ids``) with
    different tokens: one of them would be used without a word."""
    for index, example in enumerate(examples):
        if new in example and old in example:
            first = np.asarray(as_numpy(to_row(example[new], _names(index), new, "ids"))).reshape(-1)
            second = np.asarray(as_numpy(to_row(example[old], _names(index), old, "ids"))).reshape(-1)
            if not np.array_equal(first, second):
                raise ValueError(
                    f"{_names(index)}: carries both {shown(new)} and {shown(old)} (two spellings of one "
                    "side) with different tokens, so it is not clear which to train; keep one of them"
                )


def _kept(mask: Ragged, name: str) -> np.ndarray:
    """``[N]`` booleans: the tokens a side's padding mask keeps (one run of 1s, padding on either end)."""
    check_zero_one(mask, name, _names, "1 on tokens, 0 on padding")
    keep = np.asarray(mask.values) != 0
    opens = keep.copy()
    opens[1:] &= ~keep[:-1]
    opens[mask.offsets[:-1][mask.lengths > 0]] = keep[mask.offsets[:-1][mask.lengths > 0]]
    runs = np.bincount(np.repeat(np.arange(mask.rows), mask.lengths), weights=opens, minlength=mask.rows)
    if (runs > 1).any():
        index = int(np.flatnonzero(runs > 1)[0])
        raise ValueError(
            f"{_names(index)}: {shown(name)} has a 0 between 1s (a hole); a side's padding mask is 1 on its "
            "tokens and 0 on padding before or after them"
        )
    return np.asarray(keep)


@dataclass(frozen=True)
class Preference(Sequences):
    """The preference layout: pairs to their sequences (see the module doc)."""

    owner: ClassVar[str] = _OWNER
    item: ClassVar[str] = "pair"

    def read(self, features: object) -> list[Stacked]:
        """Read, check and lay out the pairs.

        Raises:
            TypeError, ValueError: for a bad pair, naming the example, the field and the fix.
        """
        key = CHOSEN_IDS if isinstance(features, Mapping) and CHOSEN_IDS in features else CHOSEN_INPUT_IDS
        examples = as_examples(features, (*_FIELDS, *_UNREAD_LABELS), key=key, owner=_OWNER)
        if not examples:
            raise ValueError(f"{_OWNER}: the batch holds no pairs")
        for index, example in enumerate(examples):
            if isinstance(example, SampleRecord) or not isinstance(example, Mapping):
                raise TypeError(
                    f"{_names(index)}: must be a dict of a pair's token ids (prompt_input_ids, "
                    f"chosen_input_ids, rejected_input_ids), got {type(example).__name__}"
                )
        _check_unread(examples)
        sides = []
        for side, new, old, mask_name in _SIDES:
            name = _spelling(examples, side, new, old)
            _check_spellings_agree(examples, new, old)
            rows = read_field(examples, name, name, "ids", _names, required=True) or []
            for index, row in enumerate(rows):
                if row.ndim != 1:
                    raise ValueError(
                        f"{_names(index)}: {shown(name)} must be one row of token ids, got shape "
                        f"{tuple(row.shape)}"
                    )
            tokens = concat([as_numpy(row) for row in rows], name, _names)
            check_ids(tokens, name, _names)
            tokens = tokens.cast(torch.int64)
            masks = read_field(examples, mask_name, mask_name, "values", _names, required=False)
            if masks is not None:
                for index, row in enumerate(masks):
                    if row.ndim != 1 or row.shape[0] != tokens.lengths[index]:
                        raise ValueError(
                            f"{_names(index)}: {shown(mask_name)} has shape {tuple(row.shape)}, but "
                            f"{shown(name)} has {int(tokens.lengths[index])} tokens; give one value per token"
                        )
                tokens = tokens.select(
                    _kept(concat([as_numpy(m) for m in masks], mask_name, _names), mask_name)
                )
            sides.append(tokens)
        extras = self._reference(examples)
        return [self.layout(self._sequences(sides[0], sides[1], sides[2], extras))]

    def _reference(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """The reference log-probs of both sides: float32 ``[num_pairs]`` each, when the pairs have them."""
        found: dict[str, np.ndarray] = {}
        ones = np.ones(len(examples), dtype=np.int64)
        for name in _REFERENCE:
            rows = read_field(examples, name, name, "values", _names, required=False)
            if rows is not None:
                values = cast(
                    list[np.ndarray], read_floats(rows, ones, FloatField(name, align="sequence"), _names)
                )
                found[name] = np.stack(values).astype(np.float32)
        if len(found) == 1:
            given = next(iter(found))
            other = next(name for name in _REFERENCE if name != given)
            raise ValueError(
                f"{_OWNER}: the pairs carry {shown(given)} but not {shown(other)}; give both, or neither"
            )
        return found

    def _sequences(
        self, prompts: Ragged, chosen: Ragged, rejected: Ragged, extras: dict[str, np.ndarray]
    ) -> SequenceBatch:
        """The ``prompt + chosen`` and ``prompt + rejected`` sequences, in this layout's order."""
        pairs = prompts.rows
        # One sequence order in every layout, TRL's: every chosen sequence, then every rejected one. A shared
        # prompt lays each pair's sequences out together (its prompt once), numbered in that order still.
        interleaved = self.shared_prompt
        order = np.arange(2 * pairs)
        pair, side = (order // 2, order % 2) if interleaved else (order % pairs, order // pairs)
        pool = np.concatenate(
            [np.asarray(prompts.values), np.asarray(chosen.values), np.asarray(rejected.values)]
        )
        first_c, first_r = prompts.values.shape[0], prompts.values.shape[0] + chosen.values.shape[0]
        response_start = np.where(side == 0, first_c + chosen.offsets[pair], first_r + rejected.offsets[pair])
        response_length = np.where(side == 0, chosen.lengths[pair], rejected.lengths[pair])
        prompt_length = prompts.lengths[pair]
        starts = np.stack([prompts.offsets[pair], response_start], axis=1).reshape(-1)
        lengths = np.stack([prompt_length, response_length], axis=1).reshape(-1)
        tokens = pool[gather_spans(starts, lengths)]
        supervised = np.repeat(np.tile([False, True], 2 * pairs), lengths)
        offsets = np.concatenate([[0], np.cumsum(prompt_length + response_length)]).astype(np.int64)
        index = np.arange(pairs, dtype=np.int64)
        return SequenceBatch(
            Ragged(tokens, offsets),
            Ragged(supervised, offsets),
            prompt_length.astype(np.int64),
            extras={CHOSEN_INDEX: index, REJECTED_INDEX: pairs + index, **extras},
            numbering=(side * pairs + pair).astype(np.int64) if interleaved else None,
        )


class PreferenceCollator(Collator):
    """The ``collate_fn`` of :meth:`Collator.for_preference`: preference pairs to an exact DPO batch.

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``; it gives ``pad_token_id`` where not passed.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        shared_prompt: lay each pair out as its prompt once, then both responses (see the module doc).
        pad_token_id: the id padding gets; required for the padded layout.
        pad_to_multiple_of: round the padded length (or, padding-free, the row's length) up to a
            multiple of this.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared prompt, where they
            are needed; a shared prompt cannot do without them).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free,
            unshared: a varlen kernel cannot express a shared prompt).
        return_seq_idx: emit ``seq_idx`` (padding-free, unshared).
        device, compile, num_boundaries, python_scalars, transforms, chain: as for :class:`Collator`.

    Returns (from a call on a list of pairs, or a batched dict of lists):
        ``input_ids``, ``attention_mask`` (padded, unshared), ``labels``, ``position_ids`` (when emitted), the
        flash-attention keys (when asked), ``document_ids``, ``branch_ids``, ``logits_index``,
        ``sequence_index``, ``chosen_index``, ``rejected_index``, ``ref_chosen_logps`` /
        ``ref_rejected_logps`` (float32 ``[num_pairs]``, when the pairs carry them) and
        ``num_sequences``.

    Raises:
        TypeError, ValueError: for bad arguments, and for a bad pair, naming it and the fix.

    Example:
        >>> from zephon_collate import Collator
        >>> pairs = [
        ...     {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        ...     {"prompt_input_ids": [7, 8], "chosen_input_ids": [9], "rejected_input_ids": [10, 11, 12]},
        ... ]
        >>> batch = Collator.for_preference(pad_token_id=0)(pairs)
        >>> batch["input_ids"].tolist()
        [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0], [1, 2, 3, 6, 0], [7, 8, 10, 11, 12]]
        >>> batch["labels"].tolist()[0], batch["chosen_index"].tolist(), batch["rejected_index"].tolist()
        ([-100, -100, -100, 4, 5], [0, 1], [2, 3])
        >>> shared = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
        >>> shared["input_ids"].tolist(), shared["position_ids"].tolist()
        ([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], [[0, 1, 2, 3, 4, 3, 0, 1, 2, 2, 3, 4]])
        >>> shared["branch_ids"].tolist(), shared["logits_index"].tolist()
        ([[0, 0, 0, 1, 1, 2, 0, 0, 1, 2, 2, 2]], [[-1, 0, 1, 2, 3, 2, -1, 6, 7, 7, 9, 10]])
    """

    @suggest_options(_OWNER)
    def __init__(
        self,
        tokenizer: Any = None,
        *,
        padding_free: bool = False,
        shared_prompt: bool = False,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        return_position_ids: bool | None = None,
        return_flash_attn_kwargs: bool = False,
        return_seq_idx: bool = False,
        device: str | torch.device | None = None,
        compile: bool = False,
        num_boundaries: int | None = None,
        python_scalars: bool = True,
        transforms: Sequence[Transform] = (),
        chain: Sequence[Transform] | None = None,
    ) -> None:
        scope = locals()
        arguments = PreferenceOptions.arguments(scope)
        if arguments["pad_token_id"] is None and tokenizer is not None:
            arguments["pad_token_id"] = getattr(tokenizer, "pad_token_id", None)
        self.preference_options = PreferenceOptions(**arguments)
        self.settings = CollatorOptions(**{name: scope[name] for name in TRANSFORMERS_COLLATOR_OPTIONS})
        options = self.preference_options
        self.layout = Preference(
            options.transformers(), "right", self.settings.num_boundaries, shared_prompt=options.shared_prompt
        )
        self._plans = Plans()

    def __repr__(self) -> str:
        return f"{_OWNER}({self.preference_options}, settings={self.settings})"


Collator.for_preference = PreferenceCollator
