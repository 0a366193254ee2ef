"""The batch inspector: exact plain rendering, the warnings, colours, the PNG and `show`."""

from __future__ import annotations

import json
import re

import pytest
import torch
from demo.__main__ import main
from demo.corpus import CHAT, Document, to_records
from demo.tokenizer import EOS, PAD, ByteTokenizer

from zephon_collate import SampleBatch, SampleMeta, SampleRecord, pack_flat
from zephon_collate.inspection.render import render_batch, render_batch_png, token_text
from zephon_collate.inspection.rows import batch_rows, batch_warnings

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Two packed rows of 8 tokens, as the quickstart builds them, after
# to_training(return_labels, loss mask, cu_seqlens, padding mask, eos_mask_loss, EOS=2).
LITERAL = {
    "ids": [(0, 0, 0), (0, 0, 1)],
    "input_ids": torch.tensor([[1, 10, 2, 1, 11, 12, 2], [1, 20, 21, 22, 2, 0, 0]]),
    "labels": torch.tensor([[10, 2, -100, 11, 12, 2, -100], [-100, 21, 22, 2, -100, -100, -100]]),
    "positions": torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]]),
    "loss_mask": torch.tensor([[1.0, 1, 0, 1, 1, 1, 0], [0.0, 1, 1, 1, 0, 0, 0]]),
    "cu_seqlens": torch.tensor([[0, 3, 7], [0, 5, 7]], dtype=torch.int32),
    "padding_mask": torch.tensor([[False] * 7, [False] * 5 + [True] * 2]),
}

LITERAL_LINES = [
    "batch: 2 rows x 7 tokens; 8 of 14 labels supervised (57%); 2 of 14 tokens padding (14%)",
    "",
    "row 0 (sample (0, 0, 0)): 7 tokens, 2 segments, 0 padding (0%), 5 supervised (71%)",
    "  pos   |0  1  2|0  1  2  3",
    "  in    |1  10 2|1  11 12 2",
    "  label |10 2  -|11 12 2  -",
    "  mask  |+  +  .|+  +  +  .",
    "",
    "row 1 (sample (0, 0, 1)): 7 tokens, 2 segments, 2 padding (29%), 3 supervised (43%)",
    "  pos   |0 1  2  3  4|0 1",
    "  in    |1 20 21 22 2|0 0",
    "  label |- 21 22 2  -|- -",
    "  mask  |. +  +  +  .|_ _",
    "",
    "legend: | starts a segment; mask + supervised, . ignored, _ padding, ! supervised padding",
    "warnings: none",
]

OPTIONS = {
    "return_labels": True,
    "return_loss_mask": True,
    "return_cu_seqlens": True,
    "return_padding_mask": True,
}


def quickstart(**options):
    """The quickstart's two rows, through to_training with ``options`` (OPTIONS by default)."""
    rows = [
        ([1, 10, 2, 1, 11, 12, 2, 0], [0, 1, 2, 0, 1, 2, 3, 0], [1, 1, 1, 1, 1, 1, 1, 0], 1),
        ([1, 20, 21, 22, 2, 0, 0, 0], [0, 1, 2, 3, 4, 0, 1, 2], [0, 0, 1, 1, 1, 0, 0, 0], 3),
    ]
    records = [
        SampleRecord(
            SampleMeta((0, 0, i), 0, 7, i, tags={"_padding_length": pad}),
            {"input_ids": ids, "positions": pos, "loss_mask": mask},
        )
        for i, (ids, pos, mask, pad) in enumerate(rows)
    ]
    return SampleBatch(records).to_training(
        **(options or {**OPTIONS, "eos_mask_loss": True, "eos_token_id": 2})
    )


def chat_batch():
    """One chat example (prompt 'Hi\\n', response 'ok') packed into a row of 9 tokens, collated."""
    records = to_records([Document(CHAT, prompt="Hi\n", response="ok")])
    rows = pack_flat(records, 9, pad_token_id=PAD)
    return SampleBatch(rows).to_training(**OPTIONS, eos_mask_loss=True, eos_token_id=EOS)


