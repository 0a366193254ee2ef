"""The fused host pass: the built-in chain's outputs computed in a few NumPy passes, on the CPU.

On the CPU, torch's elementwise comparisons over integer tensors run several
times slower than NumPy's, and every torch call has a fixed cost several times
NumPy's before it touches data (``benchmarks/bench_floor.py`` times the host
pass beside the torch chain on the same stacked batch). So when a
plan runs its built-in chain eagerly on plain CPU tensors, it computes the
chain's outputs here instead, from NumPy views of the stacked tensors (no
copy): each function below is the whole chain of one layout, fused, with the
masks combined before a single ``np.where``.

The torch chain is the specification; a hypothesis test checks every function
here against it over the whole option space, every integer dtype and lengths
up to 10,000 (``tests/test_host_pass.py``). :func:`use_host_pass` switches the
pass off in one thread (the torch chain then runs everywhere), and the pass
never runs on another device, under ``torch.compile`` or with autograd.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from zephon_collate.collate.options import TrainingOptions
from zephon_collate.keys import (
    ATTENTION_MASK,
    CU_SEQLENS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITIONS,
    SEGMENT_IDS,
    TOKEN_TYPE_IDS,
)

if TYPE_CHECKING:
    from zephon_collate.collate.hf import TransformersOptions

__all__ = [
    "applies",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "native",
    "segment_starts",
    "trailing",
    "transformers",
    "use_host_pass",
]

_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)
_state = threading.local()


@contextlib.contextmanager
def use_host_pass(enabled: bool) -> Iterator[None]:
    """Within the block, in this thread, run the fused host pass (``True``, the default) or the torch chain.

    Example:
        >>> from zephon_collate import to_training
        >>> from zephon_collate.types import SampleMeta, SampleRecord
        >>> record = SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [5, 6, 7]})
        >>> with use_host_pass(False):  # the torch transforms, as on a GPU
        ...     to_training([record], return_labels=True)["labels"].tolist()
        [[6, 7]]
    """
    previous = getattr(_state, "enabled", True)
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def applies(data: Mapping[str, object]) -> bool:
    """True when the host pass may stand in for the torch chain on ``data`` (a mapping of tensors)."""
    if not getattr(_state, "enabled", True) or torch.compiler.is_compiling():
        return False
    for value in data.values():
        if type(value) is not torch.Tensor or not value.is_cpu or value.requires_grad:
            return False  # another device, autograd, or a subclass (FakeTensor, ...)
        if value.dtype not in _NUMPY_DTYPES:
            return False
    return True


def trailing(counts: np.ndarray, length: int) -> np.ndarray:
    """``[B, length]`` booleans, True on the last ``counts[b]`` entries of row ``b`` (int64 counts)."""
    return np.arange(length) >= (length - counts)[:, None]


def segment_starts(positions: np.ndarray) -> np.ndarray:
    """The segment rule on ``[B, S]`` positions: True at each row's first token and where positions are 0."""
    starts = positions == 0
    if starts.shape[-1]:
        starts[..., 0] = True
    return np.asarray(starts)


def _longest(boundaries: np.ndarray) -> np.ndarray:
    if boundaries.shape[-1] < 2:
        return np.zeros(boundaries.shape[:-1], dtype=np.int32)
    return np.asarray((boundaries[..., 1:] - boundaries[..., :-1]).max(axis=-1))


