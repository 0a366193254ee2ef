"""DDP gradients with exact token normalization equal one process's gradients over the whole batch.

Launched by tests/test_distributed.py as::

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_train_check.py --report report.json

Each rank trains a small float64 model under DistributedDataParallel, reading its rows through a
DistributedSampler and the zephon Collator, with gradient accumulation over micro-batches whose
valid-token counts differ (loss masks and padding differ per row). Each step is checked against a
single-process run over the same rows collated as one batch: gradients and, after the optimizer
step, parameters must agree to float64 precision, both with ``no_sync`` on the accumulation
micro-batches and without. A per-micro-batch mean (the naive recipe) must not agree: that shows
the check can fail. Backend: NCCL when every local rank has a GPU, else gloo on CPU. Exit status 0
means every check passed on every rank; rank 0 writes a JSON report.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zephon_collate import Collator, SampleMeta, SampleRecord
from zephon_collate.parallel.distributed import global_num_valid_tokens, normalize_loss

SEQ_LEN, VOCAB, WIDTH = 12, 32, 8
MICRO_BATCH, ACCUMULATION, STEPS = 2, 2, 3
SEED = 7
IGNORE = -100
OPTIONS = {"return_labels": True, "return_num_valid_tokens": True, "ignore_index": IGNORE}
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}


class PackedRows(Dataset):
    """Rows of two documents and trailing padding; each row supervises a different number of tokens."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> SampleRecord:
        generator = torch.Generator().manual_seed(1000 + index)
        padding = int(torch.randint(0, 4, (1,), generator=generator))
        used = SEQ_LEN - padding
        first = int(torch.randint(1, used, (1,), generator=generator))
        tokens = torch.randint(1, VOCAB, (SEQ_LEN,), generator=generator)
        tokens[used:] = 0
        positions = torch.cat([torch.arange(first), torch.arange(used - first), torch.arange(padding)])
        prompt = int(torch.randint(0, used, (1,), generator=generator))  # unsupervised prefix
        loss_mask = (torch.arange(SEQ_LEN) >= prompt).long()
        meta = SampleMeta((0, 0, index), 0, 0, index, tags={"_padding_length": padding})
        return SampleRecord(meta, {"input_ids": tokens, "positions": positions, "loss_mask": loss_mask})


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(SEQ_LEN, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids) + self.position(positions))))


def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["positions"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [parameter.grad.detach().clone() for parameter in model.parameters()]


def max_error(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))


def close(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.allclose(a, b, **TOLERANCE) for a, b in zip(first, second, strict=True))


def train(no_sync: bool, rank: int, world: int, device: torch.device) -> dict:
    """STEPS optimizer steps under DDP, each checked against the single-process reference."""
    dataset = PackedRows()
    torch.manual_seed(SEED)
    model = TinyLM().double().to(device)
    reference = copy.deepcopy(model)  # one process, the whole batch
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)

    def sampler(for_rank: int) -> DistributedSampler:
        return DistributedSampler(
            dataset, num_replicas=world, rank=for_rank, shuffle=True, seed=SEED, drop_last=True
        )

    collate = Collator(device=device, python_scalars=False, **OPTIONS)
    batches = iter(DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler(rank), collate_fn=collate))
    every_rank_indices = [list(sampler(r)) for r in range(world)]
    per_step = MICRO_BATCH * ACCUMULATION
    report: dict = {"counts": [], "grad_errors": [], "naive_errors": []}
    for step in range(STEPS):
        micro_batches = [next(batches) for _ in range(ACCUMULATION)]
        num_tokens = global_num_valid_tokens(micro_batches)  # summed over micro-batches and ranks
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if (last or not no_sync) else ddp.no_sync():
                normalize_loss(loss_sum(ddp, batch), num_tokens).backward()
        distributed = grads(ddp)

        # The single-process reference: every rank's rows of this step, collated as one batch.
        indices = [
            i for r in range(world) for i in every_rank_indices[r][step * per_step : (step + 1) * per_step]
        ]
        whole = Collator(**OPTIONS)([dataset[i] for i in indices])
        whole = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in whole.items()}
        assert int(num_tokens) == whole["num_valid_tokens"], (int(num_tokens), whole["num_valid_tokens"])
        (loss_sum(reference, whole) / whole["num_valid_tokens"]).backward()
        expected = grads(reference)

        # The naive recipe: mean loss per micro-batch, averaged over micro-batches and ranks.
        naive_model = copy.deepcopy(reference)
        naive_model.zero_grad()
        micro = [indices[j : j + MICRO_BATCH] for j in range(0, len(indices), MICRO_BATCH)]
        for rows in micro:
            batch = Collator(device=device, **OPTIONS)([dataset[i] for i in rows])
            (loss_sum(naive_model, batch) / batch["num_valid_tokens"] / len(micro)).backward()
        counts = [Collator(**OPTIONS)([dataset[i] for i in rows])["num_valid_tokens"] for rows in micro]

        error, naive_error = max_error(distributed, expected), max_error(grads(naive_model), expected)
        assert close(distributed, expected), f"rank {rank} step {step}: gradients differ by {error}"
        assert len(set(counts)) > 1, f"micro-batches hold equal counts {counts}: the check proves nothing"
        assert naive_error > 1e-6, f"the naive recipe matches too ({naive_error}): the check proves nothing"
        report["counts"].append(counts)
        report["grad_errors"].append(error)
        report["naive_errors"].append(naive_error)

        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        parameters = [p.detach() for p in ddp.module.parameters()]
        assert close(parameters, [p.detach() for p in reference.parameters()]), (
            f"step {step}: parameters differ"
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="where rank 0 writes the JSON report")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        report = {
            "backend": dist.get_backend(),
            "world_size": world,
            "no_sync": train(True, rank, world, device),
            "sync_every_micro_batch": train(False, rank, world, device),
        }
        dist.barrier()
        if rank == 0 and args.report:
            with open(args.report, "w") as handle:
                json.dump(report, handle, indent=1)
        print(f"rank {rank}: OK ({report['backend']}, world size {world})", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
