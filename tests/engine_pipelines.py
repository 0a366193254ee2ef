"""Grain pipelines and their DataLoader twins, shared by tests/test_grain.py and its restarts.

Run as a script, it restarts a pipeline in a fresh process from each saved state:
``python tests/engine_pipelines.py PIPELINE WORKERS STATES.json OUT.json`` writes, per state,
the digests of the batches that follow it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import grain
import numpy as np
import torch

from zephon_collate import (
    BalancedBatchSampler,
    BalanceOptions,
    Collator,
    CostModel,
    SampleMeta,
    SampleRecord,
)
from zephon_collate.engines.grain import BalancedIterDataset, PackIterDataset

COLLATOR = Collator(return_labels=True)
PADDED = Collator(return_labels=True, pad_token_id=0)
BALANCE = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=24, micro_batches=2)
PACKERS: dict[str, dict[str, Any]] = {
    "greedy": {"seq_len": 32, "pad_token_id": 0},
    "best_fit": {"seq_len": 32, "pad_token_id": 0, "strategy": "best_fit", "buffer_size": 8},
    "groups": {"seq_len": 32, "pad_token_id": 0, "group_key": "group"},
}


def documents(count: int = 60, seed: int = 0) -> list[SampleRecord]:
    """Documents of 2-10 tokens with a one-token prompt; document ``i`` holds token ``i + 1`` only,
    so a row's tokens say which documents it holds. Groups of 1-3 consecutive documents."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 11, count)
    groups = np.repeat(np.arange(count), np.resize([1, 2, 3], count))[:count]  # groups of 1, 2 and 3
    return [
        SampleRecord(
            SampleMeta((0, 0, i), 0, 0, i),
            {
                "input_ids": [i + 1] * int(n),
                "loss_mask": [0] + [1] * (int(n) - 1),
                "group": int(groups[i]),
            },
        )
        for i, n in enumerate(lengths)
    ]


def lengths(docs: list[SampleRecord]) -> list[int]:
    return [len(doc.payload["input_ids"]) for doc in docs]  # type: ignore[index]


def packed(name: str, workers: int, batch_size: int = 3, docs: list[SampleRecord] | None = None) -> Any:
    """The packer stage over the documents, batched by the collator, on ``workers`` processes."""
    ds = grain.MapDataset.source(docs or documents()).to_iter_dataset()
    ds = PackIterDataset(ds, **PACKERS[name]).batch(batch_size, batch_fn=COLLATOR)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds


def sampler(rank: int, docs: list[SampleRecord] | None = None, seed: int = 0) -> BalancedBatchSampler:
    return BalancedBatchSampler(lengths(docs or documents()), BALANCE, num_replicas=2, rank=rank, seed=seed)


def balanced(rank: int, workers: int, num_epochs: int = 1) -> Any:
    """This rank's balanced micro-batches, each collated, on ``workers`` processes."""
    docs = documents()
    ds = BalancedIterDataset(grain.MapDataset.source(docs), sampler(rank, docs), num_epochs).map(PADDED)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds


def build(pipeline: str, workers: int) -> Any:
    kind, name = pipeline.split(":")
    return packed(name, workers) if kind == "packed" else balanced(int(name), workers)


def digest(batch: dict[str, Any]) -> str:
    """One batch, every key and value (dtype and shape included), as a hash."""
    parts = []
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            value = (str(value.dtype), tuple(value.shape), value.tolist())
        parts.append((key, value))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _main(pipeline: str, workers: str, states_path: str, out_path: str) -> None:
    dataset = build(pipeline, int(workers))
    with open(states_path) as file:
        states = json.load(file)
    rests = []
    for state in states:
        iterator = iter(dataset)
        iterator.set_state(state)
        rests.append([digest(batch) for batch in iterator])
        iterator.close()
    with open(out_path, "w") as file:
        json.dump(rests, file)


if __name__ == "__main__":
    _main(*sys.argv[1:])
