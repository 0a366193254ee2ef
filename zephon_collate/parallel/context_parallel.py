"""Reassembling context-parallel shards: the inverse of ``ContextParallelShard``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from zephon_collate.core.keys import CU_SEQLENS, MAX_SEQLEN, NUM_VALID_TOKENS
from zephon_collate.core.text import shown
from zephon_collate.functional.context_parallel import partition

__all__ = ["gather_context_parallel"]

_METADATA_KEYS = (CU_SEQLENS, "cu_seqlens_padded", MAX_SEQLEN, NUM_VALID_TOKENS)


def gather_context_parallel(
    shards: Sequence[TensorDictBase | Mapping[str, Any]],
    *,
    padded_key: str = "cu_seqlens_padded",
    added_key: str = "cp_padding_mask",
    metadata_keys: Sequence[str] = _METADATA_KEYS,
    drop_padding: bool = True,
    cu_seqlens_key: str = CU_SEQLENS,
) -> TensorDict:
    """Reassemble the THD token stream from the shards of every CP rank (in rank order).

    Example:
        >>> from zephon_collate.transforms.context_parallel import ContextParallelShard
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
    cu_padded = _boundaries(shards[0], padded_key, 0)
    for rank, shard in enumerate(shards[1:], 1):
        if not torch.equal(_boundaries(shard, padded_key, rank).to(cu_padded), cu_padded):
            raise ValueError(f"gather_context_parallel: shard {rank} has other boundaries than shard 0")
    total = int(cu_padded[-1])
    local = total // cp_size
    skip = set(metadata_keys) | {padded_key}
    tokens = {
        key: value
        for key, value in shards[0].items()
        if isinstance(value, torch.Tensor) and key not in skip and value.dim()
    }
    keys = [key for key, value in tokens.items() if value.shape[0] == local]
    if total % (2 * cp_size) or (tokens and not keys):  # each document is padded to a multiple of 2 * cp_size
        held = sorted({int(value.shape[0]) for value in tokens.values()})
        raise ValueError(
            f"gather_context_parallel: {cp_size} shards of a stream of {total} padded tokens should hold "
            f"{total / cp_size:g} tokens each, but shard 0's fields hold {held}: give every CP rank's shard, "
            "in rank order"
        )
    for rank, shard in enumerate(shards):
        for key in keys:
            if key not in shard or torch.as_tensor(shard[key]).shape[:1] != (local,):
                raise ValueError(
                    f"gather_context_parallel: shard {rank} lacks {shown(key)} of {local} tokens, which "
                    "shard 0 holds; give every CP rank's shard of the same fields, in rank order"
                )
    order = torch.cat([partition(cu_padded, cp_size, rank)[0] for rank in range(cp_size)])
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        values = torch.cat([torch.as_tensor(shard[key]) for shard in shards])
        order = order.to(values.device)
        stream = torch.empty((total, *values.shape[1:]), dtype=values.dtype, device=values.device)
        out[key] = stream.index_copy(0, order, values)
    if not drop_padding:
        return TensorDict(out, batch_size=[])
    if added_key in out:
        keep = out.pop(added_key).logical_not()
    elif cu_seqlens_key in shards[0]:
        keep = _real_tokens(_boundaries(shards[0], cu_seqlens_key, 0), cu_padded)
    else:
        raise ValueError(
            f"gather_context_parallel: the shards carry neither {shown(added_key)} nor "
            f"{shown(cu_seqlens_key)}, so nothing says which tokens ContextParallelShard added; include "
            "one of them, or pass drop_padding=False to keep the padded stream"
        )
    return TensorDict({key: value[keep.to(value.device)] for key, value in out.items()}, batch_size=[])


def _boundaries(shard: TensorDictBase | Mapping[str, Any], key: str, rank: int) -> torch.Tensor:
    """Shard ``rank``'s ``key`` boundaries as int64, or a ``ValueError`` naming the missing key."""
    if key not in shard:
        raise ValueError(
            f"gather_context_parallel: shard {rank} lacks {shown(key)}; give the dicts ContextParallelShard "
            "wrote (or the outputs with its boundaries beside them)"
        )
    return torch.as_tensor(shard[key]).reshape(-1).to(torch.int64)


def _real_tokens(cu: torch.Tensor, cu_padded: torch.Tensor) -> torch.Tensor:
    """``[total]`` bool: the padded stream's places that hold a real token (each document's first ones)."""
    if cu.shape != cu_padded.shape:
        raise ValueError(
            f"gather_context_parallel: cu_seqlens has {cu.numel()} boundaries and cu_seqlens_padded "
            f"{cu_padded.numel()}; give the pair one ContextParallelShard wrote"
        )
    padded = cu_padded.diff()
    start = cu_padded[:-1].repeat_interleave(padded)
    length = cu.to(cu_padded.device).diff().repeat_interleave(padded)
    return torch.arange(int(cu_padded[-1]), device=cu_padded.device) - start < length