def test_literal_batch_renders_exactly():
    assert render_batch(LITERAL).splitlines() == LITERAL_LINES


def test_to_training_output_renders_like_the_literal():
    assert render_batch(quickstart()) == render_batch(LITERAL)


def test_chat_example_with_byte_tokenizer_renders_exactly():
    text = render_batch(chat_batch(), ByteTokenizer())
    assert text.splitlines()[:8] == [
        "batch: 1 row x 8 tokens; 3 of 8 labels supervised (38%); 1 of 8 tokens padding (12%)",
        "",
        "row 0 (sample (1, 0, 0)): 8 tokens, 2 segments, 1 padding (12%), 3 supervised (38%)",
        "  pos   |0     1 2 3  4 5     6    |0",
        "  in    |<bos> H i \\n o k     <eos>|<pad>",
        "  label |-     - - o  k <eos> -    |-",
        "  mask  |.     . . +  + +     .    |_",
        "",
    ]
    assert text.endswith("warnings: none")


def test_rows_wrap_at_width_and_keep_their_columns():
    text = render_batch(LITERAL, width=22)
    row0 = text.split("\n\n")[1].splitlines()
    assert row0 == [
        "row 0 (sample (0, 0, 0)): 7 tokens, 2 segments, 0 padding (0%), 5 supervised (71%)",
        "  pos   |0  1  2|0  1",
        "  in    |1  10 2|1  11",
        "  label |10 2  -|11 12",
        "  mask  |+  +  .|+  +",
    ]
    assert text.split("\n\n")[2].splitlines() == [
        "  pos    2  3",
        "  in     12 2",
        "  label  2  -",
        "  mask   +  .",
    ]


def test_max_rows_and_max_tokens_cut_the_view_not_the_summary():
    text = render_batch(LITERAL, max_rows=1, max_tokens=3)
    assert "  in    |1  10 2" in text
    assert "  ... 4 more tokens; segments start there at tokens 3" in text  # where documents meet
    assert "... 1 more rows" in text
    assert "row 1" not in text
    assert text.startswith("batch: 2 rows x 7 tokens")


def test_long_trailing_padding_is_collapsed():
    batch = {"input_ids": [[1, 5, 2, 0, 0, 0, 0, 0, 0]], "padding_mask": [[False] * 3 + [True] * 6]}
    assert render_batch(batch).splitlines()[3:6] == [
        "  in    |1 5 2 0 0 0 0",
        "  mask  |      _ _ _ _",
        "  ... 2 more padding tokens",
    ]
    assert "more padding" not in render_batch(batch, collapse_padding=None)


def test_color_adds_ansi_codes_only():
    colored = render_batch(LITERAL, color=True)
    assert "\x1b[32m" in colored and "\x1b[1;35m|" in colored
    assert ANSI.sub("", colored) == render_batch(LITERAL)
    assert "\x1b[" not in render_batch(LITERAL)


def test_token_text_escapes_and_tokenizers():
    tok = ByteTokenizer()
    assert [token_text(tok, i) for i in tok.encode(" \n\t\ra")] == ["␣", "\\n", "\\t", "\\r", "a"]
    assert token_text(tok, 0x80 + 3) == "\\x80"
    assert token_text(None, 42) == "42"
    assert token_text(lambda i: f"tok{i}", 7) == "tok7"
    assert token_text(lambda i: "x" * 40, 7) == "x" * 15 + "~"

    class HuggingFaceLike:
        def decode(self, ids):
            return " the" if ids == [5] else "<|end|>"

    assert token_text(HuggingFaceLike(), 5) == "␣the"
    assert token_text(HuggingFaceLike(), 6) == "<|end|>"


