"""Attention that follows a tree batch: token ``k`` is seen by ``q`` with ``k <= q < subtree_end[k]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention.bias import causal_lower_right

from zephon_collate.core.keys import DOCUMENT_IDS, LOGITS_INDEX
from zephon_collate.functional._registry import as_rows, flex_block_mask

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "TREE_ATTENTION",
    "TreeBlocks",
    "additive",
    "dense_tree_mask",
    "tree_attention",
    "tree_block_mask",
    "tree_mask_mod",
    "use_tree_attention",
    "within_limits",
]

TREE_ATTENTION = "zephon_tree"
"""The name :func:`use_tree_attention` registers with ``transformers``' ``AttentionInterface``."""


def _rows(subtree_end: torch.Tensor) -> torch.Tensor:
    return as_rows(subtree_end, "subtree_end", " or [N]")


def tree_mask_mod(subtree_end: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: ``kv <= q < subtree_end[b, kv]``.

    Example:
        >>> mod = tree_mask_mod(torch.tensor([[7, 7, 4, 4, 7, 7, 7]]))  # prompt, then branches a and b
        >>> z, q = torch.tensor(0), torch.tensor(4)
        >>> bool(mod(z, z, q, torch.tensor(1))), bool(mod(z, z, q, torch.tensor(3)))
        (True, False)
    """
    ends = _rows(subtree_end)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < ends[b, kv_idx])

    return mask_mod


def tree_block_mask(
    subtree_end: torch.Tensor, *, block_size: int | tuple[int, int] = 128, compile: bool = False
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`tree_mask_mod`, on the device of ``subtree_end``."""
    ends = _rows(subtree_end)
    return flex_block_mask(tree_mask_mod(ends), ends, str(ends.device), block_size, compile)


def dense_tree_mask(subtree_end: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, 1, S, S]``: True where query ``q`` may attend key ``k`` (SDPA's ``attn_mask``); with a float
    ``dtype``, the :func:`additive` mask.

    Example:
        >>> dense_tree_mask(torch.tensor([[3, 2, 3]]))[0, 0].int().tolist()  # a root, then two branches
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    """
    ends = _rows(subtree_end)
    place = torch.arange(ends.shape[1], device=ends.device)
    q, k = place[:, None], place[None, :]
    seen = ((k <= q) & (q < ends[:, None, :])).unsqueeze(1)
    return seen if dtype is None else additive(seen, dtype)


def within_limits(
    query: torch.Tensor, key: torch.Tensor, *, window: int | None = None, chunk: int | None = None
) -> torch.Tensor | None:
    """Where position ``query`` may see ``key`` by a sliding ``window`` (``query - key < window``) and
    ``chunk`` (both in one chunk), as ``transformers`` masks them; ``None`` without either.

    Example:
        >>> place = torch.arange(4)
        >>> within_limits(place[:, None], place[None, :], window=2).int().tolist()[3]
        [0, 0, 1, 1]
    """
    limits = query - key < window if window else None
    if chunk:
        same = torch.div(query, chunk, rounding_mode="floor") == torch.div(key, chunk, rounding_mode="floor")
        limits = same if limits is None else limits & same
    return limits


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as eager attention's additive one: 0 where seen, ``dtype``'s minimum elsewhere."""
    if not dtype.is_floating_point:
        raise TypeError(f"an additive attention mask needs a float dtype (the model's), got {dtype}")
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


@dataclass
class TreeBlocks:
    """A tree batch's attention chain by chain (a chain: a run of tokens each predicted by the one before).

    Parameters:
        chains: ``(row, start, end, keys)`` each; ``keys``: its ancestors' places, then ``start .. end - 1``.
        loose: ``[K, 2]`` ``(row, place)`` of the tokens in no chain (padding): each sees itself only.
    """

    chains: list[tuple[int, int, int, torch.Tensor]]
    loose: torch.Tensor

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any]) -> TreeBlocks:
        """The chains of a batch with ``logits_index`` (padding, ``document_ids`` -1, is loose).

        Example:
            >>> blocks = TreeBlocks.from_batch({"logits_index": torch.tensor([[-1, 0, 1, 1, 3]])})
            >>> [(row, start, end, keys.tolist()) for row, start, end, keys in blocks.chains]
            [(0, 0, 3, [0, 1, 2]), (0, 3, 5, [0, 1, 3, 4])]
        """
        index = torch.as_tensor(batch[LOGITS_INDEX]).cpu()
        real = (
            torch.as_tensor(batch[DOCUMENT_IDS]).cpu() >= 0
            if DOCUMENT_IDS in batch
            else torch.ones_like(index, dtype=torch.bool)
        )
        chains: list[tuple[int, int, int, torch.Tensor]] = []
        for row, (predictor, kept) in enumerate(zip(index.tolist(), real.tolist(), strict=True)):
            owner = [-1] * len(predictor)  # each place's chain, by its start
            ends: dict[int, int] = {}
            seen: dict[int, torch.Tensor] = {}  # the keys each chain's last token sees
            place = 0
            while place < len(predictor):
                if not kept[place]:
                    place += 1
                    continue
                start, before = place, predictor[place]
                place += 1
                while place < len(predictor) and kept[place] and predictor[place] == place - 1:
                    place += 1
                keys = torch.arange(start, place)
                if before >= 0:  # after what ``before`` sees: its chain's keys up to it
                    parent = owner[before]
                    inherited = seen[parent]
                    keys = torch.cat([inherited[: inherited.numel() - (ends[parent] - 1 - before)], keys])
                owner[start:place] = [start] * (place - start)
                ends[start], seen[start] = place, keys
                chains.append((row, start, place, keys))
        return cls(chains, (~real).nonzero())


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree: TreeBlocks,
    *,
    scaling: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention ``[B, H, S, D]`` that follows the tree: each chain's queries on the keys it sees, causally.

    Parameters:
        query: ``[B, H, S, D]``; key, value: ``[B, H_kv, S, D]`` (grouped-query heads repeated).
        tree: the batch's :class:`TreeBlocks`.
        scaling: the softmax scale (default ``1 / sqrt(D)``).
        window, chunk: a sliding window and chunked attention, as in :func:`within_limits`.
        softcap: scores soft-capped to ``softcap * tanh(score / softcap)`` (Gemma 2).
        sinks: ``[H]`` a sink logit per head, in the softmax and then dropped (GPT-OSS).
        dropout: the attention dropout probability (training).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.zeros_like(query)
    for row, start, end, keys in tree.chains:
        keys = keys.to(query.device)
        q = query[row : row + 1, :, start:end]
        k, v = key[row : row + 1, :, keys], value[row : row + 1, :, keys]
        seen: Any = causal_lower_right(end - start, keys.numel())
        if window or chunk or softcap or sinks is not None:  # key j of a chain sits at position j of its path
            at = torch.arange(keys.numel(), device=query.device)
            asks = at[keys.numel() - (end - start) :, None]
            seen = at[None, :] <= asks
            limits = within_limits(asks, at[None, :], window=window, chunk=chunk)
            seen = seen if limits is None else seen & limits
        if softcap or sinks is not None:  # what SDPA cannot: the scores written out, as eager attention does
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
            if sinks is None:
                weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
            else:
                sink = sinks.reshape(1, -1, 1, 1).expand(1, -1, end - start, 1).to(scores.dtype)
                joined = torch.cat([scores, sink], dim=-1)
                weights = torch.softmax(joined - joined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
            weights = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0)
            part = torch.matmul(weights.to(v.dtype), v)  # (the float32 softmax back to the values' dtype)
        else:
            part = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=seen, scale=scaling, dropout_p=dropout
            )
        out[row : row + 1, :, start:end] = part
    if tree.loose.numel():
        rows, places = tree.loose[:, 0].to(query.device), tree.loose[:, 1].to(query.device)
        out[rows, :, places] = value[rows, :, places]
    return out


