"""Packed reward-model training inside TRL's ``RewardTrainer`` (docs/post_training.md)."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

from zephon_collate.collate.collator import Collator
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    CHOSEN_ATTENTION_MASK,
    INPUT_IDS,
    LAST_TOKEN_INDEX,
    MARGIN,
    POSITION_IDS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    REJECTED_ATTENTION_MASK,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.presets import RewardOptions
from zephon_collate.layouts.trees import Trees
from zephon_collate.trainers.view import check_packing, packed_rows, present
from zephon_collate.transforms import AttentionMask, PaddingMask

__all__ = ["PackedRewardTrainer", "packed_rewards", "wrap_score_forward"]

_OWNER = "PackedRewardTrainer"
_READ = frozenset({INPUT_IDS, ATTENTION_MASK, POSITION_IDS, MARGIN, "use_cache", "return_dict"})
"""What the packed forward reads or may ignore: TRL's ``model(**batch, use_cache=False)``, and the
``return_dict`` PEFT's sequence-classification wrapper adds."""
_UNREAD_BY_TRL = (
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    PROMPT_ATTENTION_MASK,
    CHOSEN_ATTENTION_MASK,
    REJECTED_ATTENTION_MASK,
)
"""Fields ``Collator.for_rewards`` reads and TRL's reward collator ignores (it reads the two sides, each
the whole sequence, and ``margin``): standing in for TRL's, they are refused, not read otherwise."""


def packed_rewards(
    view: Callable[..., Mapping[str, Any]], skip_id: int | None, rows: Literal["one", "fit"] = "one"
) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """The padding-free ``Collator.for_rewards`` standing in for ``view``, with ``attention_mask`` ones.

    Standing in for TRL's collator, it refuses the fields that one does not read (``prompt_ids``, the
    per-side attention masks), which ``Collator.for_rewards`` would.

    Parameters:
        view: TRL's reward ``DataCollatorForPreference`` or a ``Collator.for_rewards`` collator.
        skip_id: the model's ``pad_token_id``: each sequence is scored at its last token that is not it.
        rows: ``"one"``: the sequences in one row; ``"fit"``: best fit into rows as wide as the longest.

    Example:
        >>> from trl.trainer.reward_trainer import DataCollatorForPreference
        >>> collate = packed_rewards(DataCollatorForPreference(pad_token_id=0), skip_id=0)
        >>> batch = collate([{"chosen_ids": [5, 6], "rejected_ids": [7]}])
        >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["last_token_index"].tolist()
        ([[5, 6, 7]], [[0, 1, 0]], [1, 2])
    """
    masks = [PaddingMask(), AttentionMask()]
    if isinstance(view, Collator) and isinstance(view.layout.options, RewardOptions):
        options = dataclasses.replace(
            view.layout.options,
            padding_free=True,
            return_position_ids=True,
            return_flash_attn_kwargs=False,
            return_seq_idx=False,
            last_token_skip_id=skip_id,
            max_row_tokens="longest" if rows == "fit" else None,
        )
        settings = dataclasses.replace(view.settings, transforms=[*masks, *view.settings.transforms])
        return Collator.of(Trees(options, settings))
    if isinstance(view, DataCollatorForPreference):
        collate = Collator.for_rewards(
            padding_free=True,
            pad_token_id=view.pad_token_id,
            pad_to_multiple_of=view.pad_to_multiple_of,
            last_token_skip_id=skip_id,
            max_row_tokens="longest" if rows == "fit" else None,
            transforms=masks,
        )
        return functools.partial(_read_as_trl, collate)
    raise TypeError(
        f"{_OWNER}: packs the pairs itself, so data_collator must be TRL's reward DataCollatorForPreference "
        f"(the default) or Collator.for_rewards(...), got {type(view).__name__}; drop data_collator, or "
        "train with RewardTrainer"
    )


def _read_as_trl(collate: Collator, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``collate(examples)``, refusing a field TRL's reward collator would not read."""
    for index, example in enumerate(examples):
        unread = [name for name in _UNREAD_BY_TRL if isinstance(example, Mapping) and name in example]
        if unread:
            raise ValueError(
                f"{_OWNER}: example {index} carries {shown(unread[0])}, which RewardTrainer's collator does "
                "not read (chosen_ids and rejected_ids are each the whole sequence, prompt inside) and the "
                "packed collator would (a prompt before both sides, a mask dropping padding): drop the "
                "column (remove_unused_columns=True does), or pass data_collator=Collator.for_rewards(...), "
                "which reads it (docs/post_training.md)"
            )
    return collate(examples)


def wrap_score_forward(model: nn.Module) -> None:
    """Make ``model``'s forward run packed when the call carries ``last_token_index``, else its own."""
    original = model.forward
    if getattr(original, "_zephon_packed", False):
        return

    @functools.wraps(original.__func__)  # type: ignore[attr-defined]
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        index = kwargs.pop(LAST_TOKEN_INDEX, None)
        if index is None:
            return original(*args, **kwargs)
        given = present(kwargs)  # PEFT passes Nones
        others = sorted(set(given) - _READ)
        if args or others or INPUT_IDS not in given or POSITION_IDS not in given:
            raise ValueError(
                f"{_OWNER}: a packed call (with last_token_index) takes input_ids and position_ids by "
                f"keyword, got {len(args)} positional arguments and {shown(sorted(given))}; the packed "
                "forward lays out no other input: collate with Collator.for_rewards(padding_free=True), "
                "or train such inputs with RewardTrainer"
            )
        decoder: Any = getattr(self, str(self.base_model_prefix))
        head: Any = self.score
        hidden = decoder(
            input_ids=given[INPUT_IDS], position_ids=given[POSITION_IDS], use_cache=False
        ).last_hidden_state
        out = SequenceClassifierOutputWithPast(logits=head(hidden.flatten(0, 1)[index.to(hidden.device)]))
        return out.to_tuple() if given.get("return_dict") is False else out

    forward._zephon_packed = True  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)


class PackedRewardTrainer(RewardTrainer):
    """``trl.RewardTrainer`` on packed rows, taking its arguments unchanged (``docs/post_training.md``).

    Example:
        >>> from zephon_collate.trainers import PackedRewardTrainer  # doctest: +SKIP
        >>> PackedRewardTrainer(model=model, args=RewardConfig(...), train_dataset=pairs)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
            raise ValueError(
                f"{_OWNER}: a prompt-learning PEFT adapter ({type(model.active_peft_config).__name__}) feeds "
                "the model inputs_embeds with virtual tokens, which the packed forward does not lay out; "
                "use a LoRA-style adapter, or train it with RewardTrainer"
            )
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
        if not isinstance(decoder, nn.Module) or not isinstance(getattr(base, "score", None), nn.Module):
            raise ValueError(
                f"{_OWNER}: {type(base).__name__} has no decoder under a score head (model."
                f"{getattr(base, 'base_model_prefix', '?')} and model.score, as transformers' "
                "...ForSequenceClassification models have), so its packed forward cannot be laid out; "
                "train it with RewardTrainer"
            )
        check_packing(decoder, _OWNER)
        skip_id = getattr(base.config.get_text_config(), "pad_token_id", None)
        self.data_collator = packed_rewards(self.data_collator, skip_id, packed_rows(base))
        wrap_score_forward(base)
