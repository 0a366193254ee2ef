"""Segments of packed rows: the segment-start rule (:func:`segment_starts`) and what derives from it."""

from __future__ import annotations

import torch

from zephon_collate.core.checks import check_num_boundaries
from zephon_collate.core.keys import INT32_MAX
from zephon_collate.functional._registry import check_tensor, kernel

__all__ = [
    "PADDING_SEGMENT",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "flatten_segment_ids",
    "last_token_index",
    "segment_ids_from_positions",
    "segment_starts",
    "sequence_map",
]

PADDING_SEGMENT = -1
"""The segment id of marked padding tokens."""


@kernel
def segment_starts(positions: torch.Tensor) -> torch.Tensor:
    """True where a segment starts: the first entry of the last dim, and wherever ``positions == 0``.

    Example:
        >>> segment_starts(torch.tensor([[0, 1, 0, 1], [3, 4, 0, 1]])).tolist()
        [[True, False, True, False], [True, False, True, False]]
    """
    check_tensor("segment_starts", "positions", positions, 1)
    first = torch.arange(positions.shape[-1], device=positions.device) == 0
    return (positions == 0) | first


def _longest(boundaries: torch.Tensor) -> torch.Tensor:
    return boundaries.diff(dim=-1, prepend=boundaries[..., :1]).amax(dim=-1)


def _check_boundary_input(kernel_name: str, positions: torch.Tensor, num_boundaries: int | None) -> None:
    check_tensor(kernel_name, "positions", positions, 2, 2)
    if positions.numel() > INT32_MAX:
        raise ValueError(
            f"{kernel_name}: {tuple(positions.shape)} positions overflow the int32 boundaries; use smaller "
            "batches"
        )
    check_num_boundaries(kernel_name, num_boundaries)