def test_flattened_batch_is_one_row():
    flat = quickstart(**OPTIONS, flatten=True, eos_mask_loss=True, eos_token_id=2)
    (row,) = batch_rows(flat)
    assert len(row.input_ids) == 14
    assert row.starts == [0, 3, 7, 12]
    assert batch_warnings(flat) == []
    assert render_batch(flat).startswith("batch: 1 row x 14 tokens")


def test_a_flattened_rows_last_label_is_no_crossing():
    # Flattened, each row's end is a segment start whose label is the row's own next token (cut off):
    # every clean flattened batch was warned of a crossing.
    from zephon_collate import Collator

    rows = [
        {"input_ids": [1, 5, 6, 7, 2, 1, 8, 9], "positions": [0, 1, 2, 3, 4, 0, 1, 2]},
        {"input_ids": [1, 3, 2, 4, 5, 6, 7, 8], "positions": [0, 1, 2, 3, 0, 1, 2, 3]},
    ]
    assert batch_warnings(Collator(return_labels=True, flatten=True)(rows)) == []
    same = [  # a record's last token equal to the next record's first: still no crossing
        {"input_ids": [1, 5, 6, 7], "positions": [0, 1, 2, 3]},
        {"input_ids": [7, 8, 9, 2], "positions": [0, 1, 2, 3]},
    ]
    assert batch_warnings(Collator(return_labels=True, flatten=True)(same)) == []
    shown = render_batch(Collator(return_labels=True, flatten=True)(same), color=False)  # the drawing agrees
    assert "cross a segment boundary" not in shown
    crossing = Collator(return_labels=True, flatten=True, boundary_safe_labels=False)(rows)
    assert crossing["labels"].tolist()[3:5] == [2, 1]  # a real crossing is still found
    assert any("cross a segment boundary (first: token 4 -> 5)" in w for w in batch_warnings(crossing))


def test_batch_without_labels_shows_the_raw_mask():
    raw = {"input_ids": [[1, 5, 2]], "loss_mask": [[0, 1, 1]]}
    lines = render_batch(raw).splitlines()
    assert lines[0] == "batch: 1 row x 3 tokens; 2 of 3 tokens supervised (67%); 0 of 3 tokens padding (0%)"
    assert lines[3:5] == ["  in    |1 5 2", "  mask  |. + +"]


# ---- warnings -------------------------------------------------------------------------------


def test_no_warning_for_a_clean_batch():
    assert batch_warnings(LITERAL) == []
    assert batch_warnings(chat_batch()) == []


def test_all_zero_loss_mask_is_flagged_for_the_batch():
    batch = dict(LITERAL, labels=torch.full((2, 7), -100), loss_mask=torch.zeros(2, 7))
    warnings = batch_warnings(batch)
    assert warnings[0].startswith("batch: no supervised token in any row")
    assert not any("row 0: no supervised" in w for w in warnings)
    assert "warnings (" in render_batch(batch)


def test_a_row_without_supervised_tokens_is_flagged():
    labels = LITERAL["labels"].clone()
    labels[1] = -100
    batch = dict(LITERAL, labels=labels, loss_mask=(labels != -100).float())
    assert batch_warnings(batch) == [
        "row 1: no supervised token: its loss mask is all zero (every label is ignored), so it adds "
        "nothing to the loss; check the chat template's assistant mask"
    ]


def test_mostly_padding_row_is_flagged():
    padding = torch.tensor([[False] * 7, [False] * 3 + [True] * 4])
    batch = dict(LITERAL, padding_mask=padding)
    assert (
        "row 1: 4 of 7 tokens (57%) are padding: pack more documents per row, or shorten seq_len"
        in batch_warnings(batch)
    )
    assert not any("padding:" in w for w in batch_warnings(LITERAL))  # 2 of 7 is fine


def test_padding_from_pad_token_id_without_padding_mask():
    batch = {key: value for key, value in LITERAL.items() if key != "padding_mask"}
    assert [row.num_padding for row in batch_rows(batch)] == [0, 0]
    assert [row.num_padding for row in batch_rows(batch, pad_token_id=0)] == [0, 2]


