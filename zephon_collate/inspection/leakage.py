"""The end-to-end leakage check: packed outputs must equal each document's outputs alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zephon_collate.functional.attention import segment_ids_from_positions

__all__ = ["DocumentCheck", "LeakageError", "LeakageReport", "check_no_leakage"]


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

    Parameters:
        model_fn: ``(input_ids, positions, segment_ids) -> outputs``, all ``[b, s]``, outputs ``[b, s, ...]``.
        input_ids: ``[B, S]`` packed token ids.
        positions: ``[B, S]`` positions restarting at 0 on every segment.
        padding_mask: ``[B, S]`` bool, True on padding (not compared), or ``None``.
        atol, rtol: the tolerance: ``|packed - alone| <= atol + rtol * |alone|`` (NaN fails).
        raise_on_leak: raise :class:`LeakageError` (an ``AssertionError``) naming each leaking document,
            rather than return the report.

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
                worst = float(diff.max()) if diff.numel() else 0.0
                checks.append(DocumentCheck(row, document, start, end, worst, bool(close)))
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
