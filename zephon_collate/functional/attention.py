"""Attention metadata for packed rows, all derived from one source: the segment-restarting positions.

A packed row holds several documents side by side. Training on it is only
correct when attention stays inside each document, so every kernel needs to
know where the documents are. This module derives that from one place, the
``positions`` written by :func:`~zephon_collate.pack_flat` (a segment starts
wherever ``positions == 0``; the trailing padding is a segment of its own,
restarting at 0), and never from token values:

- segment ids (:func:`segment_ids_from_positions`, per row, and
  :func:`flatten_segment_ids`, numbered across the batch: Mamba's ``seq_idx``);
- a FlexAttention ``mask_mod`` (:func:`document_mask_mod`) and its
  ``BlockMask`` (:func:`document_block_mask`);
- a dense boolean ``[B, 1, S, S]`` mask for SDPA (:func:`dense_document_mask`);
- for shared prompts (a prompt computed once, several responses after it), the
  same three from document ids and *branch* ids (:func:`branch_mask_mod`,
  :func:`branch_block_mask`, :func:`dense_branch_mask`): branch 0 is a
  document's shared prompt, branch ``k >= 1`` its ``k``-th response, which
  attends to the prompt and to itself, never to a sibling;
- ``cu_seqlens`` for varlen kernels come from
  :func:`zephon_collate.functional.cu_seqlens_rows` /
  :func:`~zephon_collate.functional.cu_seqlens_flat` (the :class:`CuSeqlens`
  transform); :func:`cu_seqlens_from_segment_ids` and :func:`check_consistent`
  tie them to the segment ids.

The end-to-end check of a model (:func:`~zephon_collate.inspection.leakage.check_no_leakage`)
lives in :mod:`zephon_collate.inspection.leakage`.

**Padding.** Segment ids may mark trailing padding with ``-1``
(``padding_mask`` here, ``mark_padding`` in :class:`SegmentIds`). Masks built
from marked ids let a padding token attend to itself only: no real token
attends to padding, padding attends to no real token, and no softmax row is
empty (an all-masked row would give NaN in SDPA). Unmarked, the padding is a
segment like the others: nothing attends across it either way.

The pure functions take tensors and return new ones, never write into their
inputs, and hold no Python branch on tensor values (they run on any device and
under ``torch.compile``), except :func:`check_consistent`, which reads results
back to build its report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zephon_collate.functional._registry import kernel
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


def _as_rows(segment_ids: torch.Tensor) -> torch.Tensor:
    if segment_ids.dim() == 1:
        return segment_ids.unsqueeze(0)
    if segment_ids.dim() != 2:
        raise ValueError(
            f"segment ids must be [B, S] (per row) or [N] (flattened), got shape {tuple(segment_ids.shape)}"
        )
    return segment_ids


def document_mask_mod(segment_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: causal inside a segment, nothing across.

    ``segment_ids`` is ``[B, S]`` (per row; batch index ``b``) or ``[N]``
    (batch-global ids from :func:`flatten_segment_ids` or
    ``SegmentIds(flatten=True)``, for a ``[1, N]`` layout). Query ``q``
    attends key ``k`` when both lie in the same real segment and ``k <= q``.
    A marked padding token (id -1) attends to itself only, so no softmax row
    is empty and nothing attends into padding.

    Example:
        >>> mod = document_mask_mod(torch.tensor([[0, 0, 1, -1]]))
        >>> b, h, q, k = torch.tensor(0), torch.tensor(0), torch.tensor(2), torch.tensor(1)
        >>> bool(mod(b, h, q, k)), bool(mod(b, h, torch.tensor(1), torch.tensor(0)))
        (False, True)
    """
    ids = _as_rows(segment_ids)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_segment = ids[b, q_idx]
        same_document = (q_segment == ids[b, kv_idx]) & (q_segment >= 0) & (kv_idx <= q_idx)
        return same_document | (q_idx == kv_idx)

    return mask_mod


