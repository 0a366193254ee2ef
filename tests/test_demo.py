"""The demo: corpus and records, a short real training run (loss falls), and no attention across documents."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from demo import (
    CHAT,
    EOS,
    PAD,
    SOURCE,
    ByteTokenizer,
    DemoConfig,
    Document,
    DocumentTransformer,
    ModelConfig,
    demo_batch,
    load_documents,
    make_collator,
    pack_rows,
    run_demo,
    to_records,
)
from demo.__main__ import main
from demo.corpus import split_python

from zephon_collate import SampleBatch, pack_flat
from zephon_collate.inspection.leakage import check_no_leakage

TINY = {"dim": 32, "layers": 2, "heads": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run of the real pipeline: stdlib corpus, pack_flat, 2 DataLoader workers, Collator."""
    out = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    config = DemoConfig(
        seq_len=96,
        steps=40,
        batch_size=8,
        workers=2,
        eval_rows=8,
        eval_every=10,
        warmup=4,
        progress=False,
        out=str(out),
        sample_bytes=16,
        **TINY,
    )
    return run_demo(config, log=lines.append), lines, out


def test_loss_falls(trained):
    result, _, _ = trained
    assert len(result.losses) == 40
    assert result.final_loss < result.losses[0] - 1.0
    (first_step, first), (last_step, last) = result.eval_losses[0], result.eval_losses[-1]
    assert (first_step, last_step) == (0, 40)
    assert last < first - 1.0  # held-out rows, never trained on


def test_run_reports_and_writes_the_loss_curve(trained):
    result, lines, out = trained
    text = "\n".join(lines)
    assert text.startswith("corpus: ")
    assert "done in " in text and "tokens per mixture component" in text
    assert "  0 source" in text
    assert result.plot == out / "loss_curve.png"
    assert result.plot.read_bytes()[:4] == b"\x89PNG"
    assert result.tokens == 40 * 8 * 96
    assert result.real_tokens <= result.tokens and result.supervised_tokens <= result.real_tokens
    # Component token counts come from the rows' metadata: they add up to the real tokens packed,
    # one more per row than the model's inputs (the label shift drops the last token of a row).
    assert sum(result.component_tokens.values()) >= result.real_tokens


def test_no_attention_across_documents(trained):
    """Each document's logits in a packed row equal its logits when run alone."""
    result, _, _ = trained
    model = result.model.eval()
    snippets = [
        d.text[:n]
        for d, n in zip(load_documents(budget_chars=5_000), [5, 30, 12, 40, 7, 22, 18, 9], strict=False)
    ]
    records = to_records([Document(SOURCE, text=s, index=i) for i, s in enumerate(snippets)])
    batch = make_collator()(pack_flat(records, 65, pad_token_id=PAD))
    report = check_no_leakage(
        model, batch["input_ids"], batch["positions"], padding_mask=batch["padding_mask"], atol=1e-5
    )
    assert len(report.documents) > len(batch["input_ids"])  # several documents per row
    assert report.ok, str(report)

    def plain_causal(input_ids, positions, segment_ids):  # attention over the whole row: leaks
        return model(input_ids, positions, torch.zeros_like(segment_ids))

    leaky = check_no_leakage(
        plain_causal,
        batch["input_ids"],
        batch["positions"],
        padding_mask=batch["padding_mask"],
        raise_on_leak=False,
    )
    assert not leaky.ok


def test_eval_batch_is_clean_for_the_inspector(trained):
    from zephon_collate.inspection.rows import batch_warnings

    result, _, _ = trained
    assert batch_warnings(result.eval_batch) == []


# ---- corpus, tokenizer, records -------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é€'\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == EOS and ids.dtype == np.int64
    assert ids[1:-1].min() >= 3 and ids.max() < 259
    assert tok.decode(ids) == f"<bos>{text}<eos>"


def test_stdlib_corpus_has_both_components():
    documents = load_documents(max_chars=255, budget_chars=40_000)
    components = {d.component for d in documents}
    assert components == {SOURCE, CHAT}
    chat = next(d for d in documents if d.component == CHAT)
    assert chat.prompt.lstrip().startswith(("def ", "async def ", "@"))
    assert '"""' in chat.prompt or "'''" in chat.prompt
    assert chat.response.strip() and len(chat.prompt) + len(chat.response) <= 255


