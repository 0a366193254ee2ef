"""distillation_loss: a hand-worked example; on full support, TRL GKD's generalized_jsd_loss run side by side; on
top-k and ragged supports, a dense per-position float64 reference (values and gradients); absent entries, the
reductions, torch.compile, and every refused argument."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate.losses.distill import distillation_loss

pytest.importorskip("trl")
with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDTrainer

BETAS = [0.0, 0.3, 0.5, 1.0]
REDUCTIONS = ["batchmean", "sum", "mean", "none"]
NEG = float("-inf")


def case(
    seed: int,
    shape: tuple[int, ...],
    vocab: int,
    k: int,
    *,
    dtype: torch.dtype = torch.float64,
    absent: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits, distinct top-k ids per position (a fraction ``absent`` of entries -inf, id 0), teacher
    log-probs and labels (about a third -100; a position with no entry present is labelled -100)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g, dtype=dtype) * 2
    teacher_logits = torch.randn(*shape, vocab, generator=g, dtype=dtype) * 2
    ids = torch.rand(*shape, vocab, generator=g).argsort(dim=-1)[..., :k]
    logps = torch.log_softmax(teacher_logits, dim=-1).gather(-1, ids)
    gone = torch.rand(*shape, k, generator=g) < absent
    ids, logps = ids.masked_fill(gone, 0), logps.masked_fill(gone, NEG)
    labels = torch.randint(0, vocab, shape, generator=g)
    labels = labels.masked_fill((torch.rand(*shape, generator=g) < 0.3) | gone.all(-1), -100)
    return logits, teacher_logits, ids, logps, labels


def dense_reference(logits, ids, logps, labels, beta, temperature, reduction):
    """Per position in float64: both distributions dense over V with -inf outside the entries present, each
    renormalised, and TRL's generalised JSD summed over the support only (0 * log 0 left out)."""
    vocab = logits.shape[-1]
    flat_logits, flat_ids, flat_logps = (
        logits.reshape(-1, vocab),
        ids.reshape(-1, ids.shape[-1]),
        logps.reshape(-1, ids.shape[-1]),
    )
    per_token = []
    for n, label in enumerate(labels.reshape(-1).tolist()):
        present = flat_logps[n] > NEG
        if label == -100:
            per_token.append(flat_logits.new_zeros(()))
            continue
        support = torch.zeros(vocab, dtype=torch.bool)
        support[flat_ids[n][present]] = True
        teacher = torch.full((vocab,), NEG, dtype=torch.float64).index_put(
            (flat_ids[n][present],), flat_logps[n][present].double()
        )
        log_q = torch.log_softmax(torch.where(support, flat_logits[n].double() / temperature, NEG), -1)[
            support
        ]
        log_p = torch.log_softmax(teacher / temperature, -1)[support]
        if beta == 0:
            loss = (log_p.exp() * (log_p - log_q)).sum()
        elif beta == 1:
            loss = (log_q.exp() * (log_q - log_p)).sum()
        else:
            log_m = torch.log((1 - beta) * log_q.exp() + beta * log_p.exp())
            loss = (
                beta * (log_p.exp() * (log_p - log_m)).sum()
                + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum()
            )
        per_token.append(loss)
    out = torch.stack(per_token).reshape(labels.shape)
    count = int((labels != -100).sum())
    if reduction == "none":
        return out
    return out.sum() / {"sum": 1, "batchmean": max(count, 1), "mean": max(count * vocab, 1)}[reduction]


