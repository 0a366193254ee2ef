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
- ``cu_seqlens`` for varlen kernels come from
  :func:`zephon_collate.functional.cu_seqlens_rows` /
  :func:`~zephon_collate.functional.cu_seqlens_flat` (the :class:`CuSeqlens`
  transform); :func:`cu_seqlens_from_segment_ids` and :func:`check_consistent`
  tie them to the segment ids.

:func:`check_no_leakage` checks a model end to end: its outputs on a packed
batch must equal its outputs on each document alone.

**Padding.** Segment ids may mark trailing padding with ``-1``
(``padding_mask`` here, ``mark_padding`` in :class:`SegmentIds`). Masks built
from marked ids let a padding token attend to itself only: no real token
attends to padding, padding attends to no real token, and no softmax row is
empty (an all-masked row would give NaN in SDPA). Unmarked, the padding is a
segment like the others: nothing attends across it either way.

The pure functions take tensors and return new ones, never write into their
inputs, and hold no Python branch on tensor values (they run on any device and
under ``torch.compile``), except the two checks, which read results back to
build their reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zephon_collate.functional import cu_seqlens_flat, cu_seqlens_rows, trailing_mask

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "PADDING_SEGMENT",
    "DocumentCheck",
    "LeakageError",
    "LeakageReport",
    "check_consistent",
    "check_no_leakage",
    "cu_seqlens_from_segment_ids",
    "dense_document_mask",
    "document_block_mask",
    "document_mask_mod",
    "flatten_segment_ids",
    "padding_from_length",
    "segment_ids_from_positions",
]

PADDING_SEGMENT = -1
"""The segment id of marked padding tokens."""


def segment_ids_from_positions(
    positions: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token segment index from segment-restarting positions.

    A segment starts wherever ``positions == 0``; the id is the running count
    of starts minus one (``cumsum(positions == 0) - 1``), so each ``[B, S]``
    row numbers its segments ``0, 1, ...``. Flattened ``[N]`` positions (a
    ``to_training(flatten=True)`` output, every row starting at 0) give
    batch-global ids, as :func:`flatten_segment_ids` numbers them. The first
    token always starts a segment (a row whose positions do not start at 0
    has its leading tokens as segment 0; ``cu_seqlens`` needs zero-start rows
    anyway). Where the boolean ``padding_mask`` (same shape) is True the id is
    :data:`PADDING_SEGMENT` (-1), so no kernel treats padding as a document;
    padding then takes no number, so the documents keep ids ``0 .. D-1``.

    Returns:
        int32 ids of the shape of ``positions``, on its device.

    Example:
        >>> positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
        >>> segment_ids_from_positions(positions).tolist()
        [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
        >>> padding = torch.tensor([[False] * 5 + [True], [False] * 6])
        >>> segment_ids_from_positions(positions, padding).tolist()
        [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 1, 1]]
        >>> segment_ids_from_positions(positions.reshape(-1), padding.reshape(-1)).tolist()
        [0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 3, 3]
    """
    first = torch.arange(positions.shape[-1], device=positions.device) == 0
    starts = (positions == 0) | first
    if padding_mask is None:
        return starts.cumsum(dim=-1, dtype=torch.int32) - 1
    ids = (starts & padding_mask.logical_not()).cumsum(dim=-1, dtype=torch.int32) - 1
    return ids.masked_fill(padding_mask, PADDING_SEGMENT)


def padding_from_length(padding_length: torch.Tensor, length: int, shifted: bool = False) -> torch.Tensor:
    """Boolean ``[B, length]`` padding mask from per-row trailing pad counts ``[B]``.

    ``padding_length[b]`` counts the last tokens of row ``b`` as they were
    packed. With ``shifted=True`` the rows have since been cut to the model's
    inputs (``[:, :-1]``, :class:`TokenShift`), which removed one padding
    token from each padded row: the mask then covers ``padding_length - 1``
    tokens, as :class:`PaddingMask` placed before the shift does.

    Example:
        >>> padding_from_length(torch.tensor([2, 0]), 4).tolist()
        [[False, False, True, True], [False, False, False, False]]
        >>> padding_from_length(torch.tensor([2, 0]), 3, shifted=True).tolist()
        [[False, False, True], [False, False, False]]
    """
    if shifted:
        padding_length = (padding_length - 1).clamp(min=0)
    return trailing_mask(padding_length, length)


def flatten_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """Number per-row ``[B, S]`` segment ids across the batch: ``[B * S]``, the ``seq_idx`` layout.

    Row ``b``'s ids are offset by the number of segments in the rows before
    it, so every document of the batch has its own id, increasing along the
    flattened sequence; marked padding stays -1. Use these (not per-row ids
    reshaped, which would give the first document of a row the id of the one
    before it) for a flattened ``[1, B * S]`` attention layout.

    Example:
        >>> ids = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 2]], dtype=torch.int32)
        >>> flatten_segment_ids(ids).tolist()
        [0, 0, 1, -1, 2, 3, 3, 4]
    """
    if segment_ids.shape[1] == 0:
        return segment_ids.reshape(-1)
    counts = segment_ids.amax(dim=1) + 1
    offsets = counts.cumsum(dim=0) - counts
    flat = segment_ids + offsets.unsqueeze(1).to(segment_ids.dtype)
    return torch.where(segment_ids >= 0, flat, segment_ids).reshape(-1)


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


def _starts_as_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions-like ``[B, S]`` tensor, zero exactly where a segment starts, for the cu_seqlens kernels."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.ones_like(segment_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, change], dim=1).logical_not().to(torch.int32)


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


@dataclass(frozen=True)
class DocumentCheck:
    """One document's comparison: packed output ``[start:end]`` of ``row`` against the document alone."""

    row: int
    document: int
    start: int
    end: int
    max_abs_diff: float
    ok: bool

    def __str__(self) -> str:
        return (
            f"row {self.row}, document {self.document} (tokens {self.start}:{self.end}): "
            f"max |packed - alone| = {self.max_abs_diff:.3g}"
        )


