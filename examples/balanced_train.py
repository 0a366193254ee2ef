"""Data-parallel training on balanced ranks: equal modelled work in every lockstep micro-batch.

Run (CPU, two processes; NCCL is used instead of gloo when every process has a GPU):

    torchrun --nproc_per_node=2 examples/balanced_train.py
    python examples/balanced_train.py          # one process works too

Documents of very different lengths (a long tail up to 512 tokens) cost very different amounts of
work: attention inside a document grows with its length squared. Every rank builds the same
BalancedBatchSampler (same lengths, options and seed) and so computes the same plan with no
communication: each step's documents go to ``micro_batches`` lockstep slots x ranks, each micro-batch
within its token budget, and within every slot the ranks' modelled costs (a CostModel of this very
model) are as equal as the planner can make them. Each micro-batch is packed into one padding-free
row; attention stays inside each document (SDPA with ``dense_document_mask``). The loss is normalized
exactly over the step's supervised tokens on all ranks, whatever each micro-batch holds:

    N = global_num_valid_tokens(micro_batches)           # all-reduced over the ranks
    normalize_loss(loss_sum, N).backward()                # loss_sum * world_size / N

Halfway through, every rank saves the loader's state; at the end a loader restored from it must yield
exactly the micro-batches the run saw after the save.
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_train import train_step  # the same training step
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from zephon_collate import (
    BalancedBatchSampler,
    BalanceOptions,
    Collator,
    CostModel,
    SampleMeta,
    SampleRecord,
    pack_flat,
)
from zephon_collate.functional.attention import dense_document_mask, segment_ids_from_positions
from zephon_collate.parallel.even import EvenBatches

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch >= 2.9
try:  # resumes with worker processes too; pip install torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader as Loader
except ImportError:  # torch's own DataLoader: the sampler's own state_dict (num_workers=0)
    from torch.utils.data import DataLoader as Loader

VOCAB, WIDTH, HEADS, LAYERS, IGNORE = 64, 32, 2, 2, -100
LONGEST = 512


class Documents(Dataset):
    """Document i: a prompt (unsupervised) and an answer; lengths log-normal, 8 to 512 tokens."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(0)
        self.lengths = np.clip(rng.lognormal(np.log(48), 1.0, count), 8, LONGEST).astype(int).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> SampleRecord:
        rng = np.random.default_rng([1, index])
        length = self.lengths[index]
        prompt = int(rng.integers(1, max(2, length // 3)))
        payload = {
            "input_ids": np.concatenate([[1], rng.integers(3, VOCAB, length - 2), [2]]),
            "loss_mask": (np.arange(length) >= prompt).astype(np.int8),
        }
        return SampleRecord(SampleMeta((0, 0, index), 0, index // 1000, index % 1000), payload)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # causal, inside each document
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LONGEST, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = dense_document_mask(segment_ids_from_positions(positions))
        x = self.embed(input_ids) + self.position(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


# The cost model of TinyLM itself: its width, layers, heads, MLP (not gated) and vocabulary.
COST = CostModel.from_model(
    hidden_size=WIDTH,
    num_layers=LAYERS,
    num_heads=HEADS,
    ffn_hidden_size=2 * WIDTH,
    gated=False,
    vocab_size=VOCAB,
)


def main() -> None:
    parser = argparse.ArgumentParser(description="zephon_collate: balanced data-parallel training")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches (lockstep slots) per step")
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per padding-free micro-batch")
    parser.add_argument("--documents", type=int, default=400)
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

    dataset = Documents(args.documents)
    options = BalanceOptions(cost=COST, micro_batches=args.accumulation, max_tokens=args.max_tokens)
    collator = Collator(return_labels=True, return_num_valid_tokens=True, python_scalars=False, device=device)

    def collate(records: list[SampleRecord]) -> dict:
        """The micro-batch's documents in one padding-free row (positions restart per document)."""
        return collator(
            pack_flat(records, seq_len=sum(len(r.payload["input_ids"]) for r in records), pad_token_id=0)
        )

    def make_loader(state: dict | None = None):
        sampler = BalancedBatchSampler(
            dataset.lengths, options, seed=0
        )  # rank and world size: torch.distributed
        loader = Loader(dataset, batch_sampler=sampler, collate_fn=collate)
        if state is not None:
            (loader if hasattr(loader, "load_state_dict") else sampler).load_state_dict(state)
        return loader, (loader.state_dict if hasattr(loader, "state_dict") else sampler.state_dict), sampler

    loader, data_state, sampler = make_loader()
    plans = list(sampler.plans())  # the same on every rank: check it, and show what the plan models
    if launched:
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, [plan.digest() for plan in plans])
        assert all(d == digests[0] for d in digests), "the ranks planned differently"
    if rank == 0:
        print(plans[0].summary(), flush=True)
        print(
            f"plans identical on every rank; modelled max/mean cost per slot over the epoch: "
            f"{np.mean([p.imbalance().mean() for p in plans]):.4f} (lower bound "
            f"{np.mean([p.lower_bound().mean() for p in plans]):.4f})",
            flush=True,
        )

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = TinyLM().to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None) if launched else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    batches = EvenBatches(loader)  # a safety net: balanced plans give every rank the same count
    micro_batch_iter = iter(batches)
    checkpoint, seen_after = None, []
    for step in range(args.steps):
        if step == args.steps // 2:  # save what a restart needs; the data state is per rank
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "data": data_state()}, buffer)
            checkpoint = buffer.getvalue()
        micro_batches = list(itertools.islice(micro_batch_iter, args.accumulation))  # fetch the step first
        if not micro_batches:
            break
        if checkpoint is not None:
            seen_after += [batch["ids"] for batch in micro_batches]
        total, num_tokens = train_step(ddp, optimizer, micro_batches, launched, device)
        if rank == 0:
            slots = plans[step].imbalance() if step < len(plans) else np.ones(1)
            print(
                f"step {step}: loss {float(total / num_tokens):.4f} over {int(num_tokens)} tokens, "
                f"modelled max/mean cost per slot {', '.join(f'{x:.3f}' for x in slots)}",
                flush=True,
            )

    # Resume check: a loader restored from the checkpoint yields the micro-batches seen after the save.
    if checkpoint is not None:  # (none with --steps 0)
        state = torch.load(io.BytesIO(checkpoint), weights_only=True)
        resumed, _, _ = make_loader(state["data"])
        replay = [batch["ids"] for batch in itertools.islice(resumed, len(seen_after))]
        assert replay == seen_after, "the resumed loader yields other micro-batches"
        print(f"rank {rank}: resumed data stream matches ({len(replay)} micro-batches)", flush=True)
    if launched:
        # DDP and the loaders hold the process group; free them and meet before it is destroyed, so
        # no rank leaves while another still talks to it (a hang at exit otherwise).
        del ddp, batches, micro_batch_iter
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
