"""Collator.for_trees: trajectories (flat, as turns, in groups) and explicit trees laid out as prefix trees,
hand-worked; rows of a fixed width (split or refused); the copied openers; every refusal named."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given as given_examples
from hypothesis import settings
from hypothesis import strategies as st

from zephon_collate import Collator, FloatField
from zephon_collate.functional.trees import TreeBlocks, dense_tree_mask, use_tree_attention
from zephon_collate.losses import sequence_logprobs, unpack


def trajectory(ids: list[int], prompt: int, **fields: object) -> dict:
    """A trajectory: its first ``prompt`` tokens untrained, the rest trained."""
    return {"input_ids": ids, "completion_mask": [0] * prompt + [1] * (len(ids) - prompt), **fields}


GROUPS = [
    trajectory([1, 2, 3, 4], 2, group="a"),
    trajectory([1, 2, 3, 5, 6], 2, group="a"),
    trajectory([1, 2, 3, 4], 2, group="b"),  # the same tokens, another group
    trajectory([1, 2, 7], 2, group="a"),
]


def as_lists(batch: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def test_trajectories_share_within_their_group():
    out = as_lists(Collator.for_trees()(GROUPS))
    # group a: 1 2 ─┬─ 3 ─┬─ 4        group b: 1 2 3 4 (alone)
    #               │     └─ 5 6
    #               └─ 7
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]
    assert out["position_ids"] == [[0, 1, 2, 3, 3, 4, 2, 0, 1, 2, 3]]
    assert out["logits_index"] == [[-1, 0, 1, 2, 2, 4, 1, -1, 7, 8, 9]]
    assert out["subtree_end"] == [[7, 7, 6, 4, 6, 6, 7, 11, 11, 11, 11]]
    assert out["document_ids"] == [[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert out["labels"] == [[-100, -100, 3, 4, 5, 6, 7, -100, -100, 3, 4]]
    assert out["sequence_index"] == [[-1, -1, -1, 0, 1, 1, 3, 2, 2, 2, 2]]
    assert out["path_offsets"] == [0, 4, 9, 13, 16]
    assert out["path_index"] == [0, 1, 2, 3, 0, 1, 2, 4, 5, 7, 8, 9, 10, 0, 1, 6]
    assert out["num_sequences"] == 4
    shared = as_lists(Collator.for_trees(share="batch")(GROUPS))
    assert shared["input_ids"] == [[1, 2, 3, 4, 5, 6, 7]]  # the two [1, 2, 3, 4] end at one node
    assert shared["path_index"][:4] == shared["path_index"][9:13] == [0, 1, 2, 3]
    flat = as_lists(Collator.for_trees(share="none", return_flash_attn_kwargs=True)(GROUPS))
    assert flat["input_ids"] == [[1, 2, 3, 4, 1, 2, 3, 5, 6, 1, 2, 3, 4, 1, 2, 7]]
    assert flat["cu_seq_lens_q"] == [0, 4, 9, 13, 16]  # the paths whole, for a varlen kernel


def test_a_batch_without_groups_is_one_group_and_a_partial_one_is_refused():
    plain = [{k: v for k, v in t.items() if k != "group"} for t in GROUPS]
    assert Collator.for_trees()(plain)["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"example 1: lacks 'group', which example 0 carries"):
        Collator.for_trees()([GROUPS[0], plain[1]])


def test_group_ids_are_ints_or_strs_and_never_merge_across_types():
    """NumPy and tensor ints are the int they hold; a bool or a float is refused, since ``True == 1 == 1.0``
    would put trajectories of different groups into one tree."""
    same = [trajectory([1, 2, 3], 1, group=np.int64(7)), trajectory([1, 2, 4], 1, group=torch.tensor(7))]
    assert Collator.for_trees()(same)["input_ids"].tolist() == [[1, 2, 3, 4]]
    for bad in (True, 1.0, np.float32(1), torch.tensor(True), [1]):
        with pytest.raises(TypeError, match=r"example 1: group key 'group' must be an int or a str"):
            Collator.for_trees()([trajectory([1, 2, 3], 1, group=1), trajectory([1, 2, 4], 1, group=bad)])


def test_supervision_and_values_must_agree_to_share():
    """Tokens are shared only where their ids, supervision and per-token values all agree."""
    other = trajectory([1, 2, 3, 9], 3)  # token 3 untrained here, trained in the first
    assert Collator.for_trees()([trajectory([1, 2, 3, 4], 2), other])["input_ids"].tolist() == [
        [1, 2, 3, 4, 3, 9]
    ]
    old = [FloatField("old")]
    a = trajectory([1, 2, 3], 1, old=[0.0, -1.0, -2.0])
    b = trajectory([1, 2, 4], 1, old=[0.0, -1.5, -2.0])  # the value of token 2 differs
    assert Collator.for_trees(float_fields=old)([a, b])["input_ids"].tolist() == [[1, 2, 3, 2, 4]]


def test_a_spread_fill_never_merges_with_a_given_value():
    """A response-aligned field's Spread fill is written at layout by its place: a fill of one trajectory and
    a given value of another that hold the same numbers at read time stay apart."""
    from zephon_collate.losses import along_paths
    from zephon_collate.read.columns import Spread
    from zephon_collate.read.fields import TensorField

    routes = TensorField("routes", align="response", dtype=torch.int64, shape=(2,), fill=Spread(4))
    trajectories = [
        {"input_ids": [7, 7, 7], "completion_mask": [0, 1, 1], "routes": [[1, 1]], "group": 0},
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1], "routes": [[0, 0], [1, 1]], "group": 1},
        {"input_ids": [1, 2, 3, 5], "completion_mask": [0, 0, 1, 1], "routes": [[2, 3], [0, 0], [3, 3]],
         "group": 1},
    ]  # fmt: skip
    for share in ("none", "group"):
        batch = Collator.for_trees(float_fields=[routes], share=share)(trajectories)
        ends = batch["path_offsets"].tolist()
        assert along_paths(batch["routes"], batch)[ends[2] : ends[3]][1:].tolist() == [[2, 3], [0, 0], [3, 3]]


def test_trajectories_given_as_turns():
    turns = {
        "input_ids": [[1, 2], [3, 4], [5]],  # system, assistant, tool
        "completion_mask": [0, 1, 0],  # one value per turn
        "old": [[0.0, 0.0], [-1.0, -2.0], [0.0]],  # per token, turn by turn
    }
    flat = trajectory([1, 2, 3, 4, 6], 2, old=[0.0, 0.0, -1.0, -2.0, -3.0])
    out = as_lists(Collator.for_trees(float_fields=["old"])([turns, flat]))
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6]]
    assert out["labels"] == [[-100, -100, 3, 4, -100, 6]]
    assert out["old"] == [[0.0, 0.0, -1.0, -2.0, 0.0, -3.0]]
    ambiguous = {"input_ids": [[1, 2], [], [3]], "completion_mask": [0, 1, 1]}  # per turn, or per token?
    with pytest.raises(
        ValueError, match=r"example 0: 'completion_mask' holds 3 values for turns of \[2, 0, 1\]"
    ):
        Collator.for_trees()([ambiguous])
    by_turn = {"input_ids": [[1, 2], [], [3]], "completion_mask": [[0, 1], [], [1]]}
    assert Collator.for_trees()([by_turn])["labels"].tolist() == [[-100, 2, 3]]
    bad = {**turns, "completion_mask": [[0, 0], [1], [0]]}
    with pytest.raises(ValueError, match=r"example 0: 'completion_mask' holds turns of \[2, 1, 1\] values"):
        Collator.for_trees()([bad])


def test_turns_keep_verls_response_fields_whole():
    """A field of the row's last tokens (verl's) is read as for the flat trajectory, also where it holds
    as many values as there are turns."""
    collate = Collator.for_trees(float_fields=[FloatField("old", align="response")])
    verl = {"response_mask": [1, 1], "old": [-0.5, -0.25]}
    flat = as_lists(collate([{"input_ids": [1, 2, 3, 4, 5], **verl}]))
    turns = as_lists(collate([{"input_ids": [[1, 2, 3], [4, 5]], **verl}]))
    assert turns == flat
    assert flat["labels"] == [[-100, -100, -100, 4, 5]] and flat["old"] == [[0.0, 0.0, 0.0, -0.5, -0.25]]
    per_turn = as_lists(
        collate([{"input_ids": [[1, 2, 3], [4, 5]], "completion_mask": [0, 1], "old": [-0.5, -0.25]}])
    )
    assert per_turn["labels"] == flat["labels"] and per_turn["old"] == flat["old"]
    by_token = {
        "input_ids": [[1, 2, 3], [4, 5]],
        "response_mask": [[0, 0, 0], [1, 1]],
        "old": [[0, 0, 0], [-0.5, -0.25]],
    }
    assert as_lists(collate([by_token])) == flat  # a value per token, turn by turn: joined as before


def test_explicit_trees_node_by_node():
    nodes = [
        {"node_id": 10, "parent_id": -1, "input_ids": [1, 2], "completion_mask": [0, 0]},
        {"node_id": 12, "parent_id": 11, "input_ids": [5], "completion_mask": [1], "adv": 1.0},
        {"node_id": 11, "parent_id": 10, "input_ids": [3, 4], "completion_mask": [1, 1]},
        {"node_id": 13, "parent_id": 11, "input_ids": [6, 7], "completion_mask": [1, 1], "adv": -1.0},
        {"node_id": 14, "parent_id": None, "input_ids": [8], "completion_mask": [1], "adv": 2.0},
    ]
    out = as_lists(Collator.for_trees(float_fields=[FloatField("adv", "sequence")])(nodes))
    # leaves (sequences) in the order given: 12, 13, 14
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert out["position_ids"] == [[0, 1, 2, 3, 4, 4, 5, 0]]
    assert out["adv"] == [1.0, -1.0, 2.0]
    assert out["path_offsets"] == [0, 5, 11, 12]
    assert out["path_index"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 6, 7]
    base = {"input_ids": [1], "completion_mask": [1]}
    cases = [
        (
            [{**base, "node_id": 1, "parent_id": -1}, {**base, "node_id": 1, "parent_id": -1}],
            "example 1: node_id 1",
        ),
        ([{**base, "node_id": 1, "parent_id": 7}], r"example 0: parent_id 7 is no node of the batch"),
        (
            [{**base, "node_id": 1, "parent_id": 2}, {**base, "node_id": 2, "parent_id": 1}],
            r"go round in a cycle",
        ),
        ([{**base, "node_id": 1, "parent_id": -1, "input_ids": [], "completion_mask": []}], "without tokens"),
        ([{**base, "node_id": 1.5, "parent_id": -1}], r"example 0: 'node_id' is 1\.5; a node id is an int"),
    ]
    for given, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            Collator.for_trees()(given)
    inner = [{**node, "adv": 0.0} if node["node_id"] == 11 else node for node in nodes]  # 11 has children
    with pytest.raises(ValueError, match=r"example 2: gives 'adv', one value per sequence, on a node with"):
        Collator.for_trees(float_fields=[FloatField("adv", "sequence")])(inner)
    # broadcast over each path's tokens (paths apart): given on the leaves too, refused on a node with children
    broadcast = Collator.for_trees(share="none", float_fields=[FloatField("adv", "sequence", broadcast=True)])
    assert as_lists(broadcast(nodes))["adv"] == [[1.0] * 5 + [-1.0] * 6 + [2.0]]
    with pytest.raises(ValueError, match=r"example 2: gives 'adv', one value per sequence, on a node with"):
        broadcast(inner)
    with pytest.raises(ValueError, match=r"'old' is label-aligned; in a tree a node's last token"):
        Collator.for_trees(float_fields=[FloatField("old", "label")])(
            [{**base, "node_id": 1, "parent_id": -1}]
        )


def test_copied_openers_predict_one_token_per_place():
    out = as_lists(Collator.for_trees(copy_openers=True)(GROUPS[:2] + GROUPS[3:]))
    # 1 2 ─┬─ 3 ─┬─ 4      the branching nodes' last tokens (2, then 3) copied into each branch
    #      │     └─ 5 6
    #      └─ 7
    assert out["input_ids"] == [[1, 2, 3, 4, 3, 5, 6, 2, 7]]
    assert out["position_ids"] == [[0, 1, 2, 3, 2, 3, 4, 1, 2]]
    predicted: dict[int, set[int]] = {}
    for place, source in enumerate(out["logits_index"][0]):
        predicted.setdefault(source, set()).add(out["input_ids"][0][place])
    assert all(len(tokens) == 1 for source, tokens in predicted.items() if source >= 0)
    paths = [row.tolist() for row in unpack(torch.tensor(out["input_ids"]), {**out, **_tensors(out)})]
    assert paths == [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]


def test_copied_openers_give_a_models_own_shifted_loss_every_prediction_once():
    """``shift_labels``: each place's target. ``transformers``' own loss given it is the mean over every distinct
    prediction once; ``labels`` stay token-aligned for the path helpers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zephon_collate.losses import token_logprobs

    rows = [trajectory([1, 2, 3, 4], 1), trajectory([1, 2, 3, 5], 1), trajectory([1, 6, 7], 1)]
    batch = Collator.for_trees(copy_openers=True)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 3, 5, 1, 6, 7]]  # 1 and 3 copied into their branches
    assert batch["labels"].tolist() == [[-100, 2, 3, 4, 3, 5, -100, 6, 7]]
    assert batch["shift_labels"].tolist() == [[2, 3, 4, -100, 5, -100, 6, 7, -100]]  # a branch's end: none
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        out = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                    shift_labels=batch["shift_labels"], attention_mask=dense_tree_mask(batch["subtree_end"]))  # fmt: skip
        scores = token_logprobs(out.logits, batch)[0]
    once = [
        1,
        2,
        3,
        5,
        7,
        8,
    ]  # each distinct prediction once: 1 -> 2, 2 -> 3 (two paths), 3 -> 4, 3 -> 5, ...
    assert abs(float(out.loss) - float(-scores[once].mean())) < 1e-6  # transformers' loss runs in float32


