"""RolloutCollator: RL rollouts (a prompt and a completion, float fields) to one exact training batch.

``Collator.for_rollouts(...)`` takes one example per rollout, as RL stacks keep
them: ``input_ids`` (prompt + completion), a field that says which tokens are
the completion (``completion_mask``, ``loss_mask``, ``assistant_masks`` or
``labels`` with -100, every one given applied, as ``for_transformers`` does;
at least one is required; verl's ``response_mask`` too, which covers the row's
last tokens), an optional ``attention_mask`` (padding on either end,
dropped) and the ``float_fields`` named: per-token log-probs of the behaviour
policy, per-token rewards, or one number per rollout (a GRPO advantage,
``FloatField(name, align="sequence")``, broadcast to its tokens with
``broadcast=True``). It returns the ``for_transformers`` keys (padded
``[num_rollouts, L]`` or padding-free ``[1, N]``), each float field placed
with the unshifted labels (:mod:`zephon_collate.fields`), and the sequence
map (:mod:`._sequences`); sequence ``i`` is example ``i``.

The prompt of a rollout is its tokens before the first supervised one. With
``shared_prompt=True``, consecutive rollouts with the same prompt (a GRPO
group) share it: it is laid out once, each completion after it, attending to
the prompt and to itself only (the attention from ``document_ids`` and
``branch_ids``, :mod:`zephon_collate.functional.attention`), its positions
continuing from the prompt; a per-token float field must then agree on the
shared prompt (else the prompt is not shared), and a per-sequence one holds 0
there. Score tokens with :func:`zephon_collate.losses.token_logprobs`, which
reads ``logits_index``.

verl's rows are read as verl keeps them (``DataProto``, as a dict of
``[batch, ...]`` tensors or a list of rows): ``input_ids`` the prompt, left
padded, then the response, right padded; ``attention_mask`` 0 on both
paddings; ``position_ids`` counting the real tokens from 0 (read, and dropped:
a rollout is one sequence); ``response_mask`` and the per-token fields ``[batch, response_length]``,
declared ``FloatField(name, align="response")``: they cover each row's last
``response_length`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from zephon_collate.core.keys import (
    ASSISTANT_MASK,
    ASSISTANT_MASKS,
    ATTENTION_MASK,
    COMPLETION_MASK,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    POSITION_IDS,
    RESPONSE_MASK,
    TOKEN_TYPE_IDS,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.base import Stacked
from zephon_collate.layouts.sequences import SequenceBatch, SequenceOptions, Sequences, prompt_lengths
from zephon_collate.layouts.transformers import supervision
from zephon_collate.read.columns import Batch, Ragged, places, row_any
from zephon_collate.read.fields import TensorField, to_label_positions
from zephon_collate.read.rules import check_zero_one, kept_by_mask, response_aligned

__all__ = ["RolloutOptions", "Rollouts"]

_OWNER = "Collator.for_rollouts"
_SUPERVISING = (COMPLETION_MASK, LOSS_MASK, ASSISTANT_MASKS, ASSISTANT_MASK, LABELS, RESPONSE_MASK)


@dataclass(frozen=True, kw_only=True)
class RolloutOptions(SequenceOptions):
    """The options of :meth:`Collator.for_rollouts <zephon_collate.Collator.for_rollouts>`.

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``; it gives ``pad_token_id`` where not passed.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        shared_prompt: lay consecutive rollouts of one prompt out as the prompt once, then each
            completion (see the module doc).
        pad_token_id: the id padding gets; required for the padded layout.
        pad_to_multiple_of: round the padded length (or, padding-free, the row's length) up to a
            multiple of this.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared prompt).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free, unshared).
        return_seq_idx: emit ``seq_idx`` (padding-free, unshared).
        supervision: the field that marks the completion, required in every example
            (``"completion_mask"``, ``"loss_mask"``, ``"assistant_masks"``, ``"labels"``,
            ``"response_mask"``), or ``None``: every such field given is applied, and one is required.
        float_fields: float example fields (names or :class:`~zephon_collate.FloatField` specs).

    Raises:
        TypeError, ValueError: for a value of the wrong type, or options that contradict each other.
    """

    OWNER: ClassVar[str] = _OWNER
    supervision: str | None = None
    float_fields: Sequence[str | TensorField] = ()

    def __post_init__(self) -> None:
        if self.supervision is not None and self.supervision not in _SUPERVISING:
            raise ValueError(
                f"{_OWNER}: supervision must name the field that marks the completion, one of "
                f"{_SUPERVISING}, got {shown(self.supervision)}"
            )
        super().__post_init__()
        object.__setattr__(self, "float_fields", self.transformers().floats)


class Rollouts(Sequences):
    """The rollout layout: one sequence per example (see the module doc)."""

    OWNER: ClassVar[str] = _OWNER
    ITEM: ClassVar[str] = "rollout"
    UNIFORM_SUPERVISION: ClassVar[bool] = True
    READS_RESPONSE_MASK: ClassVar[bool] = True

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read, check and lay out the rollouts: supervision, padding dropped, float fields, sequences.

        Raises:
            TypeError, ValueError: for a bad rollout, naming it, the field and the fix.
        """
        fields, segments, per_sequence = self.fields(batch)
        names = batch.names
        tokens = fields[INPUT_IDS]
        if TOKEN_TYPE_IDS in fields:
            raise ValueError(
                f"{_OWNER}: the examples carry 'token_type_ids'; a rollout is one sequence (prompt and "
                "completion) for a causal LM: drop the field"
            )
        if segments is not None:
            raise ValueError(
                f"{_OWNER}: the examples carry 'seq_lengths' (several documents packed in one example); give "
                "one rollout per example, which this collator packs itself (padding_free=True)"
            )
        if not any(name in fields or name in batch for name in _SUPERVISING):
            raise ValueError(
                f"{_OWNER}: the examples carry none of {', '.join(_SUPERVISING)}, so nothing says which "
                "tokens are the completion; give a completion_mask (1 on completion tokens)"
            )
        supervised = supervision(fields, names)
        if RESPONSE_MASK in batch:  # verl's: the row's last tokens, with every other supervision given
            response = batch.get(RESPONSE_MASK, "values")
            assert response is not None
            check_zero_one(response, RESPONSE_MASK, names, "1 on the response tokens that are trained")
            placed = response_aligned(response, tokens.lengths, RESPONSE_MASK, names)
            supervised = Ragged(np.asarray(supervised.values) & (placed.host != 0), tokens.offsets)
        specs = self.options.floats
        floats = {spec.name: fields[spec.name] for spec in specs if spec.per_token}
        positions = fields.get(POSITION_IDS)
        if ATTENTION_MASK in fields:
            keep = kept_by_mask(fields[ATTENTION_MASK], ATTENTION_MASK, names)
            if not keep.all():
                tokens, supervised = tokens.select(keep), supervised.select(keep)
                floats = {name: values.select(keep) for name, values in floats.items()}
                positions = None if positions is None else positions.select(keep)
        if positions is not None:  # one sequence each (verl writes them so): they say nothing more
            wrong = np.flatnonzero(row_any(positions.host != places(positions.offsets), positions.offsets))
            if wrong.size:
                raise ValueError(
                    f"{names(int(wrong[0]))}: its positions ('position_ids' or 'positions') do not count its "
                    "tokens from 0 (padding dropped): several documents packed in one example; a rollout is "
                    "one sequence (prompt and completion): give one rollout per example, which this "
                    "collator packs itself (padding_free=True), or drop the field"
                )
        starts = places(tokens.offsets) == 0
        for spec in specs:
            if spec.align == "label":  # moved to the token each prediction is scored against
                floats[spec.name] = to_label_positions(floats[spec.name], starts, spec.fill)
        sequences = SequenceBatch(
            tokens,
            Ragged(np.asarray(supervised.values, dtype=bool), tokens.offsets),
            prompt_lengths(supervised),
            floats=floats,
            per_sequence={name: np.stack(values) for name, values in per_sequence.items()},
            broadcast=tuple(spec.name for spec in specs if spec.broadcast),
        )
        return [self.sequences(sequences, names)]
