"""Benchmark pack_flat: throughput and padding of each strategy on one stream of documents.

Documents of lognormal length (fixed seed) adding up to ``--tokens`` tokens are
packed into rows of ``--seq-len``; each strategy's best-of-``--repeats`` time is
set beside the time to merely ``np.concatenate`` the same token arrays.
Prints a markdown table. Example::

    python benchmarks/bench_packing.py --tokens 1000000 --seq-len 2048
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zephon_collate.packing.pack_flat import pack_flat
from zephon_collate.types import SampleMeta, SampleRecord


def make_documents(args: argparse.Namespace) -> list[SampleRecord]:
    """Documents of lognormal length, ``args.tokens`` tokens in all (the last one trimmed)."""
    rng = np.random.default_rng(args.seed)
    lengths: list[int] = []
    total = 0
    while total < args.tokens:
        draws = rng.lognormal(args.log_mean, args.log_sigma, size=1024)
        for length in np.clip(np.rint(draws), 1, args.max_len).astype(int):
            length = min(int(length), args.tokens - total)
            lengths.append(length)
            total += length
            if total == args.tokens:
                break
    records = []
    for i, length in enumerate(lengths):
        payload: dict[str, Any] = {"input_ids": rng.integers(3, 50_000, size=length, dtype=np.int64)}
        if args.loss_mask:
            payload["loss_mask"] = np.ones(length, np.int8)
        meta = SampleMeta(
            (0, 0, i), lane_id=0, chunk_id=i // 1000, chunk_offset=i, component_sample_counts={i % 4: 1}
        )
        records.append(SampleRecord(meta, payload))
    return records


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="total tokens to pack")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--buffer-size", type=int, default=1024, help="pieces per best-fit round")
    parser.add_argument("--log-mean", type=float, default=5.5, help="mean of log(document length)")
    parser.add_argument("--log-sigma", type=float, default=1.0, help="sigma of log(document length)")
    parser.add_argument("--max-len", type=int, default=32_768, help="longest document")
    parser.add_argument("--loss-mask", action="store_true", help="give documents a loss_mask to pack too")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    records = make_documents(args)
    arrays = [record.payload["input_ids"] for record in records]
    lengths = np.array([len(a) for a in arrays])
    print(
        f"{len(records)} documents, {lengths.sum()} tokens (median length {int(np.median(lengths))}, "
        f"max {lengths.max()}), seq_len {args.seq_len}, buffer_size {args.buffer_size}\n"
    )
    concat_time, _ = best_time(lambda: np.concatenate(arrays), args.repeats)
    runs = [
        ("greedy", {"strategy": "greedy"}),
        (f"best_fit (buffer {args.buffer_size})", {"strategy": "best_fit", "buffer_size": args.buffer_size}),
        ("best_fit (whole list)", {"strategy": "best_fit", "buffer_size": None}),
    ]
    print("| strategy | rows | padding | time (ms) | Mtokens/s | time / concatenate |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, options in runs:
        seconds, rows = best_time(
            lambda options=options: pack_flat(records, args.seq_len, pad_token_id=0, **options), args.repeats
        )
        padding = sum(row.meta.padding_length for row in rows) / (len(rows) * args.seq_len)
        print(
            f"| {name} | {len(rows)} | {padding:.2%} | {seconds * 1e3:.1f} | "
            f"{args.tokens / seconds / 1e6:.1f} | {seconds / concat_time:.1f}x |"
        )
    rate = args.tokens / concat_time / 1e6
    print(f"| np.concatenate only | - | - | {concat_time * 1e3:.1f} | {rate:.1f} | 1.0x |")


if __name__ == "__main__":
    main()
