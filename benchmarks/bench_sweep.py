"""to_training across batch shapes on the CPU, one thread: beside transformers' flattening collator,
a memory copy of its output bytes and, for list payloads, the floor of reading the lists.

Shapes (rows x tokens per row after the shift): 1x128, 8x128, 8x512, 8x1024, 8x8192,
64x8192; packed rows of documents (BOS ... EOS, sizes between length // 8 and
length // 2, at least 4 tokens) with positions, loss mask and trailing padding;
to_training with every output (common.FULL_OPTIONS). Per shape, timed side by side
in interleaved rounds (medians): to_training on tensor payloads,
DataCollatorWithFlattening on the same documents, a uint8 copy of the output
bytes, and to_training on list payloads against np.fromiter over every list.
At 8x8192 also Collator.finish on a stacked batch against a copy of its bytes.
Prints a markdown table, the goals with PASS/MISS, and saves a log-log plot.
Run: python benchmarks/bench_sweep.py [--rounds 61] [--plot PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FULL_OPTIONS, compare, hf_call, output_bytes, packed_rows_sized, read_lists, to_records

from zephon_collate import Collator, SampleBatch

SHAPES: tuple[tuple[int, int], ...] = ((1, 128), (8, 128), (8, 512), (8, 1024), (8, 8192), (64, 8192))
FINISH_SHAPE = (8, 8192)
ROOT = Path(__file__).resolve().parent.parent


def rows_for(rows: int, tokens: int) -> list[dict[str, Any]]:
    """Packed rows of ``tokens + 1`` tokens (``tokens`` after the next-token shift)."""
    length = tokens + 1
    return packed_rows_sized(rows, length, length // 8, length // 2, seed=rows * 100_003 + tokens)


def copy_call(nbytes: int) -> Callable[[], Any]:
    """A plain copy of ``nbytes`` bytes into a preallocated buffer."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def check_same(left: dict[str, Any], right: dict[str, Any]) -> None:
    """The list-payload output must equal the tensor-payload one (same work, fair comparison)."""
    if left.keys() != right.keys():
        raise AssertionError(f"outputs differ in keys: {sorted(left)} vs {sorted(right)}")
    for key, value in left.items():
        same = torch.equal(value, right[key]) if isinstance(value, torch.Tensor) else value == right[key]
        if not same:
            raise AssertionError(f"list and tensor payloads give different {key!r}")


def measure_shape(rows: int, tokens: int, rounds: int, with_hf: bool) -> dict[str, float]:
    """Seconds per call of each method on one shape, interleaved rounds, medians."""
    data = rows_for(rows, tokens)
    batch = SampleBatch(to_records(data))
    list_batch = SampleBatch(to_records(data, kind="list"))
    out = batch.to_training(**FULL_OPTIONS)
    check_same(out, list_batch.to_training(**FULL_OPTIONS))
    nbytes = output_bytes(out)
    fns: dict[str, Callable[[], Any]] = {
        "ours": lambda: batch.to_training(**FULL_OPTIONS),
        "copy": copy_call(nbytes),
        "ours_lists": lambda: list_batch.to_training(**FULL_OPTIONS),
        "fromiter": read_lists(list(list_batch.records)),
    }
    hf = hf_call(data) if with_hf else None
    if hf is not None:
        fns["hf"] = hf
    times = compare(fns, rounds=rounds)
    documents = sum(len(row["documents"]) for row in data)
    return {**times, "rows": rows, "tokens": tokens, "bytes": nbytes, "documents": documents}


def measure_finish(rounds: int) -> dict[str, float]:
    """Collator.finish on a batch stacked once, beside a copy of the stacked batch's bytes."""
    collator = Collator(**FULL_OPTIONS)
    stacked = collator.stack(to_records(rows_for(*FINISH_SHAPE)))
    nbytes = sum(t.nbytes for t in stacked.td.values(include_nested=True, leaves_only=True))
    times = compare({"finish": lambda: collator.finish(stacked), "copy": copy_call(nbytes)}, rounds=rounds)
    return {**times, "bytes": nbytes}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us" if seconds < 0.1 else f"{seconds * 1e3:,.1f} ms"


