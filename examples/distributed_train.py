"""Data-parallel training with exact token normalization and a resumable, packed data stream.

Run (CPU, two processes; NCCL is used instead of gloo when every process has a GPU):

    torchrun --nproc_per_node=2 examples/distributed_train.py
    python examples/distributed_train.py          # one process works too

Each rank packs its own shard of an endless document stream (PackedStream: FlatPacker inside an
IterableDataset), collates with the zephon Collator, and accumulates gradients over micro-batches.
The loss of a step is the sum of per-token losses divided by the step's *global* count of
supervised tokens, so every token weighs the same whatever micro-batch or rank holds it:

    N = global_num_valid_tokens(micro_batches)           # all-reduced over the ranks
    normalize_loss(loss_sum, N).backward()                # loss_sum * world_size / N

Halfway through, every rank saves the data loader's state (with the model and optimizer); at the end
a fresh loader restored from it must yield exactly the batches the run saw after the save.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zephon_collate import Collator, SampleMeta, SampleRecord
from zephon_collate.packing.stream import PackedStream
from zephon_collate.parallel.distributed import global_num_valid_tokens, normalize_loss

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch >= 2.9
try:  # resumes with worker processes too; pip install torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader as Loader
except ImportError:  # torch's own DataLoader: the stream's state_dict (num_workers=0)
    Loader = None

VOCAB, WIDTH, IGNORE = 64, 32, -100


def documents(shard: int, num_shards: int, epoch: int):
    """An endless, deterministic stream of this shard's documents: a prompt (unsupervised) and an answer."""
    for index in itertools.count(shard, num_shards):
        rng = np.random.default_rng([epoch, index])
        length = int(rng.integers(4, 40))
        prompt = int(rng.integers(1, length))
        payload = {
            "input_ids": np.concatenate([[1], rng.integers(3, VOCAB, length - 2), [2]]),
            "loss_mask": (np.arange(length) >= prompt).astype(np.int8),
        }
        yield SampleRecord(SampleMeta((0, shard, index), 0, index // 1000, index % 1000), payload)


class TinyLM(nn.Module):
    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(seq_len, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, VOCAB))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(input_ids) + self.position(positions))


def make_loader(args: argparse.Namespace, collate: Collator, state: dict | None = None):
    stream = PackedStream(documents, args.seq_len, pad_token_id=0, strategy="best_fit", buffer_size=64)
    if Loader is not None:
        loader = Loader(stream, batch_size=args.micro_batch, collate_fn=collate, num_workers=args.num_workers)
        if state is not None:
            loader.load_state_dict(state)
        return loader, loader.state_dict
    if state is not None:
        stream.load_state_dict(state)
    loader = torch.utils.data.DataLoader(stream, batch_size=args.micro_batch, collate_fn=collate)
    return loader, stream.state_dict


def train_step(
    ddp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict],
    launched: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns the all-rank loss sum and token count."""
    num_tokens = global_num_valid_tokens(micro_batches)  # the step's supervised tokens, all ranks
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # no_sync: accumulate locally, average over the ranks once, at the last micro-batch
        with contextlib.nullcontext() if last or not launched else ddp.no_sync():
            logits = ddp(batch["input_ids"], batch["positions"])
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(),
                batch["labels"].flatten(),
                ignore_index=IGNORE,
                reduction="sum",
            )
            normalize_loss(loss_sum, num_tokens).backward()  # loss_sum * world_size / N
        total += loss_sum.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if launched:
        dist.all_reduce(total)
    return total, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description="zephon_collate: exact-normalization DDP training")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="packed rows per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (needs torchdata)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    launched = "RANK" in os.environ  # by torchrun
    if use_cuda:
        torch.cuda.set_device(device)
    if launched:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if launched else 0
    if Loader is None:
        args.num_workers = 0

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = TinyLM(args.seq_len).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None) if launched else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    # python_scalars=False keeps num_valid_tokens a device tensor: no sync until the all-reduce.
    collate = Collator(return_labels=True, return_num_valid_tokens=True, python_scalars=False, device=device)
    loader, data_state = make_loader(args, collate)
    batches = iter(loader)

    checkpoint, seen_after = None, []
    for step in range(args.steps):
        if step == args.steps // 2:  # save what a restart needs; the data state is per rank
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": data_state()},
                buffer,
            )
            checkpoint = buffer.getvalue()
        micro_batches = [next(batches) for _ in range(args.accumulation)]
        if checkpoint is not None:
            seen_after += [batch["ids"] for batch in micro_batches]
        total, num_tokens = train_step(ddp, optimizer, micro_batches, launched, device)
        if rank == 0:
            print(
                f"step {step}: loss {float(total / num_tokens):.4f} over {int(num_tokens)} tokens", flush=True
            )

    # Resume check: a loader restored from the checkpoint yields the batches seen after the save.
    state = torch.load(io.BytesIO(checkpoint), weights_only=True)
    resumed, _ = make_loader(args, collate, state["data"])
    replay = [batch["ids"] for batch in itertools.islice(resumed, len(seen_after))]
    assert replay == seen_after, "the resumed loader yields other batches"
    print(f"rank {rank}: resumed data stream matches ({len(replay)} micro-batches)", flush=True)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
