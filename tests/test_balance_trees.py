"""Trees in the rank balance: ``CostModel.tree_costs`` and ``costs=`` in ``plan_balance``,
``BalanceSchedule`` and ``BalancedBatchSampler``.

A tree's cost counts the keys each token sees (``p + 1`` at position ``p``): hand-worked values; a
plain document costs what ``costs`` says; a tree costs between its longest path and its tokens as one
document; on ``Collator.for_trees`` batches of GRPO-like groups the cost is ``2 * pairs - T`` of
``dense_tree_mask``'s (query, key) pairs. The planner balances by the given costs (a hand-worked
plan that differs from the length costs' one, hypothesis properties on every micro-batch's cost),
the sampler plans by them, resumes with them and refuses a state saved with other costs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import grouped
from test_balance import next_fit, saved

from zephon_collate import Collator
from zephon_collate.functional.trees import dense_tree_mask
from zephon_collate.parallel.balance import BalanceOptions, plan_balance
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.parallel.schedule import BalanceSchedule

SQUARES = CostModel(linear=0, quadratic=1)
MIXED = CostModel(linear=3, quadratic=1)
MODELS = st.builds(CostModel, linear=st.integers(0, 1000), quadratic=st.integers(1, 50))


def grpo_tree(prompt: int, completions: list[int]) -> list[int]:
    """The positions of one prompt and its completions laid out as a tree: the prompt once, then each
    completion continuing from it."""
    return list(range(prompt)) + [prompt + i for length in completions for i in range(length)]


# --- CostModel.tree_costs: hand-worked ----------------------------------------------------------


def test_tree_costs_hand_worked():
    # keys per token: a chain of 4 sees 1+2+3+4 = 10, so 2*10 - 4 = 16 = 4**2; the fork 1+2+3+3 = 9: 14
    assert MIXED.tree_costs([[0, 1, 2, 3], [0, 1, 2, 2]]).tolist() == [12 + 16, 12 + 14]
    # a 3-token prompt, completions of 2, 3 and 2 tokens: 10 tokens, positions summing to 29, 39 keys
    tree = grpo_tree(3, [2, 3, 2])
    assert tree == [0, 1, 2, 3, 4, 3, 4, 5, 3, 4]
    assert MIXED.tree_costs([tree]).tolist() == [3 * 10 + (2 * 39 - 10)]
    assert SQUARES.tree_costs([tree]).tolist() == [68]  # not 10**2 = 100: the completions share a prompt
    # a single token; an empty tree; a chain of 2 and a padding token (itself: one key) add up
    assert MIXED.tree_costs([[0], [], [0, 1, 0]]).tolist() == [4, 0, MIXED.cost(2) + MIXED.cost(1)]
    # the order of a tree's tokens does not matter, nor the array type
    assert MIXED.tree_costs(
        [np.array([2, 0, 1, 2], np.uint8), torch.tensor([0, 1, 2, 2], dtype=torch.int32), (0, 1, 2, 2)]
    ).tolist() == [26, 26, 26]
    assert MIXED.tree_costs([]).dtype == np.int64 and MIXED.tree_costs([]).size == 0
    # a generator of trees; a 2-D array is a sequence of its rows (each a tree)
    assert MIXED.tree_costs(iter([[0, 1]])).tolist() == [10]
    assert MIXED.tree_costs(np.array([[0, 1, 1], [0, 1, 2]])).tolist() == [9 + 7, MIXED.cost(3)]


def test_tree_costs_exact_near_the_limit():
    big = CostModel(linear=0, quadratic=2**60)
    assert big.tree_costs([[0, 1]]).tolist() == [2**62]  # 2**60 * (2*1 + 2), exactly the limit
    with pytest.raises(ValueError, match=r"tree 1 \(2 tokens\) costs more than 2\*\*62"):
        CostModel(linear=1, quadratic=2**60).tree_costs([[0], [0, 1]])


@pytest.mark.parametrize(
    ("positions", "error", "match"),
    [
        ("0123", TypeError, "positions must be a sequence with one 1-D array of positions per tree"),
        ({"a": [0]}, TypeError, "positions must be a sequence"),
        (3, TypeError, "positions must be a sequence"),
        ([[0, 1], [0.0, 1.0]], TypeError, r"positions\[1\] must hold ints, got dtype float64"),
        ([[True, False]], TypeError, r"positions\[0\] must hold ints, got dtype bool"),
        ([0, 1, 2], ValueError, r"positions\[0\] must be 1-D .*for a single tree pass \[positions\]"),
        ([[[0, 1]]], ValueError, r"positions\[0\] must be 1-D \(one tree's positions\), got shape \[1, 2\]"),
        ([[0], [0, -1]], ValueError, r"positions\[1\] holds -1; positions must be >= 0"),
        ([[0, 2]], ValueError, r"positions\[0\] has a token at position 2 but none at 1"),
        ([[1, 2]], ValueError, r"none at 0, so it is not one tree's positions"),
        ([[0], [7]], ValueError, r"positions\[1\] has a token at position 7 but none at 0.*not lengths"),
        ([[0, 10**15]], ValueError, r"position 1000000000000000 but none at 1"),
    ],
)
def test_bad_tree_positions_are_named(positions, error, match):
    with pytest.raises(error, match=match):
        MIXED.tree_costs(positions)


# --- CostModel.tree_costs: properties ------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(MODELS, st.lists(st.integers(0, 300), max_size=12))
def test_a_plain_document_costs_what_costs_says(model, lengths):
    assert model.tree_costs([range(n) for n in lengths]).tolist() == model.costs(lengths).tolist()
    assert model.tree_costs([np.arange(n) for n in lengths]).tolist() == [model.cost(n) for n in lengths]


@st.composite
def trees(draw):
    """A random tree, token by token: token 0 is the root, each later one hangs from an earlier one.
    Returns each token's parent (-1 for the root) and its position (its depth)."""
    size = draw(st.integers(1, 60))
    parents, depths = [-1], [0]
    for token in range(1, size):
        parent = draw(st.integers(max(0, token - 8), token - 1))  # mostly deep, sometimes forking
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return parents, depths


