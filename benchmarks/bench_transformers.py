"""Collator.for_transformers against the transformers and TRL collators it replaces, on the same examples.

SFT examples as a Hugging Face dataset hands them over (Python lists:
``input_ids`` and ``labels`` with -100 on a prompt of about a third), batch
sizes and lengths swept. Padded: ours against ``DataCollatorForSeq2Seq``;
padding-free: ours against ``DataCollatorWithFlattening`` (position ids,
FlashAttention kwargs and seq_idx on). A second table turns options on, each
against the peer with the same options: truncation (against TRL's collator
after the slicing its dataset preparation does), left padding,
``padding="max_length"`` with ``pad_to_multiple_of``, NumPy output,
padding-free ``pad_to_multiple_of`` and packed rows (``seq_lengths``) against
TRL's collator, and a ``completion_mask`` against TRL's collator given the
labels its preparation builds from it. Every pair returns equal batches
(checked key for key, dtype for dtype, before timing); times are medians of
interleaved rounds, with a plain copy of the output's bytes as the floor.

Run: python benchmarks/bench_transformers.py   (needs the hf extra; the TRL rows need trl)
"""

from __future__ import annotations

import argparse
import importlib.util
import random
from typing import Any

import numpy as np
import torch
from common import compare, memcpy_seconds, output_bytes
from tokenizers import Tokenizer, models
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerFast

from zephon_collate import Collator

VOCAB = 32_000
SHAPES = [(1, 128), (8, 128), (8, 512), (32, 512), (8, 2048), (64, 1024)]
OPTION_SHAPES = [(8, 512), (64, 1024)]


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


def pad_tokenizer_left() -> PreTrainedTokenizerFast:
    tokenizer = pad_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


def same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Key for key: arrays of the same kind, dtype and values; equal Python ints."""
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, (torch.Tensor, np.ndarray)):
            assert type(ours[key]) is type(value) and ours[key].dtype == value.dtype, key
            assert ours[key].tolist() == value.tolist(), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key


def packed(batch: list[dict[str, Any]], longest: int) -> list[dict[str, Any]]:
    """The examples packed greedily into rows of at most ``longest`` tokens with ``seq_lengths``, as TRL's
    packing writes them."""
    rows: list[dict[str, Any]] = []
    for example in batch:
        if not rows or len(rows[-1]["input_ids"]) + len(example["input_ids"]) > longest:
            rows.append({"input_ids": [], "labels": [], "seq_lengths": []})
        row = rows[-1]
        row["input_ids"] = row["input_ids"] + example["input_ids"]
        row["labels"] = row["labels"] + example["labels"]
        row["seq_lengths"].append(len(example["input_ids"]))
    return rows


def with_completion_mask(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The examples with a ``completion_mask`` (0 on the prompt) instead of ``labels``."""
    return [
        {"input_ids": e["input_ids"], "completion_mask": [int(label != -100) for label in e["labels"]]}
        for e in batch
    ]


def option_pairs(longest: int) -> list[tuple[str, str, Any, Any, Any]]:
    """``(options, peer, ours, peer's collator, examples -> (our input, peer's input))`` for each option row."""
    right, left = pad_tokenizer(), pad_tokenizer_left()
    flat = {"return_flash_attn_kwargs": True, "return_seq_idx": True}
    both = lambda batch: (batch, batch)  # noqa: E731
    pairs = [
        (
            "left padding (tokenizer.padding_side='left')",
            "DataCollatorForSeq2Seq",
            Collator.for_transformers(left),
            DataCollatorForSeq2Seq(left),
            both,
        ),
        (
            f"padding='max_length', max_length={longest}, pad_to_multiple_of=64",
            "DataCollatorForSeq2Seq",
            Collator.for_transformers(right, padding="max_length", max_length=longest, pad_to_multiple_of=64),
            DataCollatorForSeq2Seq(right, padding="max_length", max_length=longest, pad_to_multiple_of=64),
            both,
        ),
        (
            "return_tensors='np', label_pad_token_id=-1",
            "DataCollatorForSeq2Seq",
            Collator.for_transformers(right, return_tensors="np", label_pad_token_id=-1),
            DataCollatorForSeq2Seq(right, return_tensors="np", label_pad_token_id=-1),
            both,
        ),
        (
            "padding-free, return_tensors='np'",
            "DataCollatorWithFlattening",
            Collator.for_transformers(padding_free=True, return_tensors="np", **flat),
            DataCollatorWithFlattening(return_tensors="np", return_position_ids=True, **flat),
            both,
        ),
    ]
    if importlib.util.find_spec("trl") is None:
        return pairs
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    cut = longest // 2
    pairs += [
        (
            f"max_length={cut}, truncation_mode='keep_start'",
            "TRL (sliced as its preparation)",
            Collator.for_transformers(pad_token_id=0, max_length=cut, truncation_mode="keep_start"),
            DataCollatorForLanguageModeling(pad_token_id=0),
            lambda batch: (batch, [{key: value[:cut] for key, value in e.items()} for e in batch]),
        ),
        (
            "completion_mask (labels built by TRL's preparation)",
            "TRL",
            Collator.for_transformers(pad_token_id=0),
            DataCollatorForLanguageModeling(pad_token_id=0),
            lambda batch: (with_completion_mask(batch), batch),
        ),
        (
            "padding-free, pad_to_multiple_of=128",
            "TRL",
            Collator.for_transformers(pad_token_id=0, padding_free=True, pad_to_multiple_of=128, **flat),
            DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=128),
            both,
        ),
        (
            f"packed rows (seq_lengths) of {longest}, padding-free",
            "TRL",
            Collator.for_transformers(pad_token_id=0, padding_free=True, **flat),
            DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
            lambda batch: (packed(batch, longest),) * 2,
        ),
    ]
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    padded = Collator.for_transformers(pad_token_id=0)
    flat = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True, return_seq_idx=True)
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
    print()
    print("| options | batch | ours | peer | peer time | peer / ours |")
    print("|---|---|---:|---|---:|---:|")
    for rows, longest in OPTION_SHAPES:
        batch = examples(rows, longest)
        for options, peer, ours, theirs, inputs in option_pairs(longest):
            mine, its = inputs(batch)
            same(ours(mine), dict(theirs(its)))
            times = compare(
                {"ours": lambda c=ours, b=mine: c(b), "peer": lambda c=theirs, b=its: c(b)},
                rounds=args.rounds,
            )
            print(
                f"| {options} | {rows}x{longest} | {times['ours'] * 1e6:,.0f} us | {peer} "
                f"| {times['peer'] * 1e6:,.0f} us | {times['peer'] / times['ours']:.1f} |"
            )


if __name__ == "__main__":
    main()
