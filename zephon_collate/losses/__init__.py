"""Losses that stay exact under packing, gradient accumulation and data-parallel ranks."""

from zephon_collate.losses.distill import distillation_loss
from zephon_collate.losses.policy import KL_ESTIMATORS, clipped_policy_loss, importance_ratio, kl_penalty
from zephon_collate.losses.preference import PREFERENCE_LOSSES, preference_loss
from zephon_collate.losses.sequences import (
    EMPTY,
    MODES,
    Empty,
    Mode,
    SequenceLogprobs,
    aggregate_loss,
    along_paths,
    global_loss_count,
    sequence_logprobs,
    sequence_means,
    token_logprobs,
    unpack,
)

__all__ = [
    "EMPTY",
    "KL_ESTIMATORS",
    "MODES",
    "PREFERENCE_LOSSES",
    "Empty",
    "Mode",
    "SequenceLogprobs",
    "aggregate_loss",
    "along_paths",
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
