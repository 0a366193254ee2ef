"""Prefix trees: tokens through the model against the trie's own count, and a training step against flat paths.

Workloads (``tree_workloads.py``): a GRPO group of 8 (a 200-800 token prompt, 50-1,000 token
completions); agentic rollouts of 4-8 turns (a 1-3k-token system and tool prompt, 50-400 assistant and
100-2,000 tool tokens a turn) branching 2 ways at three turns, early (1-3), late (4-6) or spread (2, 5, 8);
reasoning SFT with history, each turn an example (6 and 12 turns).

1. Tokens: the flat paths (every sequence whole), one level of sharing (``shared_prompt=True``: a
   prompt of consecutive sequences once), ``Collator.for_trees`` (every shared prefix once), and the bound
   (each distinct prefix of a group once, counted by a trie of Python dicts).
2. A training step (forward and backward of the clipped GRPO loss, per-path advantages) of a tiny Llama
   on the CPU: the tree batch against the same trajectories as flat paths in one padding-free row, both
   attending with ``tree_attention`` (SDPA, per chain: each flat path is one causal chain, the best
   attention for flat paths here; FlexAttention has no backward on the CPU). The losses and gradients are
   checked equal first.

Run: python benchmarks/bench_trees.py [--scale 0.25] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_workloads as workloads

from zephon_collate import Collator, FloatField, aggregate_loss, token_logprobs
from zephon_collate.functional.trees import TreeBlocks, use_tree_attention
from zephon_collate.losses import along_paths, clipped_policy_loss

WORKLOADS = {
    "GRPO group of 8": lambda scale: workloads.grpo(groups=2),
    "agentic, early branching": lambda scale: workloads.agentic("early", scale=scale),
    "agentic, late branching": lambda scale: workloads.agentic("late", scale=scale),
    "agentic, spread branching": lambda scale: workloads.agentic("spread", scale=scale),
    "SFT with history, 6 turns": lambda scale: workloads.sft_history(6),
    "SFT with history, 12 turns": lambda scale: workloads.sft_history(12),
}


def examples(groups: list[list[workloads.Trajectory]]) -> list[dict[str, Any]]:
    """The trajectories as examples, each with its group and an advantage."""
    out = []
    for group, trajectories in enumerate(groups):
        for index, (tokens, trained) in enumerate(trajectories):
            out.append({"input_ids": tokens, "completion_mask": [int(flag) for flag in trained],
                        "group": group, "advantage": float(index % 3 - 1)})  # fmt: skip
    return out


def token_table(scale: float) -> None:
    flat, one_level, trees = (
        Collator.for_trees(share="none"),
        Collator.for_rollouts(padding_free=True, shared_prompt=True),
        Collator.for_trees(),
    )
    print(
        "| workload | flat paths | one level (shared_prompt) | trees | bound | trees / bound | flat / trees |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, make in WORKLOADS.items():
        groups = make(scale)
        data = examples(groups)
        counts = [
            collate([{k: v for k, v in row.items() if k not in ("group", "advantage")} for row in data]
                    if collate is one_level else data)["input_ids"].numel()
            for collate in (flat, one_level, trees)
        ]  # fmt: skip
        bound = workloads.bound(groups)
        print(
            f"| {name} | {counts[0]:,} | {counts[1]:,} | {counts[2]:,} | {bound:,} | {counts[2] / bound:.3f} | "
            f"{counts[0] / counts[2]:.2f}x |"
        )


def model_for(vocab: int) -> LlamaForCausalLM:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=65536,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    use_tree_attention(model)
    return model


def step(model: LlamaForCausalLM, batch: dict[str, Any]) -> torch.Tensor:
    """The clipped GRPO loss of one batch, backward included; returns the loss."""
    tree = TreeBlocks.from_batch(batch)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], tree=tree).logits
    logps = along_paths(token_logprobs(logits, batch), batch)
    ratio = torch.exp(logps - logps.detach())
    loss = aggregate_loss(
        clipped_policy_loss(ratio, along_paths(batch["advantage"], batch)), batch,
        mode="seq-mean-token-mean", empty="count",
    )  # fmt: skip
    loss.backward()
    return loss


def time_table(scale: float, rounds: int) -> None:
    trees = Collator.for_trees(float_fields=[FloatField("advantage", "sequence")])
    flat = Collator.for_trees(share="none", float_fields=[FloatField("advantage", "sequence")])
    model = model_for(workloads.VOCAB)
    print("| workload | tokens, flat paths | tokens, trees | step, flat paths | step, trees | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in WORKLOADS.items():
        data = examples(make(scale))
        batches = {"flat": flat(data), "trees": trees(data)}
        grads = {}
        for kind, batch in batches.items():  # equal loss and gradients first
            model.zero_grad()
            loss = step(model, batch)
            grads[kind] = (float(loss.detach()), [p.grad.clone() for p in model.parameters()])
        (flat_loss, flat_grads), (tree_loss, tree_grads) = grads["flat"], grads["trees"]
        gap = max(float((a - b).abs().max()) for a, b in zip(flat_grads, tree_grads, strict=True))
        assert abs(flat_loss - tree_loss) < 1e-5 and gap < 1e-5, (name, flat_loss, tree_loss, gap)
        seconds = {}
        for kind, batch in batches.items():
            best = float("inf")
            for _ in range(rounds):
                model.zero_grad()
                start = time.perf_counter()
                step(model, batch)
                best = min(best, time.perf_counter() - start)
            seconds[kind] = best
        print(
            f"| {name} | {batches['flat']['input_ids'].numel():,} | {batches['trees']['input_ids'].numel():,} | "
            f"{seconds['flat']:.2f} s | {seconds['trees']:.2f} s | {seconds['flat'] / seconds['trees']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=0.25, help="agentic spans scaled for the timed step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("Tokens through the model (full-size workloads):\n")
    token_table(1.0)
    print(
        f"\nA training step, tiny Llama on the CPU ({args.threads} threads, agentic spans x{args.scale}):\n"
    )
    time_table(args.scale, args.rounds)


if __name__ == "__main__":
    main()
