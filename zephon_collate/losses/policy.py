"""Policy-gradient losses and KL estimators (TRL 1.16's GRPO, verl 0.10) on ``[R, L]`` log-probs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from zephon_collate.core.text import shown
from zephon_collate.losses.sequences import sequence_means

__all__ = ["KL_ESTIMATORS", "clipped_policy_loss", "importance_ratio", "kl_penalty"]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+")
"""verl's ``kl_penalty`` estimators (``+``: the estimator's value with ``k2``'s gradient)."""
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2+", "low_var_kl+": "k3+"}


def importance_ratio(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """``pi / pi_old`` per token ``[R, L]``: per token (``"token"``), or GSPO's per sequence (``"sequence"``).

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...     {"input_ids": [1, 4], "completion_mask": [0, 1]},
        ... ])
        >>> logps = torch.tensor([[0.0, -1.0, -2.0, 0.0, -1.0]])
        >>> old = torch.tensor([[0.0, -1.5, -1.5, 0.0, -2.0]])
        >>> importance_ratio(logps, old, batch, level="sequence").log().round(decimals=4).tolist()
        [[0.0, 0.0, 0.0, 1.0, 1.0]]
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_ratio: level must be 'token' or 'sequence', got {shown(level)}")
    if logps.shape != old_logps.shape:
        raise ValueError(
            f"importance_ratio: logps {tuple(logps.shape)} and old_logps {tuple(old_logps.shape)} must "
            "be one [R, L] shape, token-aligned"
        )
    log_ratio = logps - old_logps.to(logps.dtype)
    return torch.exp(log_ratio if level == "token" else sequence_means(log_ratio, batch))


def clipped_policy_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    max_ratio: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate per token: ``-min(r A, clamp(r, 1 - clip, 1 + clip_high) A)``.

    Parameters:
        ratio: ``[R, L]`` importance ratios (:func:`importance_ratio`).
        advantages: ``[R, L]``, or anything that broadcasts to it.
        clip: the lower clip range (TRL's ``epsilon``).
        clip_high: the upper clip range (TRL's ``epsilon_high``; default ``clip``).
        max_ratio: a cap on the unclipped ratio (TRL's ``delta``).
        dual_clip: ``> 1``, bounds a negative advantage's loss by ``-dual_clip * A`` (verl's
            ``clip_ratio_c``, on at 3.0 in verl; off by default, as TRL's GRPO).

    Example:
        >>> ratio = torch.tensor([[1.5, 0.5, 5.0]])
        >>> clipped_policy_loss(ratio, torch.tensor([[1.0, -1.0, -1.0]]), dual_clip=3.0).tolist()
        [[-1.2000000476837158, 0.800000011920929, 3.0]]
    """
    high = clip if clip_high is None else clip_high
    for name, value in (("clip", clip), ("clip_high", high)):
        if not value >= 0:
            raise ValueError(f"clipped_policy_loss: {name} must be >= 0, got {shown(value)}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(
            f"clipped_policy_loss: dual_clip must be > 1 (verl's clip_ratio_c), got {shown(dual_clip)}"
        )
    clipped = torch.clamp(ratio, 1 - clip, 1 + high)
    unclipped = ratio if max_ratio is None else torch.clamp(ratio, max=max_ratio)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    if dual_clip is None:
        return loss
    return torch.where(advantages < 0, torch.min(loss, -advantages * dual_clip), loss)


def kl_penalty(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    estimator: str = "k3",
    *,
    ratio: torch.Tensor | None = None,
    clamp: bool = False,
) -> torch.Tensor:
    """A per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens' log-probs.

    Parameters:
        logps, ref_logps: ``[R, L]`` log-probs of the policy and the reference.
        estimator: ``k1`` (``logps - ref``), ``abs``, ``k2`` (``(logps - ref)² / 2``), ``k3`` (TRL's,
            verl's ``low_var_kl``), a ``+`` form (:data:`KL_ESTIMATORS`) or verl's names.
        ratio: the importance ratio to weight by (TRL's ``use_bias_correction_kl``, on by default in TRL).
        clamp: verl's bounds on ``k3`` (log ratio to ±20, the estimate to ±10; always on in verl, off by
            default, as TRL's k3).

    Example:
        >>> logps, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
        >>> [round(float(kl_penalty(logps, ref, e)), 4) for e in ("k1", "k2", "k3")]
        [1.0, 0.5, 0.3679]
    """
    kind = _ALIASES.get(estimator, estimator)
    if kind not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_penalty: estimator must be one of {KL_ESTIMATORS} (or verl's names), got {shown(estimator)}"
        )
    diff = logps - ref_logps.to(logps.dtype)
    base = kind.rstrip("+")
    if base == "k1":
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base == "k2":
        value = 0.5 * diff**2
    else:
        back = -diff.clamp(-20, 20) if clamp else -diff
        value = torch.exp(back) - back - 1
        value = value.clamp(-10, 10) if clamp else value
    if kind.endswith("+"):  # the estimate's value, k2's gradient
        k2 = 0.5 * diff**2
        value = k2 - k2.detach() + value.detach()
    return value if ratio is None else value * ratio
