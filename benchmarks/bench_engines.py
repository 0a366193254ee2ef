"""Grain and Ray Data against the plain DataLoader, and Ray's Arrow collate against its NumPy one.

Every candidate gets the same documents (lognormal lengths, median 245 tokens, a prompt of
about a third) and the same options (rows of ``--seq-len`` tokens, batches of 8 rows,
``Collator(return_labels=True)``), and must give the same batches; it is timed end to end over an
epoch (each phase the median of ``--repeats`` epochs), tokens per second, with its start-up (worker
processes, the Ray cluster's actors), its steady state, its tail (the workers' last batches) and its
end (shutdown) shown apart:

- Grain: ``PackIterDataset -> .batch(batch_fn=collator)`` with 0 and 2 worker processes
  (``mp_prefetch``; torch tensors, which the collator sends as one narrow buffer, inline up to 768 KiB,
  with torch's default sharing strategy or ``file_system`` set, or NumPy arrays and ``as_torch`` after) against ``DataLoader(PackedStream, collate_fn=collator)`` with 0 and 2
  workers;
- Ray Data: ``map_batches(PackBatches) -> iter_torch_batches(collate_fn=ArrowCollateFn)`` with 1
  and 2 packing actors against a ``DataLoader`` over the same rows (``pack_columns`` of each Ray
  batch) with 0 and 2 workers;
- the collate alone, 8 to 512 documents: ``ArrowCollateFn`` on the Arrow batch against what
  ``iter_torch_batches`` does without it (the batch as a dict of NumPy arrays, the collator over its
  rows), with the bytes each allocates per byte of output (tracemalloc's peak: the copies) and a plain
  copy of the output's bytes.

Run: python benchmarks/bench_engines.py [--documents 12000] [--seq-len 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compare, memcpy_seconds, output_bytes

from zephon_collate import Collator, PackedStream, SampleMeta, SampleRecord, pack_columns

COLLATOR = Collator(return_labels=True)
NUMPY_COLLATOR = Collator(return_labels=True, dtype=np.int64)  # for Grain's own shared memory
BATCH = 8


def records(count: int, seq_len: int) -> list[SampleRecord]:
    """Documents of lognormal length (median 245 tokens, at most ``seq_len``), a prompt of a third."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, count), 8, seq_len).astype(int)
    return [
        SampleRecord(
            SampleMeta((0, 0, i), 0, 0, i),
            {
                "input_ids": rng.integers(3, 50_000, n, dtype=np.int64),
                "loss_mask": (np.arange(n) >= n // 3).astype(np.int64),
            },
        )
        for i, n in enumerate(lengths)
    ]


Candidate = tuple[Callable[[], Iterable[dict[str, Any]]], int]  # the pipeline, its worker processes


def timed(candidate: Candidate, repeats: int) -> tuple[float, float, float, float, int, list[int]]:
    """(start-up, steady, tail and end seconds, tokens, a checksum per batch), each phase the median
    of ``repeats`` epochs.

    Start-up ends when every worker has delivered a batch (workers hand batches out in turn, so
    the last worker to start holds the others back); the steady phase runs from there to the last
    batches, one per worker; the tail is the time to those last batches (Grain stops a worker whose
    slice ran out, joining its process, before it reads the next one's); the end is the time from
    the last batch to the iterator's stop (worker shutdown).
    """
    batches, workers = candidate
    phases, tokens, sums = [], 0, []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens, sums, stamps = 0, [], []
        for batch in batches():
            tokens += batch["input_ids"].numel()
            sums.append(int(batch["input_ids"].sum()))
            stamps.append(time.perf_counter())
        stop, ready = time.perf_counter(), stamps[max(workers, 1) - 1]
        steady = stamps[max(len(stamps) - max(workers, 1) - 1, max(workers, 1) - 1)]
        phases.append((ready - start, steady - ready, stamps[-1] - steady, stop - stamps[-1]))
    startup, middle, tail, end = (float(np.median(phase)) for phase in zip(*phases, strict=True))
    return startup, middle, tail, end, tokens, sums


def one_torch_thread(worker: int, workers: int) -> None:
    """A Grain worker's init: one torch thread, as a DataLoader worker sets for itself."""
    torch.set_num_threads(1)


def file_system_worker(worker: int, workers: int) -> None:
    """A Grain worker's init that shares torch tensors by file name."""
    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy("file_system")


def grain_rows(docs: list[SampleRecord], seq_len: int) -> dict[str, Candidate]:
    import grain
    from torch.utils.data import DataLoader

    from zephon_collate.engines.grain import PackIterDataset, as_torch

    def engine(workers: int, hand_over: str = "torch") -> Callable[[], Iterable[Any]]:
        def run() -> Iterable[Any]:
            ds = PackIterDataset(grain.MapDataset.source(docs), seq_len=seq_len, pad_token_id=0)
            ds = ds.batch(BATCH, batch_fn=NUMPY_COLLATOR if hand_over == "numpy" else COLLATOR)
            if not workers:
                yield from ds
                return
            options = grain.MultiprocessingOptions(num_workers=workers)
            if hand_over == "numpy":
                yield from ds.mp_prefetch(options, worker_init_fn=one_torch_thread).map(as_torch)
                return
            by_name = hand_over == "file_system"
            init = file_system_worker if by_name else one_torch_thread
            torch.multiprocessing.set_sharing_strategy("file_system" if by_name else "file_descriptor")
            try:
                yield from ds.mp_prefetch(options, worker_init_fn=init)
            finally:
                torch.multiprocessing.set_sharing_strategy("file_descriptor")

        return run

    def loader(workers: int) -> Callable[[], Iterable[Any]]:
        stream = PackedStream(docs, seq_len=seq_len, pad_token_id=0)
        return lambda: DataLoader(stream, batch_size=BATCH, collate_fn=COLLATOR, num_workers=workers)

    def hand_off() -> Iterable[Any]:  # Grain's own cost per element: the same number of plain ints
        count = -(-sum(doc.payload["input_ids"].size for doc in docs) // (seq_len * BATCH))
        ds = grain.MapDataset.source(list(range(count))).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
        ds = ds.map(lambda i: {"input_ids": torch.zeros(BATCH, seq_len, dtype=torch.int64)})
        return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2), worker_init_fn=one_torch_thread)

    return {
        "DataLoader, 0 workers": (loader(0), 0),
        "Grain, 0 workers": (engine(0), 0),
        "DataLoader, 2 workers": (loader(2), 2),
        "Grain, 2 workers, torch tensors (one narrow buffer each)": (engine(2), 2),
        "Grain, 2 workers, torch tensors, `file_system` sharing set": (engine(2, "file_system"), 2),
        "Grain, 2 workers, NumPy in the workers, `as_torch` after": (engine(2, "numpy"), 2),
        "(Grain, 2 workers, a batch of zeros per element: its own hand-off)": (hand_off, 2),
    }


