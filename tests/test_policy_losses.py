"""clipped_policy_loss, importance_ratio and kl_penalty with aggregate_loss against stock trl.GRPOTrainer: the same
rollouts and log-probs, packed by Collator.for_rollouts and padded as TRL pads them, give TRL's loss for each loss
type, both importance-sampling levels and the KL options, in one micro-batch and in two with an all-masked
(truncated) completion; verl's estimators and dual clipping by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zephon_collate import Collator, FloatField, aggregate_loss, token_logprobs
from zephon_collate.losses import clipped_policy_loss, importance_ratio, kl_penalty

pytest.importorskip("trl")
from test_trl_grpo import model_path, rows, trainer  # noqa: F401  (model_path: the fixture)
from trl import GRPOTrainer

CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False},
    {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"},
    {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.3},
]
STEPS = {
    "one-micro-batch": (1, False),
    # Row 0's 6 tokens fill max_completion_length: with mask_truncated_completions=True TRL zeroes its mask
    # (grpo_trainer.py, _generate_and_score_completions); the step is 2 micro-batches of 2 rows.
    "truncated-two-micro-batches": (2, True),
}


def aggregation(args: Any, num_items_in_batch: torch.Tensor, accumulation: int) -> dict[str, Any]:
    """The ``aggregate_loss`` arguments that give TRL 1.16's ``loss_type`` (docs/post_training.md's table)."""
    kind = args.loss_type
    if kind in ("grpo", "sapo"):
        return {"mode": "seq-mean-token-mean", "empty": "count", "accumulation_steps": accumulation}
    if kind == "bnpo":
        return {"mode": "token-mean", "accumulation_steps": accumulation}
    if kind == "dr_grpo":
        return {
            "mode": "seq-mean-token-sum-norm",
            "empty": "count",
            "normalizer": args.max_completion_length,
            "accumulation_steps": accumulation,
        }
    if kind == "luspo":
        return {"mode": "seq-mean-token-sum", "empty": "count", "accumulation_steps": accumulation}
    # dapo, cispo, vespo; with steps_per_generation != accumulation: the loss times their ratio
    assert args.steps_per_generation == accumulation
    return {"mode": "token-mean", "global_count": num_items_in_batch}


def rollouts(batch: dict[str, torch.Tensor], lengths: torch.Tensor) -> list[dict[str, Any]]:
    """TRL's padded rows as rollouts: each prompt + completion (``lengths`` tokens, masked as TRL masks them),
    and the completion-aligned fields token-aligned."""
    out = []
    for row in range(len(batch["prompt_ids"])):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        n = int(lengths[row])
        out.append(
            {
                "input_ids": prompt + batch["completion_ids"][row, :n].tolist(),
                "completion_mask": [0] * len(prompt) + batch["completion_mask"][row, :n].tolist(),
                "logps": [0.0] * len(prompt) + batch["per_token_logps"][row, :n].tolist(),
                "old": [0.0] * len(prompt) + batch["old_per_token_logps"][row, :n].tolist(),
                "ref": [0.0] * len(prompt) + batch["ref_per_token_logps"][row, :n].tolist(),
                "advantage": float(batch["advantages"][row]),
            }
        )
    return out


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_packed_policy_loss_equals_grpo_trainer(model_path, options, step):  # noqa: F811
    accumulation, truncated = STEPS[step]
    stock = trainer(GRPOTrainer, model_path, gradient_accumulation_steps=accumulation, **options)
    stock.current_gradient_accumulation_steps = accumulation
    stock.model.train()  # TRL divides by the accumulation steps in training only
    batch = rows()
    lengths = batch["completion_mask"].sum(dim=1)
    if truncated:
        assert int(lengths[0]) == stock.args.max_completion_length
        batch["completion_mask"][0] = 0
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():  # the policy's log-probs, as TRL's loss computes them (its head, in float32)
        current = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, 6)[0].double()
    noise = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    batch.update(
        advantages=torch.tensor([0.5, -1.0, 1.5, -0.2], dtype=torch.float64),
        old_per_token_logps=current + 0.3 * noise[0],
        ref_per_token_logps=current + 0.1 * noise[1],
    )
    num_items = batch["completion_mask"].sum()  # TRL's num_items_in_batch: the step's loss tokens
    size = len(lengths) // accumulation
    micro_rows = [list(range(start, start + size)) for start in range(0, len(lengths), size)]
    want = 0.0
    for where in micro_rows:
        micro = {key: value[where] for key, value in batch.items()}
        with torch.no_grad():
            want += float(stock._compute_loss(stock.model, {**micro, "num_items_in_batch": num_items}))
    batch["per_token_logps"] = current  # the same log-probs, token-aligned in the packed batch
    names = ("logps", "old", "ref")
    fields = [FloatField(name, dtype=torch.float64) for name in names]
    fields.append(FloatField("advantage", "sequence", dtype=torch.float64, broadcast=True))
    examples = rollouts(batch, lengths)
    args = stock.args
    got = 0.0
    for where in micro_rows:
        packed = Collator.for_rollouts(padding_free=True, float_fields=fields)([examples[i] for i in where])
        with torch.no_grad():  # the packed forward's own log-probs agree, to TRL's float32 head
            logits = stock.model(
                input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
            ).logits
        scored, supervised = token_logprobs(logits, packed), packed["labels"] != -100
        assert torch.allclose(scored[supervised], packed["logps"][supervised], atol=1e-5)
        logps = packed["logps"]  # TRL's own, so that the formulas are compared exactly
        ratio = importance_ratio(logps, packed["old"], packed, level=args.importance_sampling_level)
        per_token = clipped_policy_loss(
            ratio, packed["advantage"], clip=args.epsilon, clip_high=args.epsilon_high, max_ratio=args.delta
        )
        if args.beta:
            correction = ratio if args.use_bias_correction_kl else None
            per_token = per_token + args.beta * kl_penalty(logps, packed["ref"], "k3", ratio=correction)
        got += float(aggregate_loss(per_token, packed, **aggregation(args, num_items, accumulation)))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_kl_estimators_by_hand():
    """verl's estimators on log ratio 1 (and k3 both ways); the + forms carry k2's gradient."""
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    e = torch.e
    assert kl_penalty(logps, ref, "k1").tolist() == [1.0, -1.0]
    assert kl_penalty(logps, ref, "abs").tolist() == [1.0, 1.0]
    assert kl_penalty(logps, ref, "mse").tolist() == [0.5, 0.5]
    assert kl_penalty(logps, ref, "low_var_kl").tolist() == pytest.approx([1 / e - (-1) - 1, e - 1 - 1])
    assert kl_penalty(logps, ref, "k3", ratio=torch.tensor([2.0, 0.5])).tolist() == pytest.approx(
        [2 / e, (e - 2) / 2]
    )
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3", clamp=True).tolist() == [
        pytest.approx(10.0)
    ]
    kl_penalty(logps, ref, "k1+").sum().backward()
    assert logps.grad.tolist() == [1.0, -1.0]  # d/dx of (x - ref)^2 / 2
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalty(logps, ref, "k4")


def test_dual_clip_bounds_a_negative_advantage():
    """verl's clip_ratio_c: a ratio of 5 with advantage -1 costs 3, not 5; positive advantages are untouched."""
    ratio = torch.tensor([5.0, 5.0, 0.1])
    advantage = torch.tensor([-1.0, 1.0, -1.0])
    assert clipped_policy_loss(ratio, advantage).tolist() == pytest.approx([5.0, -1.2, 0.8])
    assert clipped_policy_loss(ratio, advantage, dual_clip=3.0).tolist() == pytest.approx([3.0, -1.2, 0.8])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_policy_loss(ratio, advantage, dual_clip=0.5)
