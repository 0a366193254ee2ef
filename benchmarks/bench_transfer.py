"""What a DataLoader worker's batch costs to reach the main process: inline bytes against shared memory.

Two workers hand the main process the same precomputed batch over and over, so
only the transfer is measured: the split recipe's StackedBatch and the one-step
Collator's output dict (WireOutputs), each forced inline (as bytes in the
pickle) or forced through shared memory, side by side in interleaved rounds.
By default a buffer goes inline up to transfer.PIPE_LIMIT bytes.
Run: python benchmarks/bench_transfer.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FULL_OPTIONS, packed_rows, to_records

from zephon_collate import Collator
from zephon_collate.collate import transfer
from zephon_collate.collate.transfer import StackedBatch, WireOutputs

SHAPES = ((8, 2049), (8, 8193), (8, 32769))


class Indices(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> int:
        return index


def same_batch(batch, _indices):
    """collate_fn: hand over a copy of the precomputed batch (the worker does no collation)."""
    if isinstance(batch, StackedBatch):
        return StackedBatch(batch.td, batch.per_record, batch.metas)
    return WireOutputs(batch)


def set_pipe_limit(limit: int, _worker_id: int) -> None:
    transfer.PIPE_LIMIT = limit


def loader(batch, limit: int) -> DataLoader:
    return DataLoader(
        Indices(),
        batch_size=8,
        collate_fn=functools.partial(same_batch, batch),
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=functools.partial(set_pipe_limit, limit),
    )


def per_batch_us(loaders: dict[str, DataLoader], rounds: int) -> dict[str, float]:
    """Median microseconds per batch of each loader, one epoch per round, rounds interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in loaders}
    for round_index in range(rounds + 1):  # the first round warms the workers up
        for name, data in loaders.items():
            start, count = time.perf_counter(), 0
            for _ in data:
                count += 1
            if round_index:
                samples[name].append((time.perf_counter() - start) / count * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("DataLoader, 2 workers, the same batch each time; medians of interleaved one-epoch rounds\n")
    print("| batch | sent | pickled | inline (bytes) | shared memory | shared / inline | default |")
    print("|---|---|---:|---:|---:|---:|---|")
    for rows, length in SHAPES:
        records = to_records(packed_rows(rows, length))
        collator = Collator(**FULL_OPTIONS)
        for sent, batch in (("StackedBatch", collator.stack(records)), ("output dict", collator(records))):
            size = len(pickle.dumps(same_batch(batch, None)))
            tensors = (
                batch.td
                if isinstance(batch, StackedBatch)
                else {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
            )
            inline = transfer.pack(tensors)[0].numel() <= transfer.PIPE_LIMIT
            loaders = {
                "inline": loader(batch, sys.maxsize),
                "shared": loader(batch, 0),
            }
            us = per_batch_us(loaders, args.rounds)
            del loaders  # stop the persistent workers
            print(
                f"| {rows} x {length:,} | {sent} | {size / 1e3:,.0f} kB | {us['inline']:,.0f} us "
                f"| {us['shared']:,.0f} us | {us['shared'] / us['inline']:.2f} "
                f"| {'inline' if inline else 'shared memory'} |"
            )


if __name__ == "__main__":
    main()
