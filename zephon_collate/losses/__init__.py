"""Losses that stay exact under packing, gradient accumulation and data-parallel ranks.

:mod:`~zephon_collate.losses.sequences` reads a batch's sequences (token and
sequence log-probs, ``unpack``, verl's loss aggregation);
:mod:`~zephon_collate.losses.preference` is the DPO family on the sequences'
log-probs.
"""

from zephon_collate.losses.preference import PREFERENCE_LOSSES, preference_loss
from zephon_collate.losses.sequences import (
    MODES,
    Mode,
    SequenceLogprobs,
    aggregate_loss,
    global_loss_count,
    sequence_logprobs,
    token_logprobs,
    unpack,
)

__all__ = [
    "MODES",
    "PREFERENCE_LOSSES",
    "Mode",
    "SequenceLogprobs",
    "aggregate_loss",
    "global_loss_count",
    "preference_loss",
    "sequence_logprobs",
    "token_logprobs",
    "unpack",
]
