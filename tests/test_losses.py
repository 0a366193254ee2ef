"""The loss helpers: hand-worked values, every layout against the sequences alone, gradient accumulation.

The reference for each ``aggregate_loss`` mode is its formula written over plain per-sequence lists
(verl's ``agg_loss``); the helpers must give it from any layout of the same rollouts, and a step split
into micro-batches must give the whole step's gradient.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import (
    Collator,
    aggregate_loss,
    global_loss_count,
    sequence_logprobs,
    token_logprobs,
    unpack,
)
from zephon_collate.losses import EMPTY, MODES

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = [
    {"pad_token_id": 0},
    {"pad_token_id": 0, "shared_prompt": True},
    {"padding_free": True},
    {"padding_free": True, "shared_prompt": True, "pad_token_id": 0, "pad_to_multiple_of": 16},
]
VOCAB = 11


def rollouts(spec: list[tuple[int, int]]) -> list[dict]:
    """Rollouts of a prompt (one of two) and a completion of each given length."""
    prompts = [[1, 2, 3], [4, 5]]
    out = []
    for p, n in spec:
        completion = [(6 + 3 * len(out) + k) % VOCAB for k in range(n)]
        out.append({"input_ids": prompts[p] + completion, "completion_mask": [0] * len(prompts[p]) + [1] * n})
    return out


def logits_for(batch: dict) -> torch.Tensor:
    """Logits that depend on each token's own sequence history only (what a model without leaks gives):
    a shared prompt's positions get the same rows from each of its sequences."""
    table = torch.linspace(-2, 2, 64 * VOCAB, dtype=torch.float64).reshape(64, VOCAB).sin() * 3
    out = torch.zeros(batch["input_ids"].numel(), VOCAB, dtype=torch.float64)
    where = unpack(torch.arange(batch["input_ids"].numel()).reshape(batch["input_ids"].shape), batch)
    for tokens, places in zip(unpack(batch["input_ids"], batch), where, strict=True):
        out[places] = table[torch.cumsum(tokens * 7 + 1, 0) % 64]
    return out.reshape(*batch["input_ids"].shape, VOCAB).requires_grad_()


def reference(per_token, mode, normalizer=10.0):
    """verl's formulas over per-sequence lists of (loss, supervised) pairs."""
    sums = [sum(loss for loss, m in seq if m) for seq in per_token]
    counts = [sum(1 for _, m in seq if m) for seq in per_token]
    kept = [i for i, n in enumerate(counts) if n]
    if mode == "token-mean":
        return sum(sums) / max(sum(counts), 1)
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in kept) / max(len(kept), 1)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in kept) / max(len(kept), 1)
    if mode == "seq-mean-token-sum-norm":
        return sum(sums[i] for i in kept) / max(len(kept), 1) / normalizer
    return sum(sums)


def test_token_and_sequence_logprobs_hand_worked():
    batch = Collator.for_rollouts(padding_free=True, shared_prompt=True)(rollouts([(0, 2), (0, 1)]))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6, 7, 9]]
    logits = torch.full((1, 6, VOCAB), -1e9)
    logits[0, 2, 6] = logits[0, 2, 9] = 0.0  # the prompt's last position: 6 or 9, each 1/2
    logits[0, 3, 7] = 0.0  # after 6: 7, surely
    lp = token_logprobs(logits, batch)
    assert lp[0, 3:].tolist() == pytest.approx([math.log(0.5), 0.0, math.log(0.5)])
    out = sequence_logprobs(logits, batch)
    assert out.sums.tolist() == pytest.approx([math.log(0.5), math.log(0.5)]) and out.counts.tolist() == [
        2,
        1,
    ]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "padded-shared", "flat", "flat-shared"])
