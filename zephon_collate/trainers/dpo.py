"""Packed padding-free DPO inside TRL's ``DPOTrainer``: change the class, keep everything else.

TRL 1.16 computes every DPO loss type, the reference pass, LD-DPO, WPO and the
metrics in one method on a padded batch ``[2P, L]`` (the chosen rows, then the
rejected ones), and it reaches the model through one call:
``model(**batch, labels=labels, fused_lm_head=True)``, whose per-token outputs
(log-probs, entropy, mean logits, top-1 hits) are ``[2P, L - 1]``. Its own
``padding_free`` switch is disabled. :class:`PackedDPOTrainer` keeps TRL's code
whole and changes what that call runs::

    TRL's batch (the view)               the same sequences, packed
    chosen 0   p p p c c . .             one row: p p p c c | p c c c | p p p r | p r r .
    chosen 1   p c c c . . .             position_ids restart at 0 at each sequence;
    rejected 0 p p p r . . .             the transformer sees 14 tokens, not 28
    rejected 1 p r r . . . .

The collate function (:class:`PackedPreference`) returns TRL's batch as its own
collator builds it, plus the same sequences packed padding-free by
:meth:`Collator.for_rollouts <zephon_collate.Collator.for_rollouts>` (its
sequence map places every prediction) under ``"packed"``
(:func:`~zephon_collate.trainers.view.pack_view`). The model's forward, wrapped, runs the transformer on the
packed row (``position_ids`` keep the sequences apart, as transformers reads
packed rows) with TRL's fused head, then lays each per-token output back out
as the padded view: TRL's loss and metrics read exactly the values the padded
pass gives, every loss type and option included, for the policy, the
reference model and an adapter-disabled PEFT reference alike.

Not packed (TRL's own path runs): vision-language batches, prompt-learning
PEFT (virtual tokens), and any call without the packed batch.
``precompute_ref_log_probs`` runs once, in TRL's ``__init__``, on TRL's padded
batches. A model (or reference model) that lets packed sequences attend to each
other (OPT, BLOOM, MPT, GPT-OSS, Mamba, ...: their attention does not restart at
``position_ids`` 0) is refused when the trainer is built, with or without
``shared_prompt``; so, with ``shared_prompt=True``, is one whose layers a branch
mask cannot express, one that raises on it, and an MoE trained with its
load-balancing loss (``router_aux_loss_coef=0.0`` turns it off).
"""

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
    """The ``collate_fn`` of :class:`PackedDPOTrainer`: TRL's preference batch, plus its sequences packed.

    Parameters:
        view: the collator that builds TRL's padded batch (``DPOTrainer``'s ``DataCollatorForPreference``):
            right-padded ``input_ids``, ``attention_mask`` and ``completion_mask`` ``[2P, L]``.
        rows: ``"one"``: every sequence in one row ``[1, N]``, for varlen attention kernels
            (FlashAttention), whose cost grows with each sequence's length; ``"fit"``: the sequences
            best-fit into rows as wide as the longest, for attention that masks a dense row (SDPA,
            eager), whose cost grows with the row's width squared. Each row's padding is a sequence of
            its own, never trained.
        shared_prompt: lay each pair's prompt out once, the chosen and the rejected response after it,
            each in a branch that sees the prompt and itself (rows with a 4-D ``attention_mask``, for
            SDPA or eager attention; see :func:`~zephon_collate.trainers.view.pack_view`).

    Returns (a call):
        the view's batch, and under ``"packed"``: ``input_ids``, ``position_ids`` and ``shift_labels``
        ``[rows, width]`` (each place's next token where it is trained, else -100), ``source`` (the
        flat packed place of each trained prediction) and ``target`` (its flat place in the
        ``[2P, L - 1]`` view).

    Raises:
        ValueError: if the view's batch lacks a key, or a row's ``attention_mask`` is not ones then
            zeros (left padding, holes), naming the row.

    Example:
        >>> import torch
        >>> def view(examples):
        ...     return {"input_ids": torch.tensor([[5, 6, 7], [5, 9, 0]]),
        ...             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        ...             "completion_mask": torch.tensor([[0, 1, 1], [0, 1, 0]])}
        >>> packed = PackedPreference(view)([])["packed"]
        >>> packed["input_ids"].tolist(), packed["shift_labels"].tolist()
        ([[5, 6, 7, 5, 9]], [[6, 7, -100, 9, -100]])
        >>> packed["source"].tolist(), packed["target"].tolist()
        ([0, 1, 3], [0, 1, 2])
        >>> fit = PackedPreference(view, rows="fit")([])["packed"]
        >>> fit["input_ids"].tolist(), fit["position_ids"].tolist()
        ([[5, 6, 7], [5, 9, 0]], [[0, 1, 2], [0, 1, 0]])
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
        batch = dict(self.view(examples))
        missing = [key for key in (INPUT_IDS, ATTENTION_MASK, _COMPLETION_MASK) if key not in batch]
        if missing:
            raise ValueError(
                f"PackedPreference: the view's batch lacks {shown(missing)} (it has {shown(sorted(batch))}); "
                "give TRL's DataCollatorForPreference, which writes input_ids, attention_mask and "
                "completion_mask"
            )
        batch[PACKED] = self.packed(batch[INPUT_IDS], batch[ATTENTION_MASK], batch[_COMPLETION_MASK])
        return batch

    def packed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The rows of a right-padded batch, packed (see the class doc)."""
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
    """``trl.DPOTrainer`` whose forward passes run on packed padding-free rows (see the module doc).

    The batch is packed in one row under FlashAttention (varlen), else best-fit into rows as wide as
    the longest sequence (see :class:`PackedPreference`). Takes ``DPOTrainer``'s arguments, unchanged:
    every ``loss_type`` (and lists of them with ``loss_weights``), ``f_divergence_type``, ``ld_alpha``,
    ``use_weighting``, a reference model, ``ref_model=None`` (the adapter-disabled PEFT model),
    ``precompute_ref_log_probs`` and the metrics keep TRL's meaning and values.

    ``shared_prompt=True`` (its one keyword of its own) lays each pair's prompt out once, both responses
    after it: the prompt's tokens go through the transformer once instead of twice. The attention comes
    from a 4-D mask, so it needs SDPA or eager attention (FlashAttention is refused: its varlen kernels
    cannot keep a response from its sibling); a sliding window or attention chunk goes into that mask by
    position, as transformers applies it to the padded batch. An MoE's load-balancing loss would count a
    shared prompt once instead of once per sequence: refused (``router_aux_loss_coef=0.0`` turns it off).

    Example:
        >>> from zephon_collate.trainers import PackedDPOTrainer  # doctest: +SKIP
        >>> PackedDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, shared_prompt: bool = False, **kwargs: Any) -> None:
        shared_prompt = check_bool("shared_prompt", shared_prompt, owner="PackedDPOTrainer")
        super().__init__(*args, **kwargs)
        base, rows = packed_base(self, "PackedDPOTrainer", shared_prompt)
        self.data_collator = PackedPreference(self.data_collator, rows=rows, shared_prompt=shared_prompt)
        wrap_forward(base)
        if self.ref_model is not None:
            wrap_forward(self.accelerator.unwrap_model(self.ref_model))
