"""Losses that stay exact under packing, gradient accumulation and data-parallel ranks.

:mod:`~zephon_collate.losses.sequences` reads a batch's sequences (token and
sequence log-probs, ``unpack``, verl's loss aggregation);
:mod:`~zephon_collate.losses.preference` is the DPO family on the sequences'
log-probs; :mod:`~zephon_collate.losses.policy` the clipped policy losses,
GSPO's sequence ratios and the KL estimators on token-aligned log-probs;
:mod:`~zephon_collate.losses.distill` distillation from a teacher's top-k (TRL GKD's
generalised JSD on its support).
"""

from zephon_collate.losses.distill import distillation_loss
from zephon_collate.losses.policy import KL_ESTIMATORS, clipped_policy_loss, importance_ratio, kl_penalty
from zephon_collate.losses.preference import PREFERENCE_LOSSES, preference_loss
from zephon_collate.losses.sequences import (
    MODES,
    Mode,
    SequenceLogprobs,
    aggregate_loss,
    global_loss_count,
    sequence_logprobs,
    sequence_means,
    token_logprobs,
    unpack,
)

__all__ = [
    "KL_ESTIMATORS",
    "MODES",
    "PREFERENCE_LOSSES",
    "Mode",
    "SequenceLogprobs",
    "aggregate_loss",
    "clipped_policy_loss",
    "distillation_loss",
    "global_loss_count",
    "importance_ratio",
    "kl_penalty",
    "preference_loss",
    "sequence_logprobs",
    "sequence_means",
    "token_logprobs",
    "unpack",
]
