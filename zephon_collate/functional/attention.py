"""Attention metadata for packed rows, from their segment-restarting positions (docs/packed_attention.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zephon_collate.functional._registry import as_rows, flex_block_mask, kernel
from zephon_collate.functional.labels import padding_from_length
from zephon_collate.functional.segments import (
    PADDING_SEGMENT,
    cu_seqlens_flat,
    cu_seqlens_rows,
    flatten_segment_ids,
    segment_ids_from_positions,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "PADDING_SEGMENT",
    "branch_block_mask",
    "branch_mask_mod",
    "check_consistent",
    "cu_seqlens_from_segment_ids",
    "dense_branch_mask",
    "dense_document_mask",
    "document_block_mask",
    "document_mask_mod",
    "flatten_segment_ids",
    "padding_from_length",
    "segment_ids_from_positions",
]


def _dense(docs: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1, S, S]``: causal within a document, padding (-1) sees itself only; and ``visible``."""
    index = torch.arange(docs.shape[1], device=docs.device)
    causal = index.unsqueeze(1) >= index.unsqueeze(0)
    diagonal = index.unsqueeze(1) == index.unsqueeze(0)
    query = docs.unsqueeze(2)
    same = (query == docs.unsqueeze(1)) & (query >= 0) & causal
    if visible is not None:
        same = same & visible
    return (same | diagonal).unsqueeze(1)


