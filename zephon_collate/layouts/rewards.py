"""RewardCollator: reward-model pairs in, TRL's reward batch out, and where each sequence's score is read.

``Collator.for_rewards(...)`` takes the pairs TRL's ``RewardTrainer`` trains on:
``chosen_ids`` and ``rejected_ids`` (or the older ``chosen_input_ids`` /
``rejected_input_ids``), each the whole sequence, prompt inside, with an optional
``margin`` (one number per pair) and optional per-side padding masks
(``chosen_attention_mask``, ``rejected_attention_mask``: 0 on padding, which is
dropped). A ``prompt_ids`` (or ``prompt_input_ids``) is put before both sides,
as ``RewardTrainer`` puts an explicit prompt before each side before it
tokenizes. OpenRLHF's reward pairs are read too: ``chosen_ids`` and
``reject_ids``, with ``extra`` the margin.

It returns what TRL's reward ``DataCollatorForPreference`` returns, key for key:
``input_ids`` and ``attention_mask`` ``[2P, L]``, every chosen sequence first,
then every rejected one, right-padded (``margin`` float32 ``[P]`` when the pairs
carry one), so ``RewardTrainer(data_collator=Collator.for_rewards(tokenizer))``
trains as with its own collator; plus ``last_token_index`` int64 ``[2P]``, the
place of each sequence's last token in the flattened ``input_ids``
(``hidden.flatten(0, 1)[last_token_index]`` reads its score), in the same order.
Padding-free (``padding_free=True``) the sequences lie end to end in one row
``[1, N]`` with ``position_ids`` restarting at each (and ``cu_seq_lens_*`` /
``seq_idx`` when asked), ``last_token_index`` places in that row: what
:class:`~zephon_collate.trainers.PackedRewardTrainer` feeds the model.

No per-token ``labels`` are emitted (a sequence-classification model given
labels computes a loss of its own), and no sequence map: TRL calls
``model(**batch)``. DPO pairs (reference log-probs, open-instruct's labels) are
refused, as are pairs whose sides are empty.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from zephon_collate.core.checks import check_int
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    CHOSEN_ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INPUT_IDS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    DOCUMENT_IDS,
    INPUT_IDS,
    INT32_MAX,
    LAST_TOKEN_INDEX,
    LOGITS_INDEX,
    LOSS_MASK,
    MARGIN,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_SEQUENCES,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    REF_CHOSEN_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_ATTENTION_MASK,
    REJECTED_IDS,
    REJECTED_INPUT_IDS,
    SEQ_IDX,
    SEQUENCE_INDEX,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.base import Settings, Stacked
from zephon_collate.layouts.preference import Preference
from zephon_collate.layouts.sequences import SequenceOptions, Sequences
from zephon_collate.read.columns import Batch, Names, Ragged, as_numpy
from zephon_collate.read.rules import refuse_media
from zephon_collate.transforms import (
    BoundaryMask,
    LastTokenIndex,
    LossMask,
    SeparatorLabels,
    Transform,
    UnshiftedLabels,
)

__all__ = ["RewardOptions", "Rewards"]

_OWNER = "Collator.for_rewards"
_OPENRLHF_REJECTED = "reject_ids"
"""OpenRLHF's rejected side (the prompt inside; ``extra``: the margin)."""
_DPO_ONLY = (REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS, "chosen_labels", "rejected_labels")
"""Fields only DPO pairs carry: reference log-probs (TRL), per-token labels (open-instruct)."""
_UNUSED = (DOCUMENT_IDS, BRANCH_IDS, LOGITS_INDEX, NUM_SEQUENCES, LOSS_MASK)
"""What the post-training layout writes that a reward batch does not hold."""
_LABEL_STEPS = (BoundaryMask, UnshiftedLabels, LossMask, SeparatorLabels)