@settings(max_examples=150, deadline=None)
@given(MODELS, trees())
def test_a_tree_costs_between_its_longest_path_and_its_tokens_as_one_document(model, tree):
    parents, positions = tree
    size = len(positions)
    cost = int(model.tree_costs([positions])[0])
    assert model.cost(max(positions) + 1) <= cost <= model.cost(size)
    # the keys each token sees, counted by walking up to the root: itself and every ancestor
    pairs = 0
    for token in range(size):
        while token != -1:
            pairs, token = pairs + 1, parents[token]
    assert cost == model.linear * size + model.quadratic * (2 * pairs - size)
    # a chain is the only tree that costs as much as its tokens as one document
    chain = positions == list(range(size))
    assert (cost == model.cost(size)) == chain


# --- tree_costs of Collator.for_trees batches: the dense mask's pairs ---------------------------


def grpo_examples(groups):
    """GRPO-like trajectories: each group one prompt and several completions (tokens from a small
    vocabulary, so completions share prefixes of their own too)."""
    examples = []
    for key, (prompt, completions) in enumerate(groups):
        for completion in completions:
            examples.append(
                {
                    "input_ids": prompt + completion,
                    "completion_mask": [0] * len(prompt) + [1] * len(completion),
                    "group": key,
                }
            )
    return examples


def tree_costs_against_the_mask(batch, model):
    """Each document's tree cost and its cost from the dense mask's (query, key) pairs inside it."""
    mask = dense_tree_mask(batch["subtree_end"])[:, 0]
    documents = batch["document_ids"]
    positions, expected = [], []
    for row in range(documents.shape[0]):
        for document in documents[row].unique().tolist():
            if document < 0:  # padding
                continue
            inside = documents[row] == document
            positions.append(batch["position_ids"][row][inside])
            pairs = int(mask[row][inside][:, inside].sum())
            tokens = int(inside.sum())
            expected.append(model.linear * tokens + model.quadratic * (2 * pairs - tokens))
    return model.tree_costs(positions).tolist(), expected, positions