def test_every_layout_gives_the_sequences_numbers(layout):
    """Log-probs and every aggregate mode from any layout equal the per-sequence reference."""
    spec = [(0, 3), (0, 1), (1, 2), (0, 0), (0, 4)]
    batch = Collator.for_rollouts(**layout)(rollouts(spec))
    logits = logits_for(batch)
    lp = token_logprobs(logits, batch)
    supervised = unpack((batch["labels"] != -100) & (batch["logits_index"] >= 0), batch)
    per_token = [
        list(zip(s.tolist(), m.tolist(), strict=True))
        for s, m in zip(unpack(lp, batch), supervised, strict=True)
    ]
    sums = sequence_logprobs(logits, batch)
    assert sums.sums.tolist() == pytest.approx([sum(v for v, m in seq if m) for seq in per_token])
    assert sums.counts.tolist() == [3, 1, 2, 0, 4]
    baseline = Collator.for_rollouts(pad_token_id=0)(rollouts(spec))
    expected = unpack(token_logprobs(logits_for(baseline), baseline), baseline)
    for got, want in zip(unpack(lp, batch), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-12)
    for mode in MODES:
        got = float(aggregate_loss(-lp, batch, mode=mode, normalizer=10.0).detach())
        want = reference([[(-v, m) for v, m in seq] for seq in per_token], mode)
        assert got == pytest.approx(want, rel=1e-12), mode


@FAST
@given(
    spec=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), min_size=1, max_size=8),
    layout=st.sampled_from(LAYOUTS),
    cut=st.integers(1, 7),
)
def test_gradient_accumulation_gives_the_whole_steps_gradient(spec, layout, cut):
    """Micro-batches with the step's global count: the summed gradient is the whole batch's, in every mode,
    skipping or counting the sequences without a supervised token."""
    cut = min(cut, len(spec))
    weights = torch.linspace(-1, 1, 5 * VOCAB, dtype=torch.float64).reshape(5, VOCAB).requires_grad_()
    collate = Collator.for_rollouts(**layout)

    def per_token(batch):
        features = torch.nn.functional.one_hot(batch["input_ids"] % 5, 5).double()
        return -token_logprobs(features @ weights, batch)

    examples = rollouts(spec)
    whole = collate(examples)
    micro = [collate(examples[:cut])] + ([collate(examples[cut:])] if cut < len(spec) else [])
    for mode, empty in itertools.product(MODES, EMPTY):
        weights.grad = None
        aggregate_loss(per_token(whole), whole, mode=mode, empty=empty, normalizer=7.0).backward()
        expected = weights.grad.clone()
        weights.grad = None
        count = None if mode == "token-sum" else global_loss_count(micro, mode=mode, empty=empty)
        for batch in micro:
            loss = aggregate_loss(per_token(batch), batch, mode=mode, global_count=count, normalizer=7.0)
            loss.backward()
        assert torch.allclose(weights.grad, expected, rtol=1e-10, atol=1e-12), (mode, empty)


def test_transformers_batches_read_from_their_masks_and_positions():
    examples = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
        {"input_ids": [5, 6], "completion_mask": [0, 1]},
    ]
    rollout = Collator.for_rollouts(padding_free=True)(examples)
    logits = logits_for(rollout).detach()
    want = sequence_logprobs(logits, rollout)
    flat = Collator.for_transformers(padding_free=True)(examples)
    got = sequence_logprobs(logits, flat)
    assert torch.allclose(got.sums, want.sums) and got.counts.tolist() == want.counts.tolist() == [3, 1]
    padded = Collator.for_transformers(pad_token_id=0, padding_side="left")(examples)
    lp = token_logprobs(torch.zeros(2, 4, VOCAB), padded)
    assert (lp[1, :3] == 0).all() and lp[1, 3] == pytest.approx(-math.log(VOCAB))  # row 1: [0, 0, 5, 6]
    assert [row.tolist() for row in unpack(padded["input_ids"], padded)] == [[1, 2, 3, 4], [5, 6]]