@dataclass(frozen=True, kw_only=True)
class RewardOptions(SequenceOptions):
    """The options of :meth:`Collator.for_rewards <zephon_collate.Collator.for_rewards>`.

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``; it gives ``pad_token_id`` where not passed.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        pad_token_id: the id padding gets; required for the padded layout.
        pad_to_multiple_of: round the padded length (or, padding-free, the row's length) up to a
            multiple of this.
        return_position_ids: emit ``position_ids`` (default: padding-free only).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free).
        return_seq_idx: emit ``seq_idx`` (padding-free).
        max_length: refuse a pair with a sequence longer than this, as ``RewardTrainer`` drops such
            pairs when it prepares the dataset (a cut sequence would be scored at another token).
        last_token_skip_id: ``last_token_index`` reads each sequence's last token whose id is not
            this one (its first token where every one is): pass the model's ``config.pad_token_id``
            to read the token a ``transformers`` sequence-classification model pools when sequences
            end with the padding id (``pad_token = eos_token``). ``None``: the last token.

    Raises:
        TypeError, ValueError: for a value of the wrong type, or options that contradict each other.
    """

    OWNER: ClassVar[str] = _OWNER
    OWN: ClassVar[tuple[str, ...]] = ("shared_prompt", "tokenizer", "max_length", "last_token_skip_id")
    max_length: int | None = None
    last_token_skip_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_length is not None:
            check_int(_OWNER, "max_length", self.max_length, 1, INT32_MAX)
        if self.last_token_skip_id is not None:
            check_int(_OWNER, "last_token_skip_id", self.last_token_skip_id, 0)
        if self.shared_prompt is not False:
            raise ValueError(
                f"{_OWNER}: shared_prompt is not offered for reward pairs: a reward model scores each "
                "sequence whole (TRL's RewardTrainer calls model(**batch)); drop shared_prompt, or use "
                "Collator.for_preference(shared_prompt=True) for DPO pairs"
            )
        super().__post_init__()