def document_mask_mod(segment_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: causal inside a segment, nothing across.

    Parameters:
        segment_ids: ``[B, S]`` per-row or ``[N]`` batch-global ids; -1 (padding) attends to itself only.

    Example:
        >>> mod = document_mask_mod(torch.tensor([[0, 0, 1, -1]]))
        >>> b, h, q, k = torch.tensor(0), torch.tensor(0), torch.tensor(2), torch.tensor(1)
        >>> bool(mod(b, h, q, k)), bool(mod(b, h, torch.tensor(1), torch.tensor(0)))
        (False, True)
    """
    ids = as_rows(segment_ids)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_segment = ids[b, q_idx]
        same_document = (q_segment == ids[b, kv_idx]) & (q_segment >= 0) & (kv_idx <= q_idx)
        return same_document | (q_idx == kv_idx)

    return mask_mod


def document_block_mask(
    segment_ids: torch.Tensor, *, block_size: int | tuple[int, int] = 128, compile: bool = False
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`document_mask_mod`: ``(B, 1, S, S)``, or ``(1, 1, N, N)``.

    Parameters:
        segment_ids: ``[B, S]`` per-row or ``[N]`` batch-global segment ids.
        block_size: FlexAttention's ``BLOCK_SIZE`` (keep 128 with its compiled kernels).
        compile: build the mask through ``torch.compile`` instead of evaluating it densely once.

    Example:
        >>> block_mask = document_block_mask(torch.tensor([[0, 0, 1, 1]]), block_size=2)
        >>> block_mask.shape, block_mask.to_dense().tolist()
        ((1, 1, 4, 4), [[[[1, 0], [0, 1]]]])
    """
    ids = as_rows(segment_ids)
    return flex_block_mask(document_mask_mod(ids), ids, ids.device, block_size, compile)


@kernel
def dense_document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask (True: may attend) of :func:`document_mask_mod`, for SDPA.

    Example:
        >>> dense_document_mask(torch.tensor([[0, 0, 1, -1]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    return _dense(as_rows(segment_ids))


def branch_mask_mod(document_ids: torch.Tensor, branch_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod`` for shared prompts: causal in a document, a branch never sees a sibling.

    Parameters:
        document_ids: ``[B, S]`` (or ``[N]``) document ids, -1 on padding.
        branch_ids: the same shape: 0 on the shared prompt, ``k`` on the ``k``-th response.

    Example:
        >>> docs, branches = torch.tensor([[0, 0, 0, 0, 0]]), torch.tensor([[0, 0, 1, 1, 2]])
        >>> mod = branch_mask_mod(docs, branches)
        >>> at = lambda q, k: bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(k)))
        >>> at(4, 1), at(4, 3), at(3, 2)  # branch 2 sees the prompt, not branch 1
        (True, False, True)
    """
    docs, branches = as_rows(document_ids), as_rows(branch_ids)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_doc, k_branch = docs[b, q_idx], branches[b, kv_idx]
        visible = (k_branch == 0) | (k_branch == branches[b, q_idx])
        same = (q_doc == docs[b, kv_idx]) & (q_doc >= 0) & (kv_idx <= q_idx) & visible
        return same | (q_idx == kv_idx)

    return mask_mod


def branch_block_mask(
    document_ids: torch.Tensor,
    branch_ids: torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    compile: bool = False,
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`branch_mask_mod`; the rest as :func:`document_block_mask`.

    Example:
        >>> mask = branch_block_mask(torch.tensor([[0, 0, 0, 0]]), torch.tensor([[0, 1, 2, 2]]), block_size=2)
        >>> mask.shape
        (1, 1, 4, 4)
    """
    docs = as_rows(document_ids)
    return flex_block_mask(branch_mask_mod(docs, as_rows(branch_ids)), docs, docs.device, block_size, compile)


@kernel
def dense_branch_mask(document_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask (True: may attend) of :func:`branch_mask_mod`, for SDPA.

    Example:
        >>> dense_branch_mask(torch.tensor([[0, 0, 0, 0]]), torch.tensor([[0, 1, 2, 2]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    """
    docs, branches = as_rows(document_ids), as_rows(branch_ids)
    key_branch = branches.unsqueeze(1)
    return _dense(docs, (key_branch == 0) | (key_branch == branches.unsqueeze(2)))


def _starts_as_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions-like ``[B, S]``: zero exactly where a segment starts."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.ones_like(segment_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, change], dim=1).logical_not().to(torch.int32)


@kernel
def cu_seqlens_from_segment_ids(
    segment_ids: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, max_seqlen)`` of ``segment_ids`` (``[B, S]`` or ``[N]``), as :class:`CuSeqlens` writes
    them (``num_boundaries`` as there); a run of -1 is one segment.

    Example:
        >>> cu, top = cu_seqlens_from_segment_ids(torch.tensor([[0, 0, 0, 1, -1], [0, 0, 0, 0, 0]]))
        >>> cu.tolist(), top.tolist()
        ([[0, 3, 4, 5], [0, 5, 5, 5]], [3, 5])
    """
    if segment_ids.dim() == 1:
        return cu_seqlens_flat(_starts_as_positions(segment_ids.unsqueeze(0)), num_boundaries)
    return cu_seqlens_rows(_starts_as_positions(as_rows(segment_ids)), num_boundaries)


def _trim_filler(boundaries: list[int], end: int) -> list[int]:
    """Boundaries without their filler: one ``end`` kept at the end."""
    while len(boundaries) > 1 and boundaries[-1] == end and boundaries[-2] == end:
        boundaries = boundaries[:-1]
    return boundaries


def check_consistent(segment_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``segment_ids`` and ``cu_seqlens`` describe the same segments (debug only).

    Example:
        >>> ids = torch.tensor([[0, 0, 1], [0, 0, 0]])
        >>> check_consistent(ids, torch.tensor([[0, 2, 3], [0, 3, 3]]))
        >>> check_consistent(ids, torch.tensor([[0, 1, 3], [0, 3, 3]]))
        Traceback (most recent call last):
        ...
        ValueError: check_consistent: row 0: segment ids give boundaries [0, 2, 3], cu_seqlens holds [0, 1, 3]
    """
    if segment_ids.dim() != cu_seqlens.dim() or segment_ids.dim() not in (1, 2):
        raise ValueError(
            f"check_consistent: pair [B, S] segment ids with [B, K] cu_seqlens or [N] ids with [K] "
            f"cu_seqlens, got shapes {tuple(segment_ids.shape)} and {tuple(cu_seqlens.shape)}"
        )
    derived, _ = cu_seqlens_from_segment_ids(segment_ids)
    end = segment_ids.shape[-1]  # a row's length, or the flattened batch's
    got_rows, want_rows = as_rows(cu_seqlens).tolist(), as_rows(derived).tolist()
    if len(got_rows) != len(want_rows):
        raise ValueError(
            f"check_consistent: {len(want_rows)} rows of segment ids but {len(got_rows)} rows of cu_seqlens"
        )
    for row, (got_row, want_row) in enumerate(zip(got_rows, want_rows, strict=True)):
        got, want = _trim_filler(got_row, end), _trim_filler(want_row, end)
        if got != want:
            where = f"row {row}" if segment_ids.dim() == 2 else "the flattened batch"
            raise ValueError(
                f"check_consistent: {where}: segment ids give boundaries {want}, cu_seqlens holds {got}"
            )
