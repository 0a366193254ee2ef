"""The load-balanced context-parallel token layout (TransformerEngine's ``thd_get_partitioned_indices``)."""

from __future__ import annotations

import torch

from zephon_collate.core.text import shown
from zephon_collate.functional._registry import kernel

__all__ = ["check_cp", "cp_partition_index", "partition"]


def check_cp(owner: str, cp_size: object, cp_rank: object) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` as ints with ``0 <= cp_rank < cp_size``; else ``TypeError``/``ValueError``."""
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be an int, got {shown(value)}")
    assert isinstance(cp_size, int) and isinstance(cp_rank, int)  # checked just above
    if cp_size < 1:
        raise ValueError(f"{owner}: cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"{owner}: cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return cp_size, cp_rank


def partition(
    cu_padded: torch.Tensor, cp_size: int, cp_rank: int, total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into the padded stream, document of each local token)``; ``total``: ``cu_padded[-1]``."""
    padded = cu_padded.diff()
    local = padded // cp_size
    chunk = padded // (2 * cp_size)
    starts = cu_padded[:-1]
    if total is None:
        total = int(cu_padded[-1])  # the output size depends on the data: one read-back
    total_local = total // cp_size
    device = cu_padded.device
    doc = torch.repeat_interleave(torch.arange(padded.numel(), device=device), local, output_size=total_local)
    offset = torch.arange(total_local, device=device) - (starts // cp_size)[doc]  # in [0, 2 * chunk)
    size = chunk[doc]
    second = offset >= size
    which = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return starts[doc] + which * size + offset - second * size, doc


@kernel
def cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices into the padded THD token stream that CP rank ``cp_rank`` holds, in local order (read back).

    Example:
        >>> cp_partition_index(torch.tensor([0, 8, 12]), cp_size=2, cp_rank=0).tolist()
        [0, 1, 6, 7, 8, 11]
    """
    cp_size, cp_rank = check_cp("cp_partition_index", cp_size, cp_rank)
    cu = torch.as_tensor(cu_seqlens_padded).to(torch.int64)
    steps = cu.diff() if cu.dim() == 1 else cu
    if (
        cu.dim() != 1
        or not cu.numel()
        or not bool((cu[0] == 0) & (steps >= 0).all() & (steps % (2 * cp_size) == 0).all())
    ):
        raise ValueError(
            "cp_partition_index: cu_seqlens_padded must be 1-D, start at 0 and grow by multiples of "
            f"2 * cp_size = {2 * cp_size}, got {cu_seqlens_padded.tolist()}"
        )
    return partition(cu, cp_size, cp_rank)[0]