GROUPS = [
    ([1, 2, 3], [[4, 5], [4, 6, 7], [8], [4, 5, 9]]),  # a prompt and four completions, two sharing 4, 5
    ([10, 11], [[12, 13, 14, 15], [16]]),
    ([20], [[21, 22]]),  # a single completion: a chain
]


@pytest.mark.parametrize(
    "options",
    [
        {"pad_to_multiple_of": 8, "pad_token_id": 0},  # one padding-free row, with padding
        {"padding_free": False, "pad_token_id": 0},  # a padded row per tree
        {"share": "batch"},
        {"copy_openers": True},
    ],
)
def test_tree_costs_of_a_for_trees_batch_count_the_dense_masks_pairs(options):
    batch = Collator.for_trees(**options)(grpo_examples(GROUPS))
    for model in (SQUARES, CostModel(linear=7, quadratic=3), MIXED):
        costs, expected, positions = tree_costs_against_the_mask(batch, model)
        assert costs == expected
    assert len(costs) == len(GROUPS)  # the prompts differ from their first token: a tree each
    tokens = [len(p) for p in positions]
    # the shared prompts make the first two trees cheaper than their tokens as one document each
    assert costs[0] < MIXED.cost(tokens[0]) and costs[1] < MIXED.cost(tokens[1])
    assert costs[2] == MIXED.cost(tokens[2]) == MIXED.cost(3)  # a chain is a plain document


def test_tree_cost_of_the_hand_worked_grpo_group():
    """The first group by hand: the prompt 1 2 3 (positions 0-2); 4 (3), shared by three completions;
    below it 5 (4), shared by two, then 9 (5), and 6 7 (4-5); and 8 (3): 9 tokens, not 3 + 12."""
    batch = Collator.for_trees()(grpo_examples(GROUPS[:1]))
    positions = batch["position_ids"][0].tolist()
    assert sorted(positions) == [0, 1, 2, 3, 3, 4, 4, 5, 5]
    assert int(SQUARES.tree_costs([positions])[0]) == 2 * 27 + 9 == 63  # the 15 tokens apart: 4 completions
    assert sum(SQUARES.costs([5, 6, 4, 6]).tolist()) == 113


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 3), min_size=1, max_size=4),
            st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=5), min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
)
def test_tree_costs_equal_the_dense_masks_pairs_on_random_groups(groups, padding_free):
    batch = Collator.for_trees(padding_free=padding_free, pad_token_id=0, pad_to_multiple_of=4)(
        grpo_examples(groups)
    )
    costs, expected, positions = tree_costs_against_the_mask(batch, MIXED)
    assert costs == expected
    for cost, tree in zip(costs, positions, strict=True):
        assert MIXED.cost(int(tree.max()) + 1) <= cost <= MIXED.cost(len(tree))


# --- plan_balance(costs=...) ---------------------------------------------------------------------


def test_tree_costs_send_documents_to_other_ranks_than_length_costs():
    """Four documents: 8 tokens in a chain, 8 tokens of a GRPO tree (a 2-token prompt, three 2-token
    completions), two chains of 4. By length, 8 + 4 on each rank (72 + 20 each); the tree's 8 tokens
    attend like 40 units, not 64, so both short documents join it: 72 against 48 + 20 + 20."""
    cost = CostModel(linear=1, quadratic=1)
    options = BalanceOptions(cost=cost, max_tokens=16, micro_batches=1)
    positions = [list(range(8)), grpo_tree(2, [2, 2, 2]), list(range(4)), list(range(4))]
    trees = cost.tree_costs(positions)
    assert trees.tolist() == [8 + 64, 8 + 2 * 16 + 8, 4 + 16, 4 + 16]
    lengths = [len(p) for p in positions]
    by_length = plan_balance(lengths, options, ranks=2)
    assert by_length.cells == (((0, 2), (1, 3)),)
    by_tree = plan_balance(lengths, options, ranks=2, costs=trees)
    assert by_tree.cells == (((0,), (1, 2, 3)),)
    assert by_tree.costs.tolist() == [[72, 88]]  # {0, 2} against {1, 3} would be 92 against 68
    assert by_tree.tokens.tolist() == [[8, 16]] and by_tree.largest.tolist() == [72]
    assert by_tree.digest() != by_length.digest()
    # the model's own costs given as costs: the same plan as none
    same = plan_balance(lengths, options, ranks=2, costs=cost.costs(lengths))
    assert same.digest() == by_length.digest() and same.costs.tolist() == by_length.costs.tolist()
    # extra costs still add: an image on document 1 sends a short document back
    extra = plan_balance(lengths, options, ranks=2, costs=trees, extra_costs=[0, 24, 0, 0])
    assert extra.cells == (((0, 2), (1, 3)),) and extra.costs.tolist() == [[92, 92]]


