"""PackedDPOTrainer and PackedGRPOTrainer against stock TRL: tokens the model runs per step, and a step's time.

DPO: pairs of the realistic mix (prompt 200-800 tokens, each response 50-1,000,
uniform), ``--pairs`` per step. Tokens per step: the padded batch's
``input_ids`` (``[2P, L]``, what stock TRL runs) against the packed rows: best-fit
into rows as wide as the longest sequence (the layout under SDPA, padding
included), one row of every real token (the layout under FlashAttention), and
``shared_prompt=True``'s rows (each pair's prompt once, a 4-D branch mask).
Time per step: ``compute_loss`` and ``backward`` on the same batch through each
trainer, interleaved, medians of ``--rounds`` rounds (CPU,
one torch thread), on a small Llama from a config (``--hidden``, 2 layers,
float32, SDPA attention: transformers masks the packed row's sequences apart).
The two losses are checked equal (float64 weights; TRL's head computes in float32) before the
steps are timed.

GRPO: the policy pass (``_get_per_token_logps_and_entropies``, then ``backward``) on
``--prompts`` prompts of 200-800 tokens with 8 completions of 50-1,000 tokens each,
prompts padded on the left and completions on the right as TRL pads them, the rows
shuffled as TRL shuffles them before its training pass,
checked equal (float64) and timed the same way.

Run: python benchmarks/bench_trl.py [--steps 20] [--pairs 4] [--prompts 4] [--rounds 5] [--hidden 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl import DPOTrainer, GRPOConfig, GRPOTrainer
from trl_dpo import llama, pairs, tokenizer, trainer

from zephon_collate.trainers import PackedDPOTrainer, PackedGRPOTrainer, PackedPreference, PackedRewardTrainer
from zephon_collate.trainers.view import pack_view


def step(run: Any, batch: dict[str, Any]) -> float:
    run.model.zero_grad()
    loss = run.compute_loss(run.model, batch)
    loss.backward()
    return float(loss.detach())


def checked_and_timed(
    runs: dict[str, Any], call: Callable[[str, Any], float], rounds: int
) -> dict[str, float]:
    """Each run's loss checked equal to the first's with float64 weights (float32 sums over 1,000 tokens
    round apart), then each call timed in float32: medians of ``rounds`` interleaved rounds."""
    for run in runs.values():
        run.model.to(torch.float64)
        if getattr(run, "ref_model", None) is not None:
            run.ref_model.to(torch.float64)
    losses = {name: call(name, run) for name, run in runs.items()}
    first = next(iter(losses.values()))
    assert all(abs(loss - first) < 1e-6 for loss in losses.values()), losses
    for run in runs.values():
        run.model.to(torch.float32)
        if getattr(run, "ref_model", None) is not None:
            run.ref_model.to(torch.float32)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            call(name, run)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def rollouts(prompts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``input_ids``, ``attention_mask`` ``[8 * prompts, P + C]`` and ``C``: each prompt (200-800 tokens, padded
    on the left) with 8 completions (50-1,000 tokens, padded on the right)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    groups = [torch.randint(3, 60, (rng.randint(200, 800),), generator=generator) for _ in range(prompts)]
    rows = [(prompt, rng.randint(50, 1000)) for prompt in groups for _ in range(8)]
    width_p, width_c = max(len(p) for p, _ in rows), max(c for _, c in rows)
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, c) in enumerate(rows):
        ids[row, width_p - len(prompt) : width_p] = prompt  # a group's 8 completions share its prompt
        ids[row, width_p : width_p + c] = torch.randint(3, 60, (c,), generator=generator)
        mask[row, width_p - len(prompt) : width_p + c] = 1
    shuffle = torch.randperm(len(rows), generator=generator)  # as TRL shuffles them before the training pass
    return ids[shuffle], mask[shuffle], width_c


def grpo_step(run: Any, ids: torch.Tensor, mask: torch.Tensor, keep: int) -> float:
    run.model.zero_grad()
    logps = run._get_per_token_logps_and_entropies(run.model, ids, mask, keep, compute_entropy=True)[0]
    loss = (logps * mask[:, -keep:]).sum() / mask[:, -keep:].sum()
    loss.backward()
    return float(loss.detach())


def grpo(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as path:
        llama(args.hidden, torch.float32).save_pretrained(path)
        config = GRPOConfig(
            output_dir="/tmp/zephon-grpo-bench", per_device_train_batch_size=8, num_generations=8,
            report_to=[], use_cpu=True, save_strategy="no", bf16=False,
        )  # fmt: skip
        runs = {
            name: cls(model=path, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                      train_dataset=pairs(8), processing_class=tokenizer())
            for name, cls in (("stock", GRPOTrainer), ("packed", PackedGRPOTrainer))
        }  # fmt: skip
        runs["shared"] = PackedGRPOTrainer(
            model=path, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
            train_dataset=pairs(8), processing_class=tokenizer(), shared_prompt=True,
        )  # fmt: skip
    padded = packed = shared = shared_real = 0
    for step in range(args.steps):
        ids, mask, keep = rollouts(args.prompts, seed=step)
        padded += ids.numel()
        packed += int(mask.sum())
        trained = mask.clone()
        trained[:, :-keep] = 0
        shared += pack_view(ids, mask, trained, "fit", "bench", shared_prompt=True)["input_ids"].numel()
        one_row = pack_view(ids, mask, trained, "one", "bench", shared_prompt=True)
        shared_real += one_row["input_ids"].numel()
    ids, mask, keep = rollouts(args.prompts)
    times = checked_and_timed(runs, lambda name, run: grpo_step(run, ids, mask, keep), args.rounds)
    stock_s, packed_s, shared_s = (times[name] for name in ("stock", "packed", "shared"))
    print(
        f"\nGRPO: {args.prompts} prompts x 8 completions per step (prompt 200-800, completions 50-1,000 tokens)\n"
    )
    print("| | stock GRPOTrainer | PackedGRPOTrainer | ratio |")
    print("|---|---:|---:|---:|")
    print(
        f"| tokens per step, one row (mean) | {padded / args.steps:,.0f} | {packed / args.steps:,.0f} | "
        f"{padded / packed:.2f}x fewer |"
    )
    print(
        f"| time of the policy pass, SDPA rows (+ backward) | {stock_s:.2f} s | {packed_s:.2f} s | {stock_s / packed_s:.2f}x |"
    )
    print(
        f"| shared_prompt=True: tokens per step in its rows (mean) | {padded / args.steps:,.0f} | "
        f"{shared / args.steps:,.0f} | {padded / shared:.2f}x fewer |"
    )
    print(
        f"| shared_prompt=True: real tokens per step (each prompt once) | {padded / args.steps:,.0f} | "
        f"{shared_real / args.steps:,.0f} | {padded / shared_real:.2f}x fewer |"
    )
    print(
        f"| shared_prompt=True: time of the policy pass (4-D mask) | {stock_s:.2f} s | {shared_s:.2f} s | "
        f"{stock_s / shared_s:.2f}x |"
    )


def reward(args: argparse.Namespace) -> None:
    """RewardTrainer against PackedRewardTrainer: one ``compute_loss`` and ``backward`` on the same pairs."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    rng = random.Random(0)

    def sequence() -> list[int]:  # a prompt of 200-800 tokens and a response of 50-1,000
        return [rng.randint(3, 63) for _ in range(rng.randint(200, 800) + rng.randint(50, 1000))]

    data = Dataset.from_list(
        [{"chosen_ids": sequence(), "rejected_ids": sequence()} for _ in range(args.pairs)]
    )
    runs = {}
    for name, cls in (("stock", RewardTrainer), ("packed", PackedRewardTrainer)):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
            num_labels=1,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        settings = RewardConfig(
            output_dir="/tmp/zephon-reward-bench", per_device_train_batch_size=args.pairs, report_to=[],
            use_cpu=True, save_strategy="no", bf16=False,
        )  # fmt: skip
        runs[name] = cls(model=LlamaForSequenceClassification(config), args=settings, train_dataset=data,
                         processing_class=tokenizer())  # fmt: skip
    examples = [data[i] for i in range(args.pairs)]
    batches = {name: run.data_collator(examples) for name, run in runs.items()}
    times = checked_and_timed(runs, lambda name, run: step(run, dict(batches[name])), args.rounds)
    stock_s, packed_s = times["stock"], times["packed"]
    padded, packed = (
        batches["stock"]["input_ids"].numel(),
        runs["packed"].packing(examples)["input_ids"].numel(),
    )
    real = int(batches["stock"]["attention_mask"].sum())
    print(f"\nReward model: {args.pairs} pairs of 250-1,800 token sequences\n")
    print("| | stock RewardTrainer | PackedRewardTrainer | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| tokens, SDPA rows | {padded:,} | {packed:,} | {padded / packed:.2f}x fewer |")
    print(f"| tokens, one row (FlashAttention) | {padded:,} | {real:,} | {padded / real:.2f}x fewer |")
    print(
        f"| time per step, SDPA rows (loss + backward) | {stock_s:.2f} s | {packed_s:.2f} s | {stock_s / packed_s:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="GRPO prompts per step (8 completions each)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from datasets import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()
    logging.set_verbosity_error()
    data = pairs(args.steps * args.pairs, prompt=(200, 800), response=(50, 1000))
    stock, packed, shared = (
        trainer(
            cls, data, hidden=args.hidden, per_device_train_batch_size=args.pairs, max_length=None, **more
        )
        for cls, more in (
            (DPOTrainer, {}),
            (PackedDPOTrainer, {}),
            (PackedDPOTrainer, {"shared_prompt": True}),
        )
    )
    runs = {"stock": stock, "packed": packed, "shared": shared}
    for run in runs.values():  # timed in float32
        run.model.to(torch.float32), run.ref_model.to(torch.float32)
    padded_tokens = packed_tokens = real_tokens = shared_tokens = shared_real = 0
    for index in range(args.steps):
        examples = [packed.train_dataset[i] for i in range(index * args.pairs, (index + 1) * args.pairs)]
        batch = packed.packing(examples)
        padded_tokens += batch["input_ids"].numel()
        packed_tokens += batch["packed"]["input_ids"].numel()
        real_tokens += int(batch["attention_mask"].sum())
        shared_tokens += shared.packing(examples)["packed"]["input_ids"].numel()
        one_row = PackedPreference(shared.data_collator, rows="one", shared_prompt=True)
        shared_real += one_row(examples)["packed"]["input_ids"].numel()  # one row: no padding
    examples = [packed.train_dataset[i] for i in range(args.pairs)]
    batches = {name: run.data_collator(examples) for name, run in runs.items()}
    times = checked_and_timed(runs, lambda name, run: step(run, batches[name]), args.rounds)
    stock_s, packed_s, shared_s = (times[name] for name in ("stock", "packed", "shared"))
    print(
        f"{args.steps} steps of {args.pairs} pairs (prompt 200-800, responses 50-1,000 tokens), "
        f"Llama hidden {args.hidden}, 2 layers, CPU 1 thread\n"
    )
    print("| | stock DPOTrainer | PackedDPOTrainer | ratio |")
    print("|---|---:|---:|---:|")
    print(
        f"| tokens per step, SDPA rows (mean) | {padded_tokens / args.steps:,.0f} | "
        f"{packed_tokens / args.steps:,.0f} | {padded_tokens / packed_tokens:.2f}x fewer |"
    )
    print(
        f"| tokens per step, one row (FlashAttention) | {padded_tokens / args.steps:,.0f} | "
        f"{real_tokens / args.steps:,.0f} | {padded_tokens / real_tokens:.2f}x fewer |"
    )
    print(
        f"| time per step, SDPA rows (loss + backward) | {stock_s:.2f} s | {packed_s:.2f} s | {stock_s / packed_s:.2f}x |"
    )
    print(
        f"| shared_prompt=True: tokens per step in its rows (mean) | {padded_tokens / args.steps:,.0f} | "
        f"{shared_tokens / args.steps:,.0f} | {padded_tokens / shared_tokens:.2f}x fewer |"
    )
    print(
        f"| shared_prompt=True: real tokens per step (each prompt once) | {padded_tokens / args.steps:,.0f} | "
        f"{shared_real / args.steps:,.0f} | {padded_tokens / shared_real:.2f}x fewer |"
    )
    print(
        f"| shared_prompt=True: time per step (4-D mask) | {stock_s:.2f} s | {shared_s:.2f} s | "
        f"{stock_s / shared_s:.2f}x |"
    )
    grpo(args)
    reward(args)


if __name__ == "__main__":
    main()