def ray_rows(docs: list[SampleRecord], seq_len: int) -> dict[str, Candidate]:
    import pyarrow as pa
    import ray
    from torch.utils.data import DataLoader

    from zephon_collate.engines.ray import ArrowCollateFn, PackBatches

    table = pa.table(
        {name: [doc.payload[name].tolist() for doc in docs] for name in ("input_ids", "loss_mask")}
    )
    per_batch = 1000

    def rows() -> list[Any]:  # the same packing: each Ray batch's documents on their own
        out = []
        for start in range(0, len(table), per_batch):
            packed = pack_columns(table.slice(start, per_batch), seq_len, pad_token_id=0)
            out += [packed.__getitems__([r])[0] for r in range(len(packed))]
        return out

    def engine(actors: int) -> Callable[[], Iterable[Any]]:
        def run() -> Iterable[Any]:
            blocks = [table.slice(start, per_batch) for start in range(0, len(table), per_batch)]
            ds = ray.data.from_arrow(blocks).map_batches(  # a block per Ray batch: the actors share them
                PackBatches,
                fn_constructor_kwargs={"seq_len": seq_len, "pad_token_id": 0},
                batch_format="pyarrow",
                batch_size=per_batch,
                compute=ray.data.ActorPoolStrategy(size=actors),
            )
            return ds.iter_torch_batches(batch_size=BATCH, collate_fn=ArrowCollateFn(COLLATOR))

        return run

    def loader(workers: int) -> Callable[[], Iterable[Any]]:
        return lambda: DataLoader(rows(), batch_size=BATCH, collate_fn=COLLATOR, num_workers=workers)

    return {
        "DataLoader over the rows, 0 workers": (loader(0), 0),
        "Ray Data, 1 packing actor": (engine(1), 1),
        "DataLoader over the rows, 2 workers": (loader(2), 2),
        "Ray Data, 2 packing actors": (engine(2), 1),  # one iterator hands the batches out
    }


