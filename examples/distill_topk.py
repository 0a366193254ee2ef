"""Top-k distillation on packed rows: a student learns a teacher's top-k log-probs, padding-free.

The teacher's top-k ids and log-probs of each prediction are stored with the example (as a dataset of
teacher outputs keeps them: ``[T, K]`` per example, label-aligned: row ``t`` is the prediction made at
token ``t``). ``Collator.for_transformers(padding_free=True)`` packs the examples into one row and moves
each prediction's top-k onto the token it is scored against, like the labels; the loss is
``distillation_loss`` (TRL GKD's generalised JSD on the top-k support).

Before training, the packed batch's per-token loss is checked equal to each example's computed alone.

Run: python examples/distill_topk.py [--steps 30] [--top-k 8] [--dtype float64]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zephon_collate import Collator, TensorField
from zephon_collate.losses import distillation_loss

VOCAB = 64


def tiny_llama(seed: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype)


def teacher_examples(teacher: LlamaForCausalLM, count: int, k: int, seed: int = 0) -> list[dict]:
    """``count`` examples of 8-40 tokens, each with the teacher's top-k of every prediction (run alone)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(1, VOCAB, int(rng.integers(8, 41))).tolist()
        with torch.no_grad():
            logprobs = teacher(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        top = logprobs.topk(k, dim=-1)
        out.append(
            {"input_ids": tokens, "teacher_ids": top.indices.numpy(), "teacher_logprobs": top.values.numpy()}
        )
    return out


def collator(k: int) -> Collator:
    specs = [
        TensorField("teacher_ids", align="label", dtype=torch.int64, shape=(k,)),
        TensorField("teacher_logprobs", align="label", fill=float("-inf"), shape=(k,)),
    ]
    return Collator.for_transformers(padding_free=True, float_fields=specs)


def loss_of(
    student: LlamaForCausalLM, batch: dict, reduction: str = "batchmean", beta: float = 0.5
) -> torch.Tensor:
    """The distillation loss of one batch: the predictions at ``t`` against the fields at ``t + 1``."""
    logits = student(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return distillation_loss(
        logits[:, :-1],
        batch["teacher_ids"][:, 1:],
        batch["teacher_logprobs"][:, 1:],
        batch["labels"][:, 1:],
        beta=beta,
        reduction=reduction,  # type: ignore[arg-type]
    )


def check_packed_equals_alone(student: LlamaForCausalLM, examples: list[dict], k: int) -> float:
    """The largest difference between the packed batch's per-token loss and each example's alone."""
    collate = collator(k)
    with torch.no_grad():
        packed = loss_of(student, collate(examples), "none")[0]
        alone = [loss_of(student, collate([example]), "none")[0] for example in examples]
    # Packed, the last token of an example predicts the next example's first, whose label is -100: 0.
    expected = torch.cat([torch.cat([part, part.new_zeros(1)]) for part in alone])[:-1]
    return float((packed - expected).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    teacher, student = tiny_llama(0, dtype), tiny_llama(1, dtype)
    with torch.no_grad():  # a confident teacher: its top-k carries most of the probability
        teacher.lm_head.weight.mul_(40)
    examples = teacher_examples(teacher, 48, args.top_k)
    difference = check_packed_equals_alone(student, examples[:6], args.top_k)
    print(f"packed per-token loss vs each example alone: max difference {difference:.2e}")
    collate = collator(args.top_k)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    first = last = 0.0
    for step in range(args.steps):
        batch = collate([examples[(8 * step + i) % len(examples)] for i in range(8)])
        loss = loss_of(student, batch, beta=0.0)  # forward KL, GKD's supervised-KD end
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = float(loss.detach())
        first, last = (value, value) if step == 0 else (first, value)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  {batch['input_ids'].shape[1]} tokens in one row  loss {value:.4f}")
    print(f"distillation loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
