"""The forest's sharing and layout against a simple reference: every sequence's path holds its tokens,
supervision and values in order; positions count along the path; the token before it on the path
predicts each token; a token sees exactly its path's earlier tokens; the trie lays out exactly the
distinct prefixes (the bound); the copied openers leave one predicted token per place."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate.functional.trees import TreeBlocks, dense_tree_mask, tree_attention
from zephon_collate.layouts.forest import as_paths, copy_openers, lay_out, merge_prefixes, share_prompts
from zephon_collate.read.columns import Ragged
from zephon_collate.read.forest import Forest

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def groups_of_sequences(
    draw: st.DrawFn,
) -> tuple[list[list[int]], list[list[bool]], list[list[float]], list[int]]:
    """Sequences from a tiny alphabet (so that they share prefixes), their supervision, a value per token
    and a group each."""
    count = draw(st.integers(1, 9))
    base = draw(st.lists(st.integers(1, 3), min_size=0, max_size=6))
    tokens, trained, values, groups = [], [], [], []
    for _ in range(count):
        keep = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(1, 3), min_size=0, max_size=5))
        row = base[:keep] + tail
        tokens.append(row)
        cut = draw(st.integers(0, len(row)))
        trained.append([i >= cut for i in range(len(row))])
        values.append([float(draw(st.sampled_from([0.0, 0.5]))) for _ in row])
        groups.append(draw(st.integers(0, 1)))
    return tokens, trained, values, groups


def chains(tokens: list[list[int]], trained: list[list[bool]], values: list[list[float]]) -> Forest:
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in tokens])]).astype(np.int64)
    flat = np.array([t for row in tokens for t in row], dtype=np.int64)
    return Forest.chains(
        Ragged(flat, offsets),
        Ragged(np.array([t for row in trained for t in row], dtype=bool), offsets),
        {"v": Ragged(np.array([v for row in values for v in row], dtype=np.float32), offsets)},
    )


def check_paths(forest: Forest, tokens, trained, values) -> None:
    laid = lay_out(forest)
    ids = np.asarray(forest.tokens.values)[laid.order]
    flags = np.asarray(forest.trained.values)[laid.order]
    vals = np.asarray(forest.values["v"].values)[laid.order]
    for s, row in enumerate(tokens):
        path = laid.path_index[laid.path_offsets[s] : laid.path_offsets[s + 1]]
        assert ids[path].tolist() == row
        assert flags[path].tolist() == trained[s]
        assert vals[path].tolist() == values[s]
        assert laid.position[path].tolist() == list(range(len(row)))
        assert laid.predictor[path].tolist() == [-1, *path[:-1].tolist()][: len(path)]
        for q_at, q in enumerate(path):  # a token sees exactly the path's tokens up to it
            seen = np.flatnonzero((np.arange(ids.size) <= q) & (q < laid.subtree_end))
            assert seen.tolist() == sorted(path[: q_at + 1].tolist())


@FAST
@given(groups_of_sequences())
def test_a_trie_holds_every_path_and_lays_out_the_bound(case):
    tokens, trained, values, groups = case
    tree = merge_prefixes(chains(tokens, trained, values), np.array(groups))
    check_paths(tree, tokens, trained, values)
    prefixes = {
        (groups[s], tuple(zip(row[: i + 1], trained[s][: i + 1], values[s][: i + 1], strict=True)))
        for s, row in enumerate(tokens)
        for i in range(len(row))
    }
    assert int(tree.tokens.lengths.sum()) == len(prefixes)  # every distinct prefix once: the bound
    assert (tree.parent < np.arange(tree.nodes)).all()  # parents first
    back = as_paths(tree)
    for s, row in enumerate(tokens):
        node = back.ends[s]
        got = (
            [] if node < 0 else back.tokens.values[back.tokens.offsets[node] : back.tokens.offsets[node + 1]]
        )
        assert list(got) == row


@FAST
@given(groups_of_sequences())
def test_copied_openers_keep_the_paths_and_predict_one_token_per_place(case):
    tokens, trained, values, groups = case
    copied = copy_openers(merge_prefixes(chains(tokens, trained, values), np.array(groups)))
    check_paths(copied, tokens, trained, values)
    laid = lay_out(copied)
    ids = np.asarray(copied.tokens.values)[laid.order]
    for place in range(ids.size):
        assert len(set(ids[laid.predictor == place].tolist())) <= 1


@FAST
@given(groups_of_sequences())
def test_shared_prompts_keep_the_paths(case):
    tokens, trained, values, _ = case
    shared = share_prompts(chains(tokens, trained, values))
    check_paths(shared, tokens, trained, values)
    assert (shared.parent < 0).sum() <= len(tokens)


@FAST
@given(groups_of_sequences(), st.integers(0, 2**31 - 1))
def test_tree_attention_equals_the_dense_tree_mask(case, seed):
    tokens, trained, values, groups = case
    laid = lay_out(merge_prefixes(chains(tokens, trained, values), np.array(groups)))
    total = laid.position.size
    if not total:
        return
    pad = 2
    index = torch.tensor([[*laid.predictor.tolist(), -1, -1]])
    documents = torch.tensor([[*([0] * total), -1, -1]])
    ends = torch.tensor([[*laid.subtree_end.tolist(), total + 1, total + 2]])
    generator = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 1, 2, total + pad, 4, dtype=torch.float64, generator=generator).unbind(0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(ends))
    got = tree_attention(q, k, v, TreeBlocks.from_batch({"logits_index": index, "document_ids": documents}))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