def test_split_python_takes_documented_functions_out_of_the_source():
    source = '''import os


def documented(a, b):
    """Add them."""
    total = a + b
    return total


def bare(x):
    return x
'''
    documents = split_python(source, max_chars=200)
    assert [(d.component, d.index) for d in documents] == [(CHAT, 0), (SOURCE, 1)]
    assert documents[0].prompt == 'def documented(a, b):\n    """Add them."""\n'
    assert documents[0].response == "    total = a + b\n    return total\n"
    assert "documented" not in documents[1].text and "def bare(x):" in documents[1].text


def test_chat_records_mask_the_prompt():
    (record,) = to_records([Document(CHAT, prompt="ab", response="cd", shard=3, index=5)])
    assert record.payload["input_ids"].tolist() == [1, 100, 101, 102, 103, 2]
    assert record.payload["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    assert record.meta.sample_id == (CHAT, 3, 5)
    assert record.meta.lane_id == CHAT
    assert record.meta.component_sample_counts == {CHAT: 1}


def test_user_corpus_folder_and_jsonl(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("First paragraph of prose, long enough to be a block on its own here.\n")
    (folder / "sub" / "b.py").write_text('def f():\n    """Doc."""\n    return [1, 2, 3, 4, 5, 6]\n')
    (folder / "blob.bin").write_bytes(b"\x00\x01")
    documents = load_documents(folder, max_chars=200)
    assert sorted(d.component for d in documents) == [SOURCE, CHAT]

    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(
        json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"prompt": "q", "response": "a"}) + "\n"
    )
    assert sorted(d.component for d in load_documents(jsonl)) == [SOURCE, CHAT]
    jsonl.write_text(json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:1: each line must be"):
        load_documents(jsonl)
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "missing")


def test_pack_rows_and_demo_batch():
    rows, documents, left_out = pack_rows(None, 64, 20)
    assert all(row.payload["input_ids"].shape == (65,) for row in rows)
    assert all(row.meta.component_token_counts for row in rows)
    assert documents and left_out == 0


def test_chat_examples_longer_than_a_row_are_left_out_and_counted(tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    lines = [{"prompt": "q" * 10, "response": "a" * 10}, {"prompt": "q" * 40, "response": "a" * 40}]
    lines.append({"text": "t" * 200})  # plain text longer than a row is split, as before
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows, documents, left_out = pack_rows(str(jsonl), 32, 4)
    assert left_out == 1 and sorted(len(d.prompt) for d in documents) == [0, 10]
    assert sum(int(row.payload["input_ids"].size - row.meta.padding_length) for row in rows) == 22 + 202
    batch = demo_batch(seq_len=64, batch_size=3)
    assert batch["input_ids"].shape == (3, 64)
    assert {"labels", "loss_mask", "positions", "cu_seqlens", "padding_mask"} <= batch.keys()


def test_model_matches_its_documents_alone_untrained():
    torch.manual_seed(0)
    model = DocumentTransformer(ModelConfig(**TINY)).eval()
    rows = pack_flat(
        to_records([Document(SOURCE, text="x" * n, index=n) for n in (3, 9, 4, 6)]), 33, pad_token_id=PAD
    )
    batch = SampleBatch(rows).to_training(return_labels=True, return_padding_mask=True)
    assert check_no_leakage(
        model, batch["input_ids"], batch["positions"], padding_mask=batch["padding_mask"]
    ).ok


def test_demo_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # without tqdm: plain progress lines
    args = [
        "demo",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--workers",
        "0",
        "--threads",
        "1",
    ]
    assert main([*args, "--out", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "(1 thread); 2 steps of 2 x 32 tokens, 0 DataLoader workers" in out
    assert "step 2/2: loss " in out and " tok/s, padding " in out
    assert "done in" in out and "on cpu" in out
    assert (tmp_path / "loss_curve.png").exists()


def test_demo_batch_shows_a_prompt_several_documents_and_padding():
    """The README's `show --demo-batch` opens on a row with everything a packed batch holds."""
    batch = demo_batch()  # the README's sizes: 4 rows of 128 tokens
    padding, mask = batch["padding_mask"][0], batch["loss_mask"][0]
    boundaries = batch["cu_seqlens"][0].unique()
    assert len(boundaries) - 1 >= 3  # two or more documents, then the padding segment
    assert bool(padding.any())  # trailing padding in the inputs
    assert bool((mask[~padding] == 0).any())  # a prompt: real tokens left unsupervised
