"""Losses that stay exact under packing, gradient accumulation and data-parallel ranks.

A packed batch holds many sequences in a few rows (or one); a shared prompt
holds one prompt for several of them. Computed naively, a per-sequence loss
(DPO's sequence log-probs, a GRPO sequence mean) changes with the packing, and
a mean over micro-batches or ranks weights each token by its micro-batch. The
helpers here read the batch's sequence map (what ``Collator.for_preference``
and ``Collator.for_rollouts`` write: ``logits_index``, ``sequence_index``,
``num_sequences``, ``document_ids`` / ``branch_ids``; a ``for_transformers``
batch is read from its ``attention_mask`` or ``position_ids``) and give every
layout, packed or not, shared prompt or not, the same numbers:

- :func:`token_logprobs`: ``log p(token t | its context)`` for every token;
- :func:`sequence_logprobs`: per-sequence sums over supervised tokens, and counts;
- :func:`unpack`: a per-token tensor back to one row per sequence;
- :func:`aggregate_loss`: a per-token loss to the scalar to call ``backward`` on,
  in verl's four ``loss_agg_mode`` s, with :func:`global_loss_count` for the
  denominator of a step that spans micro-batches and ranks.

A token is *supervised* when its label is not -100 and some position predicts
it (``logits_index >= 0``). Every function takes logits ``[R, L, V]`` aligned
with ``input_ids`` ``[R, L]`` (what a ``transformers`` causal LM returns), runs
on any device and keeps the gradient; those that need the number of sequences
read ``num_sequences`` (a Python int: no device sync) when the batch has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple, TypeAlias

import torch

from zephon_collate._text import shown
from zephon_collate.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOGITS_INDEX,
    NUM_SEQUENCES,
    POSITION_IDS,
    SEQUENCE_INDEX,
)
from zephon_collate.parallel.distributed import data_parallel_size, global_num_valid_tokens, normalize_loss

__all__ = [
    "MODES",
    "Mode",
    "SequenceLogprobs",
    "aggregate_loss",
    "global_loss_count",
    "sequence_logprobs",
    "token_logprobs",
    "unpack",
]

Mode: TypeAlias = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
MODES: tuple[Mode, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""verl's ``loss_agg_mode`` values (``verl.trainer.ppo.core_algos.agg_loss``), for :func:`aggregate_loss`."""
_Batch: TypeAlias = Mapping[str, Any]


class SequenceLogprobs(NamedTuple):
    """Per-sequence log-probs: ``sums`` ``[S]`` over supervised tokens, ``counts`` ``[S]`` int64 of them."""

    sums: torch.Tensor
    counts: torch.Tensor


class _Map(NamedTuple):
    logits_index: torch.Tensor  # [R, L] int64
    sequence_index: torch.Tensor  # [R, L] int64
    num_sequences: int


def _tensor(batch: _Batch, key: str, like: torch.Tensor | None = None) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if like is not None and value.shape != like.shape:
        raise ValueError(
            f"batch[{shown(key)}] has shape {tuple(value.shape)}, but 'input_ids' has {tuple(like.shape)}; "
            "pass the batch the collator returned"
        )
    return value if like is None else value.to(like.device)


