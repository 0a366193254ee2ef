"""Knowledge distillation from a teacher's top-k log-probs: TRL GKD's generalised JSD on their support."""

from __future__ import annotations

import math
from typing import Literal

import torch

from zephon_collate.core.text import shown

__all__ = ["DIVERGENCES", "distillation_loss"]

DIVERGENCES = (
    "the distributions are the teacher's top-k support, renormalised (TRL: the full vocabulary)",
    "reduction='none' returns one loss per token [..., L], 0 where not trained (TRL: [n_trained, V])",
    "reduction='mean' with no trained token is 0 (TRL: nan); 'batchmean' is 0 there as in TRL",
    "labels are required (or a bool mask); for TRL's num_items_in_batch, divide 'sum' by the global count",
)
"""Where :func:`distillation_loss` differs from TRL's ``generalized_jsd_loss``."""

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    labels: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: Literal["batchmean", "sum", "mean", "none"] = "batchmean",
) -> torch.Tensor:
    """TRL GKD's generalised Jensen-Shannon divergence between teacher and student on the teacher's top-k.

    Parameters:
        student_logits: ``[..., L, V]`` floating logits, aligned with the other arguments.
        teacher_ids: ``[..., L, K]`` integer token ids in ``[0, V)``, distinct within a position (absent: 0).
        teacher_logprobs: ``[..., L, K]`` log-probs of ``teacher_ids``, ``-inf`` where absent.
        labels: ``[..., L]`` integer labels (``ignore_index`` where not trained), or a bool mask.
        beta: in ``[0, 1]``, TRL's ``GKDConfig.beta`` (0: forward KL, 1: reverse KL).
        temperature: ``> 0``, divides both logits as in TRL.
        ignore_index: the label of positions not trained.
        reduction: ``"batchmean"`` (over trained tokens), ``"sum"``, ``"mean"`` (over
            ``n_trained * V``, TRL's) or ``"none"`` (``[..., L]``, 0 where not trained).

    Example:
        >>> logits = torch.tensor([[1.0, 1.0, 5.0]])  # V = 3, L = 1; id 2 is not in the teacher's top-2
        >>> ids, logps = torch.tensor([[[0, 1]]]), torch.tensor([[[0.3, 0.1]]]).log()  # p = [.75, .25]
        >>> loss = distillation_loss(logits[None], ids, logps, torch.tensor([[1]]), beta=0.0)
        >>> round(float(loss), 4)  # KL(p || q), q = [.5, .5]: .75 log 1.5 + .25 log .5
        0.1308
    """
    _check(student_logits, teacher_ids, teacher_logprobs, labels, beta, temperature, reduction)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    trained = labels if labels.dtype == torch.bool else labels != ignore_index
    present = teacher_logprobs > float("-inf")
    some = present.any(dim=-1, keepdim=True)
    vocab = student_logits.shape[-1]
    ids = teacher_ids.long()
    if not torch.compiler.is_compiling():
        _check_values(ids, teacher_logprobs, present, trained & ~some.squeeze(-1), vocab)
    # Every value stays finite: an absent entry gets a stand-in logit, left out of the normaliser by
    # -inf (kept when nothing is present, so the normaliser stays finite), and probability exactly 0.
    kept = present | ~some
    student = torch.gather(student_logits, -1, ids).to(dtype) / temperature
    teacher = torch.where(present, teacher_logprobs.to(dtype), 0.0) / temperature
    log_q = student - torch.logsumexp(torch.where(kept, student, float("-inf")), dim=-1, keepdim=True)
    log_p = teacher - torch.logsumexp(torch.where(kept, teacher, float("-inf")), dim=-1, keepdim=True)
    q = torch.where(present, log_q, float("-inf")).exp()
    p = torch.where(present, log_p, float("-inf")).exp()
    if beta == 0:
        per_entry = _weighted(p, log_p, log_q)
    elif beta == 1:
        per_entry = _weighted(q, log_q, log_p)
    else:
        log_m = torch.logsumexp(torch.stack([log_q + math.log1p(-beta), log_p + math.log(beta)]), dim=0)
        per_entry = beta * _weighted(p, log_p, log_m) + (1 - beta) * _weighted(q, log_q, log_m)
    per_token = torch.where(trained & some.squeeze(-1), per_entry.sum(dim=-1), 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    count = trained.sum() * (vocab if reduction == "mean" else 1)
    return per_token.sum() / count.clamp_min(1)


def _weighted(prob: torch.Tensor, log_prob: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``prob * (log_prob - other)``, 0 where ``prob`` is 0 (a -inf logit, a log-prob that overflowed to
    -inf at a low temperature): 0 log 0 is 0, where the product would be NaN, in value and gradient."""
    return prob * torch.where(prob > 0, log_prob - other, 0.0)


def _check(
    logits: torch.Tensor,
    ids: torch.Tensor,
    logps: torch.Tensor,
    labels: torch.Tensor,
    beta: float,
    temperature: float,
    reduction: str,
) -> None:
    """The arguments' dtypes, shapes and options: free, no data read."""
    name = "distillation_loss"
    for arg, tensor in (("student_logits", logits), ("teacher_logprobs", logps)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name}: {arg} must be floating, got {tensor.dtype}: cast it with .float()")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name}: teacher_ids must be integer, got {ids.dtype}: cast it with .long()")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{name}: labels must be integer (or a bool mask), got {labels.dtype}: use .long()")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"{name}: student_logits must be [..., L, V] with V >= 1, got {tuple(logits.shape)}")
    if ids.shape != logps.shape or ids.dim() < 2 or ids.shape[-1] == 0:
        raise ValueError(
            f"{name}: teacher_ids {tuple(ids.shape)} and teacher_logprobs {tuple(logps.shape)} must be one "
            "[..., L, K] shape with K >= 1, padded with id 0 and log-prob -inf"
        )
    if not logits.shape[:-1] == ids.shape[:-1] == labels.shape:
        raise ValueError(
            f"{name}: student_logits {tuple(logits.shape)}, teacher_ids {tuple(ids.shape)} and labels "
            f"{tuple(labels.shape)} must share the leading shape [..., L]: align (shift) them as the logits"
        )
    if not {ids.device, logps.device, labels.device} <= {logits.device}:
        raise ValueError(f"{name}: all tensors must be on student_logits' device {logits.device}")
    if not 0 <= beta <= 1:
        raise ValueError(f"{name}: beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {shown(beta)}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"{name}: temperature must be finite and > 0, got {shown(temperature)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {shown(reduction)}")


def _check_values(
    ids: torch.Tensor, logps: torch.Tensor, present: torch.Tensor, empty: torch.Tensor, vocab: int
) -> None:
    """The values' checks, read in one device sync: ids in range, no duplicate, log-probs, no empty row."""
    k = ids.shape[-1]
    slots = torch.arange(-1, -k - 1, -1, device=ids.device)  # absent entries: distinct negative keys
    keys = torch.where(present, ids, slots).sort(dim=-1).values
    flags = torch.stack(
        [
            ((ids < 0) | (ids >= vocab)).any(),
            (keys[..., 1:] == keys[..., :-1]).any(),
            (logps.isnan() | (logps == float("inf"))).any(),
            empty.any(),
        ]
    ).tolist()
    if flags[0]:
        raise ValueError(f"distillation_loss: teacher_ids must be in [0, {vocab}) (V), absent entries too")
    if flags[1]:
        raise ValueError("distillation_loss: teacher_ids repeat an id within a position: merge duplicates")
    if flags[2]:
        raise ValueError("distillation_loss: teacher_logprobs must be finite or -inf (absent), not nan/+inf")
    if flags[3]:
        where = tuple(empty.nonzero()[0].tolist())
        raise ValueError(
            f"distillation_loss: trained position {where} has no teacher entry (all teacher_logprobs -inf): "
            "label it ignore_index or give it a teacher"
        )
