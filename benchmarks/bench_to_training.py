"""to_training on CPU, one thread: beside a memory copy, transformers' DataCollatorWithFlattening, np.fromiter.

Workload: 8 packed records of 8,193 tokens with positions, loss mask and padding
lengths; to_training with labels, loss mask, padding mask, EOS masking,
cu_seqlens and num_valid_tokens. Run: python benchmarks/bench_to_training.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    FULL_OPTIONS,
    compare,
    hf_call,
    output_bytes,
    packed_rows,
    peak_rss_growth,
    read_lists,
    to_records,
)

from zephon_collate import SampleBatch

OPTIONS = FULL_OPTIONS


def memory_child() -> None:
    """In a fresh process: peak memory growth of one to_training call, and its output bytes."""
    batch = SampleBatch(to_records(packed_rows()))
    batch.to_training(**OPTIONS)
    out = batch.to_training(**OPTIONS)
    growth = peak_rss_growth(lambda: batch.to_training(**OPTIONS))
    print(json.dumps({"peak_extra": growth, "output": output_bytes(out)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_child:
        memory_child()
        return
    rows = packed_rows()
    batch = SampleBatch(to_records(rows))
    out = batch.to_training(**OPTIONS)
    nbytes = output_bytes(out)
    source = torch.ones(nbytes, dtype=torch.uint8)
    list_batch = SampleBatch(to_records(rows, kind="list"))
    candidates = {
        "copy": lambda: source.clone(),
        "ours": lambda: batch.to_training(**OPTIONS),
        "ours_lists": lambda: list_batch.to_training(**OPTIONS),
        "fromiter": read_lists(list_batch.records),
    }
    hf = hf_call(rows)
    if hf is not None:
        candidates["hf"] = hf
    times = compare(candidates)
    memory = json.loads(
        subprocess.run(
            [sys.executable, __file__, "--memory-child"], capture_output=True, text=True, check=True
        ).stdout
    )
    us = {name: seconds * 1e6 for name, seconds in times.items()}
    print(
        f"8 x 8,193 packed tokens, {nbytes / 1e6:.2f} MB of output, CPU, 1 thread (medians of interleaved rounds)\n"
    )
    print("| measurement | time | ratio |")
    print("|---|---:|---:|")
    print(f"| memory copy of the output bytes | {us['copy']:,.0f} us | |")
    print(
        f"| to_training, tensor payloads | {us['ours']:,.0f} us | copy / ours = {us['copy'] / us['ours']:.3f} |"
    )
    if hf is not None:
        print(
            f"| DataCollatorWithFlattening, same documents | {us['hf']:,.0f} us | hf / ours = {us['hf'] / us['ours']:.1f} |"
        )
    print(f"| np.fromiter over the list payloads | {us['fromiter']:,.0f} us | |")
    ratio = us["ours_lists"] / us["fromiter"]
    print(f"| to_training, list payloads | {us['ours_lists']:,.0f} us | ours / fromiter = {ratio:.2f} |")
    extra = memory["peak_extra"] / memory["output"]
    print(
        f"| peak extra memory of one call | {memory['peak_extra'] / 1e6:.2f} MB | / output bytes = {extra:.2f} |"
    )


if __name__ == "__main__":
    main()
