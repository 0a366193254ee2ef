"""Data-parallel training fed by Ray Data: each rank's balanced micro-batches gathered by Ray workers,
collated from Arrow, with the plan's position saved and restored.

Run (CPU, two ranks, one local Ray cluster of 2 CPUs started by rank 0):

    torchrun --nproc_per_node=2 examples/ray_balanced.py [--steps 6]
    python examples/ray_balanced.py                       # one process works too

The documents are one Arrow table. Every rank builds the same ``BalancedBatchSampler`` (same
lengths, options and seed) and so the same plan, with no communication; ``balanced_micro_batches``
turns this rank's part of it into a Ray dataset whose rows are micro-batches, gathered from the
table by Ray workers, and ``iter_torch_batches(collate_fn=ArrowCollateFn(...))`` collates each into
one padding-free row. The loss is normalised over the step's supervised tokens on all ranks.

Ray Data saves no iterator position. The sampler does: halfway, each rank saves
``sampler.state_dict()`` (a few integers); at the end a plan restored from it must give exactly the
micro-batches seen after the save.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import pyarrow as pa
import ray
import torch
import torch.distributed as dist
from balanced_train import COST, Documents, TinyLM  # the same model, documents and costs
from distributed_train import train_step  # the same training step
from torch.nn.parallel import DistributedDataParallel

from zephon_collate import (
    BalancedBatchSampler,
    BalanceOptions,
    Collator,
    pack_columns,
)
from zephon_collate.engines.ray import ArrowCollateFn, balanced_micro_batches

COLLATOR = Collator(return_labels=True, return_num_valid_tokens=True, python_scalars=False)


def one_row(documents: pa.Table) -> dict:
    """A micro-batch's documents in one padding-free row (positions restart per document)."""
    tokens = sum(len(ids) for ids in documents.column("input_ids").to_pylist())
    return COLLATOR(pack_columns(documents, tokens, pad_token_id=0).__getitems__([0]))


def start_ray(rank: int, launched: bool) -> None:
    """Rank 0 starts the local cluster; the others join it once it is up."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if rank == 0:
        ray.init(num_cpus=2, **quiet)
    if launched:
        dist.barrier()
    if rank != 0:
        ray.init(address="auto", log_to_driver=False, configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False


def main() -> None:
    parser = argparse.ArgumentParser(description="zephon_collate: balanced ranks fed by Ray Data")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per padding-free micro-batch")
    parser.add_argument("--documents", type=int, default=300)
    args = parser.parse_args()
    launched = "RANK" in os.environ  # by torchrun
    if launched:
        dist.init_process_group(backend="gloo")
    rank = dist.get_rank() if launched else 0
    start_ray(rank, launched)

    dataset = Documents(args.documents)
    payloads = [dataset[i].payload for i in range(len(dataset))]
    table = pa.table({name: [p[name].tolist() for p in payloads] for name in ("input_ids", "loss_mask")})
    options = BalanceOptions(cost=COST, micro_batches=args.accumulation, max_tokens=args.max_tokens)

    def plan(state: dict | None = None) -> BalancedBatchSampler:
        sampler = BalancedBatchSampler(dataset.lengths, options, seed=0)  # rank, world: torch.distributed
        if state is not None:
            sampler.load_state_dict(state)
        return sampler

    def micro_batches(sampler: BalancedBatchSampler, count: int | None = None):
        ds = balanced_micro_batches(table, sampler)
        if count is not None:  # the steps to train: the stream ends, and Ray's threads with it
            ds = ds.limit(count)
        return ds.iter_torch_batches(batch_size=1, collate_fn=ArrowCollateFn(one_row))

    torch.manual_seed(0)
    model = TinyLM()
    ddp = DistributedDataParallel(model) if launched else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    stream = iter(micro_batches(plan(), args.steps * args.accumulation))
    # The plan again, advanced by the micro-batches trained: its state is where a restart resumes.
    position = plan()
    trained = iter(position)
    saved, seen_after = None, []
    for step in range(args.steps):
        if step == args.steps // 2:
            saved = json.dumps(position.state_dict())
        batch_list = list(itertools.islice(stream, args.accumulation))
        if not batch_list:
            break
        for _ in batch_list:
            next(trained)
        if saved is not None:
            seen_after += [batch["input_ids"].tolist() for batch in batch_list]
        total, num_tokens = train_step(ddp, optimizer, batch_list, launched, torch.device("cpu"))
        if rank == 0:
            print(
                f"step {step}: loss {float(total / num_tokens):.4f} over {int(num_tokens)} tokens", flush=True
            )
    if saved is not None:
        replay = [batch["input_ids"].tolist() for batch in micro_batches(plan(json.loads(saved)))]
        matches = replay[: len(seen_after)] == seen_after
        print(f"rank {rank}: resumed plan matches ({len(seen_after)} micro-batches): {matches}", flush=True)
    print(f"rank {rank}: tokens per micro-batch after the save {[len(b[0]) for b in seen_after]}", flush=True)
    stream.close()
    if rank != 0:
        ray.shutdown()  # leave the cluster before rank 0 stops it
    if launched:
        del ddp
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        ray.shutdown()


if __name__ == "__main__":
    main()