def test_positions_that_disagree_with_cu_seqlens_are_flagged():
    batch = quickstart(**OPTIONS, position_mode="sequence", eos_mask_loss=True, eos_token_id=2)
    warnings = batch_warnings(batch)
    assert warnings[0] == (
        "row 0: positions restart at 0 at tokens [0] but cu_seqlens starts segments at [0, 3]: the "
        "model's positions and its attention boundaries disagree (position_mode='sequence' does this on purpose)"
    )
    assert warnings[1].startswith(
        "row 1: positions restart at 0 at tokens [0] but cu_seqlens starts segments at [0, 5]"
    )


def test_positions_that_skip_are_flagged():
    batch = dict(LITERAL, positions=torch.tensor([[0, 1, 2, 0, 1, 3, 4], [0, 1, 2, 3, 4, 0, 1]]))
    warnings = batch_warnings(batch)
    assert (
        "row 0: positions do not count up by one inside a segment at 1 tokens (first: token 5, 1 -> 3)"
        in warnings
    )


def test_supervised_padding_is_flagged_and_marked():
    labels = LITERAL["labels"].clone()
    labels[1, 6] = 7
    batch = dict(LITERAL, labels=labels, loss_mask=(labels != -100).float())
    assert "row 1: 1 padding tokens have supervised labels; they train on padding" in batch_warnings(batch)
    assert "  mask  |. +  +  +  .|_ !" in render_batch(batch)


def test_labels_across_a_segment_boundary_are_flagged():
    batch = quickstart(**OPTIONS)  # no eos_mask_loss: EOS -> next BOS stays supervised
    (warning,) = batch_warnings(batch)
    assert warning.startswith("row 0: 1 supervised labels cross a segment boundary (first: token 2 -> 3)")
    assert "eos_mask_loss=True" in warning and "Collator(boundary_safe_labels=True)" in warning


def test_loss_mask_that_disagrees_with_labels_is_flagged():
    batch = dict(LITERAL, loss_mask=torch.ones(2, 7))
    warnings = batch_warnings(batch)
    assert "row 0: loss_mask and labels disagree at 2 tokens" in warnings[0]
    assert "row 1: loss_mask and labels disagree at 4 tokens" in warnings[1]


def test_bad_batches_raise():
    with pytest.raises(KeyError, match="no 'input_ids'"):
        render_batch({"labels": [[1]]})
    with pytest.raises(ValueError, match="field 'labels' has rows of lengths"):
        render_batch({"input_ids": [[1, 2]], "labels": [[1]]})


# ---- PNG ------------------------------------------------------------------------------------


def test_png_is_written(tmp_path):
    path = render_batch_png(chat_batch(), tmp_path / "sub" / "batch.png", ByteTokenizer(), title="chat")
    data = path.read_bytes()
    assert path == tmp_path / "sub" / "batch.png"
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 1_000 < len(data) < 300_000


def test_png_of_a_batch_with_warnings(tmp_path):
    batch = dict(LITERAL, labels=torch.full((2, 7), -100), loss_mask=torch.zeros(2, 7))
    path = render_batch_png(batch, tmp_path / "bad.png", max_tokens=5, tokens_per_line=3)
    assert path.read_bytes()[:4] == b"\x89PNG"


# ---- command line ---------------------------------------------------------------------------


