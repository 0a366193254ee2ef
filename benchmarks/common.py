"""Shared workload and timing helpers for the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from zephon_collate import SampleMeta, SampleRecord

BOS, EOS, PAD = 1, 2, 0

# The benchmarks' workload: every to_training output at once.
FULL_OPTIONS = {
    "return_labels": True,
    "return_loss_mask": True,
    "return_padding_mask": True,
    "eos_mask_loss": True,
    "eos_token_id": EOS,
    "return_cu_seqlens": True,
    "return_num_valid_tokens": True,
}


def packed_rows(rows: int = 8, length: int = 8193, seed: int = 0) -> list[dict[str, Any]]:
    """Packed rows as NumPy fields: BOS ... EOS documents, trailing padding as its own segment.

    Each dict holds ``input_ids``, ``positions``, ``loss_mask`` (a chat-style prompt
    of each document unsupervised), ``padding`` and ``documents`` (the token arrays).
    Document sizes are drawn from ``[64, 2048)``; see :func:`packed_rows_sized`.
    """
    return packed_rows_sized(rows, length, 64, 2048, seed=seed)


def to_records(rows: list[dict[str, Any]], kind: str = "torch", offset: int = 0) -> list[SampleRecord]:
    """Records with torch tensor (``kind="torch"``) or Python list (``"list"``) payloads."""
    convert = torch.from_numpy if kind == "torch" else (lambda array: array.tolist())
    return [
        SampleRecord(
            SampleMeta(
                (0, 0, offset + i), i % 2, 0, offset + i, {i % 2: 1}, tags={"_padding_length": row["padding"]}
            ),
            {key: convert(row[key]) for key in ("input_ids", "positions", "loss_mask")},
        )
        for i, row in enumerate(rows)
    ]


def timeit(
    fn: Callable[[], Any], *, repeat: int = 7, number: int | None = None, budget: float = 0.25
) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` rounds of ``number`` calls."""
    fn()
    if number is None:
        start = time.perf_counter()
        fn()
        number = max(1, int(budget / max(time.perf_counter() - start, 1e-7)))
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - start) / number)
    return statistics.median(rounds)


def output_bytes(out: dict[str, Any]) -> int:
    """Bytes of the tensors in a to_training output."""
    return sum(v.numel() * v.element_size() for v in out.values() if isinstance(v, torch.Tensor))


def memcpy_seconds(nbytes: int) -> float:
    """Seconds for a plain copy of ``nbytes`` bytes into a new buffer."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    return timeit(lambda: source.clone())


def compare(fns: dict[str, Callable[[], Any]], *, rounds: int = 9, budget: float = 0.05) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds (fair on a noisy machine)."""
    numbers = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        numbers[name] = max(1, int(budget / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / numbers[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_rss_growth(fn: Callable[[], Any]) -> int:
    """Bytes by which the process's peak resident memory grows while ``fn`` runs (Linux).

    Resets the high-water mark (``/proc/self/clear_refs``) first, after returning
    freed heap memory to the system, so earlier peaks do not hide this one.
    """
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)

    def status(field: str) -> int:
        with open("/proc/self/status") as handle:
            line = next(line for line in handle if line.startswith(field))
        return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = status("VmRSS:")
    result = fn()
    growth = status("VmHWM:") - before
    del result
    return growth


def packed_rows_sized(
    rows: int, length: int, low: int, high: int, seed: int = 0, slack: int = 16
) -> list[dict[str, Any]]:
    """Like :func:`packed_rows`, with document sizes drawn from ``[low, high)`` (at least 4 tokens).

    Documents are added until the next one would leave fewer than ``slack`` tokens
    (at most ``length // 8``) free; the rest of the row is trailing padding.
    """
    rng = np.random.default_rng(seed)
    low = max(4, low)
    high = max(low + 1, high)
    cap = length - min(slack, length // 8)
    out = []
    for _ in range(rows):
        documents, used = [], 0
        while True:
            size = int(rng.integers(low, high))
            if used + size > cap:
                break
            body = rng.integers(3, 32000, size - 2)
            documents.append(np.concatenate([[BOS], body, [EOS]]).astype(np.int64))
            used += size
        padding = length - used
        tokens = np.concatenate([*documents, np.full(padding, PAD, dtype=np.int64)])
        positions = np.concatenate([np.arange(len(d)) for d in documents] + [np.arange(padding)])
        mask = np.concatenate(
            [np.arange(len(d)) >= len(d) // 4 for d in documents] + [np.zeros(padding, bool)]
        )
        out.append(
            {
                "input_ids": tokens,
                "positions": positions.astype(np.int64),
                "loss_mask": mask.astype(np.int64),
                "padding": padding,
                "documents": documents,
            }
        )
    return out


def hf_call(rows: list[dict[str, Any]]) -> Callable[[], Any] | None:
    """DataCollatorWithFlattening on the rows' documents as list features; None without transformers."""
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:
        return None
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    features = [{"input_ids": doc.tolist()} for row in rows for doc in row["documents"]]
    return lambda: collator(features, return_tensors="pt")


def read_lists(records: list[SampleRecord]) -> Callable[[], None]:
    """The floor for list payloads: np.fromiter over every field of every payload."""

    def read() -> None:
        for record in records:
            for value in record.payload.values():
                np.fromiter(value, dtype=np.int64, count=len(value))

    return read
