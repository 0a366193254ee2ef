"""The tree inspector: a tree batch read, drawn node by node and as a PNG, its warnings, and `show`."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from demo.__main__ import main

from zephon_collate import Collator
from zephon_collate.functional.attention import dense_branch_mask
from zephon_collate.functional.trees import dense_tree_mask
from zephon_collate.inspection.render import render_batch, render_batch_png
from zephon_collate.inspection.rows import batch_warnings
from zephon_collate.inspection.tree_render import render_tree, render_tree_png, spans
from zephon_collate.inspection.trees import batch_tree, is_tree_batch, tree_warnings

ROOT = Path(__file__).resolve().parent.parent

# Three trajectories: the prompt 1 2 is shared by all three, the completion's first token 3 by the first
# two; laid out depth-first: 1 2 | 3 | 4 | 5 6 | 7 (places 0..6).
TRAJECTORIES = [
    {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
    {"input_ids": [1, 2, 3, 5, 6], "completion_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [1, 2, 7], "completion_mask": [0, 0, 1]},
]
PAIRS = [
    {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6, 7, 8]},
    {"prompt_input_ids": [9, 2], "chosen_input_ids": [4], "rejected_input_ids": [6, 7]},
]

TREE_LINES = [
    "tree batch: 1 row x 7 tokens; 1 tree, 5 nodes, 3 paths; 5 of 7 tokens trained (71%); 0 padding",
    "paths from path_index, attention from subtree_end",
    "",
    "row 0: 7 tokens, 1 tree, 5 nodes, 5 trained (71%), 0 padding",
    "  tree 0: paths 0-2, 12 path tokens laid out in 7 (1.71x)",
    "    n0 1 2        x3  paths 0-2  places 0-1  pos 0-1  sees n0",
    "      n1 3+       x2  paths 0 1  places 2    pos 2    sees n0 n1",
    "        n2 4+     x1  path 0     places 3    pos 3    sees n0-n2",
    "        n3 5+ 6+  x1  path 1     places 4-5  pos 3-4  sees n0 n1 n3",
    "      n4 7+       x1  path 2     places 6    pos 2    sees n0 n4",
    "",
    "paths:",
    "  0: n0 n1 n2, 4 tokens, trains 3 4",
    "  1: n0 n1 n3, 5 tokens, trains 3 5 6",
    "  2: n0 n4, 3 tokens, trains 7",
    "",
]


def trees(**changes):
    """The three trajectories through ``Collator.for_trees()``, with fields replaced by ``changes``."""
    batch = dict(Collator.for_trees()(TRAJECTORIES))
    batch.update({name: torch.tensor(value) for name, value in changes.items()})
    return batch


# --- reading -------------------------------------------------------------------------------------


def test_the_tree_batch_is_what_the_drawings_assume():
    """The layout the hand-checked lines below are written against."""
    batch = trees()
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert batch["logits_index"].tolist() == [[-1, 0, 1, 2, 2, 4, 1]]
    assert batch["subtree_end"].tolist() == [[7, 7, 6, 4, 6, 6, 7]]
    assert batch["path_offsets"].tolist() == [0, 4, 9, 12]


def test_nodes_depths_and_sharing():
    view = batch_tree(trees())
    nodes = [(n.start, n.end, n.parent, n.depth, n.sequences, n.shared) for n in view.nodes]
    assert nodes == [
        (0, 2, -1, 0, (0, 1, 2), 3),  # the prompt
        (2, 3, 0, 1, (0, 1), 2),  # 3: the first two completions' first token
        (3, 4, 1, 2, (0,), 1),
        (4, 6, 1, 2, (1,), 1),
        (6, 7, 0, 1, (2,), 1),
    ]
    assert view.paths == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 0), (0, 1), (0, 2), (0, 4), (0, 5)],
                          [(0, 0), (0, 1), (0, 6)]]  # fmt: skip
    assert (view.paths_from, view.attention_from) == ("path_index", "subtree_end")


def test_each_token_its_depth_paths_and_training():
    view = batch_tree(trees())
    tokens = [view.token(0, place) for place in range(7)]
    assert [t.depth for t in tokens] == [0, 0, 1, 2, 2, 2, 1]
    assert [t.sequences for t in tokens] == [(0, 1, 2), (0, 1, 2), (0, 1), (0,), (1,), (1,), (2,)]
    assert [t.trained for t in tokens] == [False, False, True, True, True, True, True]
    assert [t.trained_for for t in tokens] == [(), (), (0, 1), (0,), (1,), (1,), (2,)]
    assert [t.position for t in tokens] == [0, 1, 2, 3, 3, 4, 2]


def test_what_each_token_sees_follows_subtree_end():
    """k is seen by q iff k <= q < subtree_end[k] = [7, 7, 6, 4, 6, 6, 7]: a token sees its path only."""
    view = batch_tree(trees())
    assert [view.sees(0, q) for q in range(7)] == [
        [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 4, 5], [0, 1, 6],
    ]  # fmt: skip
    assert [view.node_sees(n) for n in range(5)] == [(0,), (0, 1), (0, 1, 2), (0, 1, 3), (0, 4)]
    assert torch.equal(torch.from_numpy(view.mask(0)), dense_tree_mask(trees()["subtree_end"])[0, 0])


def test_a_shared_prompt_batch_reads_as_a_tree_of_one_level():
    """No path_index: each sequence is traced back from its last token; the attention is the branch mask."""
    batch = Collator.for_preference(padding_free=True, shared_prompt=True)(PAIRS)
    assert "path_index" not in batch and "subtree_end" not in batch and is_tree_batch(batch)
    view = batch_tree(batch)
    assert (view.paths_from, view.attention_from) == ("sequence_index", "branch_ids")
    # chosen sequences are 0 and 1, rejected 2 and 3 (chosen_index, rejected_index)
    assert [(n.document, n.start, n.end, n.depth, n.sequences) for n in view.nodes] == [
        (0, 0, 3, 0, (0, 2)), (0, 3, 5, 1, (0,)), (0, 5, 8, 1, (2,)),
        (1, 8, 10, 0, (1, 3)), (1, 10, 11, 1, (1,)), (1, 11, 13, 1, (3,)),
    ]  # fmt: skip
    assert view.paths[1] == [(0, 8), (0, 9), (0, 10)]  # prompt 9 2, then chosen 4
    assert view.token(0, 2).trained is False and view.token(0, 5).trained_for == (2,)
    assert view.sees(0, 6) == [0, 1, 2, 5, 6]  # the rejected 7 sees its prompt and itself, not the chosen
    expected = dense_branch_mask(batch["document_ids"], batch["branch_ids"])[0, 0]
    assert torch.equal(torch.from_numpy(view.mask(0)), expected)
    assert tree_warnings(batch) == []


def test_an_unshared_batch_is_not_a_tree():
    flat = Collator.for_preference(padding_free=True)(PAIRS)  # logits_index and branch_ids, no branch 0
    assert "logits_index" in flat and not is_tree_batch(flat)
    assert render_batch(flat).startswith("batch: 1 row x 18 tokens;")  # the flat view, as before


# --- text ----------------------------------------------------------------------------------------


def test_the_tree_renders_exactly():
    lines = render_tree(trees()).splitlines()
    assert lines[: len(TREE_LINES)] == TREE_LINES
    assert lines[-1] == "warnings: none"


def test_render_batch_draws_a_tree_batch_as_its_tree():
    assert render_batch(trees()) == render_tree(trees())
    assert render_batch(trees(), max_tokens=1).splitlines()[5:10] == [  # each node cut after a token
        "    n0 1 ... +1       x3  paths 0-2  places 0-1  pos 0-1  sees n0",
        "      n1 3+           x2  paths 0 1  places 2    pos 2    sees n0 n1",
        "        n2 4+         x1  path 0     places 3    pos 3    sees n0-n2",
        "        n3 5+ ... +1  x1  path 1     places 4-5  pos 3-4  sees n0 n1 n3",
        "      n4 7+           x1  path 2     places 6    pos 2    sees n0 n4",
    ]


def test_a_selected_token_shows_what_it_sees():
    text = render_tree(trees(), token=(0, 5))
    assert (
        "token 5 of row 0 (6): node n3, depth 2, position 4, path 1, trained (in the loss of path 1)\n"
        "  sees places 0-2 4 5: n0 (1 2), n1 (3), n3 (5 6)\n"
    ) in text
    assert "token 1 of row 0 (2): node n0, depth 0, position 1, paths 0-2, not trained" in render_tree(
        trees(), token=(0, 1)
    )
    with pytest.raises(ValueError, match=r"token \(0, 7\) is outside the batch"):
        render_tree(trees(), token=(0, 7))


def test_the_shared_prompt_batch_renders_its_two_trees():
    text = render_tree(Collator.for_preference(padding_free=True, shared_prompt=True)(PAIRS))
    assert text.splitlines()[3:12] == [
        "row 0: 13 tokens, 2 trees, 6 nodes, 8 trained (62%), 0 padding",
        "  tree 0: paths 0 2, 11 path tokens laid out in 8 (1.38x)",
        "    n0 1 2 3       x2  paths 0 2  places 0-2    pos 0-2  sees n0",
        "      n1 4+ 5+     x1  path 0     places 3-4    pos 3-4  sees n0 n1",
        "      n2 6+ 7+ 8+  x1  path 2     places 5-7    pos 3-5  sees n0 n2",
        "  tree 1: paths 1 3, 7 path tokens laid out in 5 (1.40x)",
        "    n3 9 2         x2  paths 1 3  places 8-9    pos 0-1  sees n3",
        "      n4 4+        x1  path 1     places 10     pos 2    sees n3 n4",
        "      n5 6+ 7+     x1  path 3     places 11-12  pos 2-3  sees n3 n5",
    ]


def test_padded_rows_show_their_padding_and_colour_marks_trained_tokens():
    batch = Collator.for_rollouts(shared_prompt=True, pad_token_id=0)(
        [*TRAJECTORIES, {"input_ids": [8, 9, 10], "completion_mask": [0, 1, 1]}]
    )
    text = render_tree(batch)
    assert "row 1: 8 tokens, 1 tree, 1 node, 2 trained (25%), 5 padding" in text
    assert "  tree 1: path 3, 3 path tokens laid out in 3 (1.00x)" in text
    assert "    n4 8 9+ 10+  x1  path 3  places 0-2  pos 0-2  sees n4" in text
    assert "row 1: 5 of 8 tokens (62%) are padding" in text
    colored = render_tree(batch, color=True)
    assert "\x1b[32m9+\x1b[0m" in colored and re.sub(r"\x1b\[[0-9;]*m", "", colored) == text


def test_spans_compress_runs():
    assert spans([2, 0, 1, 5, 7, 8, 9]) == "0-2 5 7-9"
    assert spans(range(30), listed=1) == "0-29"
    assert spans([1, 3, 5], "n", listed=2) == "n1 n3 ... (3 in all)"


# --- warnings ------------------------------------------------------------------------------------


def test_a_clean_tree_batch_has_no_warnings_where_the_flat_reading_would_complain():
    """Positions jump back at every branch: the row reading calls that a skip; the tree reading does not."""
    assert tree_warnings(trees()) == [] and batch_warnings(trees()) == []


def test_a_trained_token_on_no_path():
    # path 2 loses its last token (7, place 6), which stays trained
    batch = trees(path_index=[0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1], path_offsets=[0, 4, 9, 11])
    assert tree_warnings(batch) == [
        "batch: no path holds 1 trained token (first: row 0 place 6): the loss helpers score each path's "
        "tokens, so these count in no sequence's loss; check path_index",
        "batch: sequence_index disagrees with the paths at 1 token (first: row 0 place 6 says sequence 2, "
        "the paths through it are [])",
    ]


def test_attention_across_documents():
    batch = dict(
        Collator.for_trees()([*TRAJECTORIES, {"input_ids": [8, 9, 10], "completion_mask": [0, 1, 1]}])
    )
    assert batch["subtree_end"].tolist() == [[7, 7, 6, 4, 6, 6, 7, 10, 10, 10]]
    batch["subtree_end"] = torch.tensor([[7, 7, 6, 4, 6, 6, 8, 10, 10, 10]])  # 7 seen by the next tree's 8
    assert tree_warnings(batch) == [
        "row 0: subtree_end lets 1 token attend across documents (first: token 7, document 1, sees token 6, "
        "document 0; subtree_end[6] is 8)"
    ]


def test_attention_off_a_path_and_a_hidden_ancestor():
    sibling = trees(subtree_end=[[7, 7, 7, 4, 6, 6, 7]])  # 3 (place 2) seen by 7 (place 6), a sibling
    assert tree_warnings(sibling) == [
        "row 0: subtree_end lets 1 token see tokens off their paths (first: token 6 sees token 2, which is "
        "not its ancestor; subtree_end[2] is 7, its subtree ends at 6)"
    ]
    hidden = trees(subtree_end=[[7, 6, 6, 4, 6, 6, 7]])  # 2 (place 1) hidden from 7 (place 6)
    assert tree_warnings(hidden) == [
        "row 0: subtree_end hides an ancestor from 1 token (first: token 6 does not see token 1; "
        "subtree_end[1] is 6, its subtree ends at 7)"
    ]


def test_positions_and_predictors_that_do_not_follow_a_path():
    skipped = trees(position_ids=[[0, 1, 2, 3, 4, 5, 2]])  # path 1's 5 at position 4, not 3
    assert tree_warnings(skipped) == [
        "sequence 1: positions along its path do not count 0..4 (first: its token 3, row 0 place 4, has "
        "position 4); 1 sequence in all"
    ]
    crossed = trees(logits_index=[[-1, 0, 1, 2, 2, 4, 0]])  # 7 predicted by 1, not by 2
    assert tree_warnings(crossed) == [
        "sequence 2: its path does not follow logits_index (first: its token 2, row 0 place 6 is predicted "
        "by place 0, not by the path's previous token): its loss would read other tokens' logits; 1 "
        "sequence in all",
        "row 0: subtree_end lets 1 token see tokens off their paths (first: token 6 sees token 1, which is "
        "not its ancestor; subtree_end[1] is 7, its subtree ends at 6)",
    ]


def test_a_shared_prompt_sequence_that_cannot_be_traced():
    batch = dict(Collator.for_preference(padding_free=True, shared_prompt=True)(PAIRS))
    batch["sequence_index"] = torch.tensor([[-1, -1, -1, 0, 0, 2, 2, 2, -1, -1, -1, 3, 3]])  # 1 lost
    assert tree_warnings(batch) == [
        "batch: sequences [1] have no token of their own in sequence_index (they end inside another "
        "sequence's path), so their paths cannot be traced without path_index",
        "batch: no path holds 1 trained token (first: row 0 place 10): the loss helpers score each path's "
        "tokens, so these count in no sequence's loss; check path_index",
    ]
    assert batch_warnings(batch) == tree_warnings(batch)


def test_the_warnings_end_the_text():
    text = render_tree(trees(position_ids=[[0, 1, 2, 3, 4, 5, 2]]))
    assert text.endswith(
        "warnings (1):\n  - sequence 1: positions along its path do not count 0..4 (first: its token 3, row "
        "0 place 4, has position 4); 1 sequence in all"
    )


# --- PNG -----------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_png_renders_a_tree_and_its_attention(tmp_path):
    drawn = render_tree_png(trees(), tmp_path / "tree.png", title="three trajectories")
    assert drawn == tmp_path / "tree.png" and drawn.stat().st_size > 5000
    bare = render_tree_png(trees(), tmp_path / "bare.png", max_matrix_tokens=4)  # the row is too long
    (width, height), (bare_width, _) = png_size(drawn), png_size(bare)
    assert width > bare_width + 200  # the attention matrix beside the tree
    assert height > 200


def test_render_batch_png_draws_trees_for_tree_batches(tmp_path):
    batch = Collator.for_preference(padding_free=True, shared_prompt=True)(PAIRS)
    path = render_batch_png(batch, tmp_path / "shared.png")
    assert path.stat().st_size > 0 and png_size(path)[0] > 0
    corrupted = trees(subtree_end=[[7, 7, 7, 4, 6, 6, 7]])  # a warning is written in
    clean_height = png_size(render_tree_png(trees(), tmp_path / "a.png"))[1]
    assert png_size(render_tree_png(corrupted, tmp_path / "b.png"))[1] > clean_height


# --- show ----------------------------------------------------------------------------------------


def test_show_tree_batch_matches_the_docs(capsys, tmp_path):
    assert main(["show", "--tree-batch", "--token", "12", "--no-color", "--width", "100"]) == 0
    out = capsys.readouterr().out
    docs = (ROOT / "docs" / "demo.md").read_text(encoding="utf-8")
    block = re.search(r"### Tree batches.*?```text\n(.*?)```", docs, re.S).group(1)
    assert out == block
    assert main(["show", "--tree-batch", "--no-color", "--png", str(tmp_path / "t.png")]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 't.png'}\n")
    assert png_size(tmp_path / "t.png")[0] > 0


def test_show_trees_from_jsonl_and_token_needs_a_tree(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(json.dumps(item) for item in TRAJECTORIES))
    assert main(["show", str(path), "--trees", "--no-color", "--width", "100", "--token", "0:6"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[: len(TREE_LINES)] == TREE_LINES
    assert (
        "token 6 of row 0 (7): node n4, depth 1, position 2, path 2, trained (in the loss of path 2)" in out
    )
    path.write_text(json.dumps({"input_ids": [1, 5, 6, 2]}))
    assert main(["show", str(path), "--no-color", "--token", "3"]) == 2  # packed rows: not a tree
    assert "show: error: --token needs a tree batch" in capsys.readouterr().err


def test_a_padded_rows_first_label_is_not_counted_as_trained():
    """Padded, each row keeps its first label as transformers does, but nothing predicts it: the view
    counts what the loss helpers count (2 and 1 tokens), as the padding-free layout does."""
    examples = [
        {"input_ids": [1, 2, 3], "completion_mask": [1, 1, 1]},
        {"input_ids": [7, 8], "completion_mask": [1, 1]},
    ]
    padded = Collator.for_trees(padding_free=False, pad_token_id=0)(examples)
    assert padded["labels"].tolist() == [[1, 2, 3], [7, 8, -100]]
    view = batch_tree(padded)
    assert [row.trained for row in view.rows] == [[False, True, True], [False, True, False]]
    assert render_tree(padded).splitlines()[0].count("3 of 6 tokens trained") == 1
    assert "3 of 5 tokens trained" in render_tree(Collator.for_trees()(examples)).splitlines()[0]


def _edited(batch: dict, edit) -> dict:
    copy = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    edit(copy)
    return copy


def test_a_shared_prompt_batchs_attention_is_checked_against_its_paths():
    """Attention from document_ids / branch_ids was never checked: a response that sees its sibling, or a
    pair merged into the one before it, passed."""
    pairs = [
        {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        {"prompt_input_ids": [7, 8], "chosen_input_ids": [9], "rejected_input_ids": [10, 11, 12]},
    ]
    base = dict(Collator.for_preference(padding_free=True, shared_prompt=True)(pairs))
    assert batch_warnings(base) == []
    sibling = _edited(base, lambda b: b["branch_ids"][0, 3:5].zero_())  # the chosen tokens: branch 0
    assert batch_warnings(sibling) == [
        "row 0: 1 token see tokens off their paths (first: token 5, document 0, sees token 3, document 0, "
        "which is not its ancestor; check branch_ids)"
    ]
    merged = _edited(base, lambda b: b["document_ids"][0, 6:].zero_())
    assert "6 tokens see tokens off their paths (first: token 6" in batch_warnings(merged)[0]


def test_a_subtree_that_is_not_contiguous_is_caught():
    """r -> a -> c and r -> b laid out r a b c: a's subtree_end covers b, which then sees its sibling a;
    the range checks passed it."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "labels": torch.tensor([[-100, 2, 3, 4]]),
        "position_ids": torch.tensor([[0, 1, 1, 2]]),
        "logits_index": torch.tensor([[-1, 0, 0, 1]]),
        "document_ids": torch.tensor([[0, 0, 0, 0]]),
        "subtree_end": torch.tensor([[4, 4, 3, 4]]),
        "sequence_index": torch.tensor([[-1, -1, 1, 0]]),
        "path_index": torch.tensor([0, 1, 3, 0, 2]),
        "path_offsets": torch.tensor([0, 3, 5]),
        "num_sequences": 2,
    }
    assert tree_warnings(batch) == [
        "row 0: 1 token see tokens off their paths (first: token 2, document 0, sees token 1, document 0, "
        "which is not its ancestor; check subtree_end)"
    ]


def test_a_label_kept_on_padding_is_reported_in_tree_and_shared_batches():
    """Padding has no predictor, so a kept label there was never counted: ``model(labels=...)`` trains it."""
    trees = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1], "group": 0},
        {"input_ids": [5, 6], "completion_mask": [0, 1], "group": 1},
    ]
    padded = dict(Collator.for_trees(padding_free=False, pad_token_id=0)(trees))
    assert tree_warnings(padded) == []
    labelled = _edited(padded, lambda b: b["labels"][1, 2:].fill_(0))
    assert tree_warnings(labelled) == [
        "row 1: labels train on 2 padding tokens (in no tree; check the padding's labels)"
    ]
    pairs = [
        {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        {"prompt_input_ids": [13], "chosen_input_ids": [14], "rejected_input_ids": [15]},
    ]
    shared = dict(Collator.for_preference(pad_token_id=0, shared_prompt=True)(pairs))
    assert batch_warnings(_edited(shared, lambda b: b["labels"][1, 4].fill_(0))) == [
        "row 1: labels train on 1 padding token (in no tree; check the padding's labels)"
    ]
