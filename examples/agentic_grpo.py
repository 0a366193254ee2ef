"""Agentic GRPO on prefix trees: multi-turn rollouts that branch mid-conversation, every shared turn computed
once, each path trained with its own advantage.

Everything is built here, nothing is downloaded: a randomly initialised Llama and tasks of a few prompt
tokens. Each rollout is a conversation of three turns: the policy writes an assistant span (sampled, trained)
and a tool answers (a fixed function of what it wrote, not trained). The rollouts of a task branch two ways
after the first and after the second turn, so each task gives four trajectories that share their prompt,
their first turn and half of them their second: the shape of tree-search and multi-sample agent rollouts.
The reward is the share of rewarded words the policy wrote; advantages are normalised within each task.

``Collator.for_trees()`` lays each task's trajectories out as one tree (every shared turn once) and the
model attends along it (``use_tree_attention``: each chain of tokens sees its ancestors' keys and its own);
the clipped policy loss runs on every path's tokens (``along_paths``), with the path's advantage. The script
checks the first loss and its gradient against the same trajectories laid out flat, then trains and prints
the tokens saved, the clipped loss falling and the reward rising.

Run: python examples/agentic_grpo.py [--iterations 8]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from zephon_collate import Collator, FloatField, aggregate_loss, token_logprobs
from zephon_collate.functional.trees import TreeBlocks, use_tree_attention
from zephon_collate.losses import along_paths, clipped_policy_loss, importance_ratio

VOCAB, TASKS, SPAN, TOOL, INNER_STEPS = 32, 4, 5, 4, 4
REWARDED = torch.arange(VOCAB) % 4 == 0  # the words the reward counts


def policy_model() -> LlamaForCausalLM:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    use_tree_attention(model)
    return model


@torch.no_grad()
def sample(model: LlamaForCausalLM, prefix: list[int], generator: torch.Generator) -> list[int]:
    """An assistant span of ``SPAN`` tokens sampled after ``prefix`` (the attention: one chain)."""
    tokens = list(prefix)
    for _ in range(SPAN):
        batch = {"logits_index": torch.tensor([[-1, *range(len(tokens) - 1)]])}
        logits = model(torch.tensor([tokens]), tree=TreeBlocks.from_batch(batch)).logits[0, -1]
        tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return tokens[len(prefix) :]


def tool(span: list[int]) -> list[int]:
    """The tool's answer: a fixed function of what the assistant wrote (never trained)."""
    return [(3 * token + 1) % VOCAB for token in span[:TOOL]]


@torch.no_grad()
def rollouts(model: LlamaForCausalLM, rng: random.Random, generator: torch.Generator) -> list[dict]:
    """Each task's four trajectories: turn 1, then two ways, then two ways again; advantages per task."""
    out = []
    for task in range(TASKS):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(6, 12))]
        states = [(prompt, [0] * len(prompt))]
        for turn in range(3):
            grown = []
            for tokens, trained in states:
                for _ in range(1 if turn == 0 else 2):
                    span = sample(model, tokens, generator)
                    answer = tool(span)
                    grown.append((tokens + span + answer, trained + [1] * len(span) + [0] * len(answer)))
            states = grown
        rewards = []
        for tokens, trained in states:
            written = torch.tensor([t for t, flag in zip(tokens, trained, strict=True) if flag])
            rewards.append(float(REWARDED[written].float().mean()))
        mean, std = sum(rewards) / len(rewards), torch.tensor(rewards).std().item() + 1e-4
        for (tokens, trained), reward in zip(states, rewards, strict=True):
            out.append({"input_ids": tokens, "completion_mask": trained, "group": task,
                        "advantage": (reward - mean) / std, "reward": reward})  # fmt: skip
    return out


@torch.no_grad()
def behaviour(model: LlamaForCausalLM, batch: dict) -> torch.Tensor:
    """The log-probs of every path's tokens under the policy that sampled them."""
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], tree=TreeBlocks.from_batch(batch))
    return along_paths(token_logprobs(logits.logits, batch), batch)


def policy_loss(model: LlamaForCausalLM, batch: dict, old: torch.Tensor) -> torch.Tensor:
    """The clipped policy loss over every path's trained tokens, each with its path's advantage (flat paths
    are trees of one chain each: the same code runs them)."""
    logits = model(batch["input_ids"], position_ids=batch["position_ids"],
                   tree=TreeBlocks.from_batch(batch)).logits  # fmt: skip
    logps = along_paths(token_logprobs(logits, batch), batch)
    ratio = importance_ratio(logps, old, batch, level="token")
    per_entry = clipped_policy_loss(ratio, along_paths(batch["advantage"], batch), clip=0.2)
    return aggregate_loss(per_entry, batch, mode="seq-mean-token-mean", empty="count")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    args = parser.parse_args()
    model = policy_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    trees = Collator.for_trees(float_fields=[FloatField("advantage", "sequence")])
    flat = Collator.for_trees(share="none", float_fields=[FloatField("advantage", "sequence")])
    rewards, losses = [], []
    for iteration in range(args.iterations):
        data = rollouts(model, rng, generator)
        batch = trees(data)
        old = behaviour(model, batch)
        if iteration == 0:
            paths = flat(data)
            old_flat = behaviour(model, paths)
            size, flat_size = batch["input_ids"].numel(), paths["input_ids"].numel()
            print(f"tokens: {size:,} as trees, {flat_size:,} as flat paths ({flat_size / size:.2f}x)")
        rewards.append(sum(row["reward"] for row in data) / len(data))
        for step in range(INNER_STEPS):
            loss = policy_loss(model, batch, old)
            if iteration == 0 and step == 1:  # after an update (ratios off 1): the flat paths' loss, equal
                tree_grad = torch.autograd.grad(loss, model.model.embed_tokens.weight, retain_graph=True)[0]
                flat_loss = policy_loss(model, paths, old_flat)
                flat_grad = torch.autograd.grad(flat_loss, model.model.embed_tokens.weight)[0]
                print(
                    f"loss after an update: trees {loss.item():.7f}, flat paths {flat_loss.item():.7f} "
                    f"(gradient max difference {float((tree_grad - flat_grad).abs().max()):.1e})"
                )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 0:
                losses.append(loss.item())
        losses.append(loss.item())
    print(f"clipped loss (seq-mean-token-mean) {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")


if __name__ == "__main__":
    main()