def test_the_same_costs_give_the_same_plan_whatever_their_type():
    rng = np.random.default_rng(3)
    positions = [
        grpo_tree(int(rng.integers(1, 30)), rng.integers(1, 40, rng.integers(1, 8)).tolist())
        for _ in range(60)
    ]
    lengths = [len(p) for p in positions]
    options = BalanceOptions(cost=MIXED, max_tokens=400, micro_batches=2)
    trees = MIXED.tree_costs(positions)
    digests = {
        plan_balance(np.array(lengths), options, ranks=3, costs=given).digest()
        for given in (trees, trees.tolist(), tuple(trees.tolist()), trees.astype(np.uint64))
    }
    assert len(digests) == 1
    assert plan_balance(lengths, options, ranks=3, costs=trees).digest() in digests
    assert plan_balance(lengths, options, ranks=3).digest() not in digests


def test_fixed_rows_price_their_padding_with_the_cost_model():
    """Costs replace the documents' costs; a row's padding stays a segment priced by options.cost."""
    options = BalanceOptions(cost=MIXED, rows=1, seq_len=8, micro_batches=1)
    plan = plan_balance([6, 8], options, ranks=2, costs=[5, 7])
    assert sorted(plan.costs[0].tolist()) == [7, 5 + MIXED.cost(2)]


@st.composite
def windows(draw):
    fixed = draw(st.booleans())
    ranks = draw(st.integers(1, 4))
    budget = draw(st.integers(4, 24))
    lengths = draw(st.lists(st.integers(1, budget), min_size=1, max_size=30))
    groups = None
    if not fixed and draw(st.booleans()):
        lengths, groups = grouped(draw, lengths, budget)
    budget_kwargs = {"rows": draw(st.integers(1, 3)), "seq_len": budget} if fixed else {"max_tokens": budget}
    options = BalanceOptions(
        cost=draw(st.sampled_from([SQUARES, MIXED])),
        micro_batches=draw(st.none() | st.integers(1, 3)),
        hold_back=draw(st.integers(0, 2)),
        **budget_kwargs,
    )
    # each document a random tree of its length: its positions, so its cost is a tree's
    positions = []
    for length in lengths:
        depths = [0]
        for token in range(1, length):
            depths.append(depths[draw(st.integers(0, token - 1))] + 1)
        positions.append(depths)
    extra = draw(st.none() | st.lists(st.integers(0, 200), min_size=len(lengths), max_size=len(lengths)))
    waited = draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    return options, ranks, lengths, positions, groups, waited, extra, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(windows())
def test_plan_costs_are_the_given_costs(case):
    options, ranks, lengths, positions, groups, waited, extra, final = case
    model = options.cost
    trees = model.tree_costs(positions).tolist()
    plus = [0] * len(lengths) if extra is None else extra
    kwargs = {"ranks": ranks, "groups": groups, "waited": waited, "final": final, "extra_costs": extra}
    plan = plan_balance(lengths, options, costs=trees, **kwargs)
    placed = [doc for slot in plan.cells for cell in slot for doc in cell]
    assert sorted(placed + list(plan.held)) == list(range(len(lengths)))
    for slot in range(plan.num_slots):
        for rank in range(ranks):
            cell = plan.cells[slot][rank]
            expected = sum(trees[doc] + plus[doc] for doc in cell)
            if options.fixed_rows:
                rows = plan.rows[slot][rank]
                assert next_fit(cell, lengths, options.seq_len, groups) == list(rows)
                expected += sum(model.cost(options.seq_len - sum(lengths[d] for d in row)) for row in rows)
            else:
                assert sum(lengths[doc] for doc in cell) <= options.max_tokens
            assert int(plan.costs[slot, rank]) == expected
        units = {}
        for cell in plan.cells[slot]:
            for doc in cell:
                key = doc if groups is None else groups[doc]
                units[key] = units.get(key, 0) + trees[doc] + plus[doc]
        assert int(plan.largest[slot]) == max(units.values(), default=0)
    # the same input, the same plan
    assert plan_balance(lengths, options, costs=np.array(trees), **kwargs).digest() == plan.digest()
    # chains given as costs plan as no costs at all
    chains = model.tree_costs([range(n) for n in lengths])
    assert (
        plan_balance(lengths, options, costs=chains, **kwargs).digest()
        == plan_balance(lengths, options, **kwargs).digest()
    )


