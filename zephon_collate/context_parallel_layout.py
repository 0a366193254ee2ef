"""The load-balanced context-parallel token layout: which tokens each CP rank holds, and its inverse.

Every document of the padded THD stream (``cu_seqlens_padded[d] ..
cu_seqlens_padded[d + 1]``, a multiple of ``2 * cp_size`` long) is cut into
``2 * cp_size`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp_size - 1 - r``, as TransformerEngine's ``thd_get_partitioned_indices``.
:func:`cp_partition_index` gives one rank's indices into the stream;
:func:`gather_context_parallel` puts the shards of every rank back in stream
order. :class:`zephon_collate.context_parallel.ContextParallelShard` makes the
shards with the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["cp_partition_index", "gather_context_parallel"]

METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "num_valid_tokens")


def _check_cp(owner: str, cp_size: object, cp_rank: object) -> tuple[int, int]:
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if cp_size < 1:  # type: ignore[operator]
        raise ValueError(f"{owner}: cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:  # type: ignore[operator]
        raise ValueError(f"{owner}: cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return cp_size, cp_rank  # type: ignore[return-value]


def _partition(
    cu_padded: torch.Tensor, cp_size: int, cp_rank: int, total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into the padded stream, document of each local token)`` for ``cp_rank``.

    ``total`` is ``cu_padded[-1]`` when the caller has read it already.
    """
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


def cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices into the padded THD token stream that CP rank ``cp_rank`` holds, in its local order.

    For every document (``cu_seqlens_padded[d] .. cu_seqlens_padded[d + 1]``, a
    multiple of ``2 * cp_size`` long) cut into ``2 * cp_size`` chunks: chunk
    ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``. The same as
    TransformerEngine's ``thd_get_partitioned_indices``. The size depends on
    the data: one value is read back from the device.

    Raises:
        TypeError, ValueError: if ``cp_size``/``cp_rank`` are not ints with
            ``0 <= cp_rank < cp_size``, or the boundaries are not a 1-D, nondecreasing
            sequence from 0 whose steps are multiples of ``2 * cp_size``.

    Example:
        >>> cp_partition_index(torch.tensor([0, 8, 12]), cp_size=2, cp_rank=0).tolist()
        [0, 1, 6, 7, 8, 11]
        >>> cp_partition_index(torch.tensor([0, 8, 12]), cp_size=2, cp_rank=1).tolist()
        [2, 3, 4, 5, 9, 10]
    """
    cp_size, cp_rank = _check_cp("cp_partition_index", cp_size, cp_rank)
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
    return _partition(cu, cp_size, cp_rank)[0]


def gather_context_parallel(
    shards: Sequence[TensorDictBase | Mapping[str, Any]],
    *,
    padded_key: str = "cu_seqlens_padded",
    added_key: str = "cp_padding_mask",
    metadata_keys: Sequence[str] = METADATA_KEYS,
    drop_padding: bool = True,
) -> TensorDict:
    """Reassemble the THD token stream from the shards of every CP rank (rank order): the inverse of
    :class:`~zephon_collate.context_parallel.ContextParallelShard`.

    Per-token entries (first dim = the shard length, not in ``metadata_keys``)
    are put back in stream order; with ``drop_padding`` the added tokens are
    removed (and ``added_key`` with them), giving the batch's flattened fields.
    Use it on gathered model outputs too (logits, per-token losses) alongside
    the shards' ``added_key``.

    Raises:
        ValueError: if ``shards`` is empty or the shards disagree on their boundaries.

    Example:
        >>> from zephon_collate.context_parallel import ContextParallelShard
        >>> td = TensorDict(positions=torch.tensor([0, 1, 2, 0]), batch_size=[])
        >>> shards = [ContextParallelShard(2, r)(td) for r in range(2)]
        >>> [s["positions"].tolist() for s in shards]
        [[0, 3, 0, 3], [1, 2, 1, 2]]
        >>> gather_context_parallel(shards)["positions"].tolist()
        [0, 1, 2, 0]
    """
    if not shards:
        raise ValueError("gather_context_parallel: no shards given")
    cp_size = len(shards)
    cu_padded = torch.as_tensor(shards[0][padded_key]).to(torch.int64)
    for rank, shard in enumerate(shards[1:], 1):
        if not torch.equal(torch.as_tensor(shard[padded_key]).to(cu_padded), cu_padded):
            raise ValueError(f"gather_context_parallel: shard {rank} has other boundaries than shard 0")
    total = int(cu_padded[-1])
    local = total // cp_size
    skip = set(metadata_keys) | {padded_key}
    keys = [
        key
        for key, value in shards[0].items()
        if isinstance(value, torch.Tensor) and key not in skip and value.dim() and value.shape[0] == local
    ]
    order = torch.cat([_partition(cu_padded, cp_size, rank)[0] for rank in range(cp_size)])
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        values = torch.cat([torch.as_tensor(shard[key]) for shard in shards])
        order = order.to(values.device)
        stream = torch.empty((total, *values.shape[1:]), dtype=values.dtype, device=values.device)
        out[key] = stream.index_copy(0, order, values)
    if drop_padding and added_key in out:
        keep = out.pop(added_key).logical_not()
        out = {key: value[keep] for key, value in out.items()}
    return TensorDict(out, batch_size=[])
