"""Pure tensor kernels behind the transforms.

Each function takes tensors and returns new tensors; none writes into its
inputs, none loops over tokens in Python, and none synchronises with the device
except :func:`cu_seqlens_rows` / :func:`cu_seqlens_flat` when they are not given
a fixed boundary count (their output size then depends on the data).

On CPU tensors in eager mode the comparison-heavy kernels run their NumPy
twins (:mod:`zephon_collate.numpy_kernels`): same results, several times
faster there. On other devices and under ``torch.compile`` they run in torch.

Shapes: ``B`` rows of ``S`` tokens; per-token fields are ``[B, S]`` or
``[B, S, ...]`` for non-scalar tokens.
"""

from __future__ import annotations

import torch

from zephon_collate import numpy_kernels

__all__ = [
    "align_mask",
    "apply_loss_mask",
    "as_float",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "eos_label_mask",
    "mask_labels",
    "sequence_positions",
    "shift_tokens",
    "trailing_mask",
]


def _check_tensor(kernel: str, name: str, value: object, min_dim: int = 0, max_dim: int = 64) -> torch.Tensor:
    """``value``, if a tensor (else ``TypeError``) of ``min_dim`` to ``max_dim`` dims (else ValueError)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not min_dim <= value.dim() <= max_dim:
        raise ValueError(
            f"{kernel}: {name} has shape {tuple(value.shape)}; it needs {min_dim} to {max_dim} dims"
        )
    return value


def shift_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``[B, S, ...]`` tokens into next-token ``(inputs, labels)``.

    Returns views: ``inputs = tokens[:, :-1]`` and ``labels = tokens[:, 1:]``.

    Example:
        >>> inputs, labels = shift_tokens(torch.tensor([[5, 6, 7]]))
        >>> inputs.tolist(), labels.tolist()
        ([[5, 6]], [[6, 7]])
    """
    _check_tensor("shift_tokens", "tokens", tokens, 2)
    return tokens[:, :-1], tokens[:, 1:]