def test_hand_worked_example():
    # V = 3, one position, top-2 ids [0, 1]: the student's logits [1, 1, 5] give q = [.5, .5] on them (id 2 left
    # out); the teacher's unnormalised [.3, .1] give p = [.75, .25]. beta = .5: m = (q + p) / 2 = [.625, .375].
    logits, ids = torch.tensor([[1.0, 1.0, 5.0]], dtype=torch.float64), torch.tensor([[0, 1]])
    logps, labels = torch.tensor([[0.3, 0.1]], dtype=torch.float64).log(), torch.tensor([7])
    kl_pm = 0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)  # KL(p||m) = 0.035375
    kl_qm = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)  # KL(q||m) = 0.032269
    expected = {
        0.0: 0.75 * math.log(1.5) + 0.25 * math.log(0.5),  # KL(p||q) = 0.130812
        1.0: 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0),  # KL(q||p) = 0.143841
        0.5: 0.5 * kl_pm + 0.5 * kl_qm,  # 0.033822
    }
    for beta, value in expected.items():
        loss = distillation_loss(logits, ids, logps, labels, beta=beta)
        assert loss.item() == pytest.approx(value, abs=1e-12)
    # T = 2: q stays [.5, .5]; p = softmax(log([.3, .1]) / 2) = [sqrt 3, 1] / (sqrt 3 + 1)
    p = torch.tensor([math.sqrt(3), 1.0], dtype=torch.float64) / (math.sqrt(3) + 1)
    forward = float((p * (p / 0.5).log()).sum())
    assert distillation_loss(logits, ids, logps, labels, beta=0.0, temperature=2.0).item() == pytest.approx(
        forward
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_full_support_equals_trl_generalized_jsd(dtype, tol, reduction):
    for beta in BETAS:
        for temperature in (1.0, 0.7, 2.0):
            logits, teacher_logits, ids, logps, labels = case(int(beta * 10), (3, 5), 11, 11, dtype=dtype)
            ours = distillation_loss(
                logits, ids, logps, labels, beta=beta, temperature=temperature, reduction=reduction
            )
            trl = GKDTrainer.generalized_jsd_loss(
                logits, teacher_logits, labels=labels, beta=beta, temperature=temperature, reduction=reduction
            )
            if (
                reduction == "none"
            ):  # TRL: [n_trained, V] per entry; ours: [..., L] per token, 0 where not trained
                assert torch.equal(ours[labels == -100], torch.zeros_like(ours[labels == -100]))
                ours, trl = ours[labels != -100], trl.sum(-1)
            assert ours.dtype == dtype
            torch.testing.assert_close(ours, trl, rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(4,), (2, 3), (1, 2, 2)]),
    vocab=st.integers(2, 9),
    data=st.data(),
    beta=st.sampled_from([*BETAS, 0.9]),
    temperature=st.sampled_from([1.0, 0.5, 3.0]),
    absent=st.sampled_from([0.0, 0.4]),
    reduction=st.sampled_from(REDUCTIONS),
)
def test_top_k_equals_dense_restricted_reference(
    seed, shape, vocab, data, beta, temperature, absent, reduction
):
    k = data.draw(st.integers(1, vocab))
    logits, _, ids, logps, labels = case(seed, shape, vocab, k, absent=absent)
    ours = distillation_loss(
        logits, ids, logps, labels, beta=beta, temperature=temperature, reduction=reduction
    )
    expected = dense_reference(logits, ids, logps, labels, beta, temperature, reduction)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_ragged_k_equals_the_entries_present_alone():
    logits, _, ids, logps, labels = case(3, (2, 6), 10, 6, absent=0.5)
    per_token = distillation_loss(logits, ids, logps, labels, beta=0.3, reduction="none")
    for pos in zip(*torch.where(labels != -100), strict=True):
        present = logps[pos] > NEG
        alone = distillation_loss(
            logits[pos][None],
            ids[pos][present][None],
            logps[pos][present][None],
            labels[pos][None],
            beta=0.3,
            reduction="none",
        )
        torch.testing.assert_close(per_token[pos], alone[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_gradients_equal_dense_reference(beta):
    logits, _, ids, logps, labels = case(5, (3, 4), 8, 5, absent=0.3)
    logits[0, 0] = 0.0  # a position with no teacher: all -inf, not trained
    ids[0, 0], logps[0, 0], labels[0, 0] = 0, NEG, -100
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    t_ours, t_ref = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    distillation_loss(ours_in, ids, t_ours, labels, beta=beta, temperature=1.5).backward()
    dense_reference(ref_in, ids, t_ref, labels, beta, 1.5, "batchmean").backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(t_ours.grad, t_ref.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_absent_positions_are_zero_with_finite_gradients(beta, dtype):
    logits, _, ids, logps, labels = case(7, (2, 4), 6, 3, dtype=dtype, absent=0.3)
    logps[1], ids[1], labels[1] = NEG, 0, -100  # a whole row without teacher
    logits, logps = logits.requires_grad_(), logps.requires_grad_()
    per_token = distillation_loss(logits, ids, logps, labels, beta=beta, reduction="none")
    assert torch.equal(per_token[1], torch.zeros(4, dtype=dtype)) and torch.isfinite(per_token).all()
    per_token.sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(logps.grad).all()
    assert torch.equal(logits.grad[1], torch.zeros_like(logits.grad[1]))
    assert torch.equal(logps.grad[logps.detach() == NEG], torch.zeros_like(logps.grad[logps.detach() == NEG]))


def test_reductions_bool_mask_and_inputs_untouched():
    logits, _, ids, logps, labels = case(9, (2, 5), 7, 4, absent=0.2)
    before = [t.clone() for t in (logits, ids, logps, labels)]
    per_token = distillation_loss(logits, ids, logps, labels, reduction="none")
    n = int((labels != -100).sum())
    assert distillation_loss(logits, ids, logps, labels, reduction="sum").item() == pytest.approx(
        per_token.sum().item()
    )
    assert distillation_loss(logits, ids, logps, labels).item() == pytest.approx(per_token.sum().item() / n)
    assert distillation_loss(logits, ids, logps, labels, reduction="mean").item() == pytest.approx(
        per_token.sum().item() / (n * 7)
    )
    assert torch.equal(distillation_loss(logits, ids, logps, labels != -100, reduction="none"), per_token)
    assert torch.equal(
        distillation_loss(
            logits, ids, logps, labels.masked_fill(labels == -100, 5), ignore_index=5, reduction="none"
        ),
        per_token,
    )
    for got, was in zip((logits, ids, logps, labels), before, strict=True):
        assert torch.equal(got, was)
    nothing = torch.full_like(labels, -100)
    for reduction in REDUCTIONS:  # nothing trained: zeros, never nan
        assert not distillation_loss(logits, ids, logps, nothing, reduction=reduction).any()
    assert distillation_loss(logits.bfloat16(), ids, logps, labels).dtype == torch.float32


@pytest.mark.compile
def test_compiled_equals_eager():
    compiled = torch.compile(distillation_loss, dynamic=True, backend="aot_eager", fullgraph=True)
    for seed, shape, k in ((0, (2, 5), 4), (1, (3, 7), 3)):
        logits, _, ids, logps, labels = case(seed, shape, 9, k, dtype=torch.float32, absent=0.3)
        for beta in (0.0, 0.5):
            for reduction in ("batchmean", "none"):
                eager = distillation_loss(logits, ids, logps, labels, beta=beta, reduction=reduction)
                got = compiled(logits, ids, logps, labels, beta=beta, reduction=reduction)
                torch.testing.assert_close(got, eager, rtol=0, atol=0)


def logps_with(value: float, dim: int, index: int) -> torch.Tensor:
    return torch.zeros(2, 3, 3).index_fill(dim, torch.tensor([index]), value)


Z, LONG = torch.zeros, torch.long
REFUSED = [
    (TypeError, {"student_logits": Z(2, 3, 5, dtype=LONG)}, "student_logits must be floating"),
    (TypeError, {"teacher_logprobs": Z(2, 3, 3, dtype=LONG)}, "teacher_logprobs must be floating"),
    (TypeError, {"teacher_ids": Z(2, 3, 3)}, "teacher_ids must be integer"),
    (TypeError, {"teacher_ids": Z(2, 3, 3, dtype=torch.bool)}, "teacher_ids must be integer"),
    (TypeError, {"labels": Z(2, 3)}, "labels must be integer"),
    (ValueError, {"student_logits": Z(5)}, r"student_logits must be \[\.\.\., L, V\]"),
    (ValueError, {"student_logits": Z(2, 3, 0)}, "V >= 1"),
    (ValueError, {"teacher_logprobs": Z(2, 3, 2)}, "must be one"),
    (ValueError, {"teacher_ids": Z(2, 3, 0, dtype=LONG), "teacher_logprobs": Z(2, 3, 0)}, "K >= 1"),
    (ValueError, {"labels": Z(2, 4, dtype=LONG)}, "must share the leading shape"),
    (ValueError, {"student_logits": Z(2, 4, 5)}, "must share the leading shape"),
    (ValueError, {"labels": Z(2, 3, dtype=LONG, device="meta")}, "device"),
    (ValueError, {"beta": 1.5}, "beta must be in"),
    (ValueError, {"beta": math.nan}, "beta must be in"),
    (ValueError, {"temperature": 0.0}, "temperature must be"),
    (ValueError, {"temperature": math.inf}, "temperature must be"),
    (ValueError, {"reduction": "avg"}, "reduction must be one of"),
    (ValueError, {"teacher_ids": torch.full((2, 3, 3), 5)}, r"teacher_ids must be in \[0, 5\)"),
    (ValueError, {"teacher_ids": torch.full((2, 3, 3), -1)}, r"teacher_ids must be in \[0, 5\)"),
    (ValueError, {"teacher_ids": torch.tensor([[0, 1, 2]] * 5 + [[4, 3, 4]]).view(2, 3, 3)}, "repeat an id"),
    (ValueError, {"teacher_logprobs": logps_with(math.nan, 1, 2)}, r"nan/\+inf"),
    (ValueError, {"teacher_logprobs": logps_with(math.inf, 2, 0)}, r"nan/\+inf"),
    (
        ValueError,
        {"teacher_logprobs": logps_with(NEG, 1, 1), "labels": Z(2, 3, dtype=LONG)},
        r"trained position \(0, 1\) has no teacher entry",
    ),
]


@pytest.mark.parametrize("error, change, match", REFUSED)
def test_refused(error, change, match):
    logits, _, ids, logps, labels = case(0, (2, 3), 5, 3)
    args = {"student_logits": logits, "teacher_ids": ids, "teacher_logprobs": logps, "labels": labels}
    with pytest.raises(error, match=match):
        distillation_loss(**{**args, **change})


def test_absent_entries_may_repeat_ids():
    ids = torch.tensor([[[2, 0, 0]]])  # id 0 once present, once absent: not a duplicate
    logps = torch.tensor([[[-0.5, -1.0, NEG]]])
    assert torch.isfinite(distillation_loss(torch.zeros(1, 1, 3), ids, logps, torch.tensor([[1]])))


def _xlogy_terms(weights: torch.Tensor, log_weights: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``sum w (log w - other)`` with 0 log 0 = 0: the reference's convention."""
    return torch.where(
        weights > 0, weights * (log_weights - other), torch.zeros((), dtype=weights.dtype)
    ).sum()


def test_a_zero_probability_entry_counts_zero_not_nan():
    """A -inf student logit inside the teacher's top-k (a masked vocabulary entry), and a teacher fill of
    finfo.min divided by a temperature below 1 (it overflows to -inf): 0 log 0 is 0; it was NaN."""
    logits = torch.tensor([[[0.0, 1.0, -math.inf, 0.5]]], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[[0, 1, 2]]])
    teacher = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64).log()
    q = torch.softmax(torch.tensor([0.0, 1.0, -math.inf], dtype=torch.float64), 0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    for beta in (1.0, 0.5):
        got = distillation_loss(logits, ids, teacher, torch.tensor([[1]]), beta=beta)
        m = beta * p + (1 - beta) * q
        want = (
            _xlogy_terms(q, q.log(), p.log())
            if beta == 1
            else beta * _xlogy_terms(p, p.log(), m.log()) + (1 - beta) * _xlogy_terms(q, q.log(), m.log())
        )
        assert float(got) == pytest.approx(float(want), abs=1e-12)
        (grad,) = torch.autograd.grad(got, logits)
        assert torch.isfinite(grad).all()
    low = torch.tensor([[[math.log(0.6), math.log(0.4), torch.finfo(torch.float32).min]]])
    student = torch.tensor([[[0.3, 1.0, -0.5, 0.2]]])
    for beta in (0.0, 0.5):
        got = distillation_loss(student, ids, low, torch.tensor([[1]]), beta=beta, temperature=0.5)
        assert torch.isfinite(got)
    assert float(distillation_loss(student, ids, low, torch.tensor([[1]]), beta=0.0, temperature=0.5)) == (
        pytest.approx(0.6115678747624899, rel=1e-6)
    )
