"""Balanced ranks under DDP: the gradients of every step equal one process's exact per-token mean gradient.

Launched by tests/test_balance.py as::

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_balance_check.py --report report.json

Each rank reads a map-style dataset of documents (lengths 3 to 40, a prompt of varying length left
unsupervised) through a BalancedBatchSampler, wrapped in EvenBatches, packs each micro-batch into one
padding-free row and collates it; a float64 model under DDP accumulates over the step's micro-batches
(no_sync on all but the last) with ``normalize_loss(loss_sum, global_num_valid_tokens(step))``. The
micro-batches hold different numbers of documents and supervised tokens. Checked on every step against
one process over all the step's documents at once: gradients and parameters within rtol 1e-9; the naive
per-micro-batch mean must differ. Also checked: every rank computed bit-identical plans, yielded the same
number of micro-batches, and EvenBatches dropped none (a rank with more would have waited in a collective
the other never reached; a 60 s process-group timeout turns a hang into a failure). Rank 0 writes a report.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import itertools
import json

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from zephon_collate import Collator, SampleMeta, SampleRecord, pack_flat
from zephon_collate.parallel.balance import BalanceOptions
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.distributed import global_num_valid_tokens, normalize_loss
from zephon_collate.parallel.even import EvenBatches
from zephon_collate.parallel.sampler import BalancedBatchSampler

VOCAB, WIDTH, LONGEST = 40, 8, 40
ACCUMULATION, SEED = 2, 5
IGNORE = -100
COST = CostModel.from_model(hidden_size=WIDTH, num_layers=1, num_heads=2, ffn_hidden_size=2 * WIDTH)
OPTIONS = BalanceOptions(cost=COST, micro_batches=ACCUMULATION, max_tokens=96)
COLLATE = Collator(
    return_labels=True, return_num_valid_tokens=True, ignore_index=IGNORE, python_scalars=False
)
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}


class Documents(Dataset):
    """Document i: random tokens, a prompt (loss mask 0) of a third of it, give or take."""

    def __init__(self, count: int = 80) -> None:
        rng = np.random.default_rng(SEED)
        self.lengths = rng.integers(3, LONGEST + 1, count).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> SampleRecord:
        rng = np.random.default_rng([SEED, index])
        length = self.lengths[index]
        prompt = int(rng.integers(0, length // 2 + 1))
        payload = {
            "input_ids": rng.integers(1, VOCAB, length),
            "loss_mask": (np.arange(length) >= prompt).astype(np.int8),
        }
        return SampleRecord(SampleMeta((0, 0, index), 0, 0, index), payload)


def packed(records: list[SampleRecord]) -> dict:
    """One padding-free row holding the micro-batch's documents, collated."""
    return COLLATE(
        pack_flat(records, seq_len=sum(len(r.payload["input_ids"]) for r in records), pad_token_id=0)
    )


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(LONGEST, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids) + self.position(positions)))


def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["positions"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_error(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))


def train(rank: int, world: int) -> dict:
    """The balanced DDP run, each step checked against one process; returns the report."""
    dataset = Documents()
    sampler = BalancedBatchSampler(dataset.lengths, OPTIONS, seed=SEED)  # rank, world from torch.distributed
    plans = list(sampler.plans())
    digests = [None] * world
    dist.all_gather_object(digests, [plan.digest() for plan in plans])
    assert all(d == digests[0] for d in digests), "ranks planned differently"

    torch.manual_seed(SEED)
    model = TinyLM().double()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    batches = EvenBatches(DataLoader(dataset, batch_sampler=sampler, collate_fn=packed))
    micro_batches_iter = iter(batches)
    # One process's view: every rank's documents of each step (ACCUMULATION consecutive slots).
    slots = [slot for plan in plans for slot in plan.cells]
    report: dict = {"grad_errors": [], "naive_errors": [], "documents": [], "imbalance": [], "steps": 0}
    for step in itertools.count():
        micro_batches = list(itertools.islice(micro_batches_iter, ACCUMULATION))
        if not micro_batches:
            break
        num_tokens = global_num_valid_tokens(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                normalize_loss(loss_sum(ddp, batch), num_tokens).backward()
        distributed = grads(ddp)

        step_slots = slots[step * ACCUMULATION : step * ACCUMULATION + len(micro_batches)]
        documents = [doc for slot in step_slots for cell in slot for doc in cell]
        whole = packed([dataset[i] for i in documents])
        assert int(num_tokens) == int(whole["num_valid_tokens"])
        (loss_sum(reference, whole) / whole["num_valid_tokens"]).backward()
        expected = grads(reference)
        naive = copy.deepcopy(reference)
        naive.zero_grad()
        for slot in step_slots:  # the naive recipe: a mean per micro-batch, averaged
            for cell in slot:
                batch = packed([dataset[i] for i in cell])
                (loss_sum(naive, batch) / batch["num_valid_tokens"] / (len(step_slots) * world)).backward()
        error, naive_error = max_error(distributed, expected), max_error(grads(naive), expected)
        assert all(torch.allclose(a, b, **TOLERANCE) for a, b in zip(distributed, expected, strict=True)), (
            f"rank {rank} step {step}: gradients differ by {error}"
        )
        report["grad_errors"].append(error)
        report["naive_errors"].append(naive_error)
        report["documents"].append([len(cell) for slot in step_slots for cell in slot])
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        parameters = [p.detach() for p in ddp.module.parameters()]
        assert all(
            torch.allclose(a, b, **TOLERANCE) for a, b in zip(parameters, reference.parameters(), strict=True)
        ), f"step {step}: parameters differ"
        report["steps"] += 1
    counts = [None] * world
    dist.all_gather_object(
        counts, {"micro_batches": sum(len(p.cells) for p in plans), "dropped": batches.dropped}
    )
    assert all(c == counts[0] for c in counts) and counts[0]["dropped"] == 0, counts
    report["imbalance"] = [float(np.mean(plan.imbalance())) for plan in plans]
    report["counts"] = counts
    report["world_size"] = world
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        report = train(rank, world)  # DDP and the loaders are gone when the group is destroyed
        dist.barrier()
        if rank == 0:
            with open(args.report, "w") as handle:
                json.dump(report, handle, indent=1)
        print(f"rank {rank}: OK ({report['steps']} steps)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