def test_bad_loss_arguments():
    batch = Collator.for_rollouts(padding_free=True)(rollouts([(0, 2)]))
    loss = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_loss(loss, batch, mode="mean")
    with pytest.raises(ValueError, match="needs normalizer="):
        aggregate_loss(loss, batch, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="per_token_loss has shape"):
        aggregate_loss(torch.zeros(1, 4), batch)
    with pytest.raises(ValueError, match="logits have shape"):
        token_logprobs(torch.zeros(1, 4, VOCAB), batch)
    with pytest.raises(ValueError, match="no sequence map"):
        token_logprobs(torch.zeros(1, 5, VOCAB), {"input_ids": batch["input_ids"]})
    with pytest.raises(ValueError, match="'token-sum' divides by nothing"):
        global_loss_count([batch], mode="token-sum")
    with pytest.raises(ValueError, match="unpack: tensor has shape"):
        unpack(torch.zeros(2, 5), batch)


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, global_batch_size, loss_scale_factor):
    """verl 0.10's ``agg_loss`` (verl-project/verl@1dda039b, ``verl/trainer/ppo/core_algos.py``), one rank
    (``dp_size=1``, ``batch_num_tokens`` the mask's sum): ``[bs, response_length]`` losses, response-aligned."""
    masked_sum = lambda x, m: (x * m).sum()  # noqa: E731 (verl's helper, as written there)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    seq_mask = (loss_mask.sum(dim=-1) > 0).float()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * loss_mask).sum(dim=-1) / (loss_mask.sum(dim=-1) + 1e-8)
    else:
        seq_losses = (loss_mat * loss_mask).sum(dim=-1)
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size
    return loss / loss_scale_factor if loss_agg_mode == "seq-mean-token-sum-norm" else loss


def test_every_mode_equals_verl_and_dr_grpo_equals_trl():
    """The same per-token losses, response-aligned ``[B, C]`` as verl and TRL hold them and packed as the
    collator lays them out: ``aggregate_loss`` equals verl 0.10's ``agg_loss`` in every mode, and
    ``"seq-mean-token-sum-norm"`` with ``normalizer=max_completion_length`` equals TRL 1.16's ``dr_grpo``
    (``grpo_trainer.py``: ``(per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)``)
    here, where no row is all masked and the step is one micro-batch (``tests/test_loss_modes_peers.py`` has
    the rest: ``empty="count"``, ``accumulation_steps``)."""
    spec = [(0, 3), (1, 1), (0, 5), (1, 2)]
    examples = rollouts(spec)
    width, max_completion_length = max(n for _, n in spec), 8
    values = torch.linspace(0.5, 3.0, len(spec) * width, dtype=torch.float64).reshape(len(spec), width)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for _, n in spec], dtype=torch.float64)
    for layout in LAYOUTS:
        batch = Collator.for_rollouts(**layout)(examples)
        per_token = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        places = unpack(torch.arange(per_token.numel()).reshape(per_token.shape), batch)
        for row, ((_, n), where) in enumerate(zip(spec, places, strict=True)):
            per_token.view(-1)[where[len(where) - n :]] = values[row, :n]  # the completion's tokens
        for mode in MODES:
            got = aggregate_loss(per_token, batch, mode=mode, normalizer=max_completion_length)
            want = _verl_agg_loss(values, mask, mode, len(spec), max_completion_length)
            assert float(got) == pytest.approx(float(want), rel=1e-7), (layout, mode)
        dr_grpo = (values * mask).sum() / (values.size(0) * max_completion_length)
        norm = aggregate_loss(
            per_token, batch, mode="seq-mean-token-sum-norm", normalizer=max_completion_length
        )
        assert float(norm) == pytest.approx(float(dr_grpo), rel=1e-12)


def test_a_per_token_loss_with_a_trailing_dimension_is_refused():
    """``[R, L, 1]`` (a value head's, unsqueezed) broadcast against the ``[E]`` mask into ``[E, E]``: the
    token mean of the docstring's batch came out 30.0 for 3.0."""
    from zephon_collate import Collator
    from zephon_collate.losses import aggregate_loss, sequence_means

    batch = Collator.for_rollouts(padding_free=True)(
        [
            {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
            {"input_ids": [1, 5], "completion_mask": [0, 1]},
        ]
    )
    loss = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 6.0]])
    assert float(aggregate_loss(loss, batch)) == 3.0
    for call in (
        lambda: aggregate_loss(loss[..., None], batch),
        lambda: sequence_means(loss[..., None], batch),
    ):
        with pytest.raises(ValueError, match=r"has shape \(1, 6, 1\): give one number per token"):
            call()
