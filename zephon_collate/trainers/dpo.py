"""Packed padding-free DPO inside TRL's ``DPOTrainer``: change the class, keep everything else."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from trl.trainer.dpo_trainer import DPOTrainer

from zephon_collate.core.checks import check_bool
from zephon_collate.core.keys import ATTENTION_MASK, INPUT_IDS
from zephon_collate.core.text import shown
from zephon_collate.trainers.view import PACKED, ROWS, pack_view, packed_base, wrap_forward

__all__ = ["PackedDPOTrainer", "PackedPreference"]

_COMPLETION_MASK = "completion_mask"


class PackedPreference:
    """TRL's preference batch, plus its sequences packed (the :func:`~zephon_collate.trainers.view.pack_view`
    dict, under ``"packed"``): a ``collate_fn``, and how :class:`PackedDPOTrainer` packs each batch it trains.

    Parameters:
        view: the collator of TRL's right-padded ``[2P, L]`` batch (``DataCollatorForPreference``).
        rows: ``"one"``: every sequence in one row (FlashAttention); ``"fit"``: best-fit into rows as
            wide as the longest (SDPA, eager).
        shared_prompt: lay each pair's prompt out once, the responses after it in branches (a 4-D mask).

    Example:
        >>> import torch
        >>> def view(examples):
        ...     return {"input_ids": torch.tensor([[5, 6, 7], [5, 9, 0]]),
        ...             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        ...             "completion_mask": torch.tensor([[0, 1, 1], [0, 1, 0]])}
        >>> packed = PackedPreference(view)([])["packed"]
        >>> packed["input_ids"].tolist(), packed["shift_labels"].tolist()
        ([[5, 6, 7, 5, 9]], [[6, 7, -100, 9, -100]])
    """

    def __init__(
        self,
        view: Callable[[list[dict[str, Any]]], Mapping[str, Any]],
        rows: Literal["one", "fit"] = "one",
        *,
        shared_prompt: bool = False,
    ) -> None:
        if rows not in ROWS:
            raise ValueError(f"PackedPreference: rows must be 'one' or 'fit', got {shown(rows)}")
        self.view, self.rows = view, rows
        self.shared_prompt = check_bool("shared_prompt", shared_prompt, owner="PackedPreference")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return self.with_packed(self.view(examples))

    def with_packed(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch`` (TRL's preference batch, on any device) and its sequences packed, on its device."""
        missing = [key for key in (INPUT_IDS, ATTENTION_MASK, _COMPLETION_MASK) if key not in batch]
        if missing:
            raise ValueError(
                f"PackedPreference: the view's batch lacks {shown(missing)} (it has {shown(sorted(batch))}); "
                "give TRL's DataCollatorForPreference, which writes input_ids, attention_mask and "
                "completion_mask"
            )
        device = batch[INPUT_IDS].device  # packed on the host (the layout is NumPy's), then moved
        host = (batch[key].cpu() for key in (INPUT_IDS, ATTENTION_MASK, _COMPLETION_MASK))
        packed = {key: value.to(device) for key, value in self.packed(*host).items()}
        return {**batch, PACKED: packed}

    def packed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The rows of a right-padded batch, packed."""
        filled = torch.arange(attention_mask.shape[1]) < attention_mask.sum(dim=1)[:, None]
        holes = (attention_mask.bool() != filled).any(dim=1).nonzero()
        if holes.numel():
            row = int(holes[0, 0])
            raise ValueError(
                f"PackedPreference: row {row}'s attention_mask is not ones then zeros "
                f"({shown(attention_mask[row].tolist())}); the view must pad on the right, as TRL's "
                "DataCollatorForPreference does"
            )
        return pack_view(
            input_ids,
            attention_mask,
            completion_mask,
            self.rows,
            "PackedPreference",
            shared_prompt=self.shared_prompt,
        )


class PackedDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` on packed rows, taking its arguments unchanged (``docs/post_training.md``).

    Parameters:
        shared_prompt: lay each pair's prompt out once, both responses after it (SDPA or eager attention;
            FlashAttention and an MoE's load-balancing loss are refused).

    Example:
        >>> from zephon_collate.trainers import PackedDPOTrainer  # doctest: +SKIP
        >>> PackedDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, shared_prompt: bool = False, **kwargs: Any) -> None:
        shared_prompt = check_bool("shared_prompt", shared_prompt, owner="PackedDPOTrainer")
        super().__init__(*args, **kwargs)
        base, rows = packed_base(self, "PackedDPOTrainer", shared_prompt)
        self.packing = PackedPreference(self.data_collator, rows=rows, shared_prompt=shared_prompt)
        wrap_forward(base)
        if self.ref_model is not None:
            wrap_forward(self.accelerator.unwrap_model(self.ref_model))

    def compute_loss(
        self,
        model: Any,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """TRL's loss, the batch packed here: after accelerate has dispatched it, which slices every
        tensor by rows (a packed view's token tables would not survive it)."""
        packed = self.packing.with_packed(inputs)
        return super().compute_loss(model, packed, return_outputs, num_items_in_batch)  # type: ignore[no-untyped-call]
