"""Packed policy passes inside TRL's ``GRPOTrainer``: change the class, keep everything else.

TRL 1.16's ``GRPOTrainer`` has no padding-free option. Every log-prob pass it
makes (the policy's, the old policy's, the reference model's and an
adapter-disabled PEFT reference's) goes through one method,
``_get_per_token_logps_and_entropies``, on ``[B, P + C]`` rows: the prompt
padded on the left, the completion on the right. :class:`PackedGRPOTrainer`
overrides that method alone: it packs the rows' tokens
(:func:`~zephon_collate.trainers.view.pack_view`), runs the model's fused head on
the packed rows, and hands back the ``[B, C]`` completion-aligned log-probs and
entropies TRL expects. Generation, rewards, advantages, every loss type
(grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), GSPO's sequence-level
ratios, the KL term (``use_bias_correction_kl`` included) and the metrics run
unchanged.

Positions: stock TRL passes none, so a left-padded prompt's tokens sit at
positions shifted by its padding; packed, every sequence counts from 0. A RoPE
model scores both the same up to rounding (attention sees only position
differences); a model with absolute position embeddings (GPT-2) does not, and
trains better packed.

Not packed (TRL's own pass runs): batches with vision inputs or token types.
A model (or reference model) that lets packed sequences attend to each other is
refused when the trainer is built, with or without ``shared_prompt``; so, with
``shared_prompt=True``, is one whose layers a branch mask cannot express, one
that raises on it, and an MoE trained with its load-balancing loss.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from zephon_collate.core.checks import check_bool
from zephon_collate.trainers.view import PACKED, pack_view, packed_base, wrap_forward

__all__ = ["PackedGRPOTrainer"]


class PackedGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-prob passes run on packed rows (see the module doc).

    The rows are packed in one row under FlashAttention (varlen), else best-fit into rows as wide as
    the longest sequence. Takes ``GRPOTrainer``'s arguments, unchanged.

    ``shared_prompt=True`` (its one keyword of its own) lays the completions of one prompt (wherever
    they sit among the rows: TRL shuffles them before the training pass) out after one copy of the
    prompt, each in a branch behind a 4-D attention mask (SDPA or eager; FlashAttention is refused):
    the prompt goes through the transformer once per group instead of once per completion. A dense
    mask costs the document's width squared, so it pays when prompts are long next to the
    completions. A sliding window or attention chunk goes into the mask by position; an MoE's
    load-balancing loss is refused there (``router_aux_loss_coef=0.0`` turns it off).

    Example:
        >>> from zephon_collate.trainers import PackedGRPOTrainer  # doctest: +SKIP
        >>> PackedGRPOTrainer(model, reward_funcs=reward, args=config, train_dataset=data)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, shared_prompt: bool = False, **kwargs: Any) -> None:
        self.shared_prompt = check_bool("shared_prompt", shared_prompt, owner="PackedGRPOTrainer")
        super().__init__(*args, **kwargs)
        base, self.packed_rows = packed_base(self, "PackedGRPOTrainer", self.shared_prompt)
        wrap_forward(base)
        if self.ref_model is not None:
            wrap_forward(self.accelerator.unwrap_model(self.ref_model))

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
        """TRL's method, the rows packed: ``[B, C]`` log-probs of the completion tokens, their entropies
        (``compute_entropy``) and the MoE load-balancing loss (``compute_aux_loss``)."""
        if any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(  # type: ignore[no-any-return]
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
            packed = {
                key: value.to(ids.device)
                for key, value in pack_view(
                    ids.cpu(),
                    mask.cpu(),
                    (labels != -100).cpu(),
                    self.packed_rows,
                    "PackedGRPOTrainer",
                    shared_prompt=self.shared_prompt,
                ).items()
            }
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
