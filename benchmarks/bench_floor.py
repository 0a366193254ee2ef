"""Where to_training's time goes on the CPU: each layer beside the floor below it, in one run.

Rows, for 8 x 80 tokens (the fixed cost of a call) and 8 x 8,193 (the benchmark
workload of bench_to_training.py), every to_training output at once:
- to_training: argument and payload checks, stacking, the transform chain, output assembly;
- the transform chain alone, run on the stacked TensorDict;
- the NumPy passes alone: the same outputs from plain arrays, with no check, no
  TensorDict and no transform (checked equal to to_training's before timing);
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

from zephon_collate import SampleBatch, TrainingOptions, functional
from zephon_collate.collate.plan import build_chain

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
    cu_seqlens, max_seqlen = functional.cu_seqlens_rows.cpu(positions[:, :-1])  # the NumPy twin
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


def check_equal(batch: SampleBatch) -> None:
    want = batch.to_training(**FULL_OPTIONS)
    for key, value in numpy_passes(batch).items():
        same = torch.equal(value, want[key]) if isinstance(value, torch.Tensor) else value == want[key]
        if not same:
            raise AssertionError(f"the NumPy passes differ from to_training on {key!r}")


def main() -> None:
    torch.set_num_threads(1)
    options = TrainingOptions(**FULL_OPTIONS)
    print("to_training with every output, CPU, 1 thread; medians of interleaved rounds\n")
    print(
        "| tokens | to_training | chain alone | NumPy passes alone | copy of the output | NumPy / to_training |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for length in (81, 8193):
        batch = SampleBatch(to_records(packed_rows(length=length)))
        check_equal(batch)
        stacked = batch.to_tensordict(dtype=torch.long)  # the payloads are int64: what to_training stacks
        chain = build_chain(options, tuple(stacked.keys()))
        source = torch.ones(output_bytes(batch.to_training(**FULL_OPTIONS)), dtype=torch.uint8)
        us = {
            name: seconds * 1e6
            for name, seconds in compare(
                {
                    "ours": lambda batch=batch: batch.to_training(**FULL_OPTIONS),
                    "chain": lambda chain=chain, stacked=stacked: chain(stacked),
                    "numpy": lambda batch=batch: numpy_passes(batch),
                    "copy": lambda source=source: source.clone(),
                }
            ).items()
        }
        print(
            f"| 8 x {length - 1:,} | {us['ours']:,.0f} us | {us['chain']:,.0f} us | {us['numpy']:,.0f} us "
            f"| {us['copy']:,.0f} us | {us['numpy'] / us['ours']:.2f} |"
        )


if __name__ == "__main__":
    main()
