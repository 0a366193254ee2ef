"""TRL's GRPOTrainer, packed: one class changed, the same training, fewer tokens through the model.

Builds everything here (nothing is downloaded): prompts over a 60-word
vocabulary, the word-level tokenizer and tiny Llama of ``trl_dpo.py`` (saved to
a temporary folder: GRPOTrainer loads its reference model from a path), and a
reward that prefers longer completions. Trains stock ``trl.GRPOTrainer`` and
``PackedGRPOTrainer`` from the same weights, generation included, and prints
each step's loss and reward side by side and the largest difference between
the two trained models.

Needs the ``trl`` extra: pip install -e ".[trl]"
Run: python examples/trl_grpo.py [--steps 4]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import warnings
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl_dpo import WORDS, llama, tokenizer

from zephon_collate.trainers import PackedGRPOTrainer


def prompts(count: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list(
        [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))} for _ in range(count)]
    )


def reward(completions: list[str], **_: Any) -> list[float]:
    """Longer completions score higher."""
    return [len(text) / 10 for text in completions]


def run(cls: type, path: str, steps: int) -> Any:
    args = GRPOConfig(
        output_dir="/tmp/zephon-grpo", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, beta=0.04, model_init_kwargs={"dtype": torch.float64}, bf16=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=path, reward_funcs=reward, args=args, train_dataset=prompts(4 * steps),
                      processing_class=tokenizer())  # fmt: skip
        trainer.train()  # built, then trained: Trainer seeds the sampling when it is built
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from datasets import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()
    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as path:
        llama(dtype=torch.float64).save_pretrained(path)
        runs = {
            name: run(cls, path, args.steps)
            for name, cls in (("stock", GRPOTrainer), ("packed", PackedGRPOTrainer))
        }
    logs = {
        name: [entry for entry in trainer.state.log_history if "loss" in entry]
        for name, trainer in runs.items()
    }
    for step, (stock, packed) in enumerate(zip(logs["stock"], logs["packed"], strict=True), 1):
        print(
            f"step {step}: loss {stock['loss']:.6f} reward {stock['reward']:.3f} (GRPOTrainer)  "
            f"loss {packed['loss']:.6f} reward {packed['reward']:.3f} (PackedGRPOTrainer)"
        )
    weights = zip(runs["stock"].model.parameters(), runs["packed"].model.parameters(), strict=True)
    largest = max(float((a - b).detach().abs().max()) for a, b in weights)
    print(f"largest weight difference after {args.steps} steps: {largest:.1e}")


if __name__ == "__main__":
    main()
