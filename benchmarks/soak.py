"""Soak run: many batches through a DataLoader with worker processes and the Collator; nothing may grow.

A collator runs in every training step for weeks. This pushes ``--batches``
small batches of packed records through ``DataLoader(num_workers=2)`` with the
Collator and samples, every ``--sample-every`` batches:

- resident memory (RSS) of the main process and of each worker,
- open file descriptors (``/proc/self/fd``; shared-memory tensors travel as fds),
- threads (``threading.active_count()`` and the OS threads in ``/proc/self/task``).

It also checks every ``--check-every``-th batch against ``to_training`` on the
same records (no silent wrong batch), and every ``--bad-every``-th step calls
the collator on a bad batch in the main process, which must raise its
documented ``ValueError`` (errors must not leak either).

``--mode split`` (default): the workers run ``Collator.stack`` (a CPU
TensorDict), the main process ``Collator.finish``, the production recipe.
``--mode call``: the workers run the whole collator.

Run from the repository root (about 3 to 10 minutes for 100,000 batches on 2 cores)::

    python benchmarks/soak.py --batches 100000

Memory counts as flat when the RSS after warm-up (the first 10% of batches)
grows less than ``--max-growth-mib`` by the end; file descriptors and threads
must end where they were after warm-up. The exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BOS, EOS, FULL_OPTIONS, PAD

from zephon_collate import Collator, SampleBatch, SampleMeta, SampleRecord

OPTIONS = FULL_OPTIONS


class PackedRows(Dataset):
    """Packed rows of ``length`` tokens, built from the index: 1 to 4 documents, then padding."""

    def __init__(self, size: int, length: int) -> None:
        self.size, self.length = size, length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> SampleRecord:
        rng = np.random.default_rng(index)
        cuts = np.sort(rng.choice(np.arange(2, self.length), size=int(rng.integers(1, 4)), replace=False))
        sizes = np.diff(np.concatenate([[0], cuts]))
        used = int(sizes.sum())
        tokens = rng.integers(3, 32000, self.length)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        tokens[starts] = BOS
        tokens[np.cumsum(sizes) - 1] = EOS
        tokens[used:] = PAD
        segments = [*sizes.tolist(), self.length - used] if used < self.length else sizes.tolist()
        positions = np.concatenate([np.arange(size) for size in segments])
        mask = (np.arange(self.length) < used).astype(np.int64)
        meta = SampleMeta((0, 0, index), 0, 0, index, tags={"_padding_length": self.length - used})
        return SampleRecord(meta, {"input_ids": tokens, "positions": positions, "loss_mask": mask})


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sample(loader_iterator: object, batches: int, started: float) -> dict:
    workers = getattr(loader_iterator, "_workers", [])
    return {
        "batches": batches,
        "seconds": round(time.monotonic() - started, 1),
        "rss_mib": round(rss_mib(), 1),
        "worker_rss_mib": [round(rss_mib(w.pid), 1) for w in workers if w.is_alive()],
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
    }


def bad_batch(dataset: PackedRows, index: int) -> list[SampleRecord]:
    good = dataset[index]
    tokens = good.payload["input_ids"].copy()
    tokens[1] = -1
    return [good, SampleRecord(good.meta, {**good.payload, "input_ids": tokens})]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", choices=["split", "call"], default="split")
    parser.add_argument("--sample-every", type=int, default=5000, help="batches between samples")
    parser.add_argument(
        "--check-every", type=int, default=997, help="batches between checks against to_training"
    )
    parser.add_argument(
        "--bad-every", type=int, default=101, help="batches between bad-batch calls (0: none)"
    )
    parser.add_argument("--max-growth-mib", type=float, default=16.0, help="allowed RSS growth after warm-up")
    parser.add_argument("--json", type=Path, default=None, help="write the samples and the verdict here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    dataset = PackedRows(args.batches * args.batch_size, args.seq_len)
    collator = Collator(**OPTIONS) if args.mode == "call" else Collator(device="cpu", **OPTIONS)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=collator if args.mode == "call" else collator.stack,
        persistent_workers=args.workers > 0,
        prefetch_factor=4 if args.workers else None,
        pin_memory=args.mode == "split" and torch.cuda.is_available(),
    )
    samples: list[dict] = []
    checked = errors_seen = tokens = 0
    started = time.monotonic()
    iterator = iter(loader)
    samples.append(sample(iterator, 0, started))
    warmup = max(1, args.batches // 10)
    for step, item in enumerate(iterator, start=1):
        out = item if args.mode == "call" else collator.finish(item)
        tokens += int(out["num_valid_tokens"])
        if step % args.check_every == 0:
            first = (step - 1) * args.batch_size
            records = [dataset[i] for i in range(first, first + args.batch_size)]
            expected = SampleBatch(records).to_training(**OPTIONS)
            assert all(
                torch.equal(torch.as_tensor(out[k]), torch.as_tensor(v))
                for k, v in expected.items()
                if k not in ("ids", "texts")
            ), f"batch {step} differs from to_training"
            assert out["ids"] == expected["ids"]
            checked += 1
        if args.bad_every and step % args.bad_every == 0:
            try:
                collator(bad_batch(dataset, step))
            except ValueError as error:
                assert "record 1" in str(error) and ">= 0" in str(error), error
                errors_seen += 1
            else:
                raise AssertionError("a bad batch passed")
        if step == warmup or step % args.sample_every == 0 or step == args.batches:
            samples.append(sample(iterator, step, started))
            last = samples[-1]
            print(
                f"{step:7d} batches {last['seconds']:7.1f} s  rss {last['rss_mib']:7.1f} MiB  "
                f"workers {last['worker_rss_mib']}  fds {last['fds']}  threads {last['threads']}/{last['os_threads']}",
                flush=True,
            )
    seconds = time.monotonic() - started
    del iterator
    base = next(s for s in samples if s["batches"] >= warmup)
    end = samples[-1]
    growth = end["rss_mib"] - base["rss_mib"]
    worker_growth = [e - b for b, e in zip(base["worker_rss_mib"], end["worker_rss_mib"], strict=False)]
    verdict = {
        "batches": end["batches"],
        "mode": args.mode,
        "seconds": round(seconds, 1),
        "batches_per_s": round(end["batches"] / seconds, 1),
        "rss_start_mib": samples[0]["rss_mib"],
        "rss_after_warmup_mib": base["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_max_mib": max(s["rss_mib"] for s in samples),
        "rss_growth_after_warmup_mib": round(growth, 1),
        "worker_rss_after_warmup_mib": base["worker_rss_mib"],
        "worker_rss_end_mib": end["worker_rss_mib"],
        "fds_after_warmup": base["fds"],
        "fds_end": end["fds"],
        "fds_max": max(s["fds"] for s in samples),  # may include shared-memory fds of batches in flight
        "threads_after_warmup": [base["threads"], base["os_threads"]],
        "threads_end": [end["threads"], end["os_threads"]],
        "threads_max": max(s["os_threads"] for s in samples),
        "checked_batches": checked,
        "bad_batches_rejected": errors_seen,
        "valid_tokens": tokens,
    }
    flat = (
        growth < args.max_growth_mib
        and all(g < args.max_growth_mib for g in worker_growth)
        and end["fds"] <= base["fds"]
        and end["os_threads"] <= base["os_threads"]
    )
    verdict["flat"] = flat
    print(json.dumps(verdict, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"verdict": verdict, "samples": samples}, indent=2))
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
