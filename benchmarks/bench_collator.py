"""DataLoader end to end with the zephon Collator, beside default_collate + hand shifting and
transformers' DataCollatorWithFlattening; and the compiled chain beside eager on CPU.

Workload: packed rows of 8,193 tokens (tensor payloads with positions, loss mask,
padding), batches of 8; the Collator does all of to_training (labels, loss mask,
padding mask, EOS masking, cu_seqlens, num_valid_tokens).
Run: python benchmarks/bench_collator.py [--rows 128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from common import FULL_OPTIONS, compare, packed_rows, to_records

from zephon_collate import Collator

OPTIONS = FULL_OPTIONS


class Items(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def shift_collate(payloads):
    """torch's default_collate plus hand-written next-token shifting: the bare baseline."""
    stacked = default_collate(payloads)
    tokens = stacked["input_ids"]
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:].clone(),
        "positions": stacked["positions"][:, :-1],
        "loss_mask": stacked["loss_mask"][:, 1:],
    }


def hf_collate():
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)

    def collate(rows_of_documents):
        return collator([{"input_ids": doc} for row in rows_of_documents for doc in row], return_tensors="pt")

    return collate


def make_loader(dataset, collate_fn, workers):
    return DataLoader(
        dataset, batch_size=8, collate_fn=collate_fn, num_workers=workers, persistent_workers=workers > 0
    )


def interleaved_rates(loaders, tokens_per_epoch, rounds):
    """Median tokens per second of each (loader, finish), one epoch per round, rounds interleaved.

    The first epoch of each loader is a warm-up (worker start, first-call work).
    """
    samples = {name: [] for name in loaders}
    for round_index in range(rounds + 1):
        for name, (loader, finish) in loaders.items():
            start = time.perf_counter()
            for batch in loader:
                finish(batch)
            if round_index:
                samples[name].append(tokens_per_epoch / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved one-epoch rounds per loader")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = packed_rows(args.rows)
    tokens = sum(len(row["input_ids"]) for row in rows)
    records = Items(to_records(rows))
    payloads = Items(
        [{k: torch.from_numpy(row[k]) for k in ("input_ids", "positions", "loss_mask")} for row in rows]
    )
    documents = Items([[doc.tolist() for doc in row["documents"]] for row in rows])
    split = Collator(device="cpu", **OPTIONS)
    setups = {
        "zephon Collator (all of to_training)": (records, Collator(**OPTIONS), None),
        "zephon split: stack in workers, finish in main": (records, split.stack, split.finish),
        "default_collate + hand shifting": (payloads, shift_collate, None),
    }
    with contextlib.suppress(ImportError):
        setups["transformers DataCollatorWithFlattening"] = (documents, hf_collate(), None)
    print(
        f"DataLoader, {args.rows} packed rows of 8,193 tokens, batch 8; medians of {args.rounds} "
        "interleaved one-epoch rounds after a warm-up epoch\n"
    )
    print(
        "| collate_fn | workers | Mtokens/s | default_collate time / this time | this / DataCollatorWithFlattening |"
    )
    print("|---|---:|---:|---:|---:|")
    for workers in (0, 2):
        loaders = {
            name: (make_loader(data, fn, workers), finish or (lambda batch: batch))
            for name, (data, fn, finish) in setups.items()
        }
        rates = interleaved_rates(loaders, tokens, args.rounds)
        del loaders  # stop the persistent workers
        base = rates["default_collate + hand shifting"]
        hf = rates.get("transformers DataCollatorWithFlattening")
        for name, rate in rates.items():
            versus_hf = f"{rate / hf:.1f}x" if hf else "-"
            print(f"| {name} | {workers} | {rate / 1e6:.1f} | {rate / base:.2f} | {versus_hf} |")

    batch = [records[i] for i in range(8)]
    eager = Collator(device="cpu", **OPTIONS)
    compiled = Collator(compile=True, **OPTIONS)
    stacked = eager.stack(batch)
    start = time.perf_counter()
    compiled.finish(stacked)
    compile_seconds = time.perf_counter() - start
    times = compare({"eager": lambda: eager.finish(stacked), "compiled": lambda: compiled.finish(stacked)})
    print(
        f"\nTransform chain on CPU (1 thread), one batch of 8 x 8,193 tokens; first compile {compile_seconds:.1f} s\n"
    )
    print("| chain | time per batch | speed-up |")
    print("|---|---:|---:|")
    print(f"| eager | {times['eager'] * 1e6:,.0f} us | 1.00 |")
    print(
        f"| torch.compile (dynamic, inductor) | {times['compiled'] * 1e6:,.0f} us | {times['eager'] / times['compiled']:.2f} |"
    )


if __name__ == "__main__":
    main()
