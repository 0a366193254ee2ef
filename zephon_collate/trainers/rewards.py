"""Packed reward-model training inside TRL's ``RewardTrainer`` (docs/post_training.md)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

from zephon_collate.collate.collator import Collator
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    CHOSEN_IDS,
    INPUT_IDS,
    LAST_TOKEN_INDEX,
    MARGIN,
    POSITION_IDS,
    REJECTED_IDS,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.presets import RewardOptions
from zephon_collate.trainers.view import check_packing, packed_rows, padded_rope, present
from zephon_collate.transforms import AttentionMask, PaddingMask

__all__ = ["PackedRewardTrainer", "PackedRewards", "wrap_score_forward"]

_OWNER = "PackedRewardTrainer"
_PADDED_WIDTH = "padded_width"
"""The packed batch's key (popped by the packed forward) of the padded batch's width."""
_READ = frozenset({INPUT_IDS, ATTENTION_MASK, POSITION_IDS, MARGIN, "use_cache", "return_dict"})
"""What the packed forward reads or may ignore: TRL's ``model(**batch, use_cache=False)``, and the
``return_dict`` PEFT's sequence-classification wrapper adds."""


class PackedRewards:
    """A padded reward batch (``[2P, T]``: the chosen sequences, then the rejected) with its sequences
    packed padding-free, ``attention_mask`` ones, ``last_token_index`` each sequence's scored token,
    ``padded_width`` ``T`` (a length-dependent RoPE picks its frequencies for it, as on the padded batch).

    Parameters:
        view: the collator of the padded batch: TRL's reward ``DataCollatorForPreference`` or a padded
            ``Collator.for_rewards``; its ``pad_to_multiple_of`` rounds the packed rows.
        skip_id: the model's ``pad_token_id``: each sequence is scored at its last token that is not it.
        rows: ``"one"``: the sequences in one row; ``"fit"``: best fit into rows as wide as the longest.

    Example:
        >>> from trl.trainer.reward_trainer import DataCollatorForPreference
        >>> packing = PackedRewards(DataCollatorForPreference(pad_token_id=0), skip_id=0)
        >>> batch = packing([{"chosen_ids": [5, 6], "rejected_ids": [7]}])
        >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["last_token_index"].tolist()
        ([[5, 6, 7]], [[0, 1, 0]], [1, 2])
    """

    def __init__(
        self, view: Callable[..., Mapping[str, Any]], skip_id: int | None, rows: Literal["one", "fit"] = "one"
    ) -> None:
        if isinstance(view, Collator) and isinstance(view.layout.options, RewardOptions):
            if view.layout.options.padding_free:
                raise ValueError(
                    f"{_OWNER}: data_collator is Collator.for_rewards(padding_free=True); give the padded "
                    "collator (the trainer packs its batches itself)"
                )
            if view.settings.transforms or view.settings.chain is not None:
                raise ValueError(
                    f"{_OWNER}: data_collator runs transforms of yours, on the padded batch the trainer "
                    "packs again, so their outputs would not reach the model; drop them, or train with "
                    "RewardTrainer"
                )
            options = view.layout.options
            tokenizer, multiple, pad_id = options.tokenizer, options.pad_to_multiple_of, options.pad_token_id
        elif isinstance(view, DataCollatorForPreference):
            tokenizer, multiple, pad_id = None, view.pad_to_multiple_of, view.pad_token_id
        else:
            raise TypeError(
                f"{_OWNER}: packs the pairs itself, so data_collator must be TRL's reward "
                "DataCollatorForPreference (the default) or Collator.for_rewards(...), got "
                f"{type(view).__name__}; drop data_collator, or train with RewardTrainer"
            )
        self.view = view
        self.packer = Collator.for_rewards(
            tokenizer,
            padding_free=True,
            pad_token_id=pad_id,
            pad_to_multiple_of=multiple,
            last_token_skip_id=skip_id,
            max_row_tokens="longest" if rows == "fit" else None,
            transforms=[PaddingMask(), AttentionMask()],
        )

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return self.packed(self.view(examples))

    def packed(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch``'s sequences packed, on its device, its ``margin`` kept."""
        ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
        host_ids, host_mask = ids.cpu(), mask.cpu().bool()
        lengths = host_mask.sum(dim=1)
        first = host_mask.int().argmax(dim=1)
        columns = torch.arange(host_mask.shape[1])
        span = (columns >= first[:, None]) & (columns < (first + lengths)[:, None])
        holes = (host_mask != span).any(dim=1).nonzero()
        if holes.numel() or host_mask.shape[0] % 2:
            row = int(holes[0, 0]) if holes.numel() else host_mask.shape[0]
            raise ValueError(
                f"{_OWNER}: the padded batch's row {row} is not one span of tokens, or the batch has an odd "
                f"number of rows ({host_mask.shape[0]}); give TRL's DataCollatorForPreference, which pads "
                "each sequence on the right, the chosen ones first"
            )
        sequences = [host_ids[row][host_mask[row]] for row in range(host_ids.shape[0])]
        pairs = len(sequences) // 2
        packed = self.packer(
            [{CHOSEN_IDS: sequences[i], REJECTED_IDS: sequences[pairs + i]} for i in range(pairs)]
        )
        out: dict[str, Any] = {key: value.to(ids.device) for key, value in packed.items()}
        out[_PADDED_WIDTH] = ids.shape[1]  # what a length-dependent RoPE reads on the padded batch
        if MARGIN in batch:
            out[MARGIN] = batch[MARGIN]
        return out


def wrap_score_forward(model: nn.Module) -> None:
    """Make ``model``'s forward run packed when the call carries ``last_token_index``, else its own."""
    original = model.forward
    if getattr(original, "_zephon_packed", False):
        return

    @functools.wraps(original.__func__)  # type: ignore[attr-defined]
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        index, width = kwargs.pop(LAST_TOKEN_INDEX, None), kwargs.pop(_PADDED_WIDTH, None)
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
        with padded_rope(self, width):
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
        self.packing = PackedRewards(self.data_collator, skip_id, packed_rows(base))
        wrap_score_forward(base)

    def compute_loss(
        self,
        model: Any,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """TRL's loss, the batch packed here: after accelerate has dispatched it, which slices every
        tensor by rows (a packed batch's ``last_token_index`` would not survive it)."""
        packed = self.packing.packed(inputs)
        return super().compute_loss(model, packed, return_outputs, num_items_in_batch)  # type: ignore[no-untyped-call]