@dataclass(frozen=True)
class LeakageReport:
    """What :func:`check_no_leakage` compared: one :class:`DocumentCheck` per document."""

    documents: tuple[DocumentCheck, ...]
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        """True when every document's packed output matches its output alone."""
        return all(check.ok for check in self.documents)

    @property
    def leaks(self) -> tuple[DocumentCheck, ...]:
        """The documents whose packed output differs."""
        return tuple(check for check in self.documents if not check.ok)

    @property
    def max_abs_diff(self) -> float:
        """The largest difference over all documents (0.0 when there are none)."""
        return max((check.max_abs_diff for check in self.documents), default=0.0)

    def __str__(self) -> str:
        tolerance = f"atol={self.atol:g}, rtol={self.rtol:g}"
        if self.ok:
            return (
                f"no leakage: {len(self.documents)} documents match their outputs alone "
                f"(max |packed - alone| = {self.max_abs_diff:.3g}, {tolerance})"
            )
        shown = "; ".join(str(check) for check in self.leaks[:5])
        more = f"; and {len(self.leaks) - 5} more" if len(self.leaks) > 5 else ""
        return (
            f"attention leaks across documents: {len(self.leaks)} of {len(self.documents)} documents "
            f"change when packed ({tolerance}): {shown}{more}"
        )


class LeakageError(AssertionError):
    """Raised by :func:`check_no_leakage`: a model's packed outputs depend on other documents."""

    def __init__(self, report: LeakageReport) -> None:
        super().__init__(str(report))
        self.report = report