@pytest.mark.parametrize(
    ("costs", "error", "match"),
    [
        ([1, 2], ValueError, r"costs has 2 entries for 3 documents \(one per document; for trees"),
        ([1, 2, 3, 4], ValueError, "costs has 4 entries for 3 documents"),
        ([1, -1, 2], ValueError, r"plan_balance: costs\[1\] is -1; every entry must be an int from 0"),
        ([1.0, 2.0, 3.0], TypeError, "plan_balance: costs must be a 1-D sequence of ints"),
        ([[1, 2, 3]], TypeError, r"plan_balance: costs must be a 1-D sequence of ints.*2 dims"),
        (np.array([2**63, 0, 0], np.uint64), ValueError, r"plan_balance: costs\[0\] is 9223372036854775808"),
        ([2**62, 1, 0], ValueError, r"total cost exceeds 2\*\*62.*\(and costs\)"),
    ],
)
def test_bad_costs_are_named(costs, error, match):
    options = BalanceOptions(cost=MIXED, max_tokens=8, micro_batches=1)
    with pytest.raises(error, match=match):
        plan_balance([1, 2, 3], options, ranks=2, costs=costs)


def test_too_costly_names_both_costs_and_extra_costs():
    options = BalanceOptions(cost=MIXED, max_tokens=8, micro_batches=1)
    with pytest.raises(ValueError, match=r"\(and costs and extra_costs\)"):
        plan_balance([1, 2], options, ranks=2, costs=[2**61, 2**61], extra_costs=[0, 1])
    # far beyond the cost model's limit by length, fine by the given costs (they replace it)
    huge = BalanceOptions(cost=CostModel(linear=0, quadratic=2**40), max_tokens=2**30, micro_batches=1)
    assert plan_balance([2**29], huge, ranks=1, costs=[5]).costs.tolist() == [[5]]


# --- BalanceSchedule(costs=...) ------------------------------------------------------------------


def test_schedule_takes_each_keys_cost_and_carries_it_with_the_waiting():
    cost = CostModel(linear=1, quadratic=1)
    options = BalanceOptions(cost=cost, max_tokens=16, micro_batches=1)
    positions = {5: list(range(8)), 6: grpo_tree(2, [2, 2, 2]), 7: list(range(4)), 8: list(range(4))}
    costs = np.zeros(11, np.int64)
    costs[list(positions)] = cost.tree_costs(positions.values())
    costs[[3, 4, 9, 10]] = 50, 60, 100, 3
    schedule = BalanceSchedule(options, 2, costs=costs)
    plan = schedule.plan([5, 6, 7, 8], [8, 8, 4, 4])
    assert plan.cells == (((5,), (6, 7, 8)),) and plan.costs.tolist() == [[72, 88]]
    plan = schedule.plan([9, 10, 4], [16, 4, 16])  # 36 tokens for a step of 32: one waits
    assert len(plan.held) == 1 and schedule.waiting == plan.held
    last = schedule.plan([3], [2], final=True)
    assert plan.held[0] in {key for cell in last.cells[0] for key in cell}
    for plans in (plan, last):  # the waiting key keeps its cost
        assert len(plans.cells[0]) == 2 and all(plans.cells[0])
        for rank, cell in enumerate(plans.cells[0]):
            assert int(plans.costs[0, rank]) == sum(int(costs[key]) for key in cell)


