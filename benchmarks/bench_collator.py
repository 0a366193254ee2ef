"""DataLoader end to end with the zephon Collator, beside default_collate + hand shifting and
transformers' DataCollatorWithFlattening; and the compiled chain beside eager on CPU.

Workload: packed rows of 8,193 tokens (tensor payloads with positions, loss mask,
padding), batches of 8; the Collator does all of to_training (labels, loss mask,
padding mask, EOS masking, cu_seqlens, num_valid_tokens).
Run: python benchmarks/bench_collator.py [--rows 128] [--epochs 2]
"""

from __future__ import annotations

import argparse
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


def tokens_per_second(dataset, collate_fn, workers, epochs, tokens_per_epoch, finish=None):
    """Tokens per second through a DataLoader; ``finish`` runs on each batch in the main process."""
    loader = DataLoader(
        dataset, batch_size=8, collate_fn=collate_fn, num_workers=workers, persistent_workers=workers > 0
    )
    finish = finish or (lambda batch: batch)
    for batch in loader:  # warm-up: worker start, first-call work
        finish(batch)
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            finish(batch)
    return tokens_per_epoch * epochs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
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
    loaders = {
        "zephon Collator (all of to_training)": (records, Collator(**OPTIONS), None),
        "zephon split: stack in workers, finish in main": (records, split.stack, split.finish),
        "default_collate + hand shifting": (payloads, shift_collate, None),
    }
    with contextlib.suppress(ImportError):
        loaders["transformers DataCollatorWithFlattening"] = (documents, hf_collate(), None)
    print(
        f"DataLoader, {args.rows} packed rows of 8,193 tokens, batch 8, {args.epochs} epochs after warm-up\n"
    )
    print(
        "| collate_fn | workers | Mtokens/s | default_collate time / this time | this / DataCollatorWithFlattening |"
    )
    print("|---|---:|---:|---:|---:|")
    for workers in (0, 2):
        rates = {
            name: tokens_per_second(data, fn, workers, args.epochs, tokens, finish)
            for name, (data, fn, finish) in loaders.items()
        }
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
