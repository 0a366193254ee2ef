"""Multi-turn reasoning SFT on prefix trees: each turn its own example, the shared history computed once.

Reasoning models are fine-tuned on conversations whose earlier turns keep their answers but drop their
thinking, so every turn is an example of its own: the history so far (thinking stripped), then this turn's
thinking and answer, trained. Flat, a conversation of ``T`` turns computes its history ``T`` times over.
``Collator.for_trees()`` makes each conversation one tree (its examples in one group): the history once,
each turn's thinking and answer a branch. A tiny Llama attends along the tree (``use_tree_attention``) and
is trained on every branch's tokens.

Everything is built here, nothing is downloaded: synthetic conversations whose answer is a fixed function
of the user's turn, the thinking a run of "think" tokens. The script checks the first loss and its gradient
against the same examples laid out flat, then trains, printing the tokens saved and the loss falling.

Run: python examples/sft_history.py [--steps 40]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from zephon_collate import Collator, aggregate_loss, token_logprobs
from zephon_collate.functional.trees import TreeBlocks, use_tree_attention
from zephon_collate.losses import along_paths

VOCAB, THINK, TURNS = 40, 3, 6


def model_for_sft() -> LlamaForCausalLM:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    use_tree_attention(model)
    return model


def conversation(rng: random.Random, index: int) -> list[dict]:
    """One conversation's examples, a turn each: the history (answers kept, thinking dropped), then this
    turn's thinking and answer, trained; the answer is the user's tokens plus one."""
    history = [1] + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(8, 16))]  # the system prompt
    examples = []
    for _ in range(TURNS):
        user = [2] + [rng.randrange(10, VOCAB - 1) for _ in range(rng.randrange(2, 5))]
        thinking = [THINK] * rng.randrange(4, 9)
        answer = [token + 1 for token in user[1:]] + [4]
        prompt = history + user
        examples.append({
            "input_ids": prompt + thinking + answer,
            "completion_mask": [0] * len(prompt) + [1] * (len(thinking) + len(answer)),
            "group": index,
        })  # fmt: skip
        history = prompt + answer  # the next turn sees the answer, not the thinking
    return examples


def loss_of(model: LlamaForCausalLM, batch: dict) -> torch.Tensor:
    """Mean negative log-likelihood of every example's trained tokens (each path's, as run alone)."""
    logits = model(
        batch["input_ids"], position_ids=batch["position_ids"], tree=TreeBlocks.from_batch(batch)
    ).logits
    return aggregate_loss(-along_paths(token_logprobs(logits, batch), batch), batch, mode="token-mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    data = [example for index in range(4) for example in conversation(rng, index)]
    trees, flat = Collator.for_trees(), Collator.for_trees(share="none")
    batch, paths = trees(data), flat(data)
    model = model_for_sft()
    print(
        f"tokens: {batch['input_ids'].numel():,} as trees, {paths['input_ids'].numel():,} as flat examples "
        f"({paths['input_ids'].numel() / batch['input_ids'].numel():.2f}x)"
    )
    tree_loss, flat_loss = loss_of(model, batch), loss_of(model, paths)
    weight = model.model.embed_tokens.weight
    tree_grad = torch.autograd.grad(tree_loss, weight)[0]
    flat_grad = torch.autograd.grad(flat_loss, weight)[0]
    print(
        f"first loss: trees {tree_loss.item():.7f}, flat examples {flat_loss.item():.7f} "
        f"(gradient max difference {float((tree_grad - flat_grad).abs().max()):.1e})"
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.steps):
        loss = loss_of(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
