"""Train a tiny causal LM on batches from the zephon Collator through a DataLoader with workers.

The fast-pipeline recipe:
- workers only stack records into a CPU TensorDict (``collate_fn=collator.stack``);
- ``pin_memory=True`` pins it (on CUDA machines);
- the main process moves it to the device with ``non_blocking=True`` and runs the
  transform chain there (``collator.finish``), compiled when ``--compile`` is given.

Run: python examples/train_dataloader.py [--steps 30] [--device cuda] [--compile]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zephon_collate import Collator, SampleMeta, SampleRecord, pack_flat

BOS, EOS, PAD, VOCAB = 1, 2, 0, 64


class Documents(Dataset):
    """Packed rows of toy documents: each document counts up from a random start (learnable)."""

    def __init__(self, rows: int, seq_len: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        documents = []
        for index in range(rows * 4):
            length = int(torch.randint(4, seq_len // 2, (1,), generator=generator))
            start = int(torch.randint(3, VOCAB - 1, (1,), generator=generator))
            body = (torch.arange(length) + start - 3) % (VOCAB - 3) + 3
            tokens = torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])
            meta = SampleMeta(
                (0, 0, index), lane_id=0, chunk_id=0, chunk_offset=index, component_sample_counts={0: 1}
            )
            documents.append(SampleRecord(meta, {"input_ids": tokens.tolist()}))
        self.rows = pack_flat(documents, seq_len, pad_token_id=PAD)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> SampleRecord:
        return self.rows[index]


class TinyLM(nn.Module):
    """One causal self-attention block; attention stays inside each packed document."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(1024, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        segment = (positions == 0).cumsum(dim=1)  # document index of each token
        same_doc = segment.unsqueeze(2) == segment.unsqueeze(1)
        causal = torch.ones_like(same_doc[0]).tril()
        mask = (same_doc & causal).unsqueeze(1)
        heads = [t.unsqueeze(1) for t in (q, k, v)]  # one attention head
        x = x + F.scaled_dot_product_attention(*heads, attn_mask=mask)[:, 0]
        return self.head(x + self.mlp(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="compile the transform chain")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    collator = Collator(
        device=args.device,
        compile=args.compile,
        return_labels=True,
        return_num_valid_tokens=True,
        eos_mask_loss=True,
        eos_token_id=EOS,
        python_scalars=False,  # keep the token count on the device: no sync per step
    )
    loader = DataLoader(
        Documents(rows=64, seq_len=args.seq_len),
        batch_size=8,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=collator.stack,  # workers: CPU stacking only, no CUDA
        pin_memory=args.device.startswith("cuda"),
        persistent_workers=args.workers > 0,
    )
    model = TinyLM().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step, first_loss, loss = 0, None, torch.tensor(0.0)
    while step < args.steps:
        for stacked in loader:
            batch = collator.finish(stacked)  # main process: device copy + transform chain
            logits = model(batch["input_ids"], batch["positions"])
            loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            loss = loss_sum / batch["num_valid_tokens"].clamp(min=1)  # exact per-token mean
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            first_loss = float(loss) if first_loss is None else first_loss
            step += 1
            if step % 10 == 0 or step == args.steps:
                print(f"step {step:4d}  loss {float(loss):.3f}")
            if step == args.steps:
                break
    print(f"loss {first_loss:.3f} -> {float(loss):.3f}")


if __name__ == "__main__":
    main()
