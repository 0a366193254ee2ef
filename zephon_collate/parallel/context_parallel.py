"""Reassembling context-parallel shards: the inverse of ``ContextParallelShard``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from zephon_collate.core.keys import CU_SEQLENS, MAX_SEQLEN, NUM_VALID_TOKENS
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
) -> TensorDict:
    """Reassemble the THD token stream from the shards of every CP rank (in rank order).

    Per-token entries go back in stream order; with ``drop_padding`` the added tokens (``added_key``)
    are removed. Works on gathered model outputs too (logits, per-token losses).

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
    order = torch.cat([partition(cu_padded, cp_size, rank)[0] for rank in range(cp_size)])
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