def _layer_limits(module: torch.nn.Module, given: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The window and chunk of ``module``'s attention, by its layer kind (``config.layer_types``)."""
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    kind = kinds[layer] if kinds and isinstance(layer, int) and layer < len(kinds) else None
    window = given.get("sliding_window")
    if kind == "sliding_attention":
        return window or getattr(config, "sliding_window", None), None
    if kind == "chunked_attention":
        return None, getattr(config, "attention_chunk_size", None)
    if kind not in (None, "full_attention"):
        raise ValueError(
            f"{TREE_ATTENTION} attention: layer {layer} of {type(module).__name__} is {kind} "
            "(config.layer_types), which tree_attention does not compute (full, sliding-window and chunked "
            "layers only); load the model with another attn_implementation"
        )
    return window, None


def _transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention signature over :func:`tree_attention` (``tree=`` from the forward)."""
    tree = kwargs.get("tree")
    if not isinstance(tree, TreeBlocks):
        raise ValueError(
            f"{TREE_ATTENTION} attention needs the batch's tree: call the model with tree=TreeBlocks."
            "from_batch(batch) (and position_ids), or load it with another attn_implementation"
        )
    window, chunk = _layer_limits(module, kwargs)
    out = tree_attention(
        query, key, value, tree, scaling=scaling, window=window, chunk=chunk, softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"), dropout=dropout if module.training else 0.0,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_tree_attention(model: torch.nn.Module) -> None:
    """Make a ``transformers`` model attend by :func:`tree_attention`; call it with ``position_ids`` and
    ``tree=TreeBlocks.from_batch(batch)`` (``docs/trees.md``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, _transformers_attention)
    model.set_attn_implementation(TREE_ATTENTION)  # type: ignore[operator]