def _tensors(out: dict) -> dict:
    return {key: torch.tensor(value) for key, value in out.items() if isinstance(value, list)}


def test_rows_of_a_fixed_width_split_or_refuse_a_wide_tree():
    rows = [
        trajectory([7, 8, 1, 2], 2),
        trajectory([7, 8, 3, 4], 2),
        trajectory([7, 8, 5], 2),
        trajectory([9, 9], 1),
    ]
    out = as_lists(Collator.for_trees(max_row_tokens=6, oversized="split")(rows))
    assert out["input_ids"] == [[7, 8, 1, 2, 3, 4], [7, 8, 5, 9, 9, 0]]  # the prefix repeated in each part
    assert out["position_ids"] == [[0, 1, 2, 3, 2, 3], [0, 1, 2, 0, 1, 0]]
    assert out["subtree_end"] == [[6, 6, 4, 4, 6, 6], [3, 3, 3, 5, 5, 6]]
    assert out["labels"] == [[-100, -100, 1, 2, 3, 4], [-100, -100, 5, -100, 9, -100]]
    assert out["path_index"] == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10]
    rounded = Collator.for_trees(max_row_tokens=6, oversized="split", pad_to_multiple_of=4, pad_token_id=0)(
        rows
    )
    assert rounded["input_ids"].tolist() == [
        [*row, 0, 0] for row in out["input_ids"]
    ]  # packed by 6, padded to 8
    with pytest.raises(
        ValueError, match=r"example 0: its tree holds 7 tokens, more than max_row_tokens=6; pass"
    ):
        Collator.for_trees(max_row_tokens=6)(rows)
    smaller_first = [  # the named tree's own size, not the largest's
        {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [6, 7, 8, 9, 9, 9, 9, 9], "completion_mask": [0, 1, 1, 1, 1, 1, 1, 1]},
    ]
    with pytest.raises(ValueError, match=r"example 0: its tree holds 5 tokens, more than max_row_tokens=4"):
        Collator.for_trees(max_row_tokens=4)(smaller_first)
    with pytest.raises(ValueError, match=r"reaches 4 tokens by a node's end .* max_row_tokens=3; raise"):
        Collator.for_trees(max_row_tokens=3, oversized="split")(rows)
    with pytest.raises(
        ValueError, match=r"max_row_tokens packs the documents into rows .* \(padding_free=False\)"
    ):
        Collator.for_trees(max_row_tokens=6, padding_free=False, pad_token_id=0)


