"""Label kernels: the next-token shift, trailing padding, label and EOS masking, the loss mask."""

from __future__ import annotations

import torch

from zephon_collate.core.checks import check_fits_dtype, fits_dtype
from zephon_collate.functional._registry import check_tensor, kernel

__all__ = [
    "align_mask",
    "apply_loss_mask",
    "as_float",
    "eos_label_mask",
    "mask_labels",
    "padding_from_length",
    "predicted_labels",
    "sequence_positions",
    "shift_tokens",
    "trailing_mask",
]


@kernel
def shift_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``[B, S, ...]`` tokens into the views ``(tokens[:, :-1], tokens[:, 1:])``: inputs and labels.

    Example:
        >>> inputs, labels = shift_tokens(torch.tensor([[5, 6, 7]]))
        >>> inputs.tolist(), labels.tolist()
        ([[5, 6]], [[6, 7]])
    """
    check_tensor("shift_tokens", "tokens", tokens, 2)
    return tokens[:, :-1], tokens[:, 1:]


@kernel
def trailing_mask(padding_length: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[B, length]`` mask, True on the last ``padding_length[b]`` entries of row ``b``.

    Example:
        >>> trailing_mask(torch.tensor([0, 2]), 4).tolist()
        [[False, False, False, False], [False, False, True, True]]
    """
    check_tensor("trailing_mask", "padding_length", padding_length, 1, 1)
    index = torch.arange(length, device=padding_length.device)
    return index >= (length - padding_length.to(torch.int64)).unsqueeze(1)


@kernel
def padding_from_length(padding_length: torch.Tensor, length: int, shifted: bool = False) -> torch.Tensor:
    """Boolean ``[B, length]`` padding mask from per-row trailing pad counts ``[B]``.

    Parameters:
        padding_length: each row's pad count, as the row was packed.
        length: the row length.
        shifted: the rows have since been cut to the inputs (``[:, :-1]``): one padding token less.

    Example:
        >>> padding_from_length(torch.tensor([2, 0]), 3, shifted=True).tolist()
        [[False, False, True], [False, False, False]]
    """
    check_tensor("padding_from_length", "padding_length", padding_length, 1, 1)
    counts = padding_length.to(torch.int64)
    if shifted:
        counts = (counts - 1).clamp(min=0)
    return trailing_mask(counts, length)