def _segments(row_ids: list[int]) -> list[tuple[int, int, int]]:
    """(segment id, start, end) of each run of equal ids in one row, padding (-1) left out."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for index in range(1, len(row_ids) + 1):
        if index == len(row_ids) or row_ids[index] != row_ids[start]:
            if row_ids[start] >= 0:
                runs.append((row_ids[start], start, index))
            start = index
    return runs


def check_no_leakage(
    model_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    raise_on_leak: bool = True,
) -> LeakageReport:
    """Check that a model's outputs on a packed batch do not depend on the other documents in a row.

    Runs the packed batch once, then each document alone (a ``[1, L]`` batch of
    its tokens and positions, all in segment 0), and compares the document's
    slice of the packed output with its output alone:
    ``|packed - alone| <= atol + rtol * |alone|`` everywhere (NaN fails).
    Padding (``padding_mask``) is marked -1 in the segment ids and not
    compared. A causal leak cannot change the first document of a row; it
    shows in the documents after it, so pass rows with several documents.

    ``model_fn(input_ids, positions, segment_ids) -> outputs`` takes ``[b, s]``
    token ids, segment-restarting positions and int32 segment ids
    (:func:`segment_ids_from_positions`; build the kernel's metadata from them
    with :func:`dense_document_mask`, :func:`document_block_mask` or
    :func:`cu_seqlens_from_segment_ids`) and returns a tensor whose first two
    dims are ``[b, s]`` (e.g. logits ``[b, s, V]``). Put the model in eval mode
    (no dropout); the check runs under ``torch.no_grad()`` and reads results
    back to the host (a test or debug tool, not for the training loop).

    Parameters:
        model_fn: the model, as above.
        input_ids: ``[B, S]`` packed token ids.
        positions: ``[B, S]`` positions restarting at 0 on every segment.
        padding_mask: ``[B, S]`` bool, True on padding tokens (``padding_mask`` of
            ``to_training``), or ``None``: padding segments are then checked like documents.
        atol, rtol: the tolerance of the comparison.
        raise_on_leak: raise :class:`LeakageError` when a document differs (else
            return the report, whose ``ok`` is False).

    Returns:
        The :class:`LeakageReport`: per document, its row, index in the row,
        token span and largest absolute difference.

    Raises:
        LeakageError: (an ``AssertionError``) naming each leaking document's row,
            index, span and difference, when ``raise_on_leak``.
        ValueError: if shapes disagree or ``model_fn`` returns the wrong shape.
        TypeError: if ``model_fn`` does not return a tensor.

    Example:
        >>> def bag_of_words(input_ids, positions, segment_ids):  # mixes the whole row: leaks
        ...     return input_ids.float().cumsum(dim=1).unsqueeze(-1)
        >>> ids, pos = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 0, 1]])
        >>> report = check_no_leakage(bag_of_words, ids, pos, raise_on_leak=False)
        >>> report.ok, [str(check) for check in report.leaks]
        (False, ['row 0, document 1 (tokens 2:4): max |packed - alone| = 11'])
    """
    if input_ids.dim() != 2 or positions.shape != input_ids.shape:
        raise ValueError(
            f"check_no_leakage: input_ids and positions must both be [B, S], got shapes "
            f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if padding_mask is not None and padding_mask.shape != input_ids.shape:
        raise ValueError(
            f"check_no_leakage: padding_mask must be [B, S] like input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(padding_mask.shape)}"
        )
    segment_ids = segment_ids_from_positions(positions, padding_mask)
    with torch.no_grad():
        packed = _call(model_fn, input_ids, positions, segment_ids, "the packed batch")
        checks = []
        for row, row_ids in enumerate(segment_ids.tolist()):
            for document, start, end in _segments(row_ids):
                alone_ids = input_ids[row : row + 1, start:end]
                alone = _call(
                    model_fn,
                    alone_ids,
                    positions[row : row + 1, start:end],
                    torch.zeros_like(alone_ids, dtype=torch.int32),
                    f"row {row}, document {document} alone",
                )[0]
                got = packed[row, start:end]
                close = torch.isclose(got, alone, rtol=rtol, atol=atol).all()
                diff = (got.double() - alone.double()).abs().nan_to_num(nan=float("inf"))
                checks.append(
                    DocumentCheck(
                        row, document, start, end, float(diff.max()) if diff.numel() else 0.0, bool(close)
                    )
                )
    report = LeakageReport(tuple(checks), atol, rtol)
    if raise_on_leak and not report.ok:
        raise LeakageError(report)
    return report


def _call(
    model_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    what: str,
) -> torch.Tensor:
    out = model_fn(input_ids, positions, segment_ids)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"check_no_leakage: model_fn must return a tensor, got {type(out).__name__} for {what}"
        )
    if out.shape[:2] != input_ids.shape:
        raise ValueError(
            f"check_no_leakage: model_fn returned shape {tuple(out.shape)} for {what}; its first two "
            f"dims must be those of input_ids {tuple(input_ids.shape)}"
        )
    return out