@st.composite
def _deep_trajectories(draw: st.DrawFn) -> tuple[list[dict], int]:
    """Trajectories along a random tree of spans (any depth; some end where others go on), and a row width
    that holds every path but not always every tree."""
    nodes = draw(st.integers(1, 8))
    parents = [-1] + [draw(st.integers(max(-1, node - 3), node - 1)) for node in range(1, nodes)]  # deep
    spans = [draw(st.lists(st.integers(3, 40), min_size=1, max_size=5)) for _ in range(nodes)]

    def path(node: int) -> list[int]:
        return [] if node < 0 else path(parents[node]) + spans[node]

    leaves = [node for node in range(nodes) if node not in parents]
    inner = [node for node in range(nodes) if node in parents and draw(st.booleans())]
    ends = draw(st.permutations(leaves + inner))
    rows = [trajectory(path(node), draw(st.integers(0, len(path(node)) - 1))) for node in ends]
    longest = max(len(row["input_ids"]) for row in rows)  # the narrowest row that holds every path
    return rows, draw(st.integers(longest, max(longest, sum(len(row["input_ids"]) for row in rows))))


@settings(max_examples=400, deadline=None)
@given_examples(_deep_trajectories())
def test_a_split_deep_tree_keeps_every_path_whole(case: tuple[list[dict], int]) -> None:
    # Against the trajectories themselves: each sequence's path (its tokens, labels and positions, each
    # token's predictor and the keys it sees) is the trajectory, however deep the split cuts.
    rows, width = case
    out = Collator.for_trees(max_row_tokens=width, oversized="split", pad_token_id=0)(rows)
    ids, labels, positions = out["input_ids"], out["labels"], out["position_ids"]
    assert ids.shape[1] == width
    flat_ids = ids.reshape(-1)
    offsets, places = out["path_offsets"].tolist(), out["path_index"].tolist()
    for s, row in enumerate(rows):
        path = places[offsets[s] : offsets[s + 1]]
        trained = [mask == 1 for mask in row["completion_mask"]]
        trained[0] = False  # nothing predicts a path's first token
        assert flat_ids[path].tolist() == row["input_ids"]
        assert labels.reshape(-1)[path].tolist() == [
            t if m else -100 for t, m in zip(row["input_ids"], trained, strict=True)
        ]
        assert positions.reshape(-1)[path].tolist() == list(range(len(path)))
        assert len({place // width for place in path}) == 1  # one row holds the whole path
        index, ends = out["logits_index"].reshape(-1), out["subtree_end"].reshape(-1)
        for before, place in itertools.pairwise(path):
            assert int(index[place]) == before % width  # predicted from the token before it on the path
            query = place % width
            assert all(key % width <= query < int(ends[key]) for key in path[: path.index(place) + 1])

    # The path helpers score each sequence as its path alone: logits that depend on (token, position) only.
    def logits(batch: dict) -> torch.Tensor:
        table = torch.sin(torch.arange(41 * 64, dtype=torch.float64).reshape(41, 64))
        return table[batch["input_ids"]] + torch.cos(batch["position_ids"].double())[..., None]

    alone = Collator.for_trees(share="none")(rows)
    got, expected = sequence_logprobs(logits(out), out), sequence_logprobs(logits(alone), alone)
    torch.testing.assert_close(got.sums, expected.sums, rtol=0, atol=1e-10)
    assert got.counts.tolist() == expected.counts.tolist()


def test_option_refusals_name_the_fix():
    with pytest.raises(
        ValueError, match=r"share='group' puts several responses after one prompt.*share='none'"
    ):
        Collator.for_trees(return_flash_attn_kwargs=True)
    with pytest.raises(ValueError, match=r"share must be 'group', 'batch' or 'none', got 'tree'"):
        Collator.for_trees(share="tree")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"oversized must be 'refuse' or 'split'"):
        Collator.for_trees(oversized="cut")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nothing says which tokens are the completion"):
        Collator.for_trees()([{"input_ids": [1, 2]}])


def test_a_per_sequence_value_is_spread_along_the_paths_not_broadcast_to_shared_tokens():
    """A tree's trained tokens may belong to several paths, each with its own advantage: one value per token
    cannot hold them, so a broadcast field is refused, and a per-sequence one reaches every path's tokens
    through along_paths."""
    rows = [
        trajectory([1, 2, 3], 1, adv=1.0),
        trajectory([1, 2, 4], 1, adv=-1.0),
        trajectory([1, 5], 1, adv=2.0),
    ]
    with pytest.raises(
        ValueError, match=r"'adv' is broadcast .* FloatField\('adv', 'sequence'\) .* along_paths"
    ):
        Collator.for_trees(float_fields=[FloatField("adv", "sequence", broadcast=True)])
    out = Collator.for_trees(float_fields=[FloatField("adv", "sequence")])(rows)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5]] and out["adv"].tolist() == [1.0, -1.0, 2.0]
    from zephon_collate.losses import along_paths

    assert along_paths(out["adv"], out).tolist() == [1.0] * 3 + [-1.0] * 3 + [2.0] * 2
    flat = Collator.for_trees(share="none", float_fields=[FloatField("adv", "sequence", broadcast=True)])(
        rows
    )
    assert flat["adv"].tolist() == [
        [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 2.0, 2.0]
    ]  # one path per token: allowed


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_a_tree_batch_scores_every_path_as_it_scores_alone(dtype, tolerance):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 32, 9).tolist()
    rows = [trajectory(prompt + rng.integers(3, 32, int(rng.integers(1, 7))).tolist(), 9) for _ in range(5)]
    rows.append(trajectory(rows[0]["input_ids"] + [4, 5], 9))  # continues another path
    batch = Collator.for_trees(pad_to_multiple_of=8, pad_token_id=0)(rows)
    with torch.no_grad():
        alone = [model(torch.tensor([row["input_ids"]])).logits[0] for row in rows]
        sdpa = model(batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=dense_tree_mask(batch["subtree_end"])).logits  # fmt: skip
        model.set_attn_implementation("eager")  # eager adds its mask to the scores: the additive one
        eager = model(batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=dense_tree_mask(batch["subtree_end"], dtype=dtype)).logits  # fmt: skip
        use_tree_attention(model)
        tree = model(
            batch["input_ids"], position_ids=batch["position_ids"], tree=TreeBlocks.from_batch(batch)
        ).logits
        model.set_attn_implementation("sdpa")
    # transformers' eager attention takes its softmax in float32 (dtype=torch.float32), float64 model or not
    for logits, bound in ((sdpa, tolerance), (eager, max(tolerance, 1e-6)), (tree, tolerance)):
        for path, want in zip(unpack(logits, batch), alone, strict=True):
            assert (path - want).abs().max() < bound
