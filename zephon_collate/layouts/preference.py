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

TRL's unpaired (KTO) examples are read too: ``prompt_ids``, ``completion_ids``,
``label`` (one bool: is the completion desirable) and, for the KL term,
``KL_completion_ids`` (the prompt with a mismatched completion), with optional
``ref_logps`` / ``ref_KL_logps``. Their sequences are every ``prompt +
completion``, then every ``prompt + KL completion`` (``completion_index``,
``KL_index``: each example's sequence index); ``label`` comes out as bool
``[num_examples]``, apart from the per-token ``labels``. With a shared prompt,
an example's completion and KL completion follow its prompt laid out once.
Truncation cuts them as it cuts a pair's sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import numpy as np
import torch

from zephon_collate.core.checks import check_int
from zephon_collate.core.keys import (
    CHOSEN_ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INDEX,
    CHOSEN_INPUT_IDS,
    COMPLETION_IDS,
    COMPLETION_INDEX,
    IGNORE_INDEX,
    INT32_MAX,
    KL_COMPLETION_IDS,
    KL_INDEX,
    LABEL,
    LABELS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    REF_CHOSEN_LOGPS,
    REF_KL_LOGPS,
    REF_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_ATTENTION_MASK,
    REJECTED_IDS,
    REJECTED_INDEX,
    REJECTED_INPUT_IDS,
)
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.layouts.base import Settings, Stacked
from zephon_collate.layouts.sequences import SequenceBatch, SequenceOptions, Sequences, prompt_lengths
from zephon_collate.read.columns import Batch, Names, Ragged, as_numpy, gather_spans, places, row_any, row_of
from zephon_collate.read.fields import FloatField, read_floats
from zephon_collate.read.rules import SUPERVISING_FIELDS, check_flat, check_ids, kept_by_mask, refuse_media

__all__ = ["Preference", "PreferenceOptions"]

_OWNER = "Collator.for_preference"
_SIDES = (
    ("prompt", PROMPT_INPUT_IDS, PROMPT_IDS, PROMPT_ATTENTION_MASK),
    ("chosen", CHOSEN_INPUT_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK),
    ("rejected", REJECTED_INPUT_IDS, REJECTED_IDS, REJECTED_ATTENTION_MASK),
)
_REFERENCE = (REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS)
_FULL_LABELS = ("chosen_labels", "rejected_labels")
"""open-instruct's packed-DPO labels: whole sequences, -100 on the prompt."""
_UNPAIRED = (COMPLETION_IDS, LABEL, KL_COMPLETION_IDS)
"""The fields of TRL's unpaired (KTO) examples: any of them says the batch holds KTO examples."""
_OPENRLHF_REJECTED = "reject_ids"
"""OpenRLHF's rejected side (the prompt inside; ``extra``: the prompt's length)."""


@dataclass(frozen=True, kw_only=True)
class PreferenceOptions(SequenceOptions):
    """The options of :meth:`Collator.for_preference <zephon_collate.Collator.for_preference>`.

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
        max_prompt_length: cut each prompt to its last this many tokens (as TRL 0.x did: the end holds
            the chat template's turn header, next to the response).
        max_completion_length: cut each response to its first this many tokens.
        max_length: cut each sequence (prompt + response) to this many tokens, as TRL 1.16's
            ``DataCollatorForPreference`` does: its first (``"keep_start"``) or last (``"keep_end"``)
            ``max_length``. A pair whose prompt alone fills ``max_length`` under ``"keep_start"`` would
            train nothing, and is refused (TRL drops such pairs when it prepares the dataset).
        truncation_mode: ``"keep_start"`` (TRL's default) or ``"keep_end"``.

    Raises:
        TypeError, ValueError: for a value of the wrong type, or options that contradict each other.
    """

    OWNER: ClassVar[str] = _OWNER
    OWN: ClassVar[tuple[str, ...]] = (
        "shared_prompt", "tokenizer", "max_prompt_length", "max_completion_length", "max_length",
        "truncation_mode",
    )  # fmt: skip
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_completion_length", "max_length"):
            value = getattr(self, name)
            if value is not None:
                check_int(_OWNER, name, value, 1, INT32_MAX)
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(
                f"{_OWNER}: truncation_mode must be 'keep_start' or 'keep_end', got "
                f"{shown(self.truncation_mode)}"
            )
        if self.shared_prompt and self.max_length is not None and self.truncation_mode == "keep_end":
            raise ValueError(
                f"{_OWNER}: shared_prompt=True with max_length and truncation_mode='keep_end' would keep a "
                "different part of the prompt for each response (the longer one keeps less), so the prompt "
                "could not be shared; use truncation_mode='keep_start', max_prompt_length, or "
                "shared_prompt=False"
            )
        super().__post_init__()


class Preference(Sequences):
    """The preference layout: pairs to their sequences (see the module doc)."""

    def __init__(self, options: PreferenceOptions, settings: Settings | None = None) -> None:
        self.cut = options  # the truncation options, read before the pairs become sequences
        super().__init__(options, settings)

    OWNER: ClassVar[str] = _OWNER
    ITEM: ClassVar[str] = "pair"
    KEY: ClassVar[tuple[str, ...]] = (CHOSEN_INPUT_IDS, CHOSEN_IDS, COMPLETION_IDS)

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read, check and lay out the pairs.

        Raises:
            TypeError, ValueError: for a bad pair, naming the example, the field and the fix.
        """
        names = batch.names
        refuse_media(batch, self.OWNER)
        self._check_dicts(batch, "prompt_input_ids, chosen_input_ids, rejected_input_ids")
        prompt_given = PROMPT_INPUT_IDS in batch or PROMPT_IDS in batch
        labelled = [name for name in _FULL_LABELS if name in batch]
        if labelled and prompt_given:
            raise ValueError(
                f"{names(int(np.flatnonzero(batch.carried(labelled[0]))[0]))}: carries {shown(labelled[0])} "
                "(open-instruct's packed DPO format: whole sequences with -100 on the prompt) beside prompt "
                "ids (TRL's format: each side without the prompt), so it is not clear what the sides hold; "
                f"give one format: drop {shown(labelled[0])}, or drop the prompt ids"
            )
        unpaired = [name for name in _UNPAIRED if name in batch]
        if unpaired:
            return [self.sequences(self._unpaired(batch, unpaired[0]), names)]
        if labelled:
            prompts, chosen, rejected = self._labelled(batch)
        elif _OPENRLHF_REJECTED in batch:
            prompts, chosen, rejected = self._openrlhf(batch, prompt_given)
        else:
            prompts, chosen, rejected = (self._side(batch, *side) for side in _SIDES)
        sides = self._cut_sides(prompts, {"chosen": chosen, "rejected": rejected}, names)
        extras = {CHOSEN_INDEX: np.arange(batch.rows), REJECTED_INDEX: batch.rows + np.arange(batch.rows)}
        return [
            self.sequences(self._sequences(sides, {**extras, **self._reference(batch, _REFERENCE)}), names)
        ]

    def _check_dicts(self, batch: Batch, fields: str) -> None:
        """``TypeError`` naming the first example that is not a dict of token ids (``fields``: the expected
        ones, for the message); ``ValueError`` for a supervising field of one sequence (``labels``, a
        ``loss_mask``, ``completion_mask``, ``response_mask``, an ``attention_mask``) that would leave
        tokens untrained: a side's tokens are trained whole, so it would be lost."""
        for index, payload in enumerate(getattr(batch, "payloads", ())):
            if isinstance(payload, SampleRecord) or not hasattr(payload, "keys"):
                raise TypeError(
                    f"{batch.names(index)}: must be a dict of a pair's token ids ({fields}), got "
                    f"{type(payload).__name__}"
                )
        for name in SUPERVISING_FIELDS:
            if name not in batch:
                continue
            values = batch.get(name, "values", partial=True)
            assert values is not None
            untrained = (
                row_any(values.host != 1, values.offsets) if name != LABELS else np.ones(batch.rows, bool)
            )
            rows = np.flatnonzero(untrained & batch.carried(name))
            if rows.size:
                raise ValueError(
                    f"{batch.names(int(rows[0]))}: carries {shown(name)}, which this collator does not read: "
                    "each side's tokens are trained whole, so what it leaves out would be trained; give each "
                    "side (or completion) as the tokens to train, its padding in the side's own "
                    "*_attention_mask, and drop the field"
                )

    def _unpaired(self, batch: Batch, found: str) -> SequenceBatch:
        """TRL's KTO examples: a prompt, a completion, ``label`` (desirable or not) and, for the KL term, the
        prompt with a mismatched completion (``KL_completion_ids``): its sequences after every completion."""
        names = batch.names
        index = int(np.flatnonzero(batch.carried(found))[0])
        paired = [
            name for name in (CHOSEN_INPUT_IDS, CHOSEN_IDS, REJECTED_INPUT_IDS, REJECTED_IDS) if name in batch
        ]
        if paired or COMPLETION_IDS not in batch or LABEL not in batch:
            what = (
                f"beside {shown(paired[0])} (a pair's side)"
                if paired
                else f"without {shown(COMPLETION_IDS if COMPLETION_IDS not in batch else LABEL)}"
            )
            raise ValueError(
                f"{names(index)}: carries {shown(found)} (TRL's unpaired KTO format: prompt_ids, "
                f"completion_ids and a bool label per example) {what}; give one format: pairs (prompt, "
                "chosen and rejected ids) or KTO examples (prompt_ids, completion_ids, label)"
            )
        label = batch.objects(LABEL)
        for row, value in enumerate(label):
            if not isinstance(value, (bool, np.bool_)) and not (
                isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.ndim == 0
            ):
                raise ValueError(
                    f"{names(row)}: 'label' is {shown(value)}, but KTO's label is one bool per example "
                    "(True where the completion is desirable); give True or False (per-token labels belong "
                    "in 'labels', which this collator writes)"
                )
        prompts = self._side(batch, "prompt", PROMPT_INPUT_IDS, PROMPT_IDS, PROMPT_ATTENTION_MASK)
        responses = {
            "completion": self._side(
                batch, "completion", COMPLETION_IDS, COMPLETION_IDS, "completion_attention_mask"
            )
        }
        extras: dict[str, np.ndarray] = {
            COMPLETION_INDEX: np.arange(batch.rows),
            LABEL: np.array([bool(value) for value in label], dtype=bool),
        }
        references: tuple[str, ...] = (REF_LOGPS,)
        if KL_COMPLETION_IDS in batch:
            responses["KL"] = self._side(
                batch, "KL", KL_COMPLETION_IDS, KL_COMPLETION_IDS, "KL_attention_mask"
            )
            extras[KL_INDEX] = batch.rows + np.arange(batch.rows)
            references = (REF_LOGPS, REF_KL_LOGPS)
        elif REF_KL_LOGPS in batch:
            raise ValueError(
                f"{_OWNER}: the examples carry {shown(REF_KL_LOGPS)} but no {shown(KL_COMPLETION_IDS)}, "
                f"whose reference log-probs it holds; give both, or drop {shown(REF_KL_LOGPS)}"
            )
        sides = self._cut_sides(prompts, responses, names)
        return self._sequences(sides, {**extras, **self._reference(batch, references)})

    def _labelled(self, batch: Batch) -> tuple[Ragged, Ragged, Ragged]:
        """open-instruct's pairs: whole sequences, labels -100 on the prompt and the tokens after it. The
        prompt is each sequence's leading -100 run, one for both sides."""
        names = batch.names
        split: list[tuple[Ragged, Ragged]] = []
        for side, name, labels_name in (
            ("chosen", CHOSEN_INPUT_IDS, "chosen_labels"),
            ("rejected", REJECTED_INPUT_IDS, "rejected_labels"),
        ):
            if labels_name not in batch or name not in batch:
                raise ValueError(
                    f"{names(0)}: an open-instruct pair needs {shown(name)} and {shown(labels_name)} "
                    "for both "
                    f"sides (its fields: {shown_fields(dict.fromkeys(sorted(batch.fields)))})"
                )
            tokens = self._side(batch, side, name, name, f"{side}_attention_mask")
            labels = batch.get(labels_name, "ids")
            assert labels is not None
            if f"{side}_attention_mask" in batch:
                mask = batch.get(f"{side}_attention_mask", "values")
                assert mask is not None
                labels = labels.select(
                    kept_by_mask(Ragged(mask.host, mask.offsets), f"{side}_attention_mask", names)
                )
            bad = np.flatnonzero(labels.lengths != tokens.lengths)
            if bad.size:
                index = int(bad[0])
                raise ValueError(
                    f"{names(index)}: {shown(labels_name)} has {int(labels.lengths[index])} labels for "
                    f"{int(tokens.lengths[index])} tokens; give one label per token"
                )
            given = np.asarray(labels.host) != IGNORE_INDEX
            prompt = prompt_lengths(Ragged(given, labels.offsets))
            after = places(tokens.offsets) >= np.repeat(prompt, tokens.lengths)
            wrong = after & ((~given) | (np.asarray(labels.host) != np.asarray(tokens.host)))
            if wrong.any():
                index = row_of(tokens.offsets, int(np.flatnonzero(wrong)[0]))
                raise ValueError(
                    f"{names(index)}: {shown(labels_name)} is not -100 on a prompt, then the tokens: "
                    "a later turn "
                    "is -100 or a label differs from its token (open-instruct's multi-turn labels); this "
                    "collator trains the whole response after one prompt: label only the last turn "
                    "(open-instruct's preference_tulu_tokenize_and_truncate_v1_2)"
                )
            split.append((_kept(tokens, prompt, False), _kept(tokens, tokens.lengths - prompt, True)))
        (prompts, chosen), (other, rejected) = split
        if not np.array_equal(prompts.lengths, other.lengths) or not np.array_equal(prompts.host, other.host):
            same = (prompts.lengths == other.lengths) & np.array(
                [np.array_equal(prompts.row(i), other.row(i)) for i in range(prompts.rows)]
            )
            index = int(np.flatnonzero(~same)[0])
            raise ValueError(
                f"{names(index)}: its chosen and rejected sequences start with different prompts (the tokens "
                "before each side's first label); a pair's sides share one prompt"
            )
        return prompts, chosen, rejected

    def _openrlhf(self, batch: Batch, prompt_given: bool) -> tuple[Ragged, Ragged, Ragged]:
        """OpenRLHF's pairs: ``chosen_ids`` and ``reject_ids`` hold the prompt, ``extra`` its length."""
        names = batch.names
        index = int(np.flatnonzero(batch.carried(_OPENRLHF_REJECTED))[0])
        if prompt_given or "extra" not in batch:
            fix = (
                "beside prompt ids (TRL's format); give one format"
                if prompt_given
                else "without 'extra'; give each pair its prompt's length as 'extra'"
            )
            raise ValueError(
                f"{names(index)}: carries {shown(_OPENRLHF_REJECTED)} (OpenRLHF's pairs: chosen_ids and "
                f"reject_ids with the prompt inside, extra = the prompt's length) {fix}"
            )
        chosen = self._side(batch, "chosen", CHOSEN_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK)
        rejected = self._side(
            batch, "rejected", _OPENRLHF_REJECTED, _OPENRLHF_REJECTED, "reject_attention_mask"
        )
        extra = batch.objects("extra")
        for row, value in enumerate(extra):
            fits = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            if not fits or not 0 <= int(value) <= min(int(chosen.lengths[row]), int(rejected.lengths[row])):
                raise ValueError(
                    f"{names(row)}: 'extra' is {shown(value)}, but it must be the prompt's length: an "
                    "int from 0 "
                    "to the shorter side's length (OpenRLHF's DPO pairs; a reward model's margin is "
                    "not read here)"
                )
        prompt = np.array([int(value) for value in extra], dtype=np.int64)
        prompts, other = _kept(chosen, prompt, False), _kept(rejected, prompt, False)
        if not np.array_equal(prompts.host, other.host):
            same = np.array([np.array_equal(prompts.row(i), other.row(i)) for i in range(prompts.rows)])
            row = int(np.flatnonzero(~same)[0])
            raise ValueError(
                f"{names(row)}: chosen_ids and reject_ids differ in their first {int(prompt[row])} tokens "
                "('extra', the prompt's length); both must start with the prompt"
            )
        return (
            prompts,
            _kept(chosen, chosen.lengths - prompt, True),
            _kept(rejected, rejected.lengths - prompt, True),
        )

    def _cut_sides(
        self, prompts: Ragged, responses: dict[str, Ragged], names: Names
    ) -> list[tuple[Ragged, Ragged]]:
        """Each side's response (by name) with its prompt, cut as the options ask: ``[(prompt, response),
        ...]`` (each side its own prompt: ``keep_end`` may keep a different part of it for each)."""
        options = self.cut
        keep_end = options.truncation_mode == "keep_end"
        if options.max_prompt_length is not None:  # a prompt keeps its end, next to its response
            prompts = _kept(prompts, np.minimum(prompts.lengths, options.max_prompt_length), True)
        cut = options.max_completion_length
        if cut is not None:
            responses = {
                side: _kept(response, np.minimum(response.lengths, cut), False)
                for side, response in responses.items()
            }
        limit = options.max_length
        if limit is None:
            return [(prompts, response) for response in responses.values()]
        out: list[tuple[Ragged, Ragged]] = []
        for side, response in responses.items():
            total = prompts.lengths + response.lengths
            if keep_end:  # the sequence's last max_length tokens: the prompt gives up its start first
                cut = np.maximum(total - limit, 0)
                from_prompt = np.minimum(cut, prompts.lengths)
                out.append(
                    (
                        _kept(prompts, prompts.lengths - from_prompt, True),
                        _kept(response, response.lengths - (cut - from_prompt), True),
                    )
                )
                continue
            full = np.flatnonzero((prompts.lengths >= limit) & (response.lengths > 0))
            if full.size:
                index = int(full[0])
                raise ValueError(
                    f"{names(index)}: its prompt of {int(prompts.lengths[index])} tokens fills "
                    f"max_length={limit}, so none of the {side} response would be trained "
                    "(truncation_mode='keep_start'); drop such pairs (TRL does when it prepares the "
                    "dataset), raise max_length, or cut prompts with max_prompt_length"
                )
            kept = np.minimum(response.lengths, np.maximum(limit - prompts.lengths, 0))
            out.append((prompts, _kept(response, kept, False)))
        return out

    def _side(self, batch: Batch, side: str, new: str, old: str, mask_name: str) -> Ragged:
        """One side's tokens (either spelling; both given must agree), its padding dropped."""
        names = batch.names
        if new not in batch and old not in batch:
            raise ValueError(
                f"{names(0)}: has no {side} tokens: neither {shown(new)} nor {shown(old)} (its fields: "
                f"{shown_fields(dict.fromkeys(sorted(batch.fields)))}); tokenize the pairs first (prompt, "
                "chosen and rejected token ids)"
            )
        name = new if new in batch else old
        if new in batch and old in batch:
            given, other = batch.get(new, "ids", partial=True), batch.get(old, "ids", partial=True)
            assert given is not None and other is not None
            both = np.flatnonzero(batch.carried(new) & batch.carried(old))
            for index in both.tolist():
                if not np.array_equal(as_numpy(given.row(index)), as_numpy(other.row(index))):
                    raise ValueError(
                        f"{names(index)}: carries both {shown(new)} and {shown(old)} (two spellings of one "
                        "side) with different tokens, so it is not clear which to train; keep one of them"
                    )
        tokens = batch.get(name, "ids")
        assert tokens is not None
        check_flat(tokens, name, names)
        tokens = Ragged(tokens.host, tokens.offsets)
        check_ids(tokens, name, names)
        tokens = tokens.cast(torch.int64)
        if mask_name in batch:
            mask = batch.get(mask_name, "values")
            assert mask is not None
            bad = np.flatnonzero((mask.lengths != tokens.lengths) | (mask.values.ndim != 1))
            if bad.size:
                index = int(bad[0])
                raise ValueError(
                    f"{names(index)}: {shown(mask_name)} has shape {tuple(mask.row(index).shape)}, but "
                    f"{shown(name)} has {int(tokens.lengths[index])} tokens; give one value per token"
                )
            tokens = tokens.select(kept_by_mask(Ragged(mask.host, mask.offsets), mask_name, names))
        return tokens

    def _reference(self, batch: Batch, expected: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The reference log-probs of each side (``expected``: their names, all or none given): float32
        ``[num_examples]`` each, when the examples have them."""
        found: dict[str, np.ndarray] = {}
        ones = np.ones(batch.rows, dtype=np.int64)
        for name in expected:
            if name in batch:
                spec = FloatField(name, align="sequence")
                values = cast(
                    list[np.ndarray], read_floats(batch.per_row(name, "values"), ones, spec, batch.names)
                )
                found[name] = np.stack(values).astype(np.float32)
        if found and len(found) < len(expected):
            given = next(iter(found))
            other = next(name for name in expected if name not in found)
            raise ValueError(
                f"{_OWNER}: the examples carry {shown(given)} but not {shown(other)}; give both, or neither"
            )
        return found

    def _sequences(self, sides: list[tuple[Ragged, Ragged]], extras: dict[str, np.ndarray]) -> SequenceBatch:
        """The sequences ``prompt + response`` of every side (``sides``: each its prompts and responses,
        one per example), in this layout's order, with the batch-level ``extras``."""
        count, examples = len(sides), sides[0][0].rows
        # One sequence order in every layout, TRL's: every sequence of the first side, then of the next. A
        # shared prompt lays each example's sequences out together (its prompt once), numbered so still.
        interleaved = self.shared_prompt
        order = np.arange(count * examples)
        example, side = (
            (order // count, order % count) if interleaved else (order % examples, order // examples)
        )
        parts = [part for pair in sides for part in pair]
        firsts = np.cumsum([0] + [part.values.shape[0] for part in parts])[:-1]
        pool = np.concatenate([np.asarray(part.values) for part in parts])
        starts, lengths = [
            np.stack(
                [
                    firsts[k] + part.offsets[:-1] if which == 0 else part.lengths
                    for k, part in enumerate(parts)
                ]
            )
            for which in (0, 1)
        ]
        prompt_start, prompt_length = starts[2 * side, example], lengths[2 * side, example]
        response_start, response_length = starts[2 * side + 1, example], lengths[2 * side + 1, example]
        spans = np.stack([prompt_start, response_start], axis=1).reshape(-1)
        sizes = np.stack([prompt_length, response_length], axis=1).reshape(-1)
        tokens = pool[gather_spans(spans, sizes)]
        supervised = np.repeat(np.tile([False, True], count * examples), sizes)
        offsets = np.concatenate([[0], np.cumsum(prompt_length + response_length)]).astype(np.int64)
        return SequenceBatch(
            Ragged(tokens, offsets),
            Ragged(supervised, offsets),
            prompt_length.astype(np.int64),
            extras={
                name: value.astype(np.int64) if value.dtype.kind in "iu" else value
                for name, value in extras.items()
            },
            numbering=(side * examples + example).astype(np.int64) if interleaved else None,
        )


def _kept(field: Ragged, counts: np.ndarray, from_end: bool) -> Ragged:
    """Each row's first (or, ``from_end``, last) ``counts[row]`` values."""
    if bool((counts >= field.lengths).all()):
        return field
    place = places(field.offsets)
    if from_end:
        return field.select(place >= np.repeat(field.lengths - counts, field.lengths))
    return field.select(place < np.repeat(counts, field.lengths))