def align_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View a ``[B, S]`` mask with trailing singleton dims so it broadcasts against ``like``.

    Example:
        >>> align_mask(torch.ones(2, 3), torch.zeros(2, 3, 4)).shape
        torch.Size([2, 3, 1])
    """
    return mask.reshape(*mask.shape, *([1] * (like.dim() - mask.dim())))


@kernel
def mask_labels(labels: torch.Tensor, mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Return ``labels`` with ``ignore_index`` wherever the ``[B, S]`` ``mask`` is True; ``ValueError`` if
    the integer dtype of ``labels`` cannot hold ``ignore_index``.

    Example:
        >>> mask_labels(torch.tensor([[4, 5, 6]]), torch.tensor([[False, True, False]]), -100).tolist()
        [[4, -100, 6]]
    """
    check_tensor("mask_labels", "labels", labels)
    check_tensor("mask_labels", "mask", mask, 0, labels.dim())
    check_fits_dtype("mask_labels", "ignore_index", ignore_index, labels.dtype)
    fill = torch.full((), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.where(align_mask(mask, labels), fill, labels)


@kernel
def as_float(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as float32 1.0/0.0 (eager on the CPU, through uint8: several times faster).

    Example:
        >>> as_float(torch.tensor([True, False])).tolist()
        [1.0, 0.0]
    """
    if check_tensor("as_float", "mask", mask).dtype != torch.bool:
        raise TypeError(f"as_float: mask must be a bool tensor, got {mask.dtype}")
    if mask.device.type == "cpu" and not torch.compiler.is_compiling():
        return mask.view(torch.uint8).to(torch.float32)
    return mask.to(torch.float32)


@kernel
def eos_label_mask(inputs: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True where the input token is EOS (the prediction made *from* EOS); an id beyond the dtype: none.

    Example:
        >>> eos_label_mask(torch.tensor([[1, 10, 2, 1, 11]]), 2).tolist()
        [[False, False, True, False, False]]
    """
    check_tensor("eos_label_mask", "inputs", inputs)
    if not fits_dtype(eos_token_id, inputs.dtype):  # no token of this dtype can be it
        return torch.zeros(inputs.shape, dtype=torch.bool, device=inputs.device)
    return inputs == eos_token_id


@kernel
def apply_loss_mask(
    labels: torch.Tensor,
    supervision: torch.Tensor | None,
    padding_length: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask unsupervised and padding labels: ``(labels, loss_mask float32, per-row counts [B] int64)``.

    Parameters:
        labels: ``[B, S, ...]`` labels (their dtype must hold ``ignore_index``, else ``ValueError``).
        supervision: the label-aligned mask (any dtype; 0: not trained), or ``None``.
        padding_length: ``[B]`` trailing pad counts, or ``None``.
        ignore_index: the label of what is not trained.

    Example:
        >>> labels, loss_mask, counts = apply_loss_mask(
        ...     torch.tensor([[11, 12, 13, 0]]), torch.tensor([[0, 1, 1, 1]]), torch.tensor([1]), -100
        ... )
        >>> labels.tolist(), loss_mask.tolist(), counts.tolist()
        ([[-100, 12, 13, -100]], [[0.0, 1.0, 1.0, 0.0]], [2])
    """
    check_tensor("apply_loss_mask", "labels", labels, 2)
    for name, tensor in (("supervision", supervision), ("padding_length", padding_length)):
        if tensor is not None:
            check_tensor("apply_loss_mask", name, tensor, 1, labels.dim())
    drop = None if supervision is None else supervision.logical_not()
    if padding_length is not None:
        padding = trailing_mask(padding_length, labels.shape[1])
        drop = padding if drop is None else drop | align_mask(padding, drop)  # [B, S] over [B, S, ...]
    if drop is not None:
        labels = mask_labels(labels, drop, ignore_index)
    else:
        check_fits_dtype("apply_loss_mask", "ignore_index", ignore_index, labels.dtype)
    valid = labels != ignore_index
    return labels, as_float(valid), valid.flatten(1).sum(dim=1)  # flatten, not reshape: B = 0 works


@kernel
def sequence_positions(like: torch.Tensor) -> torch.Tensor:
    """Positions ``[0, 1, ..., S-1]`` in every row of ``like`` (``[B, S, ...]``), in its dtype and device;
    ``TypeError`` for bool or complex ``like``, ``ValueError`` if its integer dtype cannot hold ``S - 1``.

    Example:
        >>> sequence_positions(torch.zeros(2, 3, dtype=torch.int32)).tolist()
        [[0, 1, 2], [0, 1, 2]]
    """
    check_tensor("sequence_positions", "like", like, 2)
    if like.dtype == torch.bool or like.dtype.is_complex:
        raise TypeError(f"sequence_positions: like must hold integer or float values, got {like.dtype}")
    rows, length = like.shape[:2]
    if not like.dtype.is_floating_point and length - 1 > torch.iinfo(like.dtype).max:
        raise ValueError(
            f"sequence_positions: {length} positions do not fit dtype {like.dtype} (at most "
            f"{torch.iinfo(like.dtype).max + 1}); use a wider dtype"
        )
    return torch.arange(length, dtype=like.dtype, device=like.device).expand(rows, length).contiguous()


@kernel
def predicted_labels(
    labels: torch.Tensor, logits_index: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """``[B, L]``: at each place, the label of the token its logits predict (the ``p`` with
    ``logits_index[p]`` the place), ``ignore_index`` where none. A place must predict one token at most.

    Example:
        >>> labels, index = torch.tensor([[-100, 2, 3, 4, 3, 5]]), torch.tensor([[-1, 0, 1, 2, 1, 4]])
        >>> predicted_labels(labels, index).tolist()  # place 1 predicts 3 (twice), place 3 nothing
        [[2, 3, 4, -100, 5, -100]]
    """
    check_tensor("predicted_labels", "labels", labels, 2, 2)
    check_fits_dtype("predicted_labels", "ignore_index", ignore_index, labels.dtype)
    if logits_index.shape != labels.shape:
        raise ValueError(
            f"predicted_labels: logits_index has shape {tuple(logits_index.shape)}, labels "
            f"{tuple(labels.shape)}; give one predictor place per label"
        )
    rows, width = labels.shape
    index = logits_index.to(torch.int64)
    keep = (index >= 0) & (labels != ignore_index)
    base = torch.arange(rows, device=labels.device)[:, None] * width
    target = torch.where(keep, base + index, rows * width).reshape(-1)  # the rest to a spare slot
    out = labels.new_full((rows * width + 1,), ignore_index).scatter(0, target, labels.reshape(-1))
    return out[:-1].view(rows, width)