def cu_seqlens_rows(positions: np.ndarray, num_boundaries: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row boundaries ``[B, K]`` int32 and maxima ``[B]``, as
    :func:`~zephon_collate.functional.cu_seqlens_rows` computes them."""
    rows, length = positions.shape
    flat = np.flatnonzero(segment_starts(positions))  # flat indices, already row-sorted
    row = flat // max(length, 1)
    rank = np.arange(flat.size) - np.searchsorted(row, row)  # index within its row
    width = num_boundaries if num_boundaries is not None else (int(rank.max()) + 2 if flat.size else 1)
    boundaries = np.full((rows, width), length, dtype=np.int32)
    boundaries[row, rank] = flat - row * length
    return boundaries, _longest(boundaries)


def cu_seqlens_flat(positions: np.ndarray, num_boundaries: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One boundary sequence over all tokens, as :func:`~zephon_collate.functional.cu_seqlens_flat`."""
    starts = np.flatnonzero(segment_starts(positions))
    total = positions.size
    width = starts.size + 1 if num_boundaries is None else num_boundaries
    boundaries = np.full(width, total, dtype=np.int32)
    boundaries[: starts.size] = starts
    return boundaries, _longest(boundaries)


def _aligned(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask.reshape(*mask.shape, *([1] * (like.ndim - mask.ndim)))


def native(
    options: TrainingOptions,
    boundary_safe: bool,
    num_boundaries: int | None,
    data: Mapping[str, np.ndarray],
    like_labels: Sequence[str] = (),
    unshifted: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """The outputs of ``options.chain(...)`` over the stacked arrays ``data``; see the module doc.

    ``like_labels`` and ``unshifted`` are the chain's (float fields cut ``[:, 1:]``, or not at all).

    The same keys as the chain's output mapping, the same values, dtypes and shapes.
    """
    out = dict(data)
    tokens = data[INPUT_IDS]
    rows, length = tokens.shape[:2]
    counts = data[PADDING_LENGTH]
    if options.return_padding_mask:
        out[PADDING_MASK] = trailing(counts, length)
    if options.return_labels:
        supervision = data.get(LOSS_MASK)
        drop = trailing(counts, length - 1)  # the last padding_length labels
        if boundary_safe and POSITIONS in data:  # BoundaryMask: no label predicts a segment's first token
            drop = drop | segment_starts(data[POSITIONS])[:, 1:]
        if supervision is not None:
            unsupervised = supervision[:, 1:] == 0
            drop = unsupervised | _aligned(drop, unsupervised)
        inputs = tokens[:, :-1]
        if options.eos_mask_loss and options.eos_token_id is not None:
            # NumPy compares with an id beyond the dtype exactly (all False), as eos_label_mask does.
            drop = drop | _aligned(inputs == options.eos_token_id, drop)
        kept = (INPUT_IDS, LOSS_MASK, PADDING_LENGTH, *unshifted)
        for key in out:
            if key in like_labels:
                out[key] = out[key][:, 1:]
            elif key not in kept:
                out[key] = out[key][:, :-1]
        out[INPUT_IDS] = inputs
        labels = np.where(
            _aligned(drop, tokens), np.asarray(options.ignore_index, tokens.dtype), tokens[:, 1:]
        )
        out[LABELS] = labels
        valid = labels != options.ignore_index
        if options.return_loss_mask:
            out[LOSS_MASK] = valid.view(np.uint8).astype(np.float32)
        else:
            out.pop(LOSS_MASK, None)  # the supervision is consumed
        if options.return_num_valid_tokens:
            out[NUM_VALID_TOKENS] = np.count_nonzero(valid.reshape(rows, -1), axis=1).astype(np.int64)
    if options.return_cu_seqlens:
        boundaries = cu_seqlens_flat if options.flatten else cu_seqlens_rows
        out[CU_SEQLENS], out[MAX_SEQLEN] = boundaries(out[POSITIONS], num_boundaries)
    if options.position_mode == "sequence":
        inputs = out[INPUT_IDS]
        sequence = np.arange(inputs.shape[1], dtype=inputs.dtype)
        out[POSITIONS] = np.broadcast_to(sequence, inputs.shape[:2]).copy()
    return out


def _left(value: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each row rotated right by its pad count: trailing padding becomes leading (``LeftPadding``)."""
    length = value.shape[1]
    source = (np.arange(length) - counts[:, None]) % max(length, 1)
    return np.take_along_axis(value, source.reshape(*source.shape, *([1] * (value.ndim - 2))), axis=1)


def transformers(
    options: TransformersOptions, left: bool, num_boundaries: int | None, data: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The outputs of the ``transformers`` layout's chain over the stacked arrays ``data``.

    Padded: the attention mask and unshifted labels (then rows rotated for left
    padding); padding-free: labels with each segment's first one dropped, and
    ``cu_seqlens`` and segment ids as asked for.
    """
    out = {key: value for key, value in data.items() if key != LOSS_MASK}
    tokens = data[INPUT_IDS]
    counts = data[PADDING_LENGTH]
    length = tokens.shape[1]
    padding = trailing(counts, length)
    drop = data[LOSS_MASK] == 0
    if options.padding_free and options.boundary_safe_labels:
        drop = drop | segment_starts(data[POSITIONS])
    padded = not options.padding_free or options.pad_to_multiple_of is not None
    label_pad = options.label_pad_token_id
    if label_pad == IGNORE_INDEX:
        labels = np.where(drop | padding if padded else drop, tokens.dtype.type(IGNORE_INDEX), tokens)
    else:
        labels = np.where(drop, tokens.dtype.type(IGNORE_INDEX), tokens)
        labels = np.where(padding, tokens.dtype.type(label_pad), labels)
    out[LABELS] = labels
    if not options.padding_free:
        out[ATTENTION_MASK] = (~padding).view(np.uint8).astype(np.int64)
        if left:
            # One flat gather index for every field: each row rotated right by its pad count.
            rows = tokens.shape[0]
            shift = (np.arange(length) - counts[:, None]) % max(length, 1)
            gather = (shift + (np.arange(rows, dtype=np.int64) * length)[:, None]).reshape(-1)
            for key in (INPUT_IDS, POSITIONS, TOKEN_TYPE_IDS, *options.token_floats, ATTENTION_MASK, LABELS):
                if key in out:
                    value = out[key]
                    out[key] = (
                        value.reshape(-1)[gather].reshape(value.shape)
                        if value.ndim == 2
                        else _left(value, counts)
                    )
        return out
    if options.return_flash_attn_kwargs:
        out[CU_SEQLENS], out[MAX_SEQLEN] = cu_seqlens_flat(data[POSITIONS], num_boundaries)
    if options.return_seq_idx:
        out[SEGMENT_IDS] = (np.cumsum(segment_starts(data[POSITIONS]), axis=-1, dtype=np.int32) - 1).reshape(
            -1
        )
    return out
