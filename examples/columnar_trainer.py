"""Train a tiny GPT-2 with transformers' Trainer from whole batches of columns (ColumnarDataset).

The chat dataset, tokenizer and model of ``hf_trainer.py`` (built here, nothing
is downloaded), trained padding-free twice: once from the ``datasets.Dataset``
itself (examples as dicts, ``remove_unused_columns=False`` so that the
``assistant_masks`` column survives), once from ``ColumnarDataset(dataset)``
with Trainer's defaults: each step's batch arrives as one columnar batch (a
``ColumnBatch`` of ``(values, offsets)`` pairs) and is read column by column.
``Trainer`` cannot drop the ``assistant_masks`` column there (the wrapper is
not a ``datasets.Dataset``, and its batch is not an example dict), so the same
tokens are trained: both runs log the same losses. The collator is told
``supervision="assistant_masks"``: a batch without that column would be
refused, never trained whole.

Needs the ``hf`` and ``arrow`` extras: pip install -e ".[hf,arrow]"
Run: python examples/columnar_trainer.py [--steps 60]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from typing import Any

import datasets
import torch
from hf_trainer import build_tokenizer, chat_dataset
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from zephon_collate import Collator, ColumnarDataset

LOG_EVERY = 10


def train(train_dataset: Any, vocab: int, steps: int, **arguments: Any) -> list[float]:
    """The logged training losses of a fresh tiny GPT-2, padding-free."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,  # without a cache, transformers masks the padding-free row's documents apart
    )
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=16,
            learning_rate=3e-3,
            warmup_steps=10,
            logging_steps=LOG_EVERY,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            **arguments,
        )
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=train_dataset,
            # supervision=: an example without its assistant_masks is refused, never trained whole
            data_collator=Collator.for_transformers(padding_free=True, supervision="assistant_masks"),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    dataset = chat_dataset(tokenizer, count=2048).shuffle(seed=0)  # an indices mapping, as shuffled sets have
    columnar = ColumnarDataset(dataset)
    batch = columnar.__getitems__([0, 1])
    values, offsets = batch[0]["input_ids"]
    print(f"one batch: {batch[0]!r}, {len(offsets) - 1} rows, {len(values)} tokens")
    rows = train(dataset, len(tokenizer), args.steps, remove_unused_columns=False)
    columns = train(columnar, len(tokenizer), args.steps)  # Trainer's defaults: remove_unused_columns=True
    for name, losses in (("examples", rows), ("columns", columns)):
        print(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
        print(f"  every {LOG_EVERY} steps: {' '.join(f'{loss:.4f}' for loss in losses)}")
    print("same losses:", rows == columns)


if __name__ == "__main__":
    main()
