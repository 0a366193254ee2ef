"""Train a tiny GPT-2 with transformers' Trainer on chat examples, padded and padding-free.

Everything is built here, nothing is downloaded: a word-level tokenizer with a
chat template, a ``datasets.Dataset`` of conversations (the assistant copies
the user's words), and a randomly initialised GPT-2 from a config.
``Collator.for_transformers`` turns the tokenized examples into what the model
takes; only the assistant's tokens are trained. Without dropout, the padded
and the padding-free run log the same losses: the two layouts train exactly
the same tokens.

Needs the ``hf`` extra: pip install -e ".[hf]"
Run: python examples/hf_trainer.py [--steps 150]
"""

from __future__ import annotations

import argparse
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


def train(
    dataset: Dataset, tokenizer: PreTrainedTokenizerFast, padding_free: bool, steps: int
) -> list[float]:
    """The logged training losses of a fresh tiny GPT-2."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,  # no dropout: the two layouts then train the same numbers
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,  # without a cache, transformers masks the padding-free row's documents apart
    )
    collate = (
        Collator.for_transformers(padding_free=True)
        if padding_free
        else Collator.for_transformers(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=8)
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
        trainer = Trainer(
            model=GPT2LMHeadModel(config), args=args, train_dataset=dataset, data_collator=collate
        )
        trainer.remove_callback(PrinterCallback)  # the losses are printed below
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    dataset = chat_dataset(tokenizer, count=2048)
    example = dataset[0]
    batch = Collator.for_transformers(pad_token_id=tokenizer.pad_token_id)([example])
    trained = [tokenizer.convert_ids_to_tokens(int(t)) if t >= 0 else "." for t in batch["labels"][0]]
    print("tokens: ", " ".join(tokenizer.convert_ids_to_tokens(example["input_ids"])))
    print("trained:", " ".join(trained))
    for padding_free in (False, True):
        losses = train(dataset, tokenizer, padding_free, args.steps)
        layout = "padding-free" if padding_free else "padded"
        print(f"{layout}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
        print(f"  every {LOG_EVERY} steps: {' '.join(f'{loss:.3f}' for loss in losses)}")


if __name__ == "__main__":
    main()
