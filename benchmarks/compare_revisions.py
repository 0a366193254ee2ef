"""This tree against an earlier revision, side by side in one process: the sweep and the HF collators.

The package at ``REV`` (default ``HEAD~1``) is exported with ``git archive``,
renamed ``zephon_collate_base`` and imported beside this checkout's
``zephon_collate``, so both run interleaved on the same batches (medians of
interleaved rounds, one torch thread): ``to_training`` with every output on the
shapes of ``bench_sweep.py`` (tensor and list payloads), ``Collator.finish`` on
a stacked 8 x 8,192 batch, and both ``Collator.for_transformers`` layouts on the
examples of ``bench_transformers.py``. Prints one table; ``base / new`` above 1
means this tree is faster.

Run: python benchmarks/compare_revisions.py [REV] [--rounds 31]
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_sweep import SHAPES, rows_for  # noqa: E402
from common import FULL_OPTIONS, compare  # noqa: E402

HF_SHAPES = [(1, 128), (8, 128), (8, 512), (32, 512), (8, 2048), (64, 1024)]
FLAT = {"padding_free": True, "return_flash_attn_kwargs": True, "return_seq_idx": True}


def export(revision: str, target: Path) -> Any:
    """The package at ``revision``, importable as ``zephon_collate_base``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "zephon_collate"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    package = target / "zephon_collate"
    for path in package.rglob("*.py"):
        path.write_text(path.read_text().replace("zephon_collate", "zephon_collate_base"))
    package.rename(target / "zephon_collate_base")
    sys.path.insert(0, str(target))
    return importlib.import_module("zephon_collate_base")


def records(package: Any, rows: list[dict[str, Any]], kind: str) -> list[Any]:
    convert = torch.from_numpy if kind == "torch" else (lambda array: array.tolist())
    return [
        package.SampleRecord(
            package.SampleMeta((0, 0, i), i % 2, 0, i, {i % 2: 1}, tags={"_padding_length": row["padding"]}),
            {key: convert(row[key]) for key in ("input_ids", "positions", "loss_mask")},
        )
        for i, row in enumerate(rows)
    ]


def flat_collator(package: Any) -> Any:
    try:
        return package.Collator.for_transformers(**FLAT)
    except TypeError:  # a revision whose padding-free layout returned every key without switches
        return package.Collator.for_transformers(padding_free=True)


ONLY = [""]


def pair(name: str, new: Callable[[], Any], base: Callable[[], Any], rounds: int) -> tuple[str, float, float]:
    if ONLY[0] not in name:
        return name, float("nan"), float("nan")
    times = compare({"new": new, "base": base}, rounds=rounds)
    return name, times["new"], times["base"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("revision", nargs="?", default="HEAD~1")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--only", default="", help="time only the calls whose name holds this text")
    args = parser.parse_args()
    ONLY[0] = args.only
    torch.set_num_threads(1)
    import zephon_collate as new

    sys.path.insert(0, str(HERE))
    from bench_transformers import examples

    results = []
    with tempfile.TemporaryDirectory() as folder:
        base = export(args.revision, Path(folder))
        for rows, tokens in SHAPES:
            data = rows_for(rows, tokens)
            for kind in ("torch", "list"):
                ours, theirs = (
                    new.SampleBatch(records(new, data, kind)),
                    base.SampleBatch(records(base, data, kind)),
                )
                results.append(
                    pair(
                        f"to_training {rows}x{tokens} ({kind})",
                        lambda b=ours: b.to_training(**FULL_OPTIONS),
                        lambda b=theirs: b.to_training(**FULL_OPTIONS),
                        args.rounds,
                    )
                )
        data = rows_for(8, 8192)
        collators = new.Collator(**FULL_OPTIONS), base.Collator(**FULL_OPTIONS)
        stacked = [c.stack(records(p, data, "torch")) for c, p in zip(collators, (new, base), strict=True)]
        results.append(
            pair(
                "Collator.finish 8x8192",
                lambda: collators[0].finish(stacked[0]),
                lambda: collators[1].finish(stacked[1]),
                args.rounds,
            )
        )
        padded = new.Collator.for_transformers(pad_token_id=0), base.Collator.for_transformers(pad_token_id=0)
        flat = flat_collator(new), flat_collator(base)
        for rows, longest in HF_SHAPES:
            batch = examples(rows, longest)
            for name, (ours, theirs) in (("padded", padded), ("padding-free", flat)):
                results.append(
                    pair(
                        f"for_transformers {name} {rows}x{longest}",
                        lambda c=ours, b=batch: c(b),
                        lambda c=theirs, b=batch: c(b),
                        args.rounds,
                    )
                )
    print(f"this tree against {args.revision}: CPU, 1 thread, medians of {args.rounds} interleaved rounds\n")
    print("| call | new | base | base / new |")
    print("|---|---:|---:|---:|")
    for name, new_time, base_time in results:
        if new_time != new_time:  # not timed (--only)
            continue
        print(
            f"| {name} | {new_time * 1e6:,.0f} us | {base_time * 1e6:,.0f} us | {base_time / new_time:.2f} |"
        )


if __name__ == "__main__":
    main()
