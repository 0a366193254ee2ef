"""Balanced ranks: the cost model, the planner, the window schedule and the map-style sampler.

Hand-worked plans and FLOP counts, then hypothesis properties checked against plain-Python references:
every document once, budgets held, equal micro-batch counts, groups whole, exact reported costs,
determinism and exact resume.
"""

from __future__ import annotations

import io
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate.parallel.balance import BalanceOptions, BalancePlan, plan_balance
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.parallel.schedule import BalanceSchedule

SQUARES = CostModel(linear=0, quadratic=1)
MIXED = CostModel(linear=3, quadratic=1)
ONE_SLOT = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=8, micro_batches=1)


def saved(state):
    """The state after a round trip through torch.save/torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- the cost model ------------------------------------------------------------------------------


def test_llama_3_8b_cost_is_the_hand_counted_flops():
    """Per token and layer: 6 x (QKV + output projection + 3 MLP matrices); the logits once; causal
    attention 7 x heads x head_dim x L**2 per layer (FlashAttention: 2 forward + 5 backward)."""
    hidden, layers, heads, kv, ffn, vocab = 4096, 32, 32, 8, 14336, 128256
    model = CostModel.from_model(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
    )
    head_dim = hidden // heads
    for length in (1, 700, 4096, 131072):
        gemms = 6 * length * (layers * (hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden))
        mlp = 6 * length * layers * hidden * ffn * 3
        logits = 6 * length * hidden * vocab
        attention = layers * 7 * heads * head_dim * length * length
        assert model.cost(length) * model.unit == gemms + mlp + logits + attention
    assert (model.linear, model.quadratic, model.unit) == (343536, 7, 131072)
    full = CostModel.from_model(
        hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256, gated=False, causal=False
    )
    assert full.cost(10) * full.unit == 6 * 10 * 2 * (64 * 192 + 64 * 64 + 64 * 256 * 2) + 2 * 14 * 64 * 100


def test_cost_model_arrays_are_exact_int64():
    costs = MIXED.costs(np.array([0, 1, 2**20]))
    assert costs.dtype == np.int64 and costs.tolist() == [0, 4, 3 * 2**20 + 2**40]
    with pytest.raises(ValueError, match="2\\*\\*62"):
        CostModel(linear=0, quadratic=2**40).costs([2**20])
    with pytest.raises(ValueError, match="integers"):
        MIXED.costs([1.5])


def test_cost_model_from_measurements():
    assert CostModel.from_coefficients(3e-6, 1e-9) == CostModel(linear=3000, quadratic=1, unit=1e-9)
    assert CostModel.from_coefficients(0.0, 2.0) == CostModel(linear=0, quadratic=1, unit=2.0)
    lengths = [[4096], [1024] * 4, [512] * 8, [2048, 1024, 512, 512], [100] * 40]
    tokens = [sum(row) for row in lengths]
    squared = [sum(n * n for n in row) for row in lengths]
    seconds = [0.002 + 1e-5 * n + 5e-9 * q for n, q in zip(tokens, squared, strict=True)]
    fitted = CostModel.fit(tokens, squared, seconds)
    assert (fitted.linear, fitted.quadratic) == (2000, 1)
    assert math.isclose(fitted.unit, 5e-9, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"linear": 0, "quadratic": 0}, ValueError, "both 0"),
        ({"linear": -1, "quadratic": 1}, ValueError, "linear must be an int >= 0, got -1"),
        ({"linear": 1.5, "quadratic": 1}, TypeError, "linear must be an int"),
        ({"linear": 1, "quadratic": 1, "unit": 0}, ValueError, "unit must be a positive number"),
    ],
)
def test_cost_model_rejects_bad_coefficients(kwargs, error, match):
    with pytest.raises(error, match=match):
        CostModel(**kwargs)


def test_from_model_rejects_bad_dimensions():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=8"):
        CostModel.from_model(hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=3, ffn_hidden_size=64)
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1, got 0"):
        CostModel.from_model(hidden_size=0, num_layers=1, num_heads=8, ffn_hidden_size=64)
    with pytest.raises(ValueError, match="at least 3 measurements"):
        CostModel.fit([1, 2], [1, 4], [0.1, 0.2])


# --- plan_balance: hand-worked plans ------------------------------------------------------------


def test_longest_first_then_swap_reaches_the_perfect_split():
    """Costs 3, 3, 2, 2, 2 on two ranks: longest-first gives 3+2+2 against 3+2 (7/5); swapping a 3 for
    a 2 gives the perfect 6/6."""
    options = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=100, micro_batches=1)
    plan = plan_balance([3, 3, 2, 2, 2], options, ranks=2)
    assert plan.costs.tolist() == [[6, 6]] and plan.imbalance().tolist() == [1.0]
    assert sorted(map(sorted, plan.cells[0])) == [[0, 1], [2, 3, 4]]
    seed_only = BalanceOptions(
        cost=CostModel(linear=1, quadratic=0), max_tokens=100, micro_batches=1, swap_rounds=0
    )
    assert plan_balance([3, 3, 2, 2, 2], seed_only, ranks=2).costs.tolist() == [[7, 5]]


def test_hand_worked_two_slot_plan():
    """Two slots of two ranks, budget 10 tokens, cost L**2. Tiers of two in cost order snake over the
    slots: (9, 8) -> slot 0, (6, 5) -> 1, (3, 3) -> 1, (1, 1) -> 0. Slot 0: 81 | 64 + 1 + 1; slot 1:
    36 | 25 + 9, then the second 3 fits only beside the 6 (45 | 34); no swap keeps both within 10."""
    options = BalanceOptions(cost=SQUARES, max_tokens=10, micro_batches=2)
    plan = plan_balance([9, 8, 6, 5, 3, 3, 1, 1], options, ranks=2)
    assert plan.cells == (((0,), (1, 6, 7)), ((2, 5), (3, 4)))
    assert plan.costs.tolist() == [[81, 66], [45, 34]]
    assert plan.held == () and plan.extra_slots == 0
    assert plan.for_rank(1) == ((1, 6, 7), (3, 4))
    assert plan.lower_bound().tolist() == [81 / 73.5, 1.0]  # 9**2 alone is above slot 0's mean
    assert plan.imbalance().tolist() == [81 / 73.5, 45 / 39.5]
    assert plan.tokens.tolist() == [[9, 10], [9, 8]] and plan.padding_fraction() == 0.0
    text = plan.summary()
    assert "2 slots x 2 ranks (padding-free), 8 documents (0 held), 36 tokens, padding 0.00%" in text
    assert "| 0 | 4 | 1.0526 | 1.0526 | 1.1020 | 1.1020 |" in text


def test_documents_that_do_not_fit_wait_and_come_first_next_window():
    options = BalanceOptions(cost=SQUARES, max_tokens=6, micro_batches=1)
    schedule = BalanceSchedule(options, ranks=2)
    first = schedule.plan([10, 11, 12, 13], [5, 4, 3, 2])  # 14 tokens, 12 of room
    assert first.cells == (((10,), (11, 13)),) and first.held == (12,)
    assert schedule.waiting == (12,) and schedule.room() == 9
    second = schedule.plan([14], [5], final=True)
    assert second.cells == (((14,), (12,)),) and schedule.waiting == ()


def test_a_document_that_waited_is_never_held_again():
    """The waiting document (length 5, waited 1) displaces the new one that leaves its cell fullest."""
    options = BalanceOptions(cost=SQUARES, max_tokens=6, micro_batches=1)
    plan = plan_balance([6, 6, 5, 5], options, ranks=2, waited=[0, 0, 1, 0])
    assert 2 not in plan.held and len(plan.held) == 2 and plan.extra_slots == 0
    crowded = plan_balance([6, 6, 6, 5], options, ranks=2, waited=[1, 1, 1, 0])  # three must be placed
    assert crowded.extra_slots == 1 and crowded.num_slots == 2 and crowded.held == ()


def test_fixed_rows_plan_packs_rows_and_next_fit_rebuilds_them():
    cost = CostModel(linear=1, quadratic=1)
    options = BalanceOptions(cost=cost, rows=2, seq_len=8, micro_batches=1)
    plan = plan_balance([8, 6, 5, 3, 2, 2, 1], options, ranks=2)
    assert plan.rows == ((((0,), (5, 6)), ((1, 4), (2, 3))),)
    assert plan.cells == (((0, 5, 6), (1, 4, 2, 3)),)
    assert plan.costs.tolist() == [[72 + 6 + 2 + 30, 42 + 6 + 30 + 12]]  # the padding of 5 costs 30
    assert plan.computed.tolist() == [[16, 16]] and plan.padding_fraction() == 5 / 32
    assert plan.memory_spread().tolist() == [1.0]


def test_outliers_wait_for_a_whole_tier():
    """Three documents each costing more than a micro-batch's mean share, two ranks: the cheapest
    outlier waits (hold_back=2) so the other two share a slot; after waiting twice it is placed."""
    options = BalanceOptions(cost=SQUARES, max_tokens=16, micro_batches=2, hold_back=2)
    lengths = [12, 11, 10, 2, 2, 2, 2, 2, 2, 1, 1]
    plan = plan_balance(lengths, options, ranks=2)
    assert plan.held == (2,)
    assert plan_balance(lengths, options, ranks=2, waited=[0, 0, 2] + [0] * 8).held == (1,)  # 2 may not wait
    assert (
        plan_balance(lengths, BalanceOptions(cost=SQUARES, max_tokens=16, micro_batches=2), ranks=2).held
        == ()
    )


def test_groups_stay_in_one_micro_batch():
    options = BalanceOptions(cost=SQUARES, max_tokens=10, micro_batches=1)
    plan = plan_balance([3, 3, 3, 3, 4, 4], options, ranks=2, groups=[7, 7, 7, 5, 5, 9])
    # units: group 7 (9 tokens, cost 27), group 5 (7 tokens, 25), group 9 (4 tokens, 16): the last fits nowhere
    assert plan.cells == (((0, 1, 2), (3, 4)),) and plan.held == (5,)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: plan_balance([3, 0], BalanceOptions(cost=SQUARES, max_tokens=4), ranks=1),
            ValueError,
            "lengths\\[1\\] is 0",
        ),
        (
            lambda: plan_balance([5], BalanceOptions(cost=SQUARES, max_tokens=4), ranks=1),
            ValueError,
            "document 0 has 5 tokens, more than max_tokens=4",
        ),
        (
            lambda: plan_balance([2, 2], BalanceOptions(cost=SQUARES, max_tokens=3), ranks=1, groups=[1, 1]),
            ValueError,
            "the group of document 0 has 4 tokens",
        ),
        (
            lambda: plan_balance([9], BalanceOptions(cost=SQUARES, rows=2, seq_len=8), ranks=1),
            ValueError,
            "more than seq_len=8.*overflow='split'",
        ),
        (
            lambda: plan_balance([1.5], BalanceOptions(cost=SQUARES, max_tokens=4), ranks=1),
            TypeError,
            "lengths must be a 1-D sequence of ints",
        ),
        (
            lambda: plan_balance([1], BalanceOptions(cost=SQUARES, max_tokens=4), ranks=0),
            ValueError,
            "ranks must be an int >= 1",
        ),
        (lambda: BalanceOptions(cost=SQUARES), ValueError, "exactly one budget"),
        (
            lambda: BalanceOptions(cost=SQUARES, max_tokens=4, rows=2, seq_len=2),
            ValueError,
            "exactly one budget",
        ),
        (lambda: BalanceOptions(cost=SQUARES, rows=2), ValueError, "rows and seq_len together"),
        (lambda: BalanceOptions(cost="flops", max_tokens=4), TypeError, "cost must be a CostModel, got str"),
        (lambda: BalanceSchedule(BalanceOptions(cost=SQUARES, max_tokens=4), 2), ValueError, "micro_batches"),
        (  # -1 would read as "no group" and split the group across ranks
            lambda: BalanceSchedule(ONE_SLOT, 2).plan([0, 1], [2, 2], [-1, -1]),
            ValueError,
            r"groups\[0\] is -1, not an int >= 0 \(a document of no group: pass groups=None\)",
        ),
        (  # a key indexes the cost arrays: -1 would take the last document's cost
            lambda: BalanceSchedule(ONE_SLOT, 2, extra_costs=np.array([0, 0, 9])).plan([-1, 0], [1, 1]),
            ValueError,
            r"keys\[0\] is -1, not a key of the cost arrays \(0 to 2\)",
        ),
        (
            lambda: BalanceSchedule(ONE_SLOT, 2, costs=np.array([1, 1])).plan([0, 5], [1, 1]),
            ValueError,
            r"keys\[1\] is 5, not a key of the cost arrays \(0 to 1\)",
        ),
        (lambda: BalanceSchedule(ONE_SLOT, 2).plan([0, 1.5], [1, 1]), TypeError, r"keys\[1\] must be an int"),
    ],
)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- plan_balance: properties against references ------------------------------------------------


@st.composite
def windows(draw):
    fixed = draw(st.booleans())
    ranks = draw(st.integers(1, 4))
    budget = draw(st.integers(4, 24))
    lengths = draw(st.lists(st.integers(1, budget), min_size=1, max_size=40))
    grouped = draw(st.booleans()) and not fixed
    groups = None
    if grouped:  # groups of small documents, within the budget
        lengths = [max(1, n // 4) for n in lengths]
        drawn = draw(st.lists(st.integers(0, 6), min_size=len(lengths), max_size=len(lengths)))
        groups, sums = [], {}
        for i, (length, key) in enumerate(zip(lengths, drawn, strict=True)):
            key = key if sums.get(key, 0) + length <= budget else 100 + i  # a group fits the budget
            sums[key] = sums.get(key, 0) + length
            groups.append(key)
    budget_kwargs = {"rows": draw(st.integers(1, 3)), "seq_len": budget} if fixed else {"max_tokens": budget}
    options = BalanceOptions(
        cost=draw(st.sampled_from([SQUARES, MIXED, CostModel(linear=1, quadratic=0)])),
        micro_batches=draw(st.none() | st.integers(1, 3)),
        hold_back=draw(st.integers(0, 2)),
        **budget_kwargs,
    )
    waited = draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    return options, ranks, lengths, groups, waited, draw(st.booleans())


def reference_cost(options, lengths, cell_rows):
    """Cost of a micro-batch by the definition: each document's, plus each row's padding segment."""
    cost = options.cost
    if options.fixed_rows:
        documents = [doc for row in cell_rows for doc in row]
        padding = [options.seq_len - sum(lengths[doc] for doc in row) for row in cell_rows]
        return sum(cost.cost(lengths[doc]) for doc in documents) + sum(cost.cost(pad) for pad in padding)
    return sum(cost.cost(lengths[doc]) for doc in cell_rows)


def next_fit(order, lengths, seq_len, groups=None):
    """pack_flat(strategy="greedy", group_key=...): each run of one group's documents kept in one row."""
    units = []
    for doc in order:
        if units and groups is not None and groups[units[-1][-1]] == groups[doc]:
            units[-1].append(doc)
        else:
            units.append([doc])
    rows, used = [], seq_len
    for unit in units:
        size = sum(lengths[doc] for doc in unit)
        if used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].extend(unit)
        used += size
    return [tuple(row) for row in rows]