def print_table(results: list[dict[str, float]], finish: dict[str, float]) -> None:
    print("| batch | to_training | HF flattening | HF / ours | memcpy / ours | lists / np.fromiter floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        hf = f"{us(r['hf'])} | {r['hf'] / r['ours']:.1f}" if "hf" in r else "n/a | n/a"
        print(
            f"| {r['rows']:.0f}x{r['tokens']:.0f} | {us(r['ours'])} | {hf} | {r['copy'] / r['ours']:.3f} "
            f"| {r['ours_lists'] / r['fromiter']:.2f} |"
        )
    shape = "x".join(map(str, FINISH_SHAPE))
    print(
        f"\nCollator.finish at {shape}: {us(finish['finish'])} vs copy of the stacked "
        f"{finish['bytes'] / 1e6:.2f} MB: {us(finish['copy'])}; finish / copy = "
        f"{finish['finish'] / finish['copy']:.2f}"
    )


def goals(results: list[dict[str, float]], finish: dict[str, float]) -> list[tuple[str, float | None, bool]]:
    """(goal, measured value or None when skipped, met)."""
    by_shape = {(int(r["rows"]), int(r["tokens"])): r for r in results}

    def hf_ratio(shape: tuple[int, int]) -> float | None:
        r = by_shape[shape]
        return r["hf"] / r["ours"] if "hf" in r else None

    big = by_shape[(8, 8192)]
    checks: list[tuple[str, float | None, Callable[[float], bool]]] = [
        ("8x128 HF / ours >= 3", hf_ratio((8, 128)), lambda v: v >= 3),
        ("8x1024 HF / ours >= 10", hf_ratio((8, 1024)), lambda v: v >= 10),
        ("8x8192 memcpy / ours >= 1/8", big["copy"] / big["ours"], lambda v: v >= 1 / 8),
        ("8x8192 HF / ours >= 25", hf_ratio((8, 8192)), lambda v: v >= 25),
    ]
    for r in results:
        name = f"{r['rows']:.0f}x{r['tokens']:.0f} lists / floor <= 2"
        checks.append((name, r["ours_lists"] / r["fromiter"], lambda v: v <= 2))
    checks.append(("Collator.finish / copy <= 4", finish["finish"] / finish["copy"], lambda v: v <= 4))
    return [(name, value, value is not None and test(value)) for name, value, test in checks]


def plot(results: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("ours", "to_training"), ("hf", "DataCollatorWithFlattening"), ("copy", "memcpy")):
        shown = [r for r in results if key in r]
        if shown:
            ax.plot(
                [r["rows"] * r["tokens"] for r in shown], [r[key] for r in shown], marker="o", label=label
            )
    for r in results:
        ax.annotate(
            f"{r['rows']:.0f}x{r['tokens']:.0f}",
            (r["rows"] * r["tokens"], r["ours"]),
            fontsize=7,
            xytext=(3, -10),
            textcoords="offset points",
        )
    ax.set(xscale="log", yscale="log", xlabel="tokens per batch", ylabel="seconds per call")
    ax.set_title("to_training, CPU, 1 thread (medians of interleaved rounds)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=61, help="interleaved rounds per shape (default 61: about 1.5 minutes)"
    )
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/images/bench_sweep.png")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        import transformers  # noqa: F401

        with_hf = True
    except ImportError:
        with_hf = False
        print("note: transformers is not importable; the HF flattening column is skipped\n")
    results = [measure_shape(rows, tokens, args.rounds, with_hf) for rows, tokens in SHAPES]
    finish = measure_finish(args.rounds)
    print(f"CPU, 1 thread, medians of {args.rounds} interleaved rounds; every to_training output\n")
    print_table(results, finish)
    print("\nGoals:")
    for name, value, met in goals(results, finish):
        shown = "skipped (no transformers)" if value is None else f"{value:.3g}"
        print(f"- {name}: {shown} -> {'PASS' if met else ('SKIP' if value is None else 'MISS')}")
    plot(results, args.plot)
    print(f"\nplot: {args.plot}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shapes": results, "finish": finish}, indent=2))
        print(f"json: {args.json}")
    print(f"total: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