def document_block_mask(
    segment_ids: torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    compile: bool = False,
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`document_mask_mod`, on the device of ``segment_ids``.

    ``[B, S]`` ids give a mask of shape ``(B, 1, S, S)`` (broadcast over
    heads); ``[N]`` batch-global ids give ``(1, 1, N, N)``, for queries
    flattened to ``[1, H, N, D]``. Pass it as ``flex_attention(q, k, v,
    block_mask=...)``.

    Parameters:
        segment_ids: ``[B, S]`` per-row or ``[N]`` batch-global segment ids.
        block_size: FlexAttention's ``BLOCK_SIZE`` (the default 128 is what its
            compiled kernels expect; smaller values only help small CPU tests).
        compile: build the mask through ``torch.compile`` (``create_block_mask``'s
            ``_compile``). Off, the ``[B, S, S]`` mask is evaluated densely once,
            which is fine for small and moderate ``S``; on, it is not
            materialised (worth it at long sequence lengths, costs a compile).

    Example:
        >>> block_mask = document_block_mask(torch.tensor([[0, 0, 1, 1]]), block_size=2)
        >>> block_mask.shape, block_mask.to_dense().tolist()
        ((1, 1, 4, 4), [[[[1, 0], [0, 1]]]])
    """
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _as_rows(segment_ids)
    rows, length = ids.shape
    return create_block_mask(
        document_mask_mod(ids),
        rows,
        None,
        length,
        length,
        device=ids.device,
        BLOCK_SIZE=block_size,
        _compile=compile,
    )


@kernel
def dense_document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask (True: may attend) of :func:`document_mask_mod`, for SDPA.

    Pass it as ``scaled_dot_product_attention(q, k, v, attn_mask=...)`` (with
    ``is_causal=False``: the mask is already causal). ``[N]`` batch-global ids
    give ``[1, 1, N, N]``. It takes ``B * S * S`` bytes: a fallback for small
    sizes; use FlexAttention or a varlen kernel beyond that.

    Example:
        >>> dense_document_mask(torch.tensor([[0, 0, 1, -1]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    ids = _as_rows(segment_ids)
    index = torch.arange(ids.shape[1], device=ids.device)
    causal = index.unsqueeze(1) >= index.unsqueeze(0)
    diagonal = index.unsqueeze(1) == index.unsqueeze(0)
    query = ids.unsqueeze(2)
    same_document = (query == ids.unsqueeze(1)) & (query >= 0) & causal
    return (same_document | diagonal).unsqueeze(1)


def branch_mask_mod(document_ids: torch.Tensor, branch_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod`` for shared prompts: causal in a document, a branch never sees a sibling.

    ``document_ids`` and ``branch_ids`` are ``[B, S]`` (or ``[N]`` for a ``[1, N]``
    layout), as ``Collator.for_preference`` / ``for_rollouts`` write them. Query
    ``q`` attends key ``k`` when both lie in the same real document, ``k <= q``,
    and ``k`` is on the shared prompt (branch 0) or on ``q``'s own branch.
    Padding (document -1) attends to itself only. With one branch per
    document (every branch id 1) this is :func:`document_mask_mod`.

    Example:
        >>> docs, branches = torch.tensor([[0, 0, 0, 0, 0]]), torch.tensor([[0, 0, 1, 1, 2]])
        >>> mod = branch_mask_mod(docs, branches)
        >>> at = lambda q, k: bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(k)))
        >>> at(4, 1), at(4, 3), at(3, 2)  # branch 2 sees the prompt, not branch 1
        (True, False, True)
    """
    docs, branches = _as_rows(document_ids), _as_rows(branch_ids)

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
    """The FlexAttention ``BlockMask`` of :func:`branch_mask_mod`, on the device of the ids.

    ``[B, S]`` ids give a mask of shape ``(B, 1, S, S)``, ``[N]`` ids ``(1, 1, N, N)``;
    ``block_size`` and ``compile`` as for :func:`document_block_mask`.

    Example:
        >>> mask = branch_block_mask(torch.tensor([[0, 0, 0, 0]]), torch.tensor([[0, 1, 2, 2]]), block_size=2)
        >>> mask.shape
        (1, 1, 4, 4)
    """
    from torch.nn.attention.flex_attention import create_block_mask

    docs = _as_rows(document_ids)
    rows, length = docs.shape
    return create_block_mask(
        branch_mask_mod(docs, _as_rows(branch_ids)),
        rows,
        None,
        length,
        length,
        device=docs.device,
        BLOCK_SIZE=block_size,
        _compile=compile,
    )


