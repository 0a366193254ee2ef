"""A GRPO clipped loss under DDP, in every aggregate_loss mode, equals one process's exact gradient.

Launched by tests/test_post_training_distributed.py as::

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_post_training_check.py --report report.json

Each step hands every rank two micro-batches of rollouts, with a different number of rollouts on each
rank and in each micro-batch (shared prompts, padding-free or padded), old log-probs and one advantage
per rollout. Each rank calls ``aggregate_loss`` on its micro-batches with the step's
``global_loss_count`` and accumulates (``no_sync`` on the first); DDP averages. The gradient must equal
that of the whole step's loss computed in one process, rollout by rollout, from verl's formula for the
mode; the naive recipe (each micro-batch's own mean, averaged) must not, so the check can fail. Exit
status 0 means every check passed on every rank; rank 0 writes a JSON report.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zephon_collate import Collator, FloatField, aggregate_loss, global_loss_count, token_logprobs
from zephon_collate.losses import MODES

VOCAB, WIDTH, POSITIONS = 24, 8, 32
NORMALIZER = 12.0
SPLITS = {0: (3, 1), 1: (2, 4)}  # rollouts per micro-batch on each rank: uneven counts
LAYOUTS = ({"padding_free": True, "shared_prompt": True}, {"pad_token_id": 0})
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}


class TinyLM(nn.Module):
    """Token and position embeddings, a mixing layer, logits: each position's logits from its token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(POSITIONS, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids) + self.position(position_ids)))


def rollouts(step: int) -> list[dict]:
    """The step's 10 rollouts, groups of completions of a few prompts."""
    rng = random.Random(step)
    out = []
    while len(out) < sum(sum(split) for split in SPLITS.values()):
        prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 4))]
        for _ in range(rng.randint(1, 3)):
            completion = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 7))]
            out.append({
                "input_ids": prompt + completion,
                "completion_mask": [0] * len(prompt) + [1] * len(completion),
                "old": [0.0] * len(prompt) + [rng.uniform(-4, -1) for _ in completion],
                "advantage": rng.uniform(-1, 1),
            })  # fmt: skip
    return out[: sum(sum(split) for split in SPLITS.values())]


def positions(batch: dict) -> torch.Tensor:
    if "position_ids" in batch:
        return batch["position_ids"]
    return torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])


def clipped(logprobs, old, advantages, epsilon=0.2):
    ratio = torch.exp(logprobs - old)
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)


def reference_loss(model: nn.Module, examples: list[dict], mode: str) -> torch.Tensor:
    """The whole step's loss in one process, rollout by rollout (verl's agg_loss formula for ``mode``)."""
    losses = []
    for example in examples:
        ids = torch.tensor([example["input_ids"]])
        logits = model(ids, torch.arange(ids.shape[1])[None]).log_softmax(-1)
        lp = logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        prompt = example["completion_mask"].index(1)
        old = torch.tensor(example["old"][prompt:], dtype=torch.float64)
        losses.append(clipped(lp[prompt - 1 :], old, example["advantage"]))
    total = sum(loss.sum() for loss in losses)
    if mode == "token-mean":
        return total / sum(loss.numel() for loss in losses)
    if mode == "seq-mean-token-sum":
        return total / len(losses)
    if mode == "seq-mean-token-mean":
        return sum(loss.mean() for loss in losses) / len(losses)
    if mode == "seq-mean-token-sum-norm":
        return total / len(losses) / NORMALIZER
    return total


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def error(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))


def run(mode: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM().double()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    report: dict = {"grad_errors": [], "naive_errors": [], "counts": []}
    for step, layout in enumerate(LAYOUTS):
        floats = [  # float64, as the float64 reference computes them
            FloatField("old", dtype=torch.float64),
            FloatField("advantage", "sequence", dtype=torch.float64, broadcast=True),
        ]
        collate = Collator.for_rollouts(float_fields=floats, **layout)
        examples = rollouts(step)
        start = sum(sum(SPLITS[r]) for r in range(rank))
        sizes = SPLITS[rank]
        mine = [examples[start : start + sizes[0]], examples[start + sizes[0] : start + sum(sizes)]]
        micro = [collate(chunk) for chunk in mine]
        count = None if mode == "token-sum" else global_loss_count(micro, mode=mode)
        ddp.zero_grad()
        for i, batch in enumerate(micro):
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                logits = ddp(batch["input_ids"], positions(batch))
                per_token = clipped(token_logprobs(logits, batch), batch["old"], batch["advantage"])
                aggregate_loss(
                    per_token, batch, mode=mode, global_count=count, normalizer=NORMALIZER
                ).backward()
        distributed = grads(ddp)
        reference.zero_grad()
        reference_loss(reference, examples, mode).backward()
        expected = grads(reference)
        naive = copy.deepcopy(reference)
        naive.zero_grad()
        for r in range(world):  # each micro-batch's own mean, averaged over micro-batches and ranks
            begin = sum(sum(SPLITS[q]) for q in range(r))
            for lo, hi in ((0, SPLITS[r][0]), (SPLITS[r][0], sum(SPLITS[r]))):
                (reference_loss(naive, examples[begin + lo : begin + hi], mode) / (2 * world)).backward()
        report["grad_errors"].append(error(distributed, expected))
        report["naive_errors"].append(error(grads(naive), expected))
        report["counts"].append(None if count is None else int(count))
        assert all(torch.allclose(a, b, **TOLERANCE) for a, b in zip(distributed, expected, strict=True)), (
            f"rank {rank} {mode} step {step}: gradients differ by {report['grad_errors'][-1]}"
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="where rank 0 writes the JSON report")
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world == len(SPLITS), f"run with --nproc_per_node={len(SPLITS)}"
        report = {"world_size": world, **{mode: run(mode, rank, world) for mode in MODES}}
        dist.barrier()
        if rank == 0 and args.report:
            with open(args.report, "w") as handle:
                json.dump(report, handle, indent=1)
        print(f"rank {rank}: OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
