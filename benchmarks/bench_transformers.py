"""Collator.for_transformers against the transformers collators it replaces, on the same examples.

SFT examples as a Hugging Face dataset hands them over (Python lists:
``input_ids`` and ``labels`` with -100 on a prompt of about a third), batch
sizes and lengths swept. Padded: ours against ``DataCollatorForSeq2Seq``;
padding-free: ours against ``DataCollatorWithFlattening`` (position ids,
FlashAttention kwargs and seq_idx on). Both pairs return equal batches (checked
before timing); times are medians of interleaved rounds, with a plain copy of
the output's bytes as the floor.

Run: python benchmarks/bench_transformers.py   (needs the hf extra)
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from common import compare, memcpy_seconds, output_bytes
from tokenizers import Tokenizer, models
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerFast

from zephon_collate import Collator

VOCAB = 32_000
SHAPES = [(1, 128), (8, 128), (8, 512), (32, 512), (8, 2048), (64, 1024)]


def examples(count: int, longest: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` examples of ``longest // 2`` to ``longest`` tokens, the first third unsupervised."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(longest // 2, longest))]
        prompt = len(ids) // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def pad_tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>")


def same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].tolist() == value.tolist() if isinstance(value, torch.Tensor) else ours[key] == value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    padded = Collator.for_transformers(pad_token_id=0)
    flat = Collator.for_transformers(padding_free=True)
    seq2seq = DataCollatorForSeq2Seq(pad_tokenizer(), label_pad_token_id=-100)
    flattening = DataCollatorWithFlattening(
        return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True
    )
    print("| batch | padded: ours | DataCollatorForSeq2Seq | HF/ours | copy/ours "
          "| padding-free: ours | DataCollatorWithFlattening | HF/ours | copy/ours |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows, longest in SHAPES:
        batch = examples(rows, longest)
        same(padded(batch), dict(seq2seq(batch)))
        same(flat(batch), flattening(batch))
        copy_padded, copy_flat = (
            memcpy_seconds(output_bytes(padded(batch))),
            memcpy_seconds(output_bytes(flat(batch))),
        )
        collators = {"padded": padded, "seq2seq": seq2seq, "flat": flat, "flattening": flattening}
        times = compare(
            {name: lambda c=collate, b=batch: c(b) for name, collate in collators.items()}, rounds=args.rounds
        )
        print(
            f"| {rows}x{longest} | {times['padded'] * 1e6:,.0f} us | {times['seq2seq'] * 1e6:,.0f} us "
            f"| {times['seq2seq'] / times['padded']:.1f} | {copy_padded / times['padded']:.3f} "
            f"| {times['flat'] * 1e6:,.0f} us | {times['flattening'] * 1e6:,.0f} us "
            f"| {times['flattening'] / times['flat']:.1f} | {copy_flat / times['flat']:.3f} |"
        )


if __name__ == "__main__":
    main()