@kernel
def cu_seqlens_rows(
    positions: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens [B, K], max_seqlen [B])`` int32 from ``[B, S]`` positions: each row's starts, then ``S``.

    Parameters:
        positions: ``[B, S]`` segment-restarting positions.
        num_boundaries: a fixed ``K`` (no sync; more fails a device-side assertion), or ``None``: read back.

    Example:
        >>> cu, top = cu_seqlens_rows(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
        >>> cu.tolist(), top.tolist()
        ([[0, 3, 5], [0, 5, 5]], [3, 5])
    """
    _check_boundary_input("cu_seqlens_rows", positions, num_boundaries)
    is_start = segment_starts(positions)
    if num_boundaries is None:
        boundaries = _row_boundaries_from_starts(is_start)
    else:
        boundaries = _row_boundaries_static(is_start, num_boundaries)
    return boundaries, _longest(boundaries)


def _row_boundaries_from_starts(is_start: torch.Tensor) -> torch.Tensor:
    """Start indices per row, then the row length, padded to the batch's largest count."""
    rows, length = is_start.shape
    counts = is_start.sum(dim=1)
    width = int(counts.amax()) + 1 if rows and length else 1
    row, column = is_start.nonzero(as_tuple=True)
    first_of_row = counts.cumsum(dim=0) - counts
    rank = torch.arange(row.numel(), device=row.device) - first_of_row[row]
    boundaries = torch.full((rows, width), length, dtype=torch.int32, device=is_start.device)
    return boundaries.index_put((row, rank), column.to(torch.int32))


def _row_boundaries_static(is_start: torch.Tensor, num_boundaries: int, where: str = "a row") -> torch.Tensor:
    """:func:`_row_boundaries_from_starts` with a fixed width: no read-back, a device-side check."""
    rows, length = is_start.shape
    rank = is_start.cumsum(dim=1) - 1
    if length:
        torch._assert_async(
            (rank[:, -1] + 2 <= num_boundaries).all(),
            f"cu_seqlens: {where} has more segments than num_boundaries - 1",
        )
    # Non-starts (and overflowing starts) land in the spare column num_boundaries, dropped below.
    slot = torch.where(is_start, rank, num_boundaries).clamp(max=num_boundaries)
    index = torch.arange(length, device=is_start.device).expand(rows, length)
    boundaries = torch.full((rows, num_boundaries + 1), length, dtype=torch.int64, device=is_start.device)
    return boundaries.scatter(1, slot, index)[:, :num_boundaries].to(torch.int32)


@kernel
def cu_seqlens_flat(
    positions: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens [N], max_seqlen [])`` int32: one boundary sequence across all ``B * S`` tokens.
    ``num_boundaries`` fixes its length (padded with ``B * S``), as for :func:`cu_seqlens_rows`.

    Example:
        >>> cu, top = cu_seqlens_flat(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
        >>> cu.tolist(), int(top)
        ([0, 3, 5, 10], 5)
    """
    _check_boundary_input("cu_seqlens_flat", positions, num_boundaries)
    flat_starts = segment_starts(positions).reshape(-1)
    if num_boundaries is None:
        starts = flat_starts.nonzero().squeeze(1)
        end = torch.full((1,), flat_starts.numel(), dtype=starts.dtype, device=starts.device)
        boundaries = torch.cat([starts, end]).to(torch.int32)
    else:  # one row of all tokens (with no token, no check: 0 segments always fit)
        boundaries = _row_boundaries_static(flat_starts[None], num_boundaries, "the batch")[0]
    return boundaries, _longest(boundaries)


@kernel
def segment_ids_from_positions(
    positions: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token segment index (int32), from segment-restarting positions.

    Parameters:
        positions: ``[B, S]`` (each row numbered from 0) or flattened ``[N]`` (numbered across the batch).
        padding_mask: boolean, the same shape: True gives :data:`PADDING_SEGMENT` (-1), and takes no number.

    Example:
        >>> positions, padding = torch.tensor([[0, 1, 2, 0, 1, 0]]), torch.tensor([[False] * 5 + [True]])
        >>> segment_ids_from_positions(positions, padding).tolist()
        [[0, 0, 0, 1, 1, -1]]
    """
    if padding_mask is not None and padding_mask.shape != positions.shape:
        raise ValueError(
            f"segment_ids_from_positions: padding_mask has shape {tuple(padding_mask.shape)}, positions "
            f"{tuple(positions.shape)}; give one mask entry per position"
        )
    starts = segment_starts(positions)
    if padding_mask is None:
        return starts.cumsum(dim=-1, dtype=torch.int32) - 1
    ids = (starts & padding_mask.logical_not()).cumsum(dim=-1, dtype=torch.int32) - 1
    return ids.masked_fill(padding_mask, PADDING_SEGMENT)


@kernel
def flatten_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """Number per-row ``[B, S]`` segment ids across the batch: ``[B * S]`` int32, the ``seq_idx`` layout.

    Example:
        >>> flatten_segment_ids(torch.tensor([[0, 0, 1, -1], [0, 1, 1, 2]])).tolist()
        [0, 0, 1, -1, 2, 3, 3, 4]
    """
    check_tensor("flatten_segment_ids", "segment_ids", segment_ids, 2, 2)
    ids = segment_ids.to(torch.int64)  # narrow ids offset by many segments would wrap around
    if ids.shape[1] == 0:
        return ids.reshape(-1).to(torch.int32)
    counts = ids.amax(dim=1).clamp(min=-1) + 1
    offsets = counts.cumsum(dim=0) - counts
    flat = torch.where(ids >= 0, ids + offsets.unsqueeze(1), ids)
    return flat.reshape(-1).to(torch.int32)


@kernel
def last_token_index(
    sequence_index: torch.Tensor, input_ids: torch.Tensor | None = None, skip_id: int | None = None
) -> torch.Tensor:
    """``[S]`` int64: each sequence's last token's place in the flattened ``sequence_index`` (size read back).
    A number no token carries gets -1.

    Parameters:
        sequence_index: ``[B, L]`` or ``[N]``: each token's sequence, -1 on padding.
        input_ids: the same shape, read with ``skip_id``.
        skip_id: the place is that of the last token whose id is not this one (the first if all are).

    Example:
        >>> ids = torch.tensor([5, 6, 9, 7, 9, 0])
        >>> last_token_index(torch.tensor([0, 0, 0, 1, 1, -1]), ids, skip_id=9).tolist()
        [1, 3]
    """
    check_tensor("last_token_index", "sequence_index", sequence_index, 1, 2)
    if input_ids is not None and input_ids.shape != sequence_index.shape:
        raise ValueError(
            f"last_token_index: input_ids has shape {tuple(input_ids.shape)}, sequence_index "
            f"{tuple(sequence_index.shape)}; give one id per token"
        )
    flat = sequence_index.reshape(-1).to(torch.int64)
    total = flat.numel()
    count = max(int(flat.max()) + 1, 0) if total else 0  # the data-dependent size
    place = torch.arange(total, device=flat.device)
    member = flat >= 0
    spare = torch.full_like(flat, count)  # tokens of no sequence go to a slot past the end
    first = torch.full((count + 1,), total, dtype=torch.int64, device=flat.device)
    first = first.scatter_reduce(0, torch.where(member, flat, spare), place, "amin")
    kept = member
    if input_ids is not None and skip_id is not None:
        kept = member & (input_ids.reshape(-1).to(torch.int64) != skip_id)
    last = torch.full((count + 1,), -1, dtype=torch.int64, device=flat.device)
    last = last.scatter_reduce(0, torch.where(kept, flat, spare), place, "amax")
    found = torch.where(first < total, first, torch.full_like(first, -1))
    return torch.where(last >= 0, last, found)[:count]


@kernel
def sequence_map(
    positions: torch.Tensor, padding_length: torch.Tensor, example_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padding-free row's ``(logits_index, sequence_index)``, ``[1, S]`` int64 (-1 on padding), and the
    number of sequences (0-d int64); ``docs/transforms.md`` defines them.

    Parameters:
        positions: ``[1, S]`` segment-restarting positions.
        padding_length: ``[1]`` the row's trailing padding.
        example_lengths: ``[1, E]`` each example's token count, in order.

    Example:
        >>> index, number, count = sequence_map(
        ...     torch.tensor([[0, 1, 0, 0, 1, 0]]), torch.tensor([1]), torch.tensor([[3, 0, 2]])
        ... )
        >>> index.tolist(), number.tolist(), int(count)
        ([[-1, 0, -1, -1, 3, -1]], [[0, 0, 1, 3, 3, -1]], 4)
    """
    check_tensor("sequence_map", "positions", positions, 2, 2)
    flat = positions.reshape(-1)
    place = torch.arange(flat.numel(), device=flat.device)
    lengths = example_lengths.reshape(-1).to(torch.int64)
    # Tokens of the examples: not the padding, nor what follows the last example (a dummy image's token).
    real = (place < flat.numel() - padding_length.to(torch.int64).sum()) & (place < lengths.sum())
    empty = lengths == 0
    ends = lengths.cumsum(0)
    example = torch.searchsorted(ends, place, right=True)  # the example holding each token
    firsts = torch.cat([ends - lengths, ends.new_full((1,), flat.numel())])  # padding: no first token
    starts = ((flat == 0) | (place == firsts[example])) & real
    empties = torch.cat([empty.new_zeros(1, dtype=torch.int64), empty.cumsum(0)])[example]  # before it
    number = torch.where(real, starts.cumsum(0) - 1 + empties, -1)
    index = torch.where(real & ~starts, place - 1, -1)
    return index.view(positions.shape), number.view(positions.shape), starts.sum() + empty.sum()
