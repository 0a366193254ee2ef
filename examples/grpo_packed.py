"""GRPO on packed rollouts with shared prompts: a tiny GPT-2 learns to say more of the rewarded words.

Everything is built here, nothing is downloaded: a randomly initialised GPT-2,
prompts of skewed lengths, and for each prompt a group of completions sampled
from the policy itself, cut at lengths drawn from a skewed distribution (as EOS
cuts real rollouts). The reward is the share of a completion's tokens that are
"rewarded" words; advantages are normalised within each group (GRPO). Each
iteration collates the rollouts with ``Collator.for_rollouts(padding_free=True,
shared_prompt=True)``: one row, every prompt once, each completion after it
attending to the prompt and to itself only, the behaviour policy's log-probs
and the advantages as float fields placed with the labels. A few clipped
policy-gradient steps follow, the loss aggregated with ``aggregate_loss`` in
the mode asked for. The script prints the clipped loss falling over each
iteration's steps, the reward rising, the padded tokens saved against the
padded layout, and the prompt tokens no longer computed once per completion.

Needs the ``hf`` extra: pip install -e ".[hf]"
Run: python examples/grpo_packed.py [--iterations 6] [--mode token-mean]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from zephon_collate import Collator, FloatField, aggregate_loss, token_logprobs
from zephon_collate.functional.attention import dense_branch_mask
from zephon_collate.losses import MODES

VOCAB, PROMPTS, GROUP, INNER_STEPS, EPSILON = 32, 6, 4, 4, 0.2
REWARDED = torch.arange(VOCAB) % 4 == 0  # the words the reward counts


def skewed_length(rng: random.Random, low: int, high: int) -> int:
    """Mostly short, sometimes long: a Pareto tail cut at ``high``."""
    return min(high, low + int(rng.paretovariate(1.2)) - 1)


def policy_model() -> GPT2LMHeadModel:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "sdpa"  # takes the 4-D mask as given
    return model


@torch.no_grad()
def rollouts(model: GPT2LMHeadModel, rng: random.Random, generator: torch.Generator) -> list[dict]:
    """A group of sampled completions per prompt, their log-probs as sampled, group-normalised advantages."""
    out = []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(1, VOCAB) for _ in range(skewed_length(rng, 3, 40))]
        lengths = [skewed_length(rng, 2, 30) for _ in range(GROUP)]
        tokens = torch.tensor([prompt] * GROUP)
        logprobs = []
        step = model(tokens, use_cache=True)
        for _ in range(max(lengths)):  # the whole group at once, with the model's KV cache
            last = step.logits[:, -1].log_softmax(-1)
            chosen = torch.multinomial(last.exp(), 1, generator=generator)
            logprobs.append(last.gather(1, chosen))
            tokens = torch.cat([tokens, chosen], dim=1)
            step = model(chosen, cache=step.cache, use_cache=True)
        sampled = torch.cat(logprobs, dim=1)
        rewards = torch.tensor(
            [
                float(REWARDED[tokens[g, len(prompt) : len(prompt) + n]].float().mean())
                for g, n in enumerate(lengths)
            ]
        )
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for g, n in enumerate(lengths):
            out.append({
                "input_ids": tokens[g, : len(prompt) + n].tolist(),
                "completion_mask": [0] * len(prompt) + [1] * n,
                "old_logprobs": [0.0] * len(prompt) + sampled[g, :n].tolist(),
                "advantage": float(advantages[g]),
                "reward": float(rewards[g]),
            })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--mode", choices=MODES, default="token-mean")
    args = parser.parse_args()
    model = policy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    floats = ["old_logprobs", FloatField("advantage", "sequence", broadcast=True)]
    collate = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=floats)
    unshared = Collator.for_rollouts(padding_free=True)
    padded = Collator.for_rollouts(pad_token_id=0)
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    tokens = {"shared": 0, "unshared": 0, "padded": 0}
    before, after, rewards = [], [], []
    for _ in range(args.iterations):
        model.eval()
        examples = rollouts(model, rng, generator)
        rewards.append(sum(e["reward"] for e in examples) / len(examples))
        model.train()
        batch = collate(examples)
        tokens["shared"] += batch["input_ids"].numel()
        tokens["unshared"] += unshared(examples)["input_ids"].numel()
        tokens["padded"] += padded(examples)["input_ids"].numel()
        mask = dense_branch_mask(batch["document_ids"], batch["branch_ids"])
        for step in range(INNER_STEPS):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]
            ).logits
            ratio = torch.exp(token_logprobs(logits, batch) - batch["old_logprobs"])
            advantage = batch["advantage"]
            per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - EPSILON, 1 + EPSILON) * advantage)
            loss = aggregate_loss(per_token, batch, mode=args.mode, normalizer=30.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 0:
                before.append(float(loss.detach()))
            elif step == INNER_STEPS - 1:
                after.append(float(loss.detach()))
    first, last = sum(before) / len(before), sum(after) / len(after)
    print(f"clipped loss ({args.mode}) {first:.4f} -> {last:.4f} over each iteration's {INNER_STEPS} steps")
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {args.iterations} iterations")
    saved = 1 - tokens["unshared"] / tokens["padded"]
    print(
        f"padding-free: {tokens['unshared']:,} tokens instead of the padded layout's {tokens['padded']:,} "
        f"({saved:.1%} of the padded tokens saved)"
    )
    once = tokens["unshared"] - tokens["shared"]
    fewer = 1 - tokens["shared"] / tokens["padded"]
    print(
        f"shared prompts: {once:,} prompt tokens no longer computed once per completion; "
        f"{tokens['shared']:,} tokens in all, {fewer:.1%} fewer than padded"
    )


if __name__ == "__main__":
    main()
