"""The DPO family of preference losses (TRL 1.16's ``loss_type`` s), tabled in docs/post_training.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F

from zephon_collate.core.text import shown

__all__ = ["F_DIVERGENCES", "PREFERENCE_LOSSES", "PreferenceLoss", "preference_loss"]

PreferenceLoss: TypeAlias = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
PREFERENCE_LOSSES: tuple[str, ...] = PreferenceLoss.__args__  # type: ignore[attr-defined]
"""TRL 1.16's DPO ``loss_type`` values."""
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
"""TRL's ``f_divergence_type`` values: the score a log ratio ``r`` gives (``r`` for reverse KL)."""
_NEEDS_COUNTS = frozenset({"ipo", "sigmoid_norm", "sft"})


def _scores(ratios: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    """``f'(exp r)`` of the f-divergence: the score that replaces the log ratio ``r``."""
    if divergence == "forward_kl":
        return 1 - torch.exp(-ratios)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(ratios)
    if divergence == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        # TRL's float32 (exp stays finite in the input's dtype); float64 stays float64, to its own bound.
        limit = {torch.float16: 11.0, torch.float64: 709.0}.get(ratios.dtype, 80.0)
        wide = ratios.to(torch.promote_types(ratios.dtype, torch.float32))
        return (torch.exp(((alpha - 1.0) * wide).clamp(max=limit)) - 1.0).to(ratios.dtype) / (alpha - 1.0)
    return ratios


def _smoothed(logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing


def _one(
    kind: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    scores: tuple[torch.Tensor, torch.Tensor],
    counts: tuple[torch.Tensor, torch.Tensor] | None,
    beta: float,
    smoothing: float,
    tau: float,
) -> torch.Tensor:
    """One loss type's ``[P]`` losses."""
    r_c, r_r = chosen - ref_chosen, rejected - ref_rejected
    s_c, s_r = scores
    margin = beta * (s_c - s_r)
    if kind == "sigmoid":
        return -F.logsigmoid(margin)
    if kind == "hinge":
        return torch.relu(1 - margin)
    if kind in ("ipo", "sigmoid_norm"):
        assert counts is not None
        mean_margin = s_c / counts[0].clamp(min=1) - s_r / counts[1].clamp(min=1)
        return (mean_margin - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * mean_margin)
    if kind == "exo_pair":
        chosen_term = torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-smoothing))
        return chosen_term + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - math.log(smoothing))
    if kind == "nca_pair":
        return -F.logsigmoid(beta * r_c) - 0.5 * F.logsigmoid(-beta * r_c) - 0.5 * F.logsigmoid(-beta * r_r)
    if kind == "robust":
        return (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (
            1 - 2 * smoothing
        )
    if kind == "bco_pair":
        return -F.logsigmoid(beta * r_c) - F.logsigmoid(-beta * r_r)
    if kind == "sppo_hard":
        return (r_c - 0.5 / beta) ** 2 + (r_r + 0.5 / beta) ** 2
    if kind == "aot":
        delta = torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values
        return _smoothed(beta * delta, smoothing)
    if kind == "aot_unpaired":
        return _smoothed(beta * (torch.sort(r_c).values - torch.sort(r_r).values), smoothing)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * r_c) + torch.sigmoid(beta * r_r)
    if kind == "apo_down":
        return torch.sigmoid(beta * r_c) + 1 - torch.sigmoid(beta * (r_c - r_r))
    if kind == "discopop":
        mix = torch.sigmoid(margin / tau)
        return -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
    assert kind == "sft" and counts is not None
    return (-chosen.sum() / counts[0].sum().clamp(min=1)).expand(chosen.shape[0])


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    loss_type: str | Sequence[str] = "sigmoid",
    weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    chosen_counts: torch.Tensor | None = None,
    rejected_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The preference loss of ``P`` pairs: a 0-d tensor.

    Parameters:
        chosen_logps, rejected_logps: ``[P]``, the policy's summed log-probs of each response.
        ref_chosen_logps, ref_rejected_logps: ``[P]``, the reference's (no gradient needed).
        loss_type: one of :data:`PREFERENCE_LOSSES`, or a list of them.
        weights: one per loss type of a list (default 1.0 each).
        beta, label_smoothing, f_divergence_type, f_alpha_divergence_coef, discopop_tau: TRL's
            ``DPOConfig`` options of the same names and defaults.
        chosen_counts, rejected_counts: ``[P]`` supervised token counts (``sequence_logprobs(...).counts``),
            needed by ``ipo``, ``sigmoid_norm`` and ``sft``.

    Example:
        >>> chosen, rejected = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -5.0])
        >>> reference = torch.tensor([-5.0, -5.0])
        >>> round(float(preference_loss(chosen, rejected, reference, reference, beta=1.0)), 4)  # margin 1, -1
        0.8133
    """
    kinds = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [kind for kind in kinds if kind not in PREFERENCE_LOSSES]
    if unknown or not kinds:
        raise ValueError(
            f"preference_loss: loss_type must be among {PREFERENCE_LOSSES}, got {shown(loss_type)}"
        )
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(
            f"preference_loss: f_divergence_type must be one of {F_DIVERGENCES}, got "
            f"{shown(f_divergence_type)}"
        )
    scales = [1.0] * len(kinds) if weights is None else list(weights)
    if len(scales) != len(kinds):
        raise ValueError(
            f"preference_loss: weights has {len(scales)} values for {len(kinds)} loss types; give one each"
        )
    given = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    if any(not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape != chosen_logps.shape for t in given):
        raise ValueError(
            "preference_loss: the four log-prob tensors must be [P] tensors of one shape, got shapes "
            f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in given]}"
        )
    counts = None if chosen_counts is None or rejected_counts is None else (chosen_counts, rejected_counts)
    if counts is None and _NEEDS_COUNTS.intersection(kinds):
        raise ValueError(
            f"preference_loss: {shown(sorted(_NEEDS_COUNTS.intersection(kinds)))} need chosen_counts= and "
            "rejected_counts= (each response's token count: sequence_logprobs(...).counts)"
        )
    if "exo_pair" in kinds and not 0 < label_smoothing < 1:
        raise ValueError(
            f"preference_loss: exo_pair needs 0 < label_smoothing < 1, got {shown(label_smoothing)}"
        )
    scores = (
        _scores(chosen_logps - ref_chosen_logps, f_divergence_type, f_alpha_divergence_coef),
        _scores(rejected_logps - ref_rejected_logps, f_divergence_type, f_alpha_divergence_coef),
    )
    total = chosen_logps.new_zeros(())
    for kind, scale in zip(kinds, scales, strict=True):
        losses = _one(kind, *given, scores, counts, beta, label_smoothing, discopop_tau)
        total = total + losses.mean() * scale
    return total
