"""Columnar batches against the row-wise collators they replace: the goals table, side by side in one run.

Every candidate gets the same examples: SFT rows (``input_ids`` and ``labels``
with -100 on a prompt of about a third), as Python-list dicts for the
Hugging Face collators and ``datasets``' rows, as the Arrow table
``datasets.Dataset.from_list(rows).with_format("arrow")[:]`` returns for ours.
Each pair is checked equal before it is timed; times are medians of
interleaved rounds (CPU, one torch thread).

- padding-free, 8 x 128, from an Arrow batch: ``Collator.for_transformers(padding_free=True)``
  (position ids, FlashAttention kwargs and seq_idx on) against ``DataCollatorWithFlattening``
  with the same switches on the rows as dicts;
- padding-free, 64 x 1,024: the same collator against a copy of its output bytes;
- padded, 8 x 128 and 64 x 1,024: ``Collator.for_transformers(pad_token_id=0)`` against
  ``DataCollatorForSeq2Seq``;
- end to end: a ``DataLoader`` over a shuffled, memory-mapped ``datasets.Dataset`` of
  ``--examples`` rows (32 to 256 tokens), batch 8, 0 and 2 workers: ``ColumnarDataset`` and our
  collator against the dataset's own row access and ``DataCollatorWithFlattening``, tokens per second
  after the first batch;
- columnar packing: ``pack_columns`` of 1M lognormal tokens (``bench_packing.py``'s documents)
  into rows of 2,048, best fit and greedy, against ``pack_flat`` on the same documents as records.

Prints the goals table (markdown) and saves a bar chart of each ratio against its goal beside the
sweep's plot. Run: python benchmarks/bench_columnar.py [--rounds 15] [--examples 100000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packing import make_documents
from bench_transformers import examples, pad_tokenizer
from common import compare

from zephon_collate import Collator, ColumnarDataset, pack_columns, pack_flat

ROOT = Path(__file__).resolve().parent.parent
FLAT = {"return_position_ids": True, "return_flash_attn_kwargs": True, "return_seq_idx": True}


def same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same keys and values (Hugging Face's tensors, ints)."""
    if sorted(ours) != sorted(theirs):
        raise AssertionError(f"keys differ: {sorted(ours)} vs {sorted(theirs)}")
    for key, value in theirs.items():
        equal = torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value
        if not equal:
            raise AssertionError(f"{key!r} differs")


def arrow_batch(rows: list[dict[str, Any]]) -> Any:
    import datasets

    return datasets.Dataset.from_list(rows).with_format("arrow")[:]


def copy_of(nbytes: int) -> Callable[[], Any]:
    """A plain copy of ``nbytes`` bytes into a new buffer (what a collator's output must at least cost)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    return source.clone


def nbytes_of(out: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in out.values() if isinstance(v, torch.Tensor))


def collators(rounds: int) -> list[dict[str, Any]]:
    """The per-batch goals: padding-free against DataCollatorWithFlattening and a copy, padded against
    DataCollatorForSeq2Seq."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    flat = Collator.for_transformers(padding_free=True, **FLAT)
    padded = Collator.for_transformers(pad_token_id=0)
    flattening = DataCollatorWithFlattening(**FLAT)
    seq2seq = DataCollatorForSeq2Seq(pad_tokenizer(), label_pad_token_id=-100)
    results = []
    for rows, longest in ((8, 128), (64, 1024)):
        dicts = examples(rows, longest)
        table = arrow_batch(dicts)
        same(flat(table), flattening(dicts, return_tensors="pt"))
        same(padded(table), dict(seq2seq(dicts)))
        fns = {
            "flat": lambda t=table: flat(t),
            "flat_lists": lambda d=dicts: flat(d),
            "flattening": lambda d=dicts: flattening(d, return_tensors="pt"),
            "flat_copy": copy_of(nbytes_of(flat(table))),
            "padded": lambda t=table: padded(t),
            "padded_lists": lambda d=dicts: padded(d),
            "seq2seq": lambda d=dicts: seq2seq(d),
            "padded_copy": copy_of(nbytes_of(padded(table))),
        }
        times = compare(fns, rounds=rounds)
        results.append({"rows": rows, "longest": longest, **times})
    return results


