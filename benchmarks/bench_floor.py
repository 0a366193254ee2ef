"""Where to_training's time goes on the CPU: each layer beside the floor below it, in one run.

Rows, for 8 x 80 tokens (the fixed cost of a call) and 8 x 8,193 (the benchmark
workload of bench_to_training.py), every to_training output at once:
- to_training: argument and payload checks, stacking, the chain, output assembly;
- the chain alone on the stacked batch, as the collate path runs it on the CPU:
  each step's NumPy variant (``use_host_pass``, the default);
- the chain alone as the torch transforms (what runs on a device or compiled);
- hand-written NumPy passes: the same outputs from plain arrays, with no check,
  no reading of records and no chain (checked equal to to_training's first);
- a memory copy of the output bytes.
Run: python benchmarks/bench_floor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EOS, FULL_OPTIONS, compare, output_bytes, packed_rows, to_records

from zephon_collate import Collator, SampleBatch, use_host_pass

IGNORE = -100


def numpy_passes(batch: SampleBatch) -> dict[str, object]:
    """to_training(**FULL_OPTIONS) on trusted, packed, equal-length tensor payloads, in NumPy only."""
    payloads = [record.payload for record in batch.records]
    tokens = np.stack([payload["input_ids"].numpy() for payload in payloads])
    positions = np.stack([payload["positions"].numpy() for payload in payloads])
    supervision = np.stack([payload["loss_mask"].numpy() for payload in payloads])
    padding_length = np.array([record.meta.padding_length or 0 for record in batch.records])
    length = tokens.shape[1]
    padding = np.arange(length) >= (length - padding_length)[:, None]
    labels = tokens[:, 1:].copy()
    np.copyto(labels, IGNORE, where=tokens[:, :-1] == EOS)
    np.copyto(labels, IGNORE, where=(supervision[:, 1:] == 0) | padding[:, 1:])
    loss_mask = (labels != IGNORE).view(np.uint8).astype(np.float32)
    cu_seqlens, max_seqlen = _cu_seqlens_rows(positions[:, :-1])
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
        "labels": torch.from_numpy(labels),
        "positions": torch.from_numpy(np.ascontiguousarray(positions[:, :-1])),
        "num_valid_tokens": int(loss_mask.sum()),
        "loss_mask": torch.from_numpy(loss_mask),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "max_seqlen": torch.from_numpy(max_seqlen),
        "padding_mask": torch.from_numpy(np.ascontiguousarray(padding[:, :-1])),
    }


def _cu_seqlens_rows(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row segment boundaries (a row's first token and every position 0), padded with the row length."""
    rows, length = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    counts = starts.sum(axis=1)
    boundaries = np.full((rows, int(counts.max()) + 1), length, dtype=np.int32)
    row, column = np.nonzero(starts)
    boundaries[row, np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)] = column
    return boundaries, np.diff(boundaries, axis=1).max(axis=1)


def check_equal(batch: SampleBatch) -> None:
    want = batch.to_training(**FULL_OPTIONS)
    for key, value in numpy_passes(batch).items():
        same = torch.equal(value, want[key]) if isinstance(value, torch.Tensor) else value == want[key]
        if not same:
            raise AssertionError(f"the NumPy passes differ from to_training on {key!r}")


def main() -> None:
    torch.set_num_threads(1)
    print("to_training with every output, CPU, 1 thread; medians of interleaved rounds\n")
    print(
        "| tokens | to_training | host pass alone | torch chain alone | NumPy by hand | copy of the output "
        "| NumPy by hand / to_training |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    collator = Collator(**FULL_OPTIONS)
    for length in (81, 8193):
        batch = SampleBatch(to_records(packed_rows(length=length)))
        check_equal(batch)
        data = dict(collator.stack(list(batch.records)).td.items())
        plan = collator.plan(tuple(data))
        source = torch.ones(output_bytes(batch.to_training(**FULL_OPTIONS)), dtype=torch.uint8)

        def torch_chain(plan=plan, data=data):
            with use_host_pass(False):
                return plan.run(data)

        us = {
            name: seconds * 1e6
            for name, seconds in compare(
                {
                    "ours": lambda batch=batch: batch.to_training(**FULL_OPTIONS),
                    "host": lambda plan=plan, data=data: plan.run(data),
                    "torch": torch_chain,
                    "numpy": lambda batch=batch: numpy_passes(batch),
                    "copy": lambda source=source: source.clone(),
                }
            ).items()
        }
        print(
            f"| 8 x {length - 1:,} | {us['ours']:,.0f} us | {us['host']:,.0f} us | {us['torch']:,.0f} us "
            f"| {us['numpy']:,.0f} us | {us['copy']:,.0f} us | {us['numpy'] / us['ours']:.2f} |"
        )


if __name__ == "__main__":
    main()
