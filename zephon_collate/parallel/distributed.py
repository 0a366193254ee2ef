"""Exact token normalization for data-parallel training with gradient accumulation.

The loss of an optimizer step is the mean over every supervised token the step
sees, on every rank and in every micro-batch::

    loss = sum(per-token losses over all ranks and micro-batches) / N

with ``N`` the global number of supervised (valid) tokens. Averaging the
per-micro-batch or per-rank means instead weights a token by ``1 / (tokens in
its micro-batch)``, which is wrong as soon as micro-batches hold different
numbers of valid tokens (they do: loss masks, padding, EOS masking).

The recipe (see ``docs/distributed.md``), per optimizer step:

1. Fetch this rank's micro-batches, then ``N = global_num_valid_tokens(micro_batches)``:
   the sum of their ``num_valid_tokens``, all-reduced over the data-parallel group.
2. For each micro-batch: ``loss_sum = cross_entropy(logits, labels, reduction="sum")``,
   then ``normalize_loss(loss_sum, N).backward()``, which is
   ``loss_sum * world_size / N``. DDP (and FSDP) *average* gradients over the
   ``world_size`` ranks, so the factor ``world_size`` cancels that mean and the
   summed gradient is exactly ``sum(grad of per-token losses) / N``.
   Under ``ddp.no_sync()`` for all but the last micro-batch the gradients
   accumulate locally and are averaged once: the same result, less traffic.

Every function here is a no-op across ranks (world size 1, nothing reduced)
when ``torch.distributed`` is not initialised, so the same loop runs in one process.

**The group.** ``group=None`` is the default process group, right only when
every rank is a data-parallel replica. Under tensor or pipeline parallelism
pass the data-parallel group (e.g. ``device_mesh["dp"].get_group()``) to both
functions: TP peers hold the same tokens and pipeline stages before the last
compute no loss, so the default group would count tokens several times and
scale the loss by the wrong ``world_size``. ``docs/distributed.md`` has a table
per layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zephon_collate.core.keys import NUM_VALID_TOKENS
from zephon_collate.core.text import shown

__all__ = [
    "collective_device",
    "data_parallel_size",
    "global_num_valid_tokens",
    "is_distributed",
    "normalize_loss",
]

_Count = int | torch.Tensor | Mapping[str, Any]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def data_parallel_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (the default group for ``None``); 1 without torch.distributed.

    This is the number DDP (or FSDP) divides summed gradients by when it
    averages them over the data-parallel ranks.

    Example:
        >>> data_parallel_size()  # not initialised: one process
        1
    """
    return dist.get_world_size(group) if is_distributed() else 1


def collective_device(group: Any, device: torch.device) -> torch.device:
    """``device``, or the current CUDA device where a CPU tensor cannot join ``group``'s collectives."""
    if device.type != "cpu" or not is_distributed():
        return device
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _as_count(item: Any, key: str, device: torch.device | None) -> torch.Tensor:
    value = item[key] if isinstance(item, Mapping) else item
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"global_num_valid_tokens: counts must be integer tensors, got {value.dtype}")
        return value.sum().to(torch.int64)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"global_num_valid_tokens: a count must be an int, an integer tensor or a batch dict with "
            f"{shown(key)}, got {type(value).__name__}"
        )
    return torch.tensor(value, dtype=torch.int64, device=device)