def test_show_jsonl_text_records(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    lines = [{"text": "x = 1\n"}, {"prompt": "Say hi.\n", "response": "hi"}, {"text": "y = 2\n"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["show", str(path), "--seq-len", "24", "--no-color", "--png", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch: 2 rows x 24 tokens;")
    assert "  in    |<bos> x ␣ = ␣ 1  \\n    <eos>|<bos> S a y ␣ h i . \\n h i     <eos>|<pad>" in out
    assert (
        "  mask  |+     + + + + +  +     .    |.     . . . . . . . +  + +     .    |_     _     _     _"
        in out
    )
    assert "\x1b[" not in out
    assert "  in    |<bos> y ␣ = ␣ 2  \\n    <eos>|<pad> <pad> <pad> <pad>\n" in out  # 16 padding tokens:
    assert "  ... 12 more padding tokens\n" in out  # the first 4 shown
    assert f"wrote {tmp_path / 'r.png'}" in out
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_show_a_chat_example_longer_than_a_row(tmp_path, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "q" * 20, "response": "a" * 20}) + "\n")
    assert main(["show", str(path), "--seq-len", "16", "--no-color"]) == 2
    assert "more than seq_len=17, and a prompt" in capsys.readouterr().err
    assert main(["show", str(path), "--seq-len", "16", "--no-color", "--overflow", "truncate"]) == 0
    assert "0 of 16 labels supervised" in capsys.readouterr().out  # the head of it is all prompt


def test_show_jsonl_token_records_unpacked(tmp_path, capsys):
    path = tmp_path / "tokens.jsonl"
    rows = [{"input_ids": [1, 5, 6, 2], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [1, 7, 2]}]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    assert main(["show", str(path), "--no-color"]) == 2  # mixed masks: the packer's error, in one line
    assert (
        "show: error: record 0 (sample_id (0, 0, 0)) has a 'loss_mask' but record 1"
        in capsys.readouterr().err
    )
    rows[1]["loss_mask"] = [0, 0, 0]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    assert main(["show", str(path), "--no-pack", "--eos-id", "2", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2:6] == [  # ids (no tokenizer), no positions (no pos line)
        "row 0 (sample (0, 0, 0)): 3 tokens, 1 segment, 0 padding (0%), 2 supervised (67%)",
        "  in    |1 5 6",
        "  label |- 6 2",
        "  mask  |. + +",
    ]
    assert "row 1: no supervised token" in out


def test_show_reports_bad_input_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["show", str(empty)]) == 2
    assert capsys.readouterr().err == f"python -m demo show: error: {empty} holds no records\n"
    assert main(["show", str(tmp_path / "missing.pt")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_show_saved_batch(tmp_path, capsys):
    path = tmp_path / "batch.pt"
    torch.save(LITERAL, path)
    assert main(["show", str(path), "--no-color", "--width", "100"]) == 0
    assert capsys.readouterr().out.splitlines() == LITERAL_LINES


def test_show_demo_batch(capsys):
    assert (
        main(["show", "--demo-batch", "--seq-len", "48", "--batch-size", "2", "--no-color", "--rows", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("batch: 2 rows x 48 tokens;")
    assert "row 0" in out and "... 1 more rows" in out


# --- Hugging Face layouts ------------------------------------------------------------------------

HF_EXAMPLES = [
    {"input_ids": [1, 10, 11, 2], "labels": [-100, -100, 11, 2]},
    {"input_ids": [1, 20, 2], "labels": [-100, 20, 2]},
]


@pytest.mark.parametrize("padding_free", [False, True])
def test_transformers_batches_read_as_the_page_does(padding_free):
    """Both for_transformers layouts: segments from position_ids / cu_seq_lens_q, padding from
    attention_mask, unshifted labels drawn as what each token's logits predict; one row per
    example padded, one row for the batch padding-free."""
    from zephon_collate import Collator

    collate = Collator.for_transformers(
        pad_token_id=0, padding_free=padding_free, return_flash_attn_kwargs=padding_free
    )
    rows = batch_rows(collate(HF_EXAMPLES))
    if padding_free:
        (row,) = rows
        assert row.input_ids == [1, 10, 11, 2, 1, 20, 2]
        assert row.starts == [0, 4] and row.position_starts == [0, 4] and row.cu_starts == [0, 4]
        assert row.labels == [-100, 11, 2, -100, 20, 2, -100]
        assert row.padding == [False] * 7
    else:
        assert [r.labels for r in rows] == [[-100, 11, 2, -100], [20, 2, -100, -100]]
        assert [r.padding for r in rows] == [[False] * 4, [False, False, False, True]]
        assert [r.starts for r in rows] == [[0], [0]]
    assert batch_warnings(rows) == []


def test_transformers_batch_warnings_see_labels_across_documents():
    """A padding-free HF batch whose first labels are trained (DataCollatorWithFlattening without
    its separator) trains across the documents: the inspector says so instead of 'none'."""
    from zephon_collate import Collator

    unsafe = Collator.for_transformers(padding_free=True, boundary_safe_labels=False)
    batch = unsafe([{"input_ids": [1, 10, 2]}, {"input_ids": [1, 20, 2]}])
    assert batch["labels"].tolist() == [[1, 10, 2, 1, 20, 2]]
    (warning,) = batch_warnings(batch)
    assert warning.startswith("row 0: 1 supervised labels cross a segment boundary (first: token 2 -> 3)")
    assert "warnings: none" not in render_batch(batch)


def test_transformers_padded_batch_renders_its_padding_and_shifted_labels():
    from zephon_collate import Collator

    text = render_batch(Collator.for_transformers(pad_token_id=0)(HF_EXAMPLES), width=60)
    assert "row 1: 4 tokens, 1 segment, 1 padding (25%), 2 supervised (50%)" in text
    assert "  label |20 2  - -" in text  # token 1 predicts 20, token 20 predicts 2
    assert text.rstrip().endswith("warnings: none")


def test_cut_rows_still_show_where_documents_meet(tmp_path):
    """--max-tokens hides tokens, not boundaries: the starts beyond the cut are listed."""
    batch = {"input_ids": [list(range(1, 41))], "positions": [[*range(20), *range(15), *range(5)]]}
    text = render_batch(batch, max_tokens=10)
    assert "  ... 30 more tokens; segments start there at tokens 20, 35" in text
    assert "row 0: 40 tokens, 3 segments" in text
    render_batch_png(batch, tmp_path / "cut.png", max_tokens=10)  # the PNG header says the same


def test_cu_seqlens_of_the_wrong_depth_are_named():
    batch = {"input_ids": [[1, 2, 3]], "labels": [[2, 3, -100]], "cu_seqlens": [[[0, 3]]]}
    with pytest.raises(ValueError, match=r"field 'cu_seqlens' must hold \[B, K\] or \[K\] boundaries"):
        batch_rows(batch)


def test_a_label_predicting_padding_and_a_vision_batch_are_read():
    """A right-padded batch's label on the first padding place trains the last real token to predict the
    pad: it was missed (one place later was flagged). A padding-free mRoPE batch ([4, 1, N] positions) was
    refused; its text positions are read."""
    import numpy as np

    from zephon_collate import Collator
    from zephon_collate.layouts.vision import MRope

    batch = {
        "input_ids": [[5, 6, 7, 8, 9], [9, 10, 3, 0, 0]],
        "attention_mask": [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]],
        "labels": [[5, 6, 7, 8, 9], [9, 10, 3, -100, -100]],
    }
    assert batch_warnings(batch) == []
    for place in (3, 4):
        labels = [row[:] for row in batch["labels"]]
        labels[1][place] = 0
        assert batch_warnings({**batch, "labels": labels}) == [
            "row 1: 1 padding tokens have supervised labels; they train on padding"
        ]
    image = {
        "input_ids": [5, 5] + [120] * 4 + [6, 6],
        "mm_token_type_ids": [0, 0] + [1] * 4 + [0, 0],
        "pixel_values": np.zeros((16, 16), np.float32),
        "image_grid_thw": [[1, 4, 4]],
    }
    flat = Collator.for_transformers(padding_free=True, mrope=MRope(spatial_merge_size=2))([image, image])
    assert tuple(flat["position_ids"].shape) == (4, 1, 16) and batch_warnings(flat) == []