class Rewards(Preference):
    """The reward layout: pairs to their whole sequences and each one's last token (see the module doc)."""

    OWNER: ClassVar[str] = _OWNER
    ITEM: ClassVar[str] = "pair"
    KEY: ClassVar[tuple[str, ...]] = (CHOSEN_IDS, CHOSEN_INPUT_IDS)
    ORDER: ClassVar[tuple[str | None, ...]] = (
        INPUT_IDS,
        ATTENTION_MASK,
        POSITION_IDS,
        CU_SEQ_LENS_Q,
        CU_SEQ_LENS_K,
        MAX_LENGTH_Q,
        MAX_LENGTH_K,
        SEQ_IDX,
        MARGIN,
        LAST_TOKEN_INDEX,
    )
    INTERNAL: ClassVar[frozenset[str]] = frozenset(
        {PADDING_LENGTH, POSITIONS, LOSS_MASK, PADDING_MASK, SEQUENCE_INDEX}
    )

    def __init__(self, options: RewardOptions, settings: Settings | None = None) -> None:
        self.reward_options = options  # the preset's own (``options`` becomes the underlying layout's)
        self.limit = options.max_length
        self.skip_id = options.last_token_skip_id
        Sequences.__init__(self, options, settings)  # no truncation options: Preference's cut is not read

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The ``transformers`` chain without its label steps (a reward batch has no labels), then
        :class:`~zephon_collate.transforms.LastTokenIndex`."""
        steps = [step for step in super().chain(keys) if not isinstance(step, _LABEL_STEPS)]
        return [*steps, LastTokenIndex(self.skip_id)]

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read, check and lay out the pairs.

        Raises:
            TypeError, ValueError: for a bad pair, naming the example, the field and the fix.
        """
        names = batch.names
        refuse_media(batch, self.OWNER)
        self._check_dicts(batch, "chosen_ids, rejected_ids")
        for name in _DPO_ONLY:
            if name in batch:
                index = int(np.flatnonzero(batch.carried(name))[0])
                raise ValueError(
                    f"{names(index)}: carries {shown(name)}, a field of DPO pairs; a reward pair is "
                    "chosen_ids and rejected_ids (each the whole sequence, prompt inside) and an optional "
                    f"margin: drop {shown(name)}, or collate DPO pairs with Collator.for_preference"
                )
        prompt_given = PROMPT_IDS in batch or PROMPT_INPUT_IDS in batch
        if _OPENRLHF_REJECTED in batch:
            chosen, rejected, margin = self._openrlhf_rewards(batch, prompt_given)
        else:
            chosen = self._side(batch, "chosen", CHOSEN_IDS, CHOSEN_INPUT_IDS, CHOSEN_ATTENTION_MASK)
            rejected = self._side(
                batch, "rejected", REJECTED_IDS, REJECTED_INPUT_IDS, REJECTED_ATTENTION_MASK
            )
            margin = self._margins(batch, MARGIN) if MARGIN in batch else None
        for side, name, tokens in (("chosen", CHOSEN_IDS, chosen), ("rejected", REJECTED_IDS, rejected)):
            empty = np.flatnonzero(tokens.lengths == 0)
            if empty.size:
                raise ValueError(
                    f"{names(int(empty[0]))}: its {side} side ({shown(name)}) holds no tokens (once its "
                    "padding is dropped), so the reward model has no token to score; drop such pairs"
                )
        if prompt_given:
            prompts = self._side(batch, "prompt", PROMPT_IDS, PROMPT_INPUT_IDS, PROMPT_ATTENTION_MASK)
        else:
            prompts = Ragged(np.zeros(0, dtype=np.int64), np.zeros(batch.rows + 1, dtype=np.int64))
        self._check_length(prompts, chosen, rejected, names)
        extras = {} if margin is None else {MARGIN: margin}
        stacked = self.sequences(self._sequences([(prompts, chosen), (prompts, rejected)], extras), names)
        for name in _UNUSED:
            stacked.data.pop(name, None)
        return [stacked]

    def _openrlhf_rewards(self, batch: Batch, prompt_given: bool) -> tuple[Ragged, Ragged, np.ndarray | None]:
        """OpenRLHF's reward pairs: ``chosen_ids`` and ``reject_ids``, whole sequences; ``extra``, the
        margin."""
        names = batch.names
        index = int(np.flatnonzero(batch.carried(_OPENRLHF_REJECTED))[0])
        other = next((name for name in (PROMPT_IDS, PROMPT_INPUT_IDS, MARGIN) if name in batch), None)
        if prompt_given or other is not None:
            raise ValueError(
                f"{names(index)}: carries {shown(_OPENRLHF_REJECTED)} (OpenRLHF's reward pairs: chosen_ids "
                f"and reject_ids, whole sequences, extra = the margin) beside {shown(other)} (TRL's "
                "format); give one format"
            )
        chosen = self._side(batch, "chosen", CHOSEN_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK)
        rejected = self._side(
            batch, "rejected", _OPENRLHF_REJECTED, _OPENRLHF_REJECTED, "reject_attention_mask"
        )
        return chosen, rejected, self._margins(batch, "extra") if "extra" in batch else None

    def _margins(self, batch: Batch, name: str) -> np.ndarray:
        """float32 ``[P]``: each pair's margin, one finite real number, in every pair."""
        names = batch.names
        lacking = batch.lacking(name)
        if lacking is not None:
            raise ValueError(
                f"{names(lacking)}: lacks {shown(name)}, which other pairs of the batch carry; give every "
                "pair a margin (0.0 for none), or none"
            )
        values = []
        for row, value in enumerate(batch.objects(name)):
            array = as_numpy(value) if isinstance(value, torch.Tensor) else None
            number = array.item() if array is not None and array.ndim == 0 else value
            if isinstance(number, (bool, np.bool_)) or not isinstance(number, numbers.Real):
                kind = "a tensor of shape " + str(tuple(array.shape)) if array is not None else shown(value)
                raise (ValueError if array is not None or _sized(value) else TypeError)(
                    f"{names(row)}: {shown(name)} is {kind}, but a pair's margin is one real number "
                    "(how much the chosen side should outscore the rejected one); give a float"
                )
            if not np.isfinite(float(number)):
                raise ValueError(
                    f"{names(row)}: {shown(name)} is {float(number)}, but a margin must be finite (it shifts "
                    "the loss: NaN or inf would make it NaN or constant); fix or drop the pair"
                )
            values.append(float(number))
        return np.array(values, dtype=np.float32)

    def _check_length(self, prompts: Ragged, chosen: Ragged, rejected: Ragged, names: Names) -> None:
        """Refuse a sequence longer than ``max_length`` (``RewardTrainer`` drops such pairs)."""
        limit = self.limit
        if limit is None:
            return
        for side, tokens in (("chosen", chosen), ("rejected", rejected)):
            total = prompts.lengths + tokens.lengths
            over = np.flatnonzero(total > limit)
            if over.size:
                index = int(over[0])
                raise ValueError(
                    f"{names(index)}: its {side} sequence has {int(total[index])} tokens, more than "
                    f"max_length={limit}; cut, a sequence would be scored at another token: drop such pairs "
                    "(RewardTrainer does when it prepares the dataset) or raise max_length"
                )


def _sized(value: Any) -> bool:
    """Is ``value`` a container of numbers (a list, an array) rather than a non-number?"""
    return isinstance(value, (list, tuple, np.ndarray))
