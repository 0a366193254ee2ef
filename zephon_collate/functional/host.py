"""The NumPy twins of the segment and padding kernels, for the transforms' host variants."""

from __future__ import annotations

import numpy as np

__all__ = [
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "last_token_index",
    "predicted_labels",
    "ragged_starts",
    "segment_ids",
    "segment_starts",
    "sequence_map",
    "trailing",
]


def trailing(counts: np.ndarray, length: int) -> np.ndarray:
    """``[B, length]`` booleans, True on the last ``counts[b]`` entries of row ``b``."""
    ends: np.ndarray = np.arange(length) >= (length - counts.astype(np.int64, copy=False))[:, None]
    return ends


def segment_starts(positions: np.ndarray) -> np.ndarray:
    """Segment starts in ``[B, S]`` positions: each row's first token, and where they are 0."""
    starts: np.ndarray = positions == 0
    if starts.shape[-1]:
        starts[..., 0] = True
    return starts


def ragged_starts(offsets: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """Segment starts of rows laid end to end (row ``b`` from ``offsets[b]``): first tokens, and positions 0.

    Example:
        >>> ragged_starts(np.array([0, 3, 5]), np.array([0, 1, 0, 0, 1])).tolist()
        [True, False, True, True, False]
    """
    starts = np.zeros(int(offsets[-1]), dtype=bool) if positions is None else np.asarray(positions) == 0
    firsts = offsets[:-1][offsets[1:] > offsets[:-1]]
    starts[firsts] = True
    return starts


def segment_ids(starts: np.ndarray) -> np.ndarray:
    """``[B, S]`` int32: each token's segment in its row (``cumsum(starts) - 1``)."""
    if starts.ndim != 2 or starts.size < 4096 or not starts[:, 0].all():
        counted: np.ndarray = starts.cumsum(axis=-1, dtype=np.int32)  # the method: np.cumsum adds two calls
        counted -= 1
        return counted
    # Every row starts a segment: each segment's number repeated over its length, a pass cumsum's
    # serial scan cannot match (on large batches); numbered across rows, then from 0 in each row.
    firsts = np.flatnonzero(starts)
    sizes = np.empty_like(firsts)
    sizes[:-1] = firsts[1:] - firsts[:-1]
    sizes[-1] = starts.size - firsts[-1]
    ids: np.ndarray = np.arange(firsts.size, dtype=np.int32).repeat(sizes).reshape(starts.shape)
    if len(ids) > 1:
        ids -= ids[:, :1]
    return ids


def _longest(boundaries: np.ndarray) -> np.ndarray:
    if boundaries.shape[-1] < 2:
        return np.zeros(boundaries.shape[:-1], dtype=np.int32)
    # The ufunc's reduce: ndarray.max goes through a Python wrapper.
    return np.asarray(np.maximum.reduce(boundaries[..., 1:] - boundaries[..., :-1], axis=-1))


def cu_seqlens_rows(positions: np.ndarray, num_boundaries: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row boundaries ``[B, K]`` int32 and maxima ``[B]``, as the torch kernel computes them."""
    rows, length = positions.shape
    flat = np.flatnonzero(segment_starts(positions))  # flat indices, already row-sorted
    row = flat // max(length, 1)
    rank = np.arange(flat.size) - np.searchsorted(row, row)  # index within its row
    width = num_boundaries if num_boundaries is not None else (int(rank.max()) + 2 if flat.size else 1)
    if flat.size and int(rank.max()) + 2 > width:
        raise _too_few(f"a row has {int(rank.max()) + 1} segments", width)
    boundaries = np.full((rows, width), length, dtype=np.int32)
    boundaries[row, rank] = flat - row * length
    return boundaries, _longest(boundaries)


def cu_seqlens_flat(positions: np.ndarray, num_boundaries: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One boundary sequence over all tokens, as the torch kernel computes it."""
    starts = segment_starts(positions).reshape(-1).nonzero()[0]
    total = positions.size
    width = starts.size + 1 if num_boundaries is None else num_boundaries
    if starts.size + 1 > width:
        raise _too_few(f"the batch has {starts.size} segments", width)
    boundaries = np.empty(width, dtype=np.int32)  # np.full is Python over np.empty and np.copyto
    boundaries[: starts.size] = starts
    boundaries[starts.size :] = total
    return boundaries, _longest(boundaries)


def _too_few(found: str, width: int) -> ValueError:
    """The torch kernel's refusal (a device-side assertion there), with the fix."""
    return ValueError(
        f"cu_seqlens: {found}, more than num_boundaries - 1 = {width - 1}; raise num_boundaries to at "
        "least the segments plus one (the last boundary is the length)"
    )


def last_token_index(
    sequence_index: np.ndarray, input_ids: np.ndarray | None = None, skip_id: int | None = None
) -> np.ndarray:
    """Each sequence's last token (not ``skip_id``) in the flattened batch, as the torch kernel finds it."""
    flat = sequence_index.reshape(-1).astype(np.int64)
    total = flat.size
    count = max(int(flat.max()) + 1, 0) if total else 0
    place = np.arange(total, dtype=np.int64)
    member = flat >= 0
    first = np.full(count + 1, total, dtype=np.int64)
    np.minimum.at(first, np.where(member, flat, count), place)
    kept = member
    if input_ids is not None and skip_id is not None:
        kept = member & (input_ids.reshape(-1).astype(np.int64) != skip_id)
    last = np.full(count + 1, -1, dtype=np.int64)
    np.maximum.at(last, np.where(kept, flat, count), place)
    found = np.where(first < total, first, -1)
    return np.asarray(np.where(last >= 0, last, found)[:count], dtype=np.int64)


def sequence_map(
    positions: np.ndarray, padding_length: np.ndarray, example_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A padding-free row's ``logits_index``, ``sequence_index`` and sequence count, as the torch kernel."""
    flat = positions.reshape(-1)
    place = np.arange(flat.size, dtype=np.int64)
    lengths = example_lengths.reshape(-1).astype(np.int64)
    real = (place < flat.size - int(padding_length.sum())) & (place < int(lengths.sum()))
    empty = lengths == 0
    ends = np.cumsum(lengths)
    example = np.searchsorted(ends, place, side="right")
    firsts = np.concatenate([ends - lengths, [flat.size]])
    starts = ((flat == 0) | (place == firsts[example])) & real
    empties = np.concatenate([[0], np.cumsum(empty, dtype=np.int64)])[example]
    number = np.where(real, np.cumsum(starts, dtype=np.int64) - 1 + empties, -1)
    index = np.where(real & ~starts, place - 1, -1)
    count = np.array(int(starts.sum()) + int(empty.sum()), dtype=np.int64)
    return index.reshape(positions.shape), number.reshape(positions.shape), count


def predicted_labels(labels: np.ndarray, logits_index: np.ndarray, ignore_index: int = -100) -> np.ndarray:
    """At each place, the label of the token its logits predict, as the torch kernel finds it."""
    rows, width = labels.shape
    index = logits_index.astype(np.int64)
    keep = (index >= 0) & (labels != ignore_index)
    target = np.where(keep, np.arange(rows)[:, None] * width + index, rows * width).reshape(-1)
    out = np.full(rows * width + 1, ignore_index, dtype=labels.dtype)
    out[target] = labels.reshape(-1)
    return out[:-1].reshape(rows, width)