def sft_dataset(count: int, directory: str, seed: int = 0) -> Any:
    """``count`` SFT rows of 32 to 256 tokens, saved and loaded back memory-mapped, then shuffled."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 257, count)
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(1, 32_000, int(offsets[-1])).astype(np.int32)
    place = np.arange(tokens.size) - np.repeat(offsets[:-1], lengths)
    labels = np.where(place < np.repeat(lengths // 3, lengths), -100, tokens).astype(np.int64)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
            "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
        }
    )
    datasets.Dataset(table).save_to_disk(directory)
    return datasets.load_from_disk(directory).shuffle(seed=seed)


def loader_rate(dataset: Any, collate: Any, workers: int, batches: int) -> float:
    """Tokens per second of a shuffled DataLoader, batch 8, from its first batch to its ``batches``-th."""
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(0),
        persistent_workers=False,
    )
    iterator = iter(loader)
    next(iterator)  # workers started, first batch out: steady state from here
    start, tokens = time.perf_counter(), 0
    for _ in range(batches):
        tokens += int(next(iterator)["input_ids"].numel())
    rate = tokens / (time.perf_counter() - start)
    del iterator
    return rate


def end_to_end(count: int, rounds: int, batches: int) -> list[dict[str, Any]]:
    from transformers import DataCollatorWithFlattening

    flattening = DataCollatorWithFlattening(**FLAT)
    ours = Collator.for_transformers(padding_free=True, **FLAT)
    with tempfile.TemporaryDirectory() as directory:
        dataset = sft_dataset(count, directory)
        columnar = ColumnarDataset(dataset)
        mine = iter(torch.utils.data.DataLoader(columnar, batch_size=8, collate_fn=ours))
        theirs = iter(torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=flattening))
        for _ in range(3):
            same(next(mine), next(theirs))
        results = []
        for workers in (0, 2):
            samples: dict[str, list[float]] = {"ours": [], "theirs": []}
            for _ in range(rounds):
                samples["ours"].append(loader_rate(columnar, ours, workers, batches))
                samples["theirs"].append(loader_rate(dataset, flattening, workers, batches))
            results.append({"workers": workers, **{k: statistics.median(v) for k, v in samples.items()}})
    return results


def packing(rounds: int) -> dict[str, Any]:
    import pyarrow as pa

    args = argparse.Namespace(
        seed=0, tokens=1_000_000, log_mean=5.5, log_sigma=1.0, max_len=32_768, loss_mask=False
    )
    records = make_documents(args)
    tokens = [record.payload["input_ids"].astype(np.int32) for record in records]
    table = pa.table({"input_ids": pa.array(tokens, type=pa.list_(pa.int32()))})
    total = sum(t.size for t in tokens)
    for strategy in ("greedy", "best_fit"):
        packed = pack_columns(table, 2048, pad_token_id=0, strategy=strategy)
        rows = pack_flat(records, 2048, pad_token_id=0, strategy=strategy)
        assert len(packed) == len(rows)
        for index, row in enumerate(rows):
            for name, values in row.payload.items():
                assert np.array_equal(packed.fields[name][index], values), (strategy, index, name)
            assert packed.padding_length[index] == row.meta.padding_length
    fns = {
        "columns_best_fit": lambda: pack_columns(table, 2048, pad_token_id=0, strategy="best_fit"),
        "columns_greedy": lambda: pack_columns(table, 2048, pad_token_id=0, strategy="greedy"),
        "records_best_fit": lambda: pack_flat(records, 2048, pad_token_id=0, strategy="best_fit"),
    }
    times = compare(fns, rounds=rounds, budget=0.2)
    padding = {}
    for strategy in ("best_fit", "greedy"):
        packed = pack_columns(table, 2048, pad_token_id=0, strategy=strategy)
        padding[strategy] = float(packed.padding_length.sum() / packed.fields["input_ids"].size)
    return {"tokens": total, "documents": len(records), **times, "padding": padding}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"


def goals(
    per_batch: list[dict[str, Any]], loaders: list[dict[str, Any]], pack: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per goal: what, ours, the peer, the ratio, the goal and whether it is met."""
    small, big = per_batch
    rows = [
        {
            "what": "padding-free, 8 x 128, from an Arrow batch",
            "ours": us(small["flat"]),
            "peer": f"DataCollatorWithFlattening {us(small['flattening'])}",
            "ratio": small["flattening"] / small["flat"],
            "goal": ">= 10x faster",
            "met": small["flattening"] / small["flat"] >= 10,
        },
        {
            "what": "padding-free, 64 x 1,024",
            "ours": us(big["flat"]),
            "peer": f"copy of the output bytes {us(big['flat_copy'])}",
            "ratio": big["flat"] / big["flat_copy"],
            "goal": "<= 2x the copy",
            "met": big["flat"] / big["flat_copy"] <= 2,
        },
    ]
    for shape in per_batch:
        ratio = shape["seq2seq"] / shape["padded"]
        rows.append(
            {
                "what": f"padded, {shape['rows']} x {shape['longest']:,}",
                "ours": us(shape["padded"]),
                "peer": f"DataCollatorForSeq2Seq {us(shape['seq2seq'])}",
                "ratio": ratio,
                "goal": ">= 10x faster",
                "met": ratio >= 10,
            }
        )
    for loader in loaders:
        ratio = loader["ours"] / loader["theirs"]
        rows.append(
            {
                "what": f"end to end: DataLoader, shuffled dataset, batch 8, {loader['workers']} workers",
                "ours": f"{loader['ours'] / 1e6:.2f} M tokens/s",
                "peer": f"datasets rows + DataCollatorWithFlattening {loader['theirs'] / 1e6:.2f} M tokens/s",
                "ratio": ratio,
                "goal": ">= 5x the tokens/s",
                "met": ratio >= 5,
            }
        )
    rate = pack["tokens"] / pack["columns_best_fit"] / 1e6
    rows.append(
        {
            "what": "columnar packing, 1M lognormal tokens into rows of 2,048 (best fit)",
            "ours": f"{rate:.0f} M tokens/s, padding {pack['padding']['best_fit']:.2%}",
            "peer": f"pack_flat on records {pack['tokens'] / pack['records_best_fit'] / 1e6:.1f} M tokens/s",
            "ratio": rate / 100,
            "goal": ">= 100 M tokens/s, padding <= 1%",
            "met": rate >= 100 and pack["padding"]["best_fit"] <= 0.01,
        }
    )
    return rows