def _sequence_map(batch: _Batch) -> _Map:
    """The batch's sequence map: written by the post-training presets, else read from a ``for_transformers``
    batch (padded rows: its ``attention_mask``; padding-free: its restarting ``position_ids``)."""
    if not isinstance(batch, Mapping) or INPUT_IDS not in batch:
        raise TypeError(
            "expected a batch dict from Collator.for_preference, for_rollouts or for_transformers"
        )
    ids = _tensor(batch, INPUT_IDS)
    if ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [R, L], got shape {tuple(ids.shape)}")
    place = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if LOGITS_INDEX in batch and SEQUENCE_INDEX in batch:
        index, sequence = _tensor(batch, LOGITS_INDEX, ids), _tensor(batch, SEQUENCE_INDEX, ids)
        count = batch.get(NUM_SEQUENCES)
        number = int(count) if count is not None else int(sequence.max()) + 1 if sequence.numel() else 0
        return _Map(index.long(), sequence.long(), number)
    if ATTENTION_MASK in batch:  # padded: a sequence per row, on its mask
        mask = _tensor(batch, ATTENTION_MASK, ids) != 0
        before = torch.zeros_like(mask)
        before[:, 1:] = mask[:, :-1]
        index = torch.where(mask & before, place - 1, -1)
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        return _Map(index, torch.where(mask, rows, -1), ids.shape[0])
    if POSITION_IDS in batch:  # padding-free: a sequence wherever the positions restart
        starts = _tensor(batch, POSITION_IDS, ids) == 0
        starts[:, 0] = True
        sequence = (starts.reshape(-1).cumsum(0) - 1).reshape(ids.shape)
        return _Map(torch.where(starts, -1, place - 1), sequence, int(starts.sum()))
    raise ValueError(
        "the batch has no sequence map ('logits_index', 'sequence_index'), 'attention_mask' or "
        "'position_ids'; collate it with Collator.for_preference, Collator.for_rollouts or "
        "Collator.for_transformers"
    )


def _supervised(batch: _Batch, view: _Map) -> torch.Tensor:
    labels = _tensor(batch, LABELS, view.logits_index)
    return (labels != IGNORE_INDEX) & (view.logits_index >= 0) & (view.sequence_index >= 0)


