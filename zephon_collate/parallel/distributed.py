"""Exact token normalization for data-parallel training with gradient accumulation (docs/distributed.md).

Per step: ``N = global_num_valid_tokens(micro_batches)``, then ``normalize_loss(loss_sum, N).backward()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zephon_collate.core.checks import scalar
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
    value = scalar(value)  # a NumPy integer, or a 0-d array of one
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

    Parameters:
        counts: a count (an int, an integer tensor, summed, or a batch dict holding it), or several.
        group: the data-parallel process group (``None``: the default group).
        device: where the result lives (default: the first tensor count's device, else the CPU).
        key: the count's key in batch dicts.

    Returns:
        A 0-d int64 tensor, the same on every rank of ``group``.

    Example:
        >>> micro_batches = [{"num_valid_tokens": 3}, {"num_valid_tokens": torch.tensor([2, 4])}]
        >>> global_num_valid_tokens(micro_batches)  # one process: nothing to reduce
        tensor(9)
    """
    given = counts if isinstance(counts, torch.Tensor) else scalar(counts)  # a NumPy int, a 0-d array
    if isinstance(given, (int, torch.Tensor, Mapping)):
        items: list[Any] = [given]
    elif isinstance(given, Iterable) and not isinstance(given, (str, bytes)):
        items = list(given)
    else:
        raise TypeError(
            "global_num_valid_tokens: counts must be a count (an int, an integer tensor, a batch dict) or "
            f"a list of them, got {type(given).__name__}"
        )
    for index, item in enumerate(items):
        if isinstance(item, Mapping) and key not in item:
            raise ValueError(
                f"global_num_valid_tokens: micro-batch {index} has no {shown(key)} (its keys: "
                f"{shown(sorted(map(str, item)))}); collate with return_num_valid_tokens=True, or pass key="
            )
    values = (item[key] if isinstance(item, Mapping) else item for item in items)
    first = next((value for value in values if isinstance(value, torch.Tensor)), None)
    if device is None:
        device = first.device if first is not None else "cpu"
    target = collective_device(group, torch.device(device))
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

    Parameters:
        loss_sum: the summed per-token loss of one micro-batch on this rank.
        num_valid_tokens: the global valid-token count of the step (:func:`global_num_valid_tokens`).
        group: the data-parallel group (``None``: the default group).
        world_size: the ranks the gradient reduction averages over (default: ``group``'s size; 1 if it sums).

    Example:
        >>> normalize_loss(torch.tensor(6.0), torch.tensor(4))  # one process: 6 / 4
        tensor(1.5000)
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(
            f"normalize_loss: loss_sum must be a tensor (the summed loss), got {type(loss_sum).__name__}"
        )
    if world_size is None:
        world_size = data_parallel_size(group)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"normalize_loss: world_size must be an int >= 1, got {shown(world_size)}")
    dtype = torch.promote_types(loss_sum.dtype, torch.float32)  # a bf16 count would round
    count = torch.as_tensor(num_valid_tokens, device=loss_sum.device).clamp(min=1).to(dtype)
    return loss_sum * (world_size / count)