def print_tables(rows: list[dict[str, Any]], per_batch: list[dict[str, Any]], pack: dict[str, Any]) -> None:
    print("| what | ours | peer | ratio | goal | met |")
    print("|---|---:|---:|---:|---|---|")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if "copy" in row["goal"] else f"{row['ratio']:.1f}x"
        if "M tokens/s, padding" in row["goal"]:
            ratio = f"{row['ratio']:.2f} of the goal"
        print(
            f"| {row['what']} | {row['ours']} | {row['peer']} | {ratio} | {row['goal']} | "
            f"{'yes' if row['met'] else 'no'} |"
        )
    print("\nThe same batches read row-wise (Python-list dicts), for comparison:\n")
    print("| batch | padding-free: Arrow | padding-free: lists | padded: Arrow | padded: lists |")
    print("|---|---:|---:|---:|---:|")
    for shape in per_batch:
        print(
            f"| {shape['rows']} x {shape['longest']:,} | {us(shape['flat'])} | {us(shape['flat_lists'])} | "
            f"{us(shape['padded'])} | {us(shape['padded_lists'])} |"
        )
    greedy = pack["tokens"] / pack["columns_greedy"] / 1e6
    print(
        f"\nColumnar packing, greedy: {greedy:.0f} M tokens/s, padding {pack['padding']['greedy']:.2%} "
        f"({pack['documents']} documents, {pack['tokens']:,} tokens)"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Each goal as "how far along": 1.0 means the goal is met exactly, above it beaten.
    progress = []
    for row in rows:
        if "copy" in row["goal"]:
            progress.append(2 / row["ratio"])
        elif "x faster" in row["goal"]:
            progress.append(row["ratio"] / 10)
        elif "5x" in row["goal"]:
            progress.append(row["ratio"] / 5)
        else:
            progress.append(row["ratio"])
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    labels = [
        row["what"].replace("end to end: DataLoader, shuffled dataset, ", "end to end, ") for row in rows
    ]
    colors = ["tab:green" if row["met"] else "tab:orange" for row in rows]
    ax.barh(range(len(rows)), progress, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10) if min(progress) / 2 <= t <= max(progress) * 2]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    for y, value in enumerate(progress):
        ax.annotate(
            f"{value:.2f}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7
        )
    ax.set_xlabel("measured / goal (1 = goal met; green: met)")
    ax.set_title("Columnar batches: each goal, CPU, side by side in one run")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per measurement")
    parser.add_argument("--examples", type=int, default=100_000, help="rows of the end-to-end dataset")
    parser.add_argument("--batches", type=int, default=300, help="batches timed per DataLoader run")
    parser.add_argument("--loader-rounds", type=int, default=3, help="interleaved DataLoader runs")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/images/bench_columnar.png")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    per_batch = collators(args.rounds)
    loaders = end_to_end(args.examples, args.loader_rounds, args.batches)
    pack = packing(max(3, args.rounds // 3))
    rows = goals(per_batch, loaders, pack)
    print(f"CPU, 1 torch thread, medians of interleaved rounds ({args.rounds} per batch shape)\n")
    print_tables(rows, per_batch, pack)
    plot(rows, args.plot)
    print(f"\nplot: {args.plot}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        numbers = {"per_batch": per_batch, "loaders": loaders, "packing": pack}
        args.json.write_text(json.dumps(numbers, indent=2))
        print(f"json: {args.json}")
    print(f"total: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
