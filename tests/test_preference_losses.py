"""preference_loss against stock trl.DPOTrainer: the same pairs, scored by sequence_logprobs on a packed batch
and by TRL on its padded one, give TRL's loss for every loss type and f-divergence (tiny Llama, float64 weights;
TRL's head computes its log-probs in float32, which sets the tolerance)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from zephon_collate import Collator, sequence_logprobs
from zephon_collate.losses import PREFERENCE_LOSSES, preference_loss

pytest.importorskip("trl")
from trl import DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import trl_dpo

SMOOTHED = {"exo_pair", "robust", "aot", "aot_unpaired"}
CASES = [
    {"loss_type": [kind], **({"label_smoothing": 0.1} if kind in SMOOTHED else {})}
    for kind in PREFERENCE_LOSSES
]
CASES += [
    {"f_divergence_type": "forward_kl"},
    {"f_divergence_type": "js_divergence"},
    {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    {"loss_type": ["sigmoid", "sft", "ipo"], "loss_weights": [1.0, 0.5, 0.2], "beta": 0.3},
    {"loss_type": ["discopop"], "discopop_tau": 0.2},
]


def packed_logps(model: Any, batch: dict[str, Any]) -> Any:
    with torch.no_grad():
        # use_cache=False: with a cache, transformers ignores the packed position_ids and lets sequences attend
        # to each other
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
    return sequence_logprobs(logits, batch)


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_preference_loss_equals_trl(options):
    stock = trl_dpo.trainer(DPOTrainer, trl_dpo.pairs(8), **options)
    with torch.no_grad():  # a policy away from its reference: margins of order 1
        generator = torch.Generator().manual_seed(3)
        for weight in stock.model.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=generator, dtype=weight.dtype))
    examples = [stock.train_dataset[i] for i in range(4)]
    with torch.no_grad():
        want = float(stock.compute_loss(stock.model, stock.data_collator(examples)))
    batch = Collator.for_preference(padding_free=True)(
        examples
    )  # TRL's prompt_ids / chosen_ids / rejected_ids
    policy, reference = packed_logps(stock.model, batch), packed_logps(stock.ref_model, batch)
    chosen, rejected = batch["chosen_index"], batch["rejected_index"]
    args = stock.args
    got = preference_loss(
        policy.sums[chosen], policy.sums[rejected], reference.sums[chosen], reference.sums[rejected],
        loss_type=args.loss_type, weights=args.loss_weights, beta=args.beta, label_smoothing=args.label_smoothing,
        f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        discopop_tau=args.discopop_tau, chosen_counts=policy.counts[chosen], rejected_counts=policy.counts[rejected],
    )  # fmt: skip
    assert float(got) == pytest.approx(
        want, rel=1e-4
    )  # TRL's float32 head: about 1e-5 of a sequence's log-prob


def test_hand_worked_values():
    """Two pairs with log ratios (1, 0) and (-1, 0), beta 1: margins 1 and -1."""
    chosen, rejected, reference = (
        torch.tensor([-4.0, -6.0]),
        torch.tensor([-5.0, -5.0]),
        torch.tensor([-5.0, -5.0]),
    )
    logsig = torch.nn.functional.logsigmoid

    def loss(kind: str, **options: Any) -> float:
        return float(
            preference_loss(chosen, rejected, reference, reference, loss_type=kind, beta=1.0, **options)
        )

    assert loss("sigmoid") == pytest.approx(
        float(-(logsig(torch.tensor(1.0)) + logsig(torch.tensor(-1.0))) / 2)
    )
    assert loss("hinge") == pytest.approx((0 + 2) / 2)
    assert loss("sppo_hard") == pytest.approx(((1 - 0.5) ** 2 + 0.25 + (-1 - 0.5) ** 2 + 0.25) / 2)
    counts = {"chosen_counts": torch.tensor([2, 4]), "rejected_counts": torch.tensor([1, 1])}
    assert loss("ipo", **counts) == pytest.approx(((0.5 - 0.5) ** 2 + (-0.25 - 0.5) ** 2) / 2)
    assert loss("sft", **counts) == pytest.approx(10 / 6)  # -(-4 - 6) over 2 + 4 tokens


def test_preference_loss_refusals():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type must be among"):
        preference_loss(t, t, t, t, loss_type="dpo")
    with pytest.raises(ValueError, match=r"\['ipo'\] need chosen_counts= and rejected_counts="):
        preference_loss(t, t, t, t, loss_type="ipo")
    with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing < 1"):
        preference_loss(t, t, t, t, loss_type="exo_pair")
    with pytest.raises(ValueError, match="weights has 1 values for 2 loss types"):
        preference_loss(t, t, t, t, loss_type=["sigmoid", "hinge"], weights=[1.0])
    with pytest.raises(ValueError, match=r"must be \[P\] tensors of one shape"):
        preference_loss(t, torch.zeros(3), t, t)
    with pytest.raises(ValueError, match="f_divergence_type must be one of"):
        preference_loss(t, t, t, t, f_divergence_type="kl")


def test_the_defaults_are_dpo_configs():
    """The options TRL's DPOConfig names have its defaults (f_alpha_divergence_coef was 1.0, TRL's 0.5:
    left out, alpha_divergence fell back to reverse KL)."""
    import dataclasses
    import inspect

    from trl import DPOConfig

    from zephon_collate.losses.preference import preference_loss

    ours = inspect.signature(preference_loss).parameters
    theirs = {field.name: field.default for field in dataclasses.fields(DPOConfig)}
    for name in ("beta", "label_smoothing", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau"):
        assert ours[name].default == theirs[name], name
    ratios = (torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    given = preference_loss(
        *ratios, beta=1.0, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5
    )
    assert torch.equal(preference_loss(*ratios, beta=1.0, f_divergence_type="alpha_divergence"), given)
    assert abs(float(given) - 0.117235) < 1e-6  # TRL's value on these log-probs (1 and -1, beta 1)


def test_alpha_divergence_keeps_float64():
    """float64 log ratios stay float64 (TRL computes in float32 and has no float64 bound): exact to the
    docs' formula, past float32's clamp too (at -170 it gave 1.1e34 for 1.6e36, and a zero gradient)."""
    import torch.nn.functional as F

    alpha, beta = 0.5, 0.1

    def score(x: torch.Tensor) -> torch.Tensor:
        return (torch.exp((alpha - 1) * x) - 1) / (alpha - 1)

    for ratio in (-3.3, -170.0):
        chosen = torch.tensor([ratio], dtype=torch.float64, requires_grad=True)
        rejected, zero = torch.tensor([-1.2], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        got = preference_loss(
            chosen, rejected, zero, zero, loss_type="sigmoid", beta=beta,
            f_divergence_type="alpha_divergence", f_alpha_divergence_coef=alpha,
        )  # fmt: skip
        want = -F.logsigmoid(beta * (score(chosen) - score(rejected))).mean()
        assert got.dtype == torch.float64 and float(got) == pytest.approx(float(want), rel=1e-12)
        assert float(torch.autograd.grad(got, chosen)[0]) == pytest.approx(
            float(torch.autograd.grad(want, chosen)[0]), rel=1e-12
        )