def throughput(title: str, candidates: dict[str, Candidate], repeats: int) -> None:
    print(f"\n### {title}\n")
    print(
        "| pipeline | start-up s | steady s | tail s | end s | tokens/s | vs DataLoader | steady vs DataLoader's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    results = {name: timed(run, repeats) for name, run in candidates.items()}
    names = list(results)
    for index, name in enumerate(names):
        startup, steady, tail, end, tokens, sums = results[name]
        base = results[names[2 if index >= 2 else index - index % 2]]
        if not name.startswith("("):
            assert sums == base[5], f"{name} gives other batches than its DataLoader"
        total = startup + steady + tail + end
        overall = sum(base[:4]) / total * tokens / base[4]
        rate = f"{base[1] / steady * tokens / base[4]:.2f}x" if steady > 0 else "-"
        print(
            f"| {name} | {startup:.2f} | {steady:.2f} | {tail:.2f} | {end:.2f} | {tokens / total:,.0f} | "
            f"{overall:.2f}x | {rate} |"
        )


def collate_costs(seq_len: int) -> None:
    import pyarrow as pa
    from ray.data._internal.arrow_block import ArrowBlockAccessor

    from zephon_collate.engines.ray import ArrowCollateFn

    padded = Collator(return_labels=True, pad_token_id=0)
    arrow = ArrowCollateFn(padded)
    print("\n### Collate of one Ray batch: Arrow against a dict of NumPy arrays\n")
    print("| documents | Arrow us | NumPy dict us | Arrow vs NumPy | copy of the output us | "
          "allocated / output bytes: Arrow | NumPy |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for count in (8, 64, 512):
        docs = records(count, seq_len)
        table = pa.table(
            {name: [doc.payload[name].tolist() for doc in docs] for name in ("input_ids", "loss_mask")}
        )

        def numpy_path(table: pa.Table = table, count: int = count) -> Any:
            batch = ArrowBlockAccessor(table).to_numpy()  # what a NumpyBatchCollateFn is handed
            return padded([{name: values[i] for name, values in batch.items()} for i in range(count)])

        def arrow_path(table: pa.Table = table) -> Any:
            return arrow(table)

        a, b = arrow_path(), numpy_path()
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
        times = compare({"arrow": arrow_path, "numpy": numpy_path})
        size = output_bytes(a)
        allocated = {}
        for name, fn in (("arrow", arrow_path), ("numpy", numpy_path)):
            tracemalloc.start()
            fn()
            allocated[name] = tracemalloc.get_traced_memory()[1] / size
            tracemalloc.stop()
        print(
            f"| {count} | {times['arrow'] * 1e6:,.0f} | {times['numpy'] * 1e6:,.0f} | "
            f"{times['numpy'] / times['arrow']:.2f}x faster | {memcpy_seconds(size) * 1e6:,.1f} | "
            f"{allocated['arrow']:.2f} | {allocated['numpy']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=12000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="epochs per pipeline; each phase's median")
    args = parser.parse_args()
    torch.set_num_threads(1)
    docs = records(args.documents, args.seq_len)
    print(
        f"{args.documents} documents, {sum(d.payload['input_ids'].size for d in docs):,} tokens, rows of {args.seq_len}"
    )
    throughput("Grain", grain_rows(docs, args.seq_len), args.repeats)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    try:
        throughput("Ray Data", ray_rows(docs, args.seq_len), args.repeats)
    finally:
        ray.shutdown()
    collate_costs(args.seq_len)


if __name__ == "__main__":
    main()
