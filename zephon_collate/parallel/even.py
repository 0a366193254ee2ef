"""EvenBatches: every rank steps the same number of times per epoch, whatever its shard holds."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist

from zephon_collate.core.checks import check_device
from zephon_collate.parallel.distributed import collective_device, is_distributed

__all__ = ["EvenBatches"]

_END = object()


class EvenBatches:
    """Iterate ``loader`` so that every rank of ``group`` yields the same number of batches.

    Parameters:
        loader: any iterable of batches (a ``DataLoader``, a ``StatefulDataLoader``).
        group: the data-parallel process group (``None``: the default group).
        device: where the all-reduce runs (default: the CPU, or the current CUDA device for NCCL).

    Example:
        >>> even = EvenBatches([{"step": 0}, {"step": 1}])
        >>> [batch["step"] for batch in even], even.dropped
        ([0, 1], 0)
    """

    def __init__(self, loader: Iterable[Any], *, group: Any = None, device: str | torch.device | None = None):
        if isinstance(loader, (str, bytes)) or not isinstance(loader, Iterable):
            raise TypeError(
                f"EvenBatches: loader must be an iterable of batches, got {type(loader).__name__}"
            )
        self.loader = loader
        self.group = group
        self.device = check_device("EvenBatches", device)
        self.dropped = 0

    def __len__(self) -> int:
        """The loader's own length (``TypeError`` for a loader without one)."""
        try:
            if isinstance(self.loader, Sized):
                return len(self.loader)
        except TypeError:  # a DataLoader whose sampler or dataset has no length
            pass
        raise TypeError(
            f"EvenBatches: its loader ({type(self.loader).__name__}) has no length, so neither has "
            "EvenBatches; iterate it, or wrap a loader with a len() (a DataLoader over a map-style "
            "dataset and a sampler with a length)"
        )

    def __iter__(self) -> Iterator[Any]:
        self.dropped = 0
        batches = iter(self.loader)
        if not is_distributed():
            yield from batches
            return
        device = collective_device(self.group, self.device or torch.device("cpu"))
        while True:
            batch = next(batches, _END)
            everyone_has_one = torch.tensor([0 if batch is _END else 1], dtype=torch.int32, device=device)
            dist.all_reduce(everyone_has_one, op=dist.ReduceOp.MIN, group=self.group)
            if not int(everyone_has_one):
                if batch is not _END:
                    self.dropped = 1 + sum(1 for _ in batches)
                return
            yield batch