@settings(max_examples=150, deadline=None)
@given(windows())
def test_plan_properties(case):
    options, ranks, lengths, groups, waited, final = case
    plan = plan_balance(lengths, options, ranks=ranks, groups=groups, waited=waited, final=final)
    placed = [doc for slot in plan.cells for cell in slot for doc in cell]
    # every document exactly once: placed or held
    assert sorted(placed + list(plan.held)) == list(range(len(lengths)))
    assert len(set(placed)) == len(placed)
    # every rank gets the same number of micro-batches: one cell per rank in every slot
    assert all(len(slot) == ranks for slot in plan.cells) and plan.costs.shape == (plan.num_slots, ranks)
    flexible = options.micro_batches is not None and not final
    if flexible:
        assert plan.num_slots == options.micro_batches + plan.extra_slots
    else:
        assert plan.held == () and plan.extra_slots == 0
    # a document that has waited max(hold_back, 1) windows is never held
    must = max(options.hold_back, 1)
    assert not [doc for doc in plan.held if waited[doc] >= must]
    # budgets, and the reported numbers against the definitions
    for s, slot in enumerate(plan.cells):
        for r, cell in enumerate(slot):
            tokens = sum(lengths[doc] for doc in cell)
            assert plan.tokens[s, r] == tokens
            if options.fixed_rows:
                rows = plan.rows[s][r]
                assert len(rows) <= options.rows and [doc for row in rows for doc in row] == list(cell)
                assert all(sum(lengths[doc] for doc in row) <= options.seq_len for row in rows)
                assert next_fit(cell, lengths, options.seq_len, groups) == list(rows)  # pack_flat greedy
                assert plan.computed[s, r] == len(rows) * options.seq_len
                assert plan.costs[s, r] == reference_cost(options, lengths, rows)
            else:
                assert tokens <= options.max_tokens and plan.computed[s, r] == tokens
                assert plan.costs[s, r] == reference_cost(options, lengths, cell)
    # groups whole: one cell (or all waiting)
    if groups is not None:
        where = {}
        for s, slot in enumerate(plan.cells):
            for r, cell in enumerate(slot):
                for doc in cell:
                    where.setdefault(groups[doc], set()).add((s, r))
        for doc in plan.held:
            where.setdefault(groups[doc], set()).add("held")
        assert all(len(places) == 1 for places in where.values()), where
    # the lower bound is one, and deterministic
    assert np.all(plan.imbalance() >= plan.lower_bound() - 1e-12)
    again = plan_balance(list(lengths), options, ranks=ranks, groups=groups, waited=waited, final=final)
    assert again.digest() == plan.digest() and np.array_equal(again.costs, plan.costs)


