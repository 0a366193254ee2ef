"""Uneven shards of a finite PackedStream: EvenBatches makes every rank step the same number of times.

Launched by tests/test_distributed.py as::

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_even_check.py --report report.json

Rank 0's shard holds long documents (many packed rows), rank 1's short ones
(few rows), so a plain loop gives the ranks different numbers of batches: the
rank with more would hang in its next collective. Through ``EvenBatches`` both
ranks step exactly the shorter count, call ``global_num_valid_tokens`` (a
collective) every step, and the longer rank reports the batches it dropped.
Checked with 0 and 2 DataLoader workers. Rank 0 writes a JSON report.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from torch.utils.data import DataLoader

from zephon_collate import Collator, PackedStream, SampleMeta, SampleRecord
from zephon_collate.parallel.distributed import global_num_valid_tokens
from zephon_collate.parallel.even import EvenBatches

COLLATE = Collator(return_labels=True, return_num_valid_tokens=True)


def source(shard: int, num_shards: int, epoch: int) -> list[SampleRecord]:
    """Rank r's shards: rank 0 long documents, rank 1 short ones (the workers split each rank's share)."""
    rank, workers = divmod(shard, num_shards // 2)
    count, length = (12, 14) if rank == 0 else (5, 3)
    docs = [d for d in range(count) if d % (num_shards // 2) == workers]
    return [SampleRecord(SampleMeta((rank, 0, d), 0, 0, d), {"input_ids": [1 + d] * length}) for d in docs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    for workers in (0, 2):
        stream = PackedStream(source, 16, pad_token_id=0)
        loader = DataLoader(stream, batch_size=2, collate_fn=COLLATE, num_workers=workers)
        plain = sum(1 for _ in loader)
        even = EvenBatches(loader)
        steps = 0
        for batch in even:
            global_num_valid_tokens(batch)  # a collective each step: it would hang without EvenBatches
            steps += 1
        counts = [None, None]
        dist.all_gather_object(counts, {"plain": plain, "steps": steps, "dropped": even.dropped})
        report[workers] = counts
    if rank == 0:
        with open(args.report, "w") as file:
            json.dump(report, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