def token_logprobs(logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Per-token log-probs, token-aligned: ``out[r, t] = log p(input_ids[r, t] | its context)``.

    Token ``t`` is scored with the logits of the position that predicts it
    (``logits_index``: the token before it, or the shared prompt's last token
    for a response's first), in float32 (or the logits' dtype, if wider); 0
    where no position predicts it (a sequence's first token, padding). The
    result is aligned with ``labels`` and with every token-aligned float field
    (a behaviour policy's ``old_logprobs``), so ``out - batch["old_logprobs"]``
    is a per-token log-ratio in any layout.

    Parameters:
        logits: ``[R, L, V]``, the model's output for ``batch["input_ids"]``.
        batch: a batch of ``Collator.for_preference`` / ``for_rollouts`` (or ``for_transformers``).

    Returns:
        ``[R, L]`` float, differentiable with respect to ``logits``.

    Raises:
        ValueError: if ``logits`` do not match ``input_ids``.

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...     {"input_ids": [1, 3], "completion_mask": [0, 1]},
        ... ])
        >>> logits = torch.zeros(1, 5, 4)  # uniform over 4 tokens: every log-prob is log(1/4)
        >>> token_logprobs(logits, batch).double().round(decimals=4).tolist()
        [[0.0, -1.3863, -1.3863, 0.0, -1.3863]]
    """
    view = _sequence_map(batch)
    index = view.logits_index
    if logits.dim() != 3 or logits.shape[:2] != index.shape:
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}; they must be [R, L, V] for input_ids of shape "
            f"{tuple(index.shape)} (the model's output for this batch, unshifted)"
        )
    ids = _tensor(batch, INPUT_IDS).to(logits.device)
    index = index.to(logits.device)
    scores = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    safe = index.clamp(min=0)
    rows = torch.arange(scores.shape[0], device=scores.device)[:, None]
    normaliser = torch.logsumexp(scores, dim=-1).gather(1, safe)
    picked = scores[rows, safe, ids]
    return torch.where(
        index >= 0, picked - normaliser, torch.zeros((), dtype=scores.dtype, device=scores.device)
    )


def _per_sequence(values: torch.Tensor, batch: _Batch, view: _Map) -> torch.Tensor:
    """``[S]``: ``values`` ``[R, L]`` summed over each sequence's supervised tokens (no device sync)."""
    supervised = _supervised(batch, view).to(values.device)
    sequence = view.sequence_index.to(values.device)
    slot = torch.where(supervised, sequence, view.num_sequences).reshape(-1)
    picked = torch.where(supervised, values, torch.zeros((), dtype=values.dtype, device=values.device))
    total = torch.zeros(view.num_sequences + 1, dtype=values.dtype, device=values.device)
    return total.scatter_add(0, slot, picked.reshape(-1))[: view.num_sequences]


def sequence_logprobs(logits: torch.Tensor, batch: _Batch) -> SequenceLogprobs:
    """Per-sequence log-probs: the sum over each sequence's supervised tokens, and their count.

    The sequence log-prob of DPO (``chosen = out.sums[batch["chosen_index"]]``),
    the same in every layout: packed or padded, shared prompt or not.

    Returns:
        ``SequenceLogprobs(sums [S] float, counts [S] int64)``, ``S`` the batch's sequences.

    Example:
        >>> from zephon_collate import Collator
        >>> pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [2, 3]}]
        >>> batch = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
        >>> out = sequence_logprobs(torch.zeros(1, 5, 4), batch)  # uniform: log(1/4) per supervised token
        >>> out.sums.double().round(decimals=4).tolist(), out.counts.tolist()
        ([-1.3863, -2.7726], [1, 2])
        >>> float(out.sums[batch["chosen_index"]][0]) == float(out.sums[0])
        True
    """
    view = _sequence_map(batch)
    scores = token_logprobs(logits, batch)
    counts = _per_sequence(torch.ones_like(scores, dtype=torch.int64), batch, view)
    return SequenceLogprobs(_per_sequence(scores, batch, view), counts)


def unpack(
    tensor: torch.Tensor, batch: _Batch, *, padded: bool = False, padding_value: float = 0
) -> list[torch.Tensor] | torch.Tensor:
    """A per-token tensor ``[R, L, ...]`` back to its sequences: each one's tokens, in order.

    A sequence's tokens are its shared prompt's (when it has one) and its own,
    so ``unpack(batch["input_ids"], batch)[i]`` is sequence ``i``'s
    ``prompt + response`` in every layout. A device sync reads the sizes.

    Parameters:
        tensor: ``[R, L, ...]``, aligned with ``batch["input_ids"]`` (a float field, token log-probs,
            a per-token loss).
        batch: a batch of ``Collator.for_preference`` / ``for_rollouts`` (or ``for_transformers``).
        padded: return ``[S, max_len, ...]``, each row padded with ``padding_value``, instead of a list.

    Returns:
        A list of ``S`` tensors ``[len_i, ...]``, or one ``[S, max_len, ...]`` tensor.

    Example:
        >>> from zephon_collate import Collator
        >>> pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}]
        >>> batch = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
        >>> batch["input_ids"].tolist()
        [[1, 2, 3, 4, 5]]
        >>> [row.tolist() for row in unpack(batch["input_ids"], batch)]
        [[1, 2, 3], [1, 2, 4, 5]]
        >>> unpack(batch["input_ids"], batch, padded=True).tolist()
        [[1, 2, 3, 0], [1, 2, 4, 5]]
    """
    view = _sequence_map(batch)
    rows, length = view.sequence_index.shape
    if tuple(tensor.shape[:2]) != (rows, length):
        raise ValueError(
            f"unpack: tensor has shape {tuple(tensor.shape)}; it must be [R, L, ...] for input_ids of shape "
            f"{(rows, length)}"
        )
    device = tensor.device
    sequence = view.sequence_index.reshape(-1).to(device)
    count = view.num_sequences
    flat = torch.arange(sequence.numel(), device=device)
    own = sequence >= 0
    slot = torch.where(own, sequence, count)
    own_length = torch.zeros(count + 1, dtype=torch.int64, device=device).scatter_add(0, slot, own.long())[
        :count
    ]
    far = torch.full((count + 1,), sequence.numel(), dtype=torch.int64, device=device)
    own_start = far.scatter_reduce(0, slot, flat, reduce="amin")[:count]
    trunk_start = torch.zeros(count, dtype=torch.int64, device=device)
    trunk_length = torch.zeros(count, dtype=torch.int64, device=device)
    if DOCUMENT_IDS in batch and BRANCH_IDS in batch:  # a shared prompt: the document's branch-0 tokens
        document = _tensor(batch, DOCUMENT_IDS).reshape(-1).to(device).long()
        branch = _tensor(batch, BRANCH_IDS).reshape(-1).to(device)
        trunk = (branch == 0) & (document >= 0)
        documents = int(document.max()) + 1 if document.numel() else 0
        key = torch.where(trunk, document, documents)
        lengths = torch.zeros(documents + 1, dtype=torch.int64, device=device).scatter_add(
            0, key, trunk.long()
        )
        starts = torch.full((documents + 1,), 0, dtype=torch.int64, device=device)
        starts = starts.scatter_reduce(0, key, flat, reduce="amin", include_self=False)
        mine = document[own_start.clamp(max=max(sequence.numel() - 1, 0))] if count else own_start
        trunk_start = starts[mine]
        trunk_length = torch.where(own_length > 0, lengths[mine], 0)  # an empty sequence has no prompt here
    total = trunk_length + own_length
    spans_start = torch.stack([trunk_start, own_start], dim=1).reshape(-1)
    spans_length = torch.stack([trunk_length, own_length], dim=1).reshape(-1)
    ends = spans_length.cumsum(0)
    index = torch.arange(int(ends[-1]) if count else 0, device=device)
    index = index + torch.repeat_interleave(spans_start - (ends - spans_length), spans_length)
    values = tensor.reshape(rows * length, *tensor.shape[2:])[index]
    if not padded:
        return list(torch.split(values, total.tolist()))
    width = int(total.max()) if count else 0
    out = values.new_full((count, width, *tensor.shape[2:]), padding_value)
    place = torch.arange(values.shape[0], device=device) - torch.repeat_interleave(
        total.cumsum(0) - total, total
    )
    out[torch.repeat_interleave(torch.arange(count, device=device), total), place] = values
    return out


def _local_count(batch: _Batch, mode: Mode) -> torch.Tensor:
    """This batch's units of ``mode``: supervised tokens, or sequences with a supervised token."""
    view = _sequence_map(batch)
    supervised = _supervised(batch, view)
    if mode == "token-mean":
        return supervised.sum()
    per_sequence = _per_sequence(supervised.long(), batch, view)
    return (per_sequence > 0).sum()


def _check_mode(mode: object) -> Mode:
    if mode not in MODES:
        raise ValueError(f"aggregate_loss: mode must be one of {MODES}, got {shown(mode)}")
    return mode


def global_loss_count(
    batches: _Batch | Iterable[_Batch],
    *,
    mode: Mode = "token-mean",
    group: Any = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """The denominator of ``mode`` over one optimizer step: every micro-batch of every rank.

    Supervised tokens (``"token-mean"``) or sequences with at least one
    supervised token (``"seq-mean-*"``), summed over this rank's micro-batches
    (``batches``), then all-reduced over ``group``
    (:func:`~zephon_collate.parallel.distributed.global_num_valid_tokens`): a
    collective every rank of ``group`` calls once per step. Pass it to
    :func:`aggregate_loss` as ``global_count``.

    Raises:
        ValueError: for an unknown mode, or ``"seq-mean-token-sum-norm"`` (a constant normaliser).

    Example:
        >>> from zephon_collate import Collator
        >>> collate = Collator.for_rollouts(padding_free=True)
        >>> micro = [collate([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}]),
        ...          collate([{"input_ids": [4, 5], "completion_mask": [0, 1]}] * 2)]
        >>> int(global_loss_count(micro)), int(global_loss_count(micro, mode="seq-mean-token-mean"))
        (4, 3)
    """
    checked = _check_mode(mode)
    if checked == "seq-mean-token-sum-norm":
        raise ValueError(
            "global_loss_count: 'seq-mean-token-sum-norm' divides by a constant; pass normalizer=..."
        )
    items = [batches] if isinstance(batches, Mapping) else list(batches)
    return global_num_valid_tokens(
        [_local_count(batch, checked) for batch in items], group=group, device=device
    )


def aggregate_loss(
    per_token_loss: torch.Tensor,
    batch: _Batch,
    *,
    mode: Mode = "token-mean",
    global_count: torch.Tensor | int | None = None,
    normalizer: float | None = None,
    group: Any = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """The loss to call ``backward`` on: ``per_token_loss`` over supervised tokens, aggregated by ``mode``.

    With ``l`` the per-token loss, ``m`` the supervised tokens, ``i`` the
    sequences and ``n_i = sum_t m_i,t`` (verl's ``agg_loss`` modes), over the whole step:

    - ``"token-mean"``: ``sum_i,t l*m / sum_i,t m``;
    - ``"seq-mean-token-sum"``: ``mean_i sum_t l*m`` (over sequences with ``n_i > 0``);
    - ``"seq-mean-token-mean"``: ``mean_i (sum_t l*m / n_i)`` (over sequences with ``n_i > 0``);
    - ``"seq-mean-token-sum-norm"``: ``sum_i,t l*m / normalizer``, a constant (Dr. GRPO: e.g. the
      largest response length times the group size; constant, so that packing and batch sizes
      do not change it).

    Each is exact under packing (sequences come from the batch's map, not its
    rows), under gradient accumulation and across data-parallel ranks: this
    micro-batch's part of the numerator is divided by ``global_count`` (from
    :func:`global_loss_count` over the step's micro-batches; ``None``: this
    batch's own count, all-reduced over ``group`` when torch.distributed runs)
    and multiplied by ``world_size`` (:func:`~zephon_collate.parallel.distributed.normalize_loss`),
    which cancels the gradient averaging of DDP and FSDP. The sum of ``backward``
    over the micro-batches is then the gradient of the whole step's loss.

    Parameters:
        per_token_loss: ``[R, L]``, aligned with ``input_ids`` (e.g. from :func:`token_logprobs`).
        batch: the micro-batch (``Collator.for_preference`` / ``for_rollouts`` / ``for_transformers``).
        mode: one of :data:`MODES`.
        global_count: the step's denominator (tokens or sequences), or ``None``.
        normalizer: the constant of ``"seq-mean-token-sum-norm"`` (required there, unused elsewhere).
        group: the data-parallel group (``None``: the default group).
        world_size: the ranks gradients are averaged over (default: ``group``'s size, 1 alone).

    Returns:
        A 0-d tensor.

    Raises:
        ValueError: for an unknown mode, a shape that does not fit the batch, or a missing or
            non-positive ``normalizer``.

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
        ...     {"input_ids": [1, 5], "completion_mask": [0, 1]},
        ... ])
        >>> loss = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 6.0]])  # sequence sums 6 and 6
        >>> [round(float(aggregate_loss(loss, batch, mode=m, normalizer=8.0)), 4) for m in MODES]
        [3.0, 6.0, 4.0, 1.5]
    """
    checked = _check_mode(mode)
    view = _sequence_map(batch)
    if tuple(per_token_loss.shape) != tuple(view.logits_index.shape):
        raise ValueError(
            f"aggregate_loss: per_token_loss has shape {tuple(per_token_loss.shape)}, the batch's tokens "
            f"{tuple(view.logits_index.shape)}; give one loss per token, aligned with input_ids"
        )
    supervised = _supervised(batch, view).to(per_token_loss.device)
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    if checked == "seq-mean-token-sum-norm":
        if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)) or not normalizer > 0:
            raise ValueError(
                f"aggregate_loss: mode 'seq-mean-token-sum-norm' needs normalizer=, a constant > 0 (e.g. the "
                f"largest response length), got {shown(normalizer)}"
            )
        ranks = data_parallel_size(group) if world_size is None else world_size
        return torch.where(supervised, per_token_loss, zero).sum() * (ranks / float(normalizer))
    if checked == "token-mean":
        numerator = torch.where(supervised, per_token_loss, zero).sum()
    else:
        sums = _per_sequence(per_token_loss, batch, view)
        if checked == "seq-mean-token-mean":
            counts = _per_sequence(torch.ones_like(per_token_loss, dtype=torch.int64), batch, view)
            sums = sums / counts.clamp(min=1).to(sums.dtype)
        numerator = sums.sum()
    if global_count is None:
        global_count = global_num_valid_tokens(_local_count(batch, checked), group=group)
    return normalize_loss(numerator, global_count, group=group, world_size=world_size)
