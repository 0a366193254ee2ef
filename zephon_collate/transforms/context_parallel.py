"""Context-parallel sharding of a packed batch: the load-balanced THD layout (``docs/distributed.md``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from zephon_collate.core.checks import check_ignore_index, check_key, check_keys
from zephon_collate.core.keys import (
    CU_SEQLENS,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LAST_TOKEN_INDEX,
    LOGITS_INDEX,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_MASK,
    PATH_INDEX,
    POSITIONS,
    SUBTREE_END,
)
from zephon_collate.core.text import shown
from zephon_collate.functional.context_parallel import check_cp, partition
from zephon_collate.functional.labels import align_mask
from zephon_collate.functional.segments import segment_starts
from zephon_collate.read.columns import Spread
from zephon_collate.transforms.base import Transform

__all__ = ["ContextParallelShard"]

_ROW_PLACES = (LOGITS_INDEX, SUBTREE_END, LAST_TOKEN_INDEX, PATH_INDEX)
"""Keys whose values are places in the unsharded row (the post-training layouts'): no shard keeps them."""


def _document_lengths(positions: torch.Tensor, boundaries: torch.Tensor | None) -> torch.Tensor:
    """Lengths (> 0) of the documents of the flattened token stream, in order."""
    total = positions.numel()
    device = positions.device
    end = torch.full((1,), total, dtype=torch.int64, device=device)
    if boundaries is None:
        bounds = torch.cat([segment_starts(positions).reshape(-1).nonzero().squeeze(1), end])
    else:
        cu = boundaries.to(device=device, dtype=torch.int64)
        if cu.dim() == 2 and positions.dim() == 2 and cu.shape[0] == positions.shape[0]:
            limit = positions.shape[1]
            offsets = torch.arange(positions.shape[0], device=device).unsqueeze(1) * limit
        elif cu.dim() == 1:
            limit, offsets = total, torch.zeros((), dtype=torch.int64, device=device)
        else:
            raise ValueError(
                f"ContextParallelShard: cu_seqlens of shape {list(cu.shape)} fits neither the rows "
                f"({list(positions.shape)}) nor the flattened stream; give [B, K] or [K] boundaries"
            )
        valid = cu.numel() > 0 and bool(
            (cu[..., 0] == 0).all() & (cu.diff(dim=-1) >= 0).all() & (cu <= limit).all()
        )
        if not valid:
            raise ValueError(
                "ContextParallelShard: cu_seqlens must start at 0 and be nondecreasing within the "
                f"sequence length {limit}, got {cu.tolist()}"
            )
        bounds = torch.cat([(cu + offsets).reshape(-1), end])
    lengths = bounds.diff()
    return lengths[lengths > 0]


class ContextParallelShard(Transform):
    """Split every per-token field of a batch into CP rank ``cp_rank``'s load-balanced THD shard. Run it after
    the labels are made (on the collator's output); its output size is read back from the device.

    Parameters:
        cp_size: the context-parallel world size, an int >= 1.
        cp_rank: this rank's index in the CP group, ``0 <= cp_rank < cp_size``.
        pad_token_id: the token of added padding (default 0).
        ignore_index: the label of added padding and of ignored labels (default -100).
        keys: the per-token fields to shard, or ``None`` for every field shaped like ``positions``.
        tokens_key, labels_key, positions_key: the fields so named (positions are required).
        cu_seqlens_key: boundaries to read when present, and where to write the real ones.
        padded_key, max_key, count_key, added_key: where to write the padded boundaries, maximum, count, mask.
        fill_values: ``{key: value}`` for added tokens, overriding the defaults (a ``Spread`` for routes).

    Example:
        >>> td = TensorDict(input_ids=torch.tensor([[11, 12, 13, 14, 15, 21, 22, 23]]), batch_size=[1],
        ...                 labels=torch.tensor([[12, 13, 14, 15, -100, 22, 23, -100]]),
        ...                 positions=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))  # documents of 5 and 3 tokens
        >>> rank0, rank1 = (ContextParallelShard(cp_size=2, cp_rank=r)(td) for r in (0, 1))
        >>> rank0["input_ids"].tolist(), rank1["input_ids"].tolist()  # padded to 8 and 4: chunks of 2 and 1
        ([11, 12, 0, 0, 21, 0], [13, 14, 15, 0, 22, 23])
        >>> rank0["cu_seqlens"].tolist(), rank0["cu_seqlens_padded"].tolist(), int(rank0["max_seqlen"])
        ([0, 5, 8], [0, 8, 12], 8)
    """

    def __init__(
        self,
        cp_size: int,
        cp_rank: int,
        *,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        keys: Sequence[str] | None = None,
        tokens_key: str = INPUT_IDS,
        labels_key: str = LABELS,
        positions_key: str = POSITIONS,
        cu_seqlens_key: str = CU_SEQLENS,
        padded_key: str = "cu_seqlens_padded",
        max_key: str = MAX_SEQLEN,
        count_key: str = NUM_VALID_TOKENS,
        added_key: str = "cp_padding_mask",
        fill_values: Mapping[str, int | float | bool | Spread] | None = None,
    ) -> None:
        super().__init__()
        owner = "ContextParallelShard"
        self.cp_size, self.cp_rank = check_cp(owner, cp_size, cp_rank)
        if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0:
            raise ValueError(f"{owner}: pad_token_id must be an int >= 0, got {shown(pad_token_id)}")
        self.pad_token_id = pad_token_id
        self.ignore_index = check_ignore_index(ignore_index, owner=owner)
        self.keys = None if keys is None else check_keys(owner, "keys", keys)
        self.tokens_key = check_key(owner, "tokens_key", tokens_key)
        self.labels_key = check_key(owner, "labels_key", labels_key)
        self.positions_key = check_key(owner, "positions_key", positions_key)
        self.cu_seqlens_key = check_key(owner, "cu_seqlens_key", cu_seqlens_key)
        self.padded_key = check_key(owner, "padded_key", padded_key)
        self.max_key = check_key(owner, "max_key", max_key)
        self.count_key = check_key(owner, "count_key", count_key)
        self.added_key = check_key(owner, "added_key", added_key)
        written = (cu_seqlens_key, padded_key, max_key, count_key, added_key)
        if len(set(written)) != len(written) or set(written) & {tokens_key, labels_key, positions_key}:
            raise ValueError(f"{owner}: output keys must be distinct from each other and the fields")
        if self.keys is not None and set(self.keys) & set(written):
            raise ValueError(f"{owner}: keys may not list the metadata keys {list(written)}")
        if fill_values is not None and not isinstance(fill_values, Mapping):
            raise TypeError(f"{owner}: fill_values must be a dict of key -> value, got {shown(fill_values)}")
        defaults = {tokens_key: pad_token_id, labels_key: self.ignore_index, PADDING_MASK: True}
        self.fill_values: dict[str, int | float | bool | Spread] = {**defaults, **dict(fill_values or {})}
        for key, value in self.fill_values.items():
            if isinstance(value, Spread) and (type(value.count) is not int or value.count < 1):
                raise ValueError(f"{owner}: fill_values[{shown(key)}] = {value} needs a count >= 1 (experts)")
        self.in_keys = [positions_key, *(k for k in (self.keys or ()) if k != positions_key)]
        self.optional_keys = (cu_seqlens_key, *_ROW_PLACES)  # the segments; places it refuses, when given
        self.out_keys = [*(self.keys or ()), positions_key, *written]
        self.reads_every_key = keys is None  # every per-token field is sharded

    data_dependent_shape = True  # the shard's length depends on the document lengths
    replaces_batch = True  # per-row entries dropped, the count only with labels: the outputs follow the data

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, " + super().extra_repr()

    def _token_keys(self, td: TensorDictBase, shape: torch.Size) -> list[str]:
        metadata = {self.cu_seqlens_key, self.padded_key, self.max_key, self.count_key, self.added_key}
        if self.keys is None:
            return [
                key
                for key, value in td.items()
                if isinstance(value, torch.Tensor)
                and key not in metadata
                and value.shape[: len(shape)] == shape
            ]
        for key in self.keys:
            if key not in td:
                raise ValueError(
                    f"ContextParallelShard: the TensorDict lacks {shown(key)} (it holds {sorted(td.keys())})"
                )
            if td.get(key).shape[: len(shape)] != shape:
                raise ValueError(
                    f"ContextParallelShard: {shown(key)} has shape {list(td.get(key).shape)}, not per-token "
                    f"like {shown(self.positions_key)} ({list(shape)})"
                )
        return [*self.keys, *([] if self.positions_key in self.keys else [self.positions_key])]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Overridden whole: the output holds only the shards and the metadata, with ``batch_size=[]``."""
        places = [key for key in _ROW_PLACES if key in td]
        if places:  # their labels are read through these places, across the chunks another rank holds
            raise ValueError(
                f"ContextParallelShard: the batch carries {shown(places[0])}, places in the unsharded row "
                "that no shard can keep (the labels are read through them); shard labels that give each "
                "place its own target, shifted before sharding (docs/distributed.md), without "
                f"{shown(places[0])}"
            )
        positions = td.get(self.positions_key)
        if positions.dim() not in (1, 2):
            raise ValueError(
                f"ContextParallelShard: {shown(self.positions_key)} must be [B, S] or [N], "
                f"got shape {list(positions.shape)}"
            )
        shape, total, device = positions.shape, positions.numel(), positions.device
        boundaries = td.get(self.cu_seqlens_key) if self.cu_seqlens_key in td else None
        lengths = _document_lengths(positions, boundaries)
        multiple = 2 * self.cp_size
        padded = (lengths + multiple - 1) // multiple * multiple
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        cu = torch.cat([zero, lengths.cumsum(0)])
        cu_padded = torch.cat([zero, padded.cumsum(0)])
        total_padded = int(cu_padded[-1])  # the output size depends on the data: one read-back
        if total_padded > INT32_MAX:
            raise ValueError(
                f"ContextParallelShard: {total_padded} padded tokens exceed what int32 boundaries can count"
            )
        index, doc = partition(cu_padded, self.cp_size, self.cp_rank, total_padded)
        offset = index - cu_padded[:-1][doc]  # within the padded document
        length = lengths[doc]
        real = offset < length
        within = torch.minimum(offset, length - 1)  # added tokens read the document's last one
        source = cu[:-1][doc] + within
        updates: dict[str, torch.Tensor] = {}
        for key in self._token_keys(td, shape):
            value = td.get(key)
            picked = value.reshape(total, *value.shape[len(shape) :]).index_select(0, source)
            if key == self.positions_key:
                updates[key] = picked + (offset - within).to(picked.dtype)  # numbering continues
                continue
            updates[key] = torch.where(
                align_mask(real, picked), picked, _fill(self.fill_values.get(key, 0), picked)
            )
        updates[self.cu_seqlens_key] = cu.to(torch.int32)
        updates[self.padded_key] = cu_padded.to(torch.int32)
        longest = padded.amax() if padded.numel() else torch.zeros((), dtype=torch.int64, device=device)
        updates[self.max_key] = longest.to(torch.int32)
        if self.labels_key in updates:
            updates[self.count_key] = (updates[self.labels_key] != self.ignore_index).sum()
        updates[self.added_key] = real.logical_not()
        return TensorDict(updates, batch_size=[], device=td.device)

    def shard(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Shard a ``Collator`` / ``to_training`` output dict: tensors sharded, ``ids`` / ``texts`` kept.

        Example:
            >>> from zephon_collate import Collator
            >>> collate = Collator(return_labels=True, return_num_valid_tokens=True)
            >>> batch = collate([{"input_ids": [1, 10, 11, 12, 2], "positions": [0, 1, 2, 3, 4]}])
            >>> out = ContextParallelShard(cp_size=2, cp_rank=1).shard(batch)
            >>> out["ids"], out["input_ids"].tolist(), out["labels"].tolist(), int(out["num_valid_tokens"])
            ([(0, 0, 0)], [10, 11], [11, 12], 2)
        """
        tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
        result = self(TensorDict(tensors, batch_size=[]))
        # Each rank's own ids and texts lists: one rank's edit must not reach the batch or the others.
        out = {key: copy.copy(value) for key, value in batch.items() if key not in tensors}
        out.update(result.items())
        return out


def _fill(fill: int | float | bool | Spread, like: torch.Tensor) -> torch.Tensor:
    """What an added token holds in a field like ``like``: a number, or a ``Spread`` of the shard's places."""
    if not isinstance(fill, Spread):
        return torch.tensor(fill, device=like.device).to(like.dtype)
    last = like.shape[-1] if like.dim() > 1 else 1
    place = torch.arange(like.shape[0], device=like.device).reshape(-1, *([1] * (like.dim() - 1)))
    entry = torch.arange(last, device=like.device)
    return ((place * last + entry) % fill.count).expand(like.shape).to(like.dtype)
