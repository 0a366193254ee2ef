"""Packed policy passes inside TRL's ``GRPOTrainer`` and ``RLOOTrainer``: every log-prob pass runs on packed
rows, except those of batches with vision inputs or token types."""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer

from zephon_collate.core.checks import check_bool
from zephon_collate.trainers.view import PACKED, pack_view, packed_base, wrap_forward

__all__ = ["PackedGRPOTrainer", "PackedRLOOTrainer"]


class _PackedPolicyPasses(_BaseTrainer):
    """The one method GRPO and RLOO share, ``_get_per_token_logps_and_entropies``, on packed rows: every
    log-prob pass (policy, old policy, reference, a PEFT adapter disabled) goes through it."""

    def __init__(self, *args: Any, shared_prompt: bool = False, **kwargs: Any) -> None:
        owner = type(self).__name__
        self.shared_prompt = check_bool("shared_prompt", shared_prompt, owner=owner)
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # GRPOTrainer's or RLOOTrainer's
        base, self.packed_rows = packed_base(self, owner, self.shared_prompt)
        wrap_forward(base)
        reference = getattr(self, "ref_model", None)  # set by both trainers, None without a KL term
        if reference is not None:
            wrap_forward(self.accelerator.unwrap_model(reference))

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's method on packed rows: ``[B, C]`` completion log-probs, entropies and the MoE aux loss."""
        if any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(  # type: ignore[misc,no-any-return]
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal,
            )  # fmt: skip
        size = batch_size or input_ids.size(0)  # chunks of rows, as TRL's memory bound
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), size):
            ids, mask = input_ids[start : start + size], attention_mask[start : start + size]
            labels = ids.masked_fill(mask == 0, -100)  # only the completion tokens are scored
            labels[:, :-logits_to_keep] = -100
            # Packed on the host (the layout is NumPy's), then moved to the rows' device.
            view = pack_view(
                ids.cpu(),
                mask.cpu(),
                (labels != -100).cpu(),
                self.packed_rows,
                type(self).__name__,
                shared_prompt=self.shared_prompt,
            )
            packed = {key: value.to(ids.device) for key, value in view.items()}
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = model(
                    input_ids=ids,
                    attention_mask=mask,
                    labels=labels,
                    fused_lm_head=True,
                    **{PACKED: packed},
                    **extra,
                )
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                aux_losses.append(out.aux_loss)
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )


class PackedGRPOTrainer(_PackedPolicyPasses, GRPOTrainer):
    """``trl.GRPOTrainer`` on packed rows, taking its arguments unchanged (``docs/post_training.md``).

    Parameters:
        shared_prompt: lay the completions of one prompt out after one copy of it (SDPA or eager attention;
            FlashAttention and an MoE's load-balancing loss are refused); pays when prompts are long.

    Example:
        >>> from zephon_collate.trainers import PackedGRPOTrainer  # doctest: +SKIP
        >>> PackedGRPOTrainer(model, reward_funcs=reward, args=config, train_dataset=data)  # doctest: +SKIP
    """


class PackedRLOOTrainer(_PackedPolicyPasses, RLOOTrainer):
    """``trl.RLOOTrainer`` on packed rows, taking its arguments unchanged (``docs/post_training.md``).

    Parameters:
        shared_prompt: as :class:`PackedGRPOTrainer`'s.

    Example:
        >>> from zephon_collate.trainers import PackedRLOOTrainer  # doctest: +SKIP
        >>> PackedRLOOTrainer(model, reward_funcs=reward, args=config, train_dataset=data)  # doctest: +SKIP
    """
