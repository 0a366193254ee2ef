"""TRL's DPOTrainer, packed: one class changed, the same training, fewer tokens through the model.

Builds everything here (nothing is downloaded): text preference pairs over a
60-word vocabulary, a word-level tokenizer and a tiny Llama from a config.
Trains stock ``trl.DPOTrainer`` and ``PackedDPOTrainer`` from the same weights
on the same pairs, and prints each step's loss side by side, the largest
difference between the two trained models, and the tokens each ran.

Needs the ``trl`` extra: pip install -e ".[trl]"
Run: python examples/trl_dpo.py [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import random
import warnings
from typing import Any

import torch
from datasets import Dataset, disable_progress_bars
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging
from trl import DPOConfig, DPOTrainer

from zephon_collate.trainers import PackedDPOTrainer

WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the words."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def pairs(
    count: int, prompt: tuple[int, int] = (2, 12), response: tuple[int, int] = (1, 10), seed: int = 0
) -> Dataset:
    """Text pairs whose prompt and response lengths (in words) are drawn from the given ranges."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    return Dataset.from_list(
        [{"prompt": words(*prompt), "chosen": " " + words(*response), "rejected": " " + words(*response)}
         for _ in range(count)]
    )  # fmt: skip


def llama(hidden: int = 32, dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
    """A 2-layer Llama from a config, seeded; SDPA attention."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype)


def trainer(
    cls: type, data: Dataset, steps: int = 3, hidden: int = 32, shared_prompt: bool = False, **options: Any
) -> Any:
    """``cls`` (stock or packed; ``shared_prompt``: packed, each prompt once) on ``data`` with a fresh
    :func:`llama` and a copy of it as the reference; ``options`` go to ``DPOConfig``."""
    disable_progress_bars()
    logging.set_verbosity_error()
    settings = {
        "output_dir": "/tmp/zephon-dpo", "per_device_train_batch_size": 4, "max_steps": steps,
        "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True,
        "seed": 0, "beta": 0.1, "bf16": False, **options,  # TRL turns bf16 autocast on by default
    }  # fmt: skip
    args = DPOConfig(**settings)
    model = llama(hidden)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            model=model,
            ref_model=copy.deepcopy(model),
            args=args,
            train_dataset=data,
            processing_class=tokenizer(),
            **({"shared_prompt": True} if shared_prompt else {}),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    data = pairs(4 * args.steps)
    runs = {
        name: trainer(cls, data, args.steps)
        for name, cls in (("stock", DPOTrainer), ("packed", PackedDPOTrainer))
    }
    for run in runs.values():
        run.train()
    history = {
        name: [entry["loss"] for entry in run.state.log_history if "loss" in entry]
        for name, run in runs.items()
    }
    for step, (stock, packed) in enumerate(zip(history["stock"], history["packed"], strict=True), 1):
        print(f"step {step}: loss {stock:.6f} (DPOTrainer)  {packed:.6f} (PackedDPOTrainer)")
    weights = zip(runs["stock"].model.parameters(), runs["packed"].model.parameters(), strict=True)
    largest = max(float((a - b).detach().abs().max()) for a, b in weights)
    print(f"largest weight difference after {args.steps} steps: {largest:.1e}")
    padded = real = 0
    for start in range(0, len(data), 4):
        batch = runs["packed"].data_collator(
            [runs["packed"].train_dataset[i] for i in range(start, start + 4)]
        )
        padded += batch["input_ids"].numel()
        real += int(batch["attention_mask"].sum())
    print(f"tokens through the model: {padded:,} padded, {real:,} packed ({padded / real:.2f}x fewer)")


if __name__ == "__main__":
    main()