# --- BalancedBatchSampler(costs=...) -------------------------------------------------------------

RNG = np.random.default_rng(11)
POSITIONS = [
    grpo_tree(int(RNG.integers(1, 24)), RNG.integers(1, 12, RNG.integers(1, 6)).tolist()) for _ in range(150)
]
LENGTHS = [len(p) for p in POSITIONS]
OPTIONS = BalanceOptions(cost=MIXED, max_tokens=128, micro_batches=3)
TREES = MIXED.tree_costs(POSITIONS)


def sampler(rank=0, costs=TREES, **kwargs):
    return BalancedBatchSampler(LENGTHS, OPTIONS, num_replicas=3, rank=rank, seed=2, costs=costs, **kwargs)


def test_sampler_plans_by_the_given_costs_and_every_rank_alike():
    assert max(LENGTHS) <= 128
    plans = [list(sampler(rank).plans()) for rank in range(3)]
    assert [p.digest() for p in plans[0]] == [p.digest() for p in plans[1]] == [p.digest() for p in plans[2]]
    per_rank = [list(sampler(rank)) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [slot for plan in plans[0] for slot in plan.cells]
    for rank in range(3):
        assert [list(slot[rank]) for slot in flat] == per_rank[rank]
    dropped = sum(len(plan.dropped) for plan in plans[0])
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert len(seen) == len(set(seen)) == len(LENGTHS) - dropped
    for plan in plans[0]:
        for slot, cells in enumerate(plan.cells):
            for rank, cell in enumerate(cells):
                assert int(plan.costs[slot, rank]) == sum(int(TREES[i]) for i in cell)
    # other costs, other plans; the model's own costs, the plans of none
    assert [p.digest() for p in sampler(costs=None).plans()] != [p.digest() for p in plans[0]]
    assert [p.digest() for p in sampler(costs=MIXED.costs(LENGTHS)).plans()] == [
        p.digest() for p in sampler(costs=None).plans()
    ]
    # extra costs still add
    extra = np.arange(len(LENGTHS), dtype=np.int64)
    for plan in sampler(extra_costs=extra).plans():
        for slot, cells in enumerate(plan.cells):
            for rank, cell in enumerate(cells):
                assert int(plan.costs[slot, rank]) == sum(int(TREES[i]) + i for i in cell)


def test_sampler_with_costs_resumes_exactly_and_refuses_other_costs():
    full = list(sampler(rank=2))
    for stop in (0, 4, len(full) - 1):
        first = sampler(rank=2)
        taken = list(zip(range(stop), iter(first), strict=False))
        state = saved(first.state_dict())
        resumed = sampler(rank=2)
        resumed.load_state_dict(state)
        assert [batch for _, batch in taken] + list(resumed) == full
    state = saved(sampler(rank=2).state_dict())
    for other in (None, TREES + 1, MIXED.costs(LENGTHS)):
        with pytest.raises(ValueError, match=r"another data .*same dataset lengths, groups, costs"):
            sampler(rank=2, costs=other).load_state_dict(state)
    with pytest.raises(ValueError, match="another data"):  # costs and extra costs are not interchangeable
        sampler(rank=2, costs=None, extra_costs=TREES).load_state_dict(state)
    with pytest.raises(ValueError, match="another data"):
        sampler(rank=2, costs=None).load_state_dict(saved(sampler(rank=2).state_dict()))


@pytest.mark.parametrize(
    ("costs", "error", "match"),
    [
        ([1, 2], ValueError, r"BalancedBatchSampler: costs has 2 entries for 150 lengths \(one per item\)"),
        ([-1] * 150, ValueError, r"BalancedBatchSampler: costs\[0\] is -1"),
        ([0.5] * 150, TypeError, "BalancedBatchSampler: costs must be a 1-D sequence of ints"),
        ([[1] * 150], TypeError, "BalancedBatchSampler: costs must be a 1-D sequence of ints"),
    ],
)
def test_sampler_refuses_bad_costs(costs, error, match):
    with pytest.raises(error, match=match):
        sampler(costs=costs)
