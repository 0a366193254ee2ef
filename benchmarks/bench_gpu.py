"""The transform chain on a GPU: achieved bytes per second beside a plain device copy, in one run.

For 8 x 8,193 and 64 x 2,049 packed rows (every to_training output), the
stacked batch is moved to the device once; then each chain runs on it:
eager, compiled (dynamic shapes; the data-dependent cu_seqlens step stays
eager and reads one number back), and compiled with a static cu_seqlens
(``num_boundaries``: the whole chain is one graph). Bytes moved count what the
chain reads (the stacked fields) and what it writes (its outputs); the copy
baseline copies that many bytes on the same device. Before timing, each
chain's outputs are checked equal to to_training's on the CPU.

Without a CUDA device it says so and exits 0 (CI has none). ``--device cpu``
runs the same measurement on the CPU, to try the script out.
Run: python benchmarks/bench_gpu.py [--device cuda] [--repeat 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FULL_OPTIONS, packed_rows, to_records

from zephon_collate import Collator, SampleBatch

SHAPES = ((8, 8193), (64, 2049))


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def seconds_per_call(fn, device: torch.device, repeat: int) -> float:
    """Median over 5 rounds of ``repeat`` calls, the device synchronised around each round."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        synchronize(device)
        rounds.append((time.perf_counter() - start) / repeat)
    return sorted(rounds)[len(rounds) // 2]


def tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def check_equal(got: dict, want: dict, label: str) -> None:
    """``got`` equals to_training's ``want``; a static cu_seqlens may add filler columns (the row length)."""
    for key, value in want.items():
        if key in ("ids", "texts"):
            continue
        other = got[key].cpu() if isinstance(got[key], torch.Tensor) else got[key]
        if key == "cu_seqlens":
            width = value.shape[1]
            filler = other[:, width:]
            same = torch.equal(other[:, :width], value) and bool((filler == value[:, -1:]).all())
        else:
            same = torch.equal(other, value) if isinstance(value, torch.Tensor) else int(other) == value
        if not same:
            raise AssertionError(f"{label}: {key!r} differs from to_training on the CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    print(f"transform chain on {name}, torch {torch.__version__}; medians of 5 rounds\n")
    print("| batch | chain | time | bytes moved | GB/s | copy of those bytes | copy time / chain time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    batches = [to_records(packed_rows(rows, length)) for rows, length in SHAPES]
    wants = [SampleBatch(records).to_training(**FULL_OPTIONS) for records in batches]
    width = max(int(want["cu_seqlens"].shape[1]) for want in wants)
    collators = {  # one of each for both shapes: dynamic shapes compile once
        "eager": Collator(device=device, **FULL_OPTIONS, boundary_safe_labels=False),
        "compiled": Collator(device=device, compile=True, **FULL_OPTIONS, boundary_safe_labels=False),
        "compiled, static cu_seqlens": Collator(
            device=device,
            compile=True,
            num_boundaries=width,
            python_scalars=False,
            **FULL_OPTIONS,
            boundary_safe_labels=False,
        ),
    }
    for (rows, length), records, want in zip(SHAPES, batches, wants, strict=True):
        for label, collator in collators.items():
            stacked = collator.stack(records)
            check_equal(collator.finish(stacked), want, label)
            td = stacked.td.to(device)
            plan = collator.plan(tuple(td.keys()))

            def chain(td: Any, plan: Any = plan, collator: Any = collator) -> dict[str, Any]:
                return collator.layout.run(plan, dict(td.items()), device)

            out = chain(td)
            moved = tensor_bytes(td.values()) + tensor_bytes(out.values())
            source = torch.ones(moved, dtype=torch.uint8, device=device)
            chain_s = seconds_per_call(lambda chain=chain, td=td: chain(td), device, args.repeat)
            copy_s = seconds_per_call(lambda source=source: source.clone(), device, args.repeat)
            print(
                f"| {rows} x {length - 1:,} | {label} | {chain_s * 1e6:,.0f} us | {moved / 1e6:.2f} MB "
                f"| {moved / chain_s / 1e9:.1f} | {copy_s * 1e6:,.1f} us | {copy_s / chain_s:.3f} |"
            )


if __name__ == "__main__":
    main()