@kernel
def dense_branch_mask(document_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask (True: may attend) of :func:`branch_mask_mod`, for SDPA.

    A ``transformers`` model with ``attn_implementation="sdpa"`` takes it as its
    ``attention_mask`` (a 4-D mask is used as given). ``[N]`` ids give ``[1, 1, N, N]``.

    Example:
        >>> dense_branch_mask(torch.tensor([[0, 0, 0, 0]]), torch.tensor([[0, 1, 2, 2]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    """
    docs, branches = _as_rows(document_ids), _as_rows(branch_ids)
    index = torch.arange(docs.shape[1], device=docs.device)
    causal = index.unsqueeze(1) >= index.unsqueeze(0)
    diagonal = index.unsqueeze(1) == index.unsqueeze(0)
    query = docs.unsqueeze(2)
    key_branch = branches.unsqueeze(1)
    visible = (key_branch == 0) | (key_branch == branches.unsqueeze(2))
    same = (query == docs.unsqueeze(1)) & (query >= 0) & causal & visible
    return (same | diagonal).unsqueeze(1)


def _starts_as_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions-like ``[B, S]`` tensor, zero exactly where a segment starts, for the cu_seqlens kernels."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.ones_like(segment_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, change], dim=1).logical_not().to(torch.int32)


@kernel
def cu_seqlens_from_segment_ids(
    segment_ids: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, max_seqlen)`` of the segments that ``segment_ids`` describe.

    A segment starts at the first token and wherever the id changes; the
    boundaries then come from :func:`~zephon_collate.functional.cu_seqlens_rows`
    (``[B, S]`` ids: ``[B, K]`` and ``[B]``) or
    :func:`~zephon_collate.functional.cu_seqlens_flat` (``[N]`` batch-global
    ids: ``[N']`` and ``[]``), in the layouts :class:`CuSeqlens` writes, with the
    same ``num_boundaries`` (static shape) option. A run of marked padding
    (-1) is one segment, as :func:`~zephon_collate.pack_flat` writes it
    (flattened, the padding of a row and an all-padding row after it merge).

    Example:
        >>> cu, top = cu_seqlens_from_segment_ids(torch.tensor([[0, 0, 0, 1, -1], [0, 0, 0, 0, 0]]))
        >>> cu.tolist(), top.tolist()
        ([[0, 3, 4, 5], [0, 5, 5, 5]], [3, 5])
    """
    if segment_ids.dim() == 1:
        return cu_seqlens_flat(_starts_as_positions(segment_ids.unsqueeze(0)), num_boundaries)
    return cu_seqlens_rows(_starts_as_positions(_as_rows(segment_ids)), num_boundaries)


def _trim_filler(boundaries: list[int], end: int) -> list[int]:
    """Boundaries without the filler that pads them: one ``end`` kept at the end."""
    while len(boundaries) > 1 and boundaries[-1] == end and boundaries[-2] == end:
        boundaries = boundaries[:-1]
    return boundaries


def check_consistent(segment_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``segment_ids`` and ``cu_seqlens`` describe the same segments.

    ``[B, S]`` ids pair with per-row ``[B, K]`` boundaries, ``[N]`` batch-global
    ids with flattened ``[K]`` ones. Boundaries padded with the row (or total)
    length, as ``num_boundaries`` pads them, compare equal to unpadded ones.
    The message names the row and both boundary lists. A debug check: it reads
    both tensors back to the host.

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
    rows_ids = _as_rows(segment_ids)
    end = rows_ids.shape[1] if segment_ids.dim() == 2 else rows_ids.numel()
    got_rows, want_rows = _as_rows(cu_seqlens).tolist(), _as_rows(derived).tolist()
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