def global_num_valid_tokens(
    counts: _Count | Iterable[_Count],
    *,
    group: Any = None,
    device: str | torch.device | None = None,
    key: str = NUM_VALID_TOKENS,
) -> torch.Tensor:
    """The valid-token count of one optimizer step: summed over this rank's micro-batches, then over ranks.

    ``counts`` is one count or several (one per gradient-accumulation
    micro-batch); a count is a Python int, an integer tensor (summed, so the
    ``[B]`` per-row counts of :class:`~zephon_collate.transforms.LossMask` work
    too) or a batch dict holding it under ``key`` (what :class:`Collator`
    returns with ``return_num_valid_tokens=True``; with ``python_scalars=False``
    the count stays on the device and nothing synchronises here). The local
    sum is then all-reduced (``SUM``) over ``group`` when torch.distributed is
    initialised; otherwise it is returned as is. The all-reduce is a
    collective: every rank of ``group`` must call this, once per step.

    Parameters:
        counts: a count, a batch dict, or an iterable of them.
        group: the data-parallel process group (``None``: the default group, right only when
            every rank is a data-parallel replica; under TP or PP pass the DP group).
        device: where the result lives; default: the first tensor count's
            device, else the CPU (the current CUDA device under an NCCL-only group).
        key: the count's key in batch dicts.

    Returns:
        A 0-d int64 tensor, the same on every rank of ``group``.

    Raises:
        TypeError: if a count is not an int, an integer tensor or a dict holding one.

    Example:
        >>> micro_batches = [{"num_valid_tokens": 3}, {"num_valid_tokens": torch.tensor([2, 4])}]
        >>> global_num_valid_tokens(micro_batches)  # one process: nothing to reduce
        tensor(9)
    """
    items = [counts] if isinstance(counts, (int, torch.Tensor, Mapping)) else list(counts)
    first = next(
        (
            value
            for value in (item[key] if isinstance(item, Mapping) else item for item in items)
            if isinstance(value, torch.Tensor)
        ),
        None,
    )
    if device is not None:
        target = torch.device(device)
    else:
        target = first.device if first is not None else torch.device("cpu")
    target = collective_device(group, target)
    total = torch.zeros((), dtype=torch.int64, device=target)
    for item in items:
        total = total + _as_count(item, key, target).to(target)
    if is_distributed():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)  # a fresh tensor of ours
    return total


def normalize_loss(
    loss_sum: torch.Tensor,
    num_valid_tokens: torch.Tensor | int,
    *,
    group: Any = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """The micro-batch loss to call ``backward`` on: ``loss_sum * world_size / num_valid_tokens``.

    ``loss_sum`` is this micro-batch's sum of per-token losses
    (``cross_entropy(..., reduction="sum", ignore_index=...)``) and
    ``num_valid_tokens`` the step's global count
    (:func:`global_num_valid_tokens`). DDP and FSDP average gradients over the
    data-parallel ranks, dividing by ``world_size``; multiplying by it here
    makes the accumulated, averaged gradient exactly that of
    ``sum(all per-token losses of the step) / num_valid_tokens`` (with or
    without ``no_sync``). A step without valid tokens gives a zero loss (the
    count is clamped to 1; ``loss_sum`` is 0 then), never NaN. No device sync.

    Parameters:
        loss_sum: the summed per-token loss of one micro-batch on this rank.
        num_valid_tokens: the global valid-token count of the step.
        group: the data-parallel group (``None``: the default group; under TP or PP pass the
            DP group, whose size is then the default ``world_size``).
        world_size: the number of ranks the gradient reduction averages over;
            default ``data_parallel_size(group)`` (1 in one process). Pass 1
            if your reduction sums instead of averaging (e.g. a custom comm hook).

    Returns:
        ``loss_sum * world_size / max(num_valid_tokens, 1)``, in ``loss_sum``'s dtype or float32,
        whichever is wider.

    Raises:
        ValueError: if ``world_size`` is not an int >= 1.

    Example:
        >>> normalize_loss(torch.tensor(6.0), torch.tensor(4))  # one process: 6 / 4
        tensor(1.5000)
        >>> normalize_loss(torch.tensor(6.0), 4, world_size=2)  # DDP halves it again
        tensor(3.)
    """
    if world_size is None:
        world_size = data_parallel_size(group)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"normalize_loss: world_size must be an int >= 1, got {shown(world_size)}")
    dtype = torch.promote_types(loss_sum.dtype, torch.float32)  # a bf16 count would round
    count = torch.as_tensor(num_valid_tokens, device=loss_sum.device).clamp(min=1).to(dtype)
    return loss_sum * (world_size / count)
