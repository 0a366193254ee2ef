"""Train a tiny GPT-2 with transformers' Trainer and TRL's SFTTrainer on chat examples.

Everything is built here, nothing is downloaded: a word-level tokenizer with a
chat template, a ``datasets.Dataset`` of conversations (the assistant copies
the user's words), and a randomly initialised GPT-2 from a config.
``Collator.for_transformers(tokenizer, ...)`` turns the tokenized examples into
what the model takes; only the assistant's tokens are trained.

- ``Trainer``, padded and padding-free: without dropout the two runs log the
  same losses, since the two layouts train exactly the same tokens.
- TRL's ``SFTTrainer`` on rows packed by ``trl.pack_dataset`` (best-fit
  decreasing, the rows ``SFTTrainer(packing=True)`` trains on), padding-free:
  the batch equals TRL's own collator's, key for key, and its loss equals the
  loss of the same documents run one at a time (they do not attend to each other).

Needs the ``hf`` extra (pip install -e ".[hf]"); the SFTTrainer run needs ``trl`` too.
Run: python examples/hf_trainer.py [--steps 150] [--sft-steps 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import random
import tempfile

import datasets
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)

from zephon_collate import Collator

WORDS = [f"w{i}" for i in range(24)]
LOG_EVERY = 10
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}<|user|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a chat template that marks the assistant's tokens."""
    vocab = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "copy:", *WORDS]
    model = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocab)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_dataset(tokenizer: PreTrainedTokenizerFast, count: int, seed: int = 0) -> Dataset:
    """Conversations of 2-8 words copied back, tokenized with the assistant mask."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        words = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
        conversations.append(
            {
                "messages": [
                    {"role": "user", "content": f"copy: {words}"},
                    {"role": "assistant", "content": words},
                ]
            }
        )

    def tokenize(example: dict) -> dict:
        return tokenizer.apply_chat_template(
            example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )

    return Dataset.from_list(conversations).map(tokenize, remove_columns=["messages"])


def tiny_gpt2(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    """A fresh GPT-2 of two layers, without dropout."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,  # without a cache, transformers masks a padding-free row's documents apart
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(
    dataset: Dataset, tokenizer: PreTrainedTokenizerFast, padding_free: bool, steps: int
) -> list[float]:
    """The logged training losses of a fresh tiny GPT-2."""
    # The tokenizer gives pad_token_id and padding_side; supervision= refuses a batch that lost the mask.
    collate = (
        Collator.for_transformers(tokenizer, padding_free=True, supervision="assistant_masks")
        if padding_free
        else Collator.for_transformers(tokenizer, pad_to_multiple_of=8, supervision="assistant_masks")
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
            remove_unused_columns=False,  # keep `assistant_masks`: the collator needs it
        )
        trainer = Trainer(model=tiny_gpt2(tokenizer), args=args, train_dataset=dataset, data_collator=collate)
        trainer.remove_callback(PrinterCallback)  # the losses are printed below
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def sft_train(dataset: Dataset, tokenizer: PreTrainedTokenizerFast, steps: int) -> None:
    """TRL's SFTTrainer on bfd-packed rows, padding-free, with this collator; prints what it checks."""
    import trl
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    # What SFTTrainer's own preparation writes: labels with -100 outside the assistant's turns, then
    # best-fit-decreasing packing into rows of at most 64 tokens, each with its documents' seq_lengths.
    def labelled(example: dict) -> dict:
        mask = example["assistant_masks"]
        return {"labels": [t if m else -100 for t, m in zip(example["input_ids"], mask, strict=True)]}

    documents = dataset.map(labelled).select_columns(["input_ids", "labels"])
    packed = trl.pack_dataset(documents, seq_length=64, strategy="bfd")
    collate = Collator.for_transformers(
        tokenizer, padding_free=True, return_flash_attn_kwargs=True, return_seq_idx=True, supervision="labels"
    )
    rows = [packed[i] for i in range(4)]
    ours = collate(rows)
    theirs = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)(rows)
    same = list(ours) == list(theirs) and all(
        ours[k].tolist() == theirs[k].tolist()
        if isinstance(theirs[k], torch.Tensor)
        else ours[k] == theirs[k]
        for k in theirs
    )
    print(f"SFTTrainer rows: {len(packed)} packed from {len(documents)} conversations")
    print(f"  batch equal to TRL's DataCollatorForLanguageModeling(padding_free=True): {same}")

    model = tiny_gpt2(tokenizer)
    with torch.no_grad():  # the packed row's loss against the same documents one at a time
        packed_loss = model(**ours).loss
        lengths = [n for row in rows for n in row["seq_lengths"]]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        one_by_one = [
            {key: ours[key][0, start : start + n].tolist() for key in ("input_ids", "labels")}
            for start, n in zip(starts, lengths, strict=True)
        ]
        alone = model(**Collator.for_transformers(tokenizer)(one_by_one)).loss
    print(f"  packed loss {packed_loss:.6f}, documents one at a time {alone:.6f}")

    with tempfile.TemporaryDirectory() as output_dir:
        args = trl.SFTConfig(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
            logging_steps=LOG_EVERY, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
            bf16=False,
            dataset_kwargs={"skip_prepare_dataset": True},  # packed above, as SFTTrainer packs
            remove_unused_columns=False,  # keep seq_lengths
        )  # fmt: skip
        # The collator is passed without packing=True: SFTTrainer refuses a custom collator in its own
        # padding-free mode, and this one does that part.
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=packed, processing_class=tokenizer, data_collator=collate
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"SFTTrainer packed padding-free: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=40)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    dataset = chat_dataset(tokenizer, count=2048)
    example = dataset[0]
    batch = Collator.for_transformers(tokenizer)([example])
    trained = [tokenizer.convert_ids_to_tokens(int(t)) if t >= 0 else "." for t in batch["labels"][0]]
    print("tokens: ", " ".join(tokenizer.convert_ids_to_tokens(example["input_ids"])))
    print("trained:", " ".join(trained))
    for padding_free in (False, True):
        losses = train(dataset, tokenizer, padding_free, args.steps)
        layout = "padding-free" if padding_free else "padded"
        print(f"{layout}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
        print(f"  every {LOG_EVERY} steps: {' '.join(f'{loss:.3f}' for loss in losses)}")
    if importlib.util.find_spec("trl") is None:
        print("trl is not installed: the SFTTrainer run is skipped (pip install trl)")
    else:
        sft_train(dataset, tokenizer, args.sft_steps)


if __name__ == "__main__":
    main()