def trailing_mask(padding_length: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[B, length]`` mask, True on the last ``padding_length[b]`` entries of row ``b``.

    Example:
        >>> trailing_mask(torch.tensor([0, 2]), 4).tolist()
        [[False, False, False, False], [False, False, True, True]]
    """
    _check_tensor("trailing_mask", "padding_length", padding_length, 1, 1)
    if numpy_kernels.applies(padding_length):
        return numpy_kernels.trailing_mask(padding_length, length)
    index = torch.arange(length, device=padding_length.device)
    return index >= (length - padding_length).unsqueeze(1)


def align_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View a ``[B, S]`` mask with trailing singleton dims so it broadcasts against ``like``."""
    return mask.reshape(*mask.shape, *([1] * (like.dim() - mask.dim())))


def mask_labels(labels: torch.Tensor, mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Return ``labels`` with ``ignore_index`` wherever the ``[B, S]`` ``mask`` is True.

    Example:
        >>> mask_labels(torch.tensor([[4, 5, 6]]), torch.tensor([[False, True, False]]), -100).tolist()
        [[4, -100, 6]]
    """
    _check_tensor("mask_labels", "labels", labels)
    _check_tensor("mask_labels", "mask", mask, 0, labels.dim())
    if numpy_kernels.applies(labels, mask):
        return numpy_kernels.mask_labels(labels, mask, ignore_index)
    fill = torch.full((), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.where(align_mask(mask, labels), fill, labels)


def as_float(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as float32 1.0/0.0.

    In eager mode on the CPU it casts through uint8 (the same bytes): that cast
    is vectorised there and several times faster than bool -> float32. Compiled
    code casts directly (inductor turns the uint8 view into slow bool stores).

    Example:
        >>> as_float(torch.tensor([True, False])).tolist()
        [1.0, 0.0]
    """
    if _check_tensor("as_float", "mask", mask).dtype != torch.bool:
        raise TypeError(f"as_float: mask must be a bool tensor, got {mask.dtype}")
    if mask.device.type == "cpu" and not torch.compiler.is_compiling():
        return mask.view(torch.uint8).to(torch.float32)
    return mask.to(torch.float32)


def eos_label_mask(inputs: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True where the input token is EOS: the prediction made *from* EOS.

    Example:
        >>> eos_label_mask(torch.tensor([[1, 10, 2, 1, 11]]), 2).tolist()
        [[False, False, True, False, False]]
    """
    if numpy_kernels.applies(_check_tensor("eos_label_mask", "inputs", inputs)):
        return numpy_kernels.eos_label_mask(inputs, eos_token_id)
    return inputs == eos_token_id


def apply_loss_mask(
    labels: torch.Tensor,
    supervision: torch.Tensor | None,
    padding_length: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask unsupervised and padding labels; return ``(labels, loss_mask, counts)``.

    ``labels`` ``[B, S, ...]`` become ``ignore_index`` where the label-aligned
    ``supervision`` mask (``[B, S, ...]``, any dtype) is 0 and on each row's last
    ``padding_length[b]`` positions (either may be ``None``). ``loss_mask`` is
    ``labels != ignore_index`` as float32 and ``counts`` (``[B]`` int64) its
    per-row number of ones.

    Example:
        >>> labels, loss_mask, counts = apply_loss_mask(
        ...     torch.tensor([[11, 12, 13, 0]]), torch.tensor([[0, 1, 1, 1]]), torch.tensor([1]), -100
        ... )
        >>> labels.tolist(), loss_mask.tolist(), counts.tolist()
        ([[-100, 12, 13, -100]], [[0.0, 1.0, 1.0, 0.0]], [2])
    """
    _check_tensor("apply_loss_mask", "labels", labels, 2)
    given = [t for t in (supervision, padding_length) if t is not None]
    for name, tensor in (("supervision", supervision), ("padding_length", padding_length)):
        if tensor is not None:
            _check_tensor("apply_loss_mask", name, tensor, 1, labels.dim())
    if numpy_kernels.applies(labels, *given):
        return numpy_kernels.apply_loss_mask(labels, supervision, padding_length, ignore_index)
    drop = None if supervision is None else supervision.logical_not()
    if padding_length is not None:
        padding = trailing_mask(padding_length, labels.shape[1])
        drop = padding if drop is None else drop | align_mask(padding, drop)  # [B, S] over [B, S, ...]
    if drop is not None:
        labels = mask_labels(labels, drop, ignore_index)
    valid = labels != ignore_index
    return labels, as_float(valid), valid.flatten(1).sum(dim=1)  # flatten, not reshape: B = 0 works


def sequence_positions(like: torch.Tensor) -> torch.Tensor:
    """Positions ``[0, 1, ..., S-1]`` in every row of ``like`` (``[B, S, ...]``), in its dtype and device.

    Example:
        >>> sequence_positions(torch.zeros(2, 3, dtype=torch.int32)).tolist()
        [[0, 1, 2], [0, 1, 2]]
    """
    rows, length = _check_tensor("sequence_positions", "like", like, 2).shape[:2]
    if like.dtype == torch.bool or like.dtype.is_complex:
        raise TypeError(f"sequence_positions: like must hold integer or float values, got {like.dtype}")
    return torch.arange(length, dtype=like.dtype, device=like.device).expand(rows, length).contiguous()


def _segment_lengths_max(boundaries: torch.Tensor) -> torch.Tensor:
    return boundaries.diff(dim=-1, prepend=boundaries[..., :1]).amax(dim=-1)


def cu_seqlens_rows(
    positions: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row segment boundaries from segment-restarting ``[B, S]`` positions.

    A row's boundaries are the indices where its positions are zero, then its
    length ``S``; rows are padded with ``S`` to ``K`` columns. ``K`` is the
    largest boundary count in the batch, which depends on the data: finding it
    reads one number back from the device. Pass ``num_boundaries`` to fix ``K``
    instead (no sync, static shape); a row needing more boundaries than that
    fails a device-side assertion.

    Returns:
        ``(cu_seqlens [B, K] int32, max_seqlen [B] int32)``, the maximum being
        each row's longest segment.

    Example:
        >>> cu, top = cu_seqlens_rows(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
        >>> cu.tolist(), top.tolist()
        ([[0, 3, 5], [0, 5, 5]], [3, 5])
    """
    _check_tensor("cu_seqlens_rows", "positions", positions, 2, 2)
    if num_boundaries is None and numpy_kernels.applies(positions):
        return numpy_kernels.cu_seqlens_rows(positions)
    is_start = positions.logical_not()
    if num_boundaries is None:
        boundaries = _row_boundaries_from_starts(is_start)
    else:
        boundaries = _row_boundaries_static(is_start, num_boundaries)
    return boundaries, _segment_lengths_max(boundaries)


def _row_boundaries_from_starts(is_start: torch.Tensor) -> torch.Tensor:
    """Start indices per row, then the row length, padded to the batch's largest count (reads it back)."""
    rows, length = is_start.shape
    counts = is_start.sum(dim=1)
    width = int(counts.amax()) + 1 if rows and length else 1
    row, column = is_start.nonzero(as_tuple=True)
    first_of_row = counts.cumsum(dim=0) - counts
    rank = torch.arange(row.numel(), device=row.device) - first_of_row[row]
    boundaries = torch.full((rows, width), length, dtype=torch.int32, device=is_start.device)
    return boundaries.index_put((row, rank), column.to(torch.int32))


def _row_boundaries_static(is_start: torch.Tensor, num_boundaries: int) -> torch.Tensor:
    """Like :func:`_row_boundaries_from_starts` with a fixed width: no read-back, a device-side check."""
    rows, length = is_start.shape
    rank = is_start.cumsum(dim=1) - 1
    if length:
        torch._assert_async(
            (rank[:, -1] + 2 <= num_boundaries).all(),
            "cu_seqlens: a row has more segments than num_boundaries - 1",
        )
    # Non-starts (and overflowing starts) land in the spare column num_boundaries, dropped below.
    slot = torch.where(is_start, rank, num_boundaries).clamp(max=num_boundaries)
    index = torch.arange(length, device=is_start.device).expand(rows, length)
    boundaries = torch.full((rows, num_boundaries + 1), length, dtype=torch.int64, device=is_start.device)
    return boundaries.scatter(1, slot, index)[:, :num_boundaries].to(torch.int32)


def cu_seqlens_flat(
    positions: torch.Tensor, num_boundaries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cumulative boundary sequence across all ``B * S`` tokens of ``[B, S]`` positions.

    Row ``b``'s boundaries are offset by ``b * S``; the sequence ends at ``B * S``.
    Its length depends on the data (one read back from the device), unless
    ``num_boundaries`` fixes it: it is then padded with ``B * S``.

    Returns:
        ``(cu_seqlens [N] int32, max_seqlen [] int32)``.

    Example:
        >>> cu, top = cu_seqlens_flat(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
        >>> cu.tolist(), int(top)
        ([0, 3, 5, 10], 5)
    """
    _check_tensor("cu_seqlens_flat", "positions", positions, 2, 2)
    if num_boundaries is None and numpy_kernels.applies(positions):
        return numpy_kernels.cu_seqlens_flat(positions)
    flat_starts = positions.logical_not().reshape(-1)
    total = flat_starts.numel()
    if num_boundaries is None:
        starts = flat_starts.nonzero().squeeze(1)
        end = torch.full((1,), total, dtype=starts.dtype, device=starts.device)
        boundaries = torch.cat([starts, end]).to(torch.int32)
    else:
        torch._assert_async(
            flat_starts.sum() + 1 <= num_boundaries,
            "cu_seqlens: the batch has more segments than num_boundaries - 1",
        )
        index = torch.arange(total, device=positions.device)
        slot = torch.where(flat_starts, flat_starts.cumsum(0) - 1, num_boundaries)
        slot = slot.clamp(max=num_boundaries)
        boundaries = torch.full((num_boundaries + 1,), total, dtype=torch.int64, device=positions.device)
        boundaries = boundaries.scatter(0, slot, index)
        boundaries = boundaries[:num_boundaries].to(torch.int32)
    return boundaries, _segment_lengths_max(boundaries)
