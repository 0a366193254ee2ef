"""clipped_policy_loss, importance_ratio and kl_penalty with aggregate_loss against stock trl.GRPOTrainer: the same
rollouts and log-probs, packed by Collator.for_rollouts and padded as TRL pads them, give TRL's loss for each loss
type, both importance-sampling levels and the KL options; verl's estimators and dual clipping by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zephon_collate import Collator, FloatField, aggregate_loss, token_logprobs
from zephon_collate.losses import clipped_policy_loss, importance_ratio, kl_penalty

pytest.importorskip("trl")
from test_trl_grpo import model_path, rows, trainer  # noqa: F401  (model_path: the fixture)
from trl import GRPOTrainer

AGGREGATION = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False},
    {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"},
    {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.3},
]


def rollouts(batch: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """TRL's padded rows as rollouts: each prompt + completion, and the completion-aligned fields token-aligned."""
    out = []
    for row in range(len(batch["prompt_ids"])):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        n = int(batch["completion_mask"][row].sum())
        out.append(
            {
                "input_ids": prompt + batch["completion_ids"][row, :n].tolist(),
                "completion_mask": [0] * len(prompt) + [1] * n,
                "logps": [0.0] * len(prompt) + batch["per_token_logps"][row, :n].tolist(),
                "old": [0.0] * len(prompt) + batch["old_per_token_logps"][row, :n].tolist(),
                "ref": [0.0] * len(prompt) + batch["ref_per_token_logps"][row, :n].tolist(),
                "advantage": float(batch["advantages"][row]),
            }
        )
    return out


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_packed_policy_loss_equals_grpo_trainer(model_path, options):  # noqa: F811
    stock = trainer(GRPOTrainer, model_path, **options)
    batch = rows()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():  # the policy's log-probs, as TRL's loss computes them (its head, in float32)
        current = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, 6)[0].double()
    noise = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    batch.update(
        advantages=torch.tensor([0.5, -1.0, 1.5, -0.2], dtype=torch.float64),
        old_per_token_logps=current + 0.3 * noise[0],
        ref_per_token_logps=current + 0.1 * noise[1],
        num_items_in_batch=batch["completion_mask"].sum(),
    )
    with torch.no_grad():
        want = float(stock._compute_loss(stock.model, dict(batch)))
    batch["per_token_logps"] = current  # the same log-probs, token-aligned in the packed batch
    names = ("logps", "old", "ref")
    fields = [FloatField(name, dtype=torch.float64) for name in names]
    fields.append(FloatField("advantage", "sequence", dtype=torch.float64, broadcast=True))
    packed = Collator.for_rollouts(padding_free=True, float_fields=fields)(rollouts(batch))
    with torch.no_grad():  # the packed forward's own log-probs agree, to TRL's float32 head
        logits = stock.model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
    scored, supervised = token_logprobs(logits, packed), packed["labels"] != -100
    assert torch.allclose(scored[supervised], packed["logps"][supervised], atol=1e-5)
    logps = packed["logps"]  # TRL's own, so that the formulas are compared exactly
    args = stock.args
    ratio = importance_ratio(logps, packed["old"], packed, level=args.importance_sampling_level)
    per_token = clipped_policy_loss(
        ratio, packed["advantage"], clip=args.epsilon, clip_high=args.epsilon_high, max_ratio=args.delta
    )
    if args.beta:
        correction = ratio if args.use_bias_correction_kl else None
        per_token = per_token + args.beta * kl_penalty(logps, packed["ref"], "k3", ratio=correction)
    mode = AGGREGATION.get(args.loss_type, "token-mean")
    count = batch["num_items_in_batch"] if args.loss_type == "dapo" else None
    got = aggregate_loss(
        per_token, packed, mode=mode, global_count=count, normalizer=args.max_completion_length
    )
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-12)


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