def best_split(costs, ranks):
    """The least possible maximum over ``ranks`` parts, by brute force."""
    best = math.inf
    for assignment in itertools.product(range(ranks), repeat=len(costs)):
        loads = [0] * ranks
        for cost, part in zip(costs, assignment, strict=True):
            loads[part] += cost
        best = min(best, max(loads))
    return best


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 3), st.lists(st.integers(1, 30), min_size=2, max_size=7))
def test_unconstrained_slot_is_within_the_longest_first_bound_of_the_optimum(ranks, lengths):
    """One slot, no binding budget: the plan's max is at most (4/3 - 1/(3 ranks)) x the optimum (Graham's
    bound for longest-first; the swaps only lower the max)."""
    options = BalanceOptions(cost=MIXED, max_tokens=sum(lengths), micro_batches=1)
    plan = plan_balance(lengths, options, ranks=ranks)
    optimum = best_split([MIXED.cost(n) for n in lengths], ranks)
    assert plan.costs.max() <= (4 / 3 - 1 / (3 * ranks)) * optimum + 1e-9


# --- the sampler ---------------------------------------------------------------------------------

LENGTHS = np.random.default_rng(3).integers(1, 40, 300).tolist()
SAMPLER_OPTIONS = BalanceOptions(cost=MIXED, max_tokens=64, micro_batches=3)


