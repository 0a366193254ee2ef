"""A torchtitan-style training loop on Grain: documents packed by a Grain stage, collated as Grain's
``batch_fn``, prefetched by a thread, checkpointed with the model and resumed bit for bit.

Run (CPU; add --workers 2 for two Grain worker processes):

    python examples/grain_loop.py [--steps 12] [--workers 0]

The pipeline is torchtitan's, with the package's stages in it::

    grain.MapDataset.source(documents).shuffle(seed)[rank::world]     # a MapDataset, read in order
      -> PackIterDataset(seq_len, pad_token_id)        # rows of seq_len tokens, documents kept apart
      -> .batch(batch_size, batch_fn=Collator(...))    # labels, positions, num_valid_tokens
      -> ThreadPrefetchIterDataset                      # (or .mp_prefetch(workers).map(as_torch))

Halfway, the loop saves the model and ``{"version": 1, "dp_world_size": 1, "dp_rank_0":
iterator.get_state()}`` as JSON (what torchtitan saves). It trains on, then a fresh model and a fresh
pipeline restored from the checkpoint run the same steps: their losses must equal the first run's.
"""

from __future__ import annotations

import argparse
import io
import json

import grain
import numpy as np
import torch
import torch.nn.functional as F
from balanced_train import IGNORE, Documents, TinyLM  # the same tiny model and documents

from zephon_collate import Collator
from zephon_collate.engines.grain import PackIterDataset, as_torch

SEQ_LEN, BATCH, SEED = 512, 2, 0


def pipeline(dataset: Documents, workers: int, rank: int = 0, world: int = 1) -> grain.IterDataset:
    """torchtitan's Grain pipeline, with the packer and the collator as its stages."""
    ds = grain.MapDataset.source([dataset[i] for i in range(len(dataset))]).shuffle(seed=SEED)
    ds = PackIterDataset(ds[rank::world], seq_len=SEQ_LEN, pad_token_id=0)
    options = {"return_labels": True, "return_num_valid_tokens": True}
    if workers:  # NumPy out of the workers (Grain's shared memory carries it), torch tensors after
        ds = ds.batch(BATCH, batch_fn=Collator(**options, dtype=np.int64))
        prefetch = grain.MultiprocessingOptions(num_workers=workers)
        # one torch thread per worker, as a DataLoader worker sets for itself
        ds = ds.mp_prefetch(prefetch, worker_init_fn=lambda worker, count: torch.set_num_threads(1))
        return ds.map(as_torch)
    ds = ds.batch(BATCH, batch_fn=Collator(**options))
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)


def step(model: TinyLM, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    logits = model(batch["input_ids"], batch["positions"])
    loss = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum"
    )
    count = max(batch["num_valid_tokens"], 1)  # a batch with nothing trained: a loss of 0, not NaN
    (loss / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()) / count


def fresh() -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description="zephon_collate on Grain, torchtitan-style")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, default=0, help="Grain worker processes (mp_prefetch)")
    parser.add_argument("--documents", type=int, default=300)
    args = parser.parse_args()
    dataset = Documents(args.documents)
    model, optimizer = fresh()
    iterator = iter(pipeline(dataset, args.workers))
    save_at, checkpoint, losses = args.steps // 2, None, []
    for index in range(args.steps):
        if index == save_at:  # the data state beside the model's, as JSON
            data = {"version": 1, "dp_world_size": 1, "dp_rank_0": iterator.get_state()}
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
            checkpoint = (buffer.getvalue(), json.dumps(data))
        batch = next(iterator)
        losses.append(step(model, optimizer, batch))
        tokens = batch["input_ids"].numel()
        print(f"step {index}: loss {losses[-1]:.4f}, {batch['num_valid_tokens']} trained of {tokens} tokens")
    iterator.close()
    if checkpoint is None:
        return
    weights, data = checkpoint
    print(f"checkpoint at step {save_at}: data state {len(data)} bytes of JSON")

    # Restart: a fresh model and pipeline, restored from the checkpoint, run the same steps.
    model, optimizer = fresh()
    saved = torch.load(io.BytesIO(weights), weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = iter(pipeline(dataset, args.workers))
    resumed.set_state(json.loads(data)["dp_rank_0"])
    again = [step(model, optimizer, next(resumed)) for _ in range(save_at, args.steps)]
    resumed.close()
    print(f"resumed at step {save_at}: losses equal to the uninterrupted run: {again == losses[save_at:]}")


if __name__ == "__main__":
    main()