def sampler(rank=0, **kwargs):
    return BalancedBatchSampler(
        LENGTHS, kwargs.pop("options", SAMPLER_OPTIONS), num_replicas=3, rank=rank, seed=11, **kwargs
    )


def test_sampler_covers_the_epoch_once_with_equal_counts_per_rank():
    per_rank = [list(sampler(rank)) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    plans = list(sampler().plans())
    dropped = sum(len(plan.dropped) for plan in plans)
    assert len(seen) == len(set(seen)) == len(LENGTHS) - dropped
    assert all(sum(LENGTHS[i] for i in batch) <= 64 for batches in per_rank for batch in batches)
    # micro-batch k on every rank belongs to the same plan slot
    flat = [slot for plan in plans for slot in plan.cells]
    for rank in range(3):
        assert [list(slot[rank]) for slot in flat] == per_rank[rank]
    assert all(plan.num_slots == 3 for plan in plans[:-1])
    assert np.mean([plan.imbalance().mean() for plan in plans[:-1]]) < 1.05


def test_sampler_epochs_differ_and_every_rank_agrees():
    first, other = sampler(), sampler(rank=2)
    epoch0 = [plan.digest() for plan in first.plans()]
    assert epoch0 == [plan.digest() for plan in other.plans()]
    first.set_epoch(1)
    assert [plan.digest() for plan in first.plans()] != epoch0
    assert not np.array_equal(first.order(0), first.order(1))
    ordered = sampler(shuffle=False)
    assert ordered.order(5).tolist() == list(range(len(LENGTHS)))


def test_sampler_groups_stay_together():
    groups = [i // 4 for i in range(len(LENGTHS))]
    options = BalanceOptions(cost=MIXED, max_tokens=200, micro_batches=2)
    lengths = [max(1, n // 2) for n in LENGTHS]
    batches = list(BalancedBatchSampler(lengths, options, num_replicas=2, rank=0, groups=groups, seed=1))
    batches += list(BalancedBatchSampler(lengths, options, num_replicas=2, rank=1, groups=groups, seed=1))
    owner = {}
    for k, batch in enumerate(batches):
        for i in batch:
            owner.setdefault(groups[i], set()).add(k)
    assert all(len(micro_batches) == 1 for micro_batches in owner.values())


@pytest.mark.parametrize(
    "options", [SAMPLER_OPTIONS, BalanceOptions(cost=MIXED, rows=2, seq_len=40, micro_batches=2, hold_back=2)]
)
def test_sampler_resumes_exactly_at_every_micro_batch(options):
    expected = list(sampler(1, options=options))
    for stop in range(len(expected) + 1):
        first = sampler(1, options=options)
        batches = iter(first)
        seen = [next(batches) for _ in range(stop)]
        state = saved(first.state_dict())
        resumed = sampler(1, options=options)
        resumed.load_state_dict(state)
        assert seen + list(resumed) == expected, f"resumed after {stop} micro-batches"
    assert list(resumed) == expected  # the next iter() starts the epoch over


def test_sampler_refuses_a_state_from_other_settings():
    state = sampler().state_dict()
    with pytest.raises(ValueError, match="another seed"):
        BalancedBatchSampler(LENGTHS, SAMPLER_OPTIONS, num_replicas=3, rank=0, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="another data"):
        BalancedBatchSampler(LENGTHS[:-1], SAMPLER_OPTIONS, num_replicas=3, rank=0, seed=11).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match="another num_replicas"):
        BalancedBatchSampler(LENGTHS, SAMPLER_OPTIONS, num_replicas=2, rank=0, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="version-1"):
        sampler().load_state_dict({"version": 0})
    with pytest.raises(ValueError, match="micro_batches"):
        BalancedBatchSampler(LENGTHS, BalanceOptions(cost=MIXED, max_tokens=64), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="rank must be an int <= 2"):
        BalancedBatchSampler(LENGTHS, SAMPLER_OPTIONS, num_replicas=3, rank=3)


no_vital_warning = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Documents(torch.utils.data.Dataset):
    """Document i: its index, repeated LENGTHS[i] times."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, index: int) -> list[int]:
        return [index] * LENGTHS[index]


def firsts(batch):
    return [document[0] for document in batch]


@no_vital_warning
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_the_sampler(num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", exc_type=ImportError)

    def loader():
        return stateful.StatefulDataLoader(
            Documents(), batch_sampler=sampler(2), collate_fn=firsts, num_workers=num_workers
        )

    expected = list(loader())
    assert expected == list(sampler(2))
    for stop in (0, 3, len(expected) - 1):
        first = loader()
        batches = iter(first)
        seen = [next(batches) for _ in range(stop)]
        state = saved(first.state_dict())
        del batches
        resumed = loader()
        resumed.load_state_dict(state)
        assert seen + list(resumed) == expected, f"resumed after {stop} micro-batches"

    # A checkpoint at the epoch's end, resumed into the next epoch: torchdata loads the sampler's state
    # inside iter(), after the loop's set_epoch(1); the next epoch is drawn, not the finished one again.
    def epoch_one(run):
        run.batch_sampler.set_epoch(1)
        return list(run)

    uninterrupted = loader()
    list(uninterrupted)
    want = epoch_one(uninterrupted)
    assert want != expected
    first = loader()
    list(first)
    resumed = loader()
    resumed.load_state_dict(saved(first.state_dict()))
    assert epoch_one(resumed) == want


def test_a_state_saved_at_the_epochs_end_gives_way_to_the_next_epoch():
    """Loaded before or after set_epoch(1): epoch 1 whole. Without set_epoch: the finished epoch's rest
    (nothing), then the epoch over, as an uninterrupted sampler."""
    finished = sampler(1)
    assert list(finished)
    state = saved(finished.state_dict())
    following = sampler(1)
    following.set_epoch(1)
    want = list(following)
    for load_first in (True, False):
        resumed = sampler(1)
        if load_first:
            resumed.load_state_dict(state)
            resumed.set_epoch(1)
        else:
            resumed.set_epoch(1)
            resumed.load_state_dict(state)
        assert list(resumed) == want, load_first
    same = sampler(1)
    same.load_state_dict(state)
    assert list(same) == [] and list(same) == list(sampler(1))


def test_plan_is_a_plan():
    plan = next(sampler().plans())
    assert isinstance(plan, BalancePlan) and str(plan) == plan.summary()
    shifted = plan.with_keys(range(100, 100 + len(LENGTHS)))
    assert shifted.held == tuple(100 + i for i in plan.held) and shifted.digest() != plan.digest()
    assert shifted.cells[0][0] == tuple(100 + i for i in plan.cells[0][0])


# --- PackedStream(balance=...) -------------------------------------------------------------------

from zephon_collate import SampleMeta, SampleRecord  # noqa: E402
from zephon_collate.packing.stream import PackedStream  # noqa: E402

STREAM_FREE = BalanceOptions(cost=MIXED, micro_batches=2, max_tokens=48)
STREAM_ROWS = BalanceOptions(cost=MIXED, micro_batches=2, rows=2, seq_len=24)


def stream_documents(count=70, seed=0):
    rng = np.random.default_rng(seed)
    return [
        SampleRecord(
            SampleMeta((0, 0, i), 0, i // 10, i % 10),
            {"input_ids": rng.integers(3, 50, int(rng.integers(1, 30)))},
        )
        for i in range(count)
    ]


def balanced_stream(options, rank=0, records=None):
    seq_len = options.seq_len if options.fixed_rows else 20
    return PackedStream(
        records or stream_documents(),
        seq_len,
        pad_token_id=0,
        rank=rank,
        world_size=2,
        balance=options,
        overflow="split",
    )


def step_summary(steps):
    return [
        [[row.payload["input_ids"].tolist() for row in micro_batch] for micro_batch in step] for step in steps
    ]


@pytest.mark.parametrize("options", [STREAM_FREE, STREAM_ROWS], ids=["padding-free", "fixed-rows"])
def test_balanced_stream_gives_each_rank_its_share_of_every_step(options):
    per_rank = [list(balanced_stream(options, rank)) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) >= 3
    closed = []
    for steps in per_rank:
        for step, other in zip(steps, per_rank[1], strict=True):
            assert len(step) == len(other)  # the same micro-batches per step on every rank
            for micro_batch in step:
                assert micro_batch
                if options.fixed_rows:
                    assert len(micro_batch) <= options.rows
                    assert all(row.payload["input_ids"].size == options.seq_len for row in micro_batch)
                else:
                    (row,) = micro_batch
                    assert (
                        row.payload["input_ids"].size <= options.max_tokens and row.meta.padding_length == 0
                    )
                closed += [
                    ref.cursor.sample_id
                    for row in micro_batch
                    for ref in row.meta.contributors
                    if ref.is_last_child
                ]
    documents = stream_documents()
    assert sorted(closed) == sorted(record.meta.sample_id for record in documents)  # each document once


@pytest.mark.parametrize("options", [STREAM_FREE, STREAM_ROWS], ids=["padding-free", "fixed-rows"])
def test_balanced_stream_resumes_at_every_step(options):
    expected = step_summary(balanced_stream(options, 1))
    for stop in range(len(expected) + 1):
        stream = balanced_stream(options, 1)
        steps = iter(stream)
        seen = step_summary(next(steps) for _ in range(stop))
        resumed = balanced_stream(options, 1)
        resumed.load_state_dict(saved(stream.state_dict()))
        assert seen + step_summary(resumed) == expected, f"resumed after {stop} steps"


@no_vital_warning
@pytest.mark.parametrize("num_workers", [0, 2])
def test_balanced_stream_with_stateful_dataloader(num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", exc_type=ImportError)
    records = stream_documents(120)

    def loader():
        stream = balanced_stream(STREAM_ROWS, 0, records)
        return stateful.StatefulDataLoader(
            stream, batch_size=None, collate_fn=step_summary_one, num_workers=num_workers
        )

    expected = list(loader())
    assert expected == step_summary(balanced_stream(STREAM_ROWS, 0, records))  # workers keep the step order
    for stop in (1, 4):
        first = loader()
        steps = iter(first)
        seen = [next(steps) for _ in range(stop)]
        state = saved(first.state_dict())
        del steps
        resumed = loader()
        resumed.load_state_dict(state)
        assert seen + list(resumed) == expected, f"resumed after {stop} steps"


def step_summary_one(step):
    return step_summary([step])[0]


def test_balanced_stream_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="strategy do not apply with balance="):
        PackedStream([], 24, pad_token_id=0, balance=STREAM_ROWS, strategy="best_fit")
    with pytest.raises(ValueError, match="rows of seq_len=24, the stream seq_len=16"):
        PackedStream([], 16, pad_token_id=0, balance=STREAM_ROWS)
    with pytest.raises(ValueError, match="exceeds the micro-batch budget max_tokens=48"):
        PackedStream([], 64, pad_token_id=0, balance=STREAM_FREE)
    with pytest.raises(TypeError, match=r"balance must be zephon_collate\.BalanceOptions, got dict"):
        PackedStream([], 24, pad_token_id=0, balance={"rows": 2})
    packed = PackedStream(stream_documents(), 24, pad_token_id=0)
    next(iter(packed))
    with pytest.raises(ValueError, match="saved by a packed stream; resume with the same balance= option"):
        balanced_stream(STREAM_ROWS).load_state_dict(packed.state_dict())
    other_world = balanced_stream(STREAM_ROWS)
    next(iter(other_world))
    state = other_world.state_dict()
    single = PackedStream(
        stream_documents(), 24, pad_token_id=0, rank=0, world_size=1, balance=STREAM_ROWS, overflow="split"
    )
    single.load_state_dict(state)
    with pytest.raises(ValueError, match="saved for 2 ranks, this run has 1"):
        next(iter(single))


# --- two ranks under torchrun --------------------------------------------------------------------


def test_ddp_over_the_balanced_sampler_equals_one_process(tmp_path):
    """torchrun, 2 ranks (gloo): gradient accumulation over balanced micro-batches of varying documents
    equals one process's exact per-token mean gradient; plans are bit-identical across ranks and every
    rank reaches the same collectives (EvenBatches dropped nothing)."""
    import json

    from test_distributed import ROOT, torchrun

    report_path = tmp_path / "balance.json"
    result = torchrun(ROOT / "tests" / "dist_balance_check.py", "--report", str(report_path))
    assert "rank 0: OK" in result.stdout and "rank 1: OK" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2 and report["steps"] >= 3
    assert max(report["grad_errors"]) < 1e-10
    assert min(report["naive_errors"]) > 1e-4  # a mean per micro-batch is measurably wrong here
    assert any(len(set(counts)) > 1 for counts in report["documents"])  # documents per micro-batch vary
    assert report["counts"][0]["dropped"] == 0


def test_balanced_example_runs_under_torchrun():
    from test_distributed import ROOT, torchrun

    result = torchrun(ROOT / "examples" / "balanced_train.py", "--steps", "4")
    assert "plans identical on every rank" in result.stdout and "step 3: loss" in result.stdout
    assert "rank 0: resumed data stream matches" in result.stdout
    assert "rank 1: resumed data stream matches" in result.stdout


def test_documents_of_zero_cost_are_spread_over_the_ranks():
    """Costs of 0 are allowed: ties in cost go to the cell of fewer items, so no rank is left empty."""
    free = CostModel(linear=1, quadratic=0)
    options = BalanceOptions(cost=free, micro_batches=1, max_tokens=10)
    assert plan_balance([1, 1, 1, 1], options, ranks=2, costs=[0, 0, 0, 0]).cells == (((0, 2), (1, 3)),)
    ranks = [
        list(BalancedBatchSampler([1] * 4, options, num_replicas=2, rank=r, costs=[0] * 4, shuffle=False))
        for r in range(2)
    ]
    assert ranks == [[[0, 2]], [[1, 3]]]  # every document once, none dropped
    rows = BalanceOptions(cost=free, micro_batches=1, rows=2, seq_len=4)
    assert plan_balance([4, 4], rows, ranks=2, costs=[0, 0], final=True).cells == (((0,), (1,)),)
    mixed = BalanceOptions(cost=free, micro_batches=2, max_tokens=10)
    plan = plan_balance([5, 5, 1, 1], mixed, ranks=2, costs=[9, 9, 0, 0], final=True)
    assert sorted(i for slot in plan.cells for cell in slot for i in cell) == [0, 1, 2, 3]
    assert all(cell for slot in plan.cells for cell in slot) and not plan.dropped


def test_a_pass_that_hands_out_nothing_keeps_the_state_it_resumed():
    """Resumed at an epoch's end, the pass is empty, and its state is still that end (it was the start)."""
    lengths = [8, 1, 6, 2, 5, 3, 4, 4, 7, 1]
    options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=8, micro_batches=2)

    def make():
        return BalancedBatchSampler(lengths, options, num_replicas=2, rank=0, seed=0)

    first = make()
    assert list(first)
    end = first.state_dict()
    resumed = make()
    resumed.load_state_dict(end)
    assert list(resumed) == []
    assert resumed.state_dict() == end
    again = make()
    again.load_state_dict(resumed.state_dict())
    assert list(again) == []


def test_a_balanced_stream_state_is_refused_under_other_options():
    """Other balance or packing options plan other steps: the resume is refused, naming what differs."""
    stream = balanced_stream(STREAM_FREE)
    steps = iter(stream)
    next(steps)
    state = stream.state_dict()
    more = BalanceOptions(cost=MIXED, micro_batches=3, max_tokens=48)
    for other, named in ((balanced_stream(more), "balance"), (balanced_stream(STREAM_ROWS), "balance")):
        with pytest.raises(ValueError, match=rf"saved with other options \({named}: saved"):
            other.load_state_dict(state)
    wider = PackedStream(
        stream_documents(), 21, pad_token_id=0, rank=0, world_size=2, balance=STREAM_FREE, overflow="split"
    )
    with pytest.raises(ValueError, match=r"saved with other options \(seq_len: saved 20, here 21\)"):
        wider.load_state_dict(state)
    same = balanced_stream(STREAM_FREE)
    same.load_state_dict(state)
    assert step_summary(same) == step_summary(steps)


def test_a_schedule_takes_keys_as_ints_numpy_ints_or_0_d_tensors():
    plans = [
        BalanceSchedule(ONE_SLOT, ranks=2).plan(keys, [2, 3], final=True).cells
        for keys in ([4, 5], np.array([4, 5], np.uint64), torch.tensor([4, 5]))
    ]
    assert plans[0] == plans[1] == plans[2] == (((5,), (4,)),)  # the longer first


def test_a_schedule_keeps_group_0_together_as_plan_balance_does():
    # Four documents of group 0 fill one 8-token micro-batch; the others share the other rank's.
    lengths, groups = [2, 2, 2, 2, 3, 3], [0, 0, 0, 0, 100, 101]
    plan = BalanceSchedule(ONE_SLOT, ranks=2).plan([10, 11, 12, 13, 14, 15], lengths, groups)
    assert plan.cells == (((10, 11, 12, 13), (14, 15)),)
    assert plan_balance(lengths, ONE_SLOT, ranks=2, groups=groups).cells == (((0, 1, 2, 3), (4, 5)),)
