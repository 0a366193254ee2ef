"""Fields that change what gets supervised are used or refused, never silently dropped."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import as_lists, batch, record
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, SampleBatch, pack_flat

# Hugging Face-style rows: a prompt masked with -100 in labels, trailing padding marked 0 in attention_mask.
HF_ROWS = [
    {
        "input_ids": [1, 5, 6, 7, 0, 0],
        "attention_mask": [1, 1, 1, 1, 0, 0],
        "labels": [-100, -100, 6, 7, -100, -100],
    },
    {"input_ids": [1, 8, 9, 2, 3, 4], "attention_mask": [1] * 6, "labels": [-100, 8, 9, 2, 3, 4]},
]
OPTIONS = {"return_labels": True, "return_num_valid_tokens": True}


def test_hf_rows_are_refused_not_trained_on_padding_and_prompts():
    """The reproduction: these rows gave num_valid_tokens 10 where 4 was right; now an error names the fix."""
    with pytest.raises(
        ValueError,
        match=r"record 0 .*'attention_mask' that is not all 1s.*Collator.for_transformers.*Collator\(pad_token_id",
    ):
        Collator(**OPTIONS)(HF_ROWS)
    numbered = {"input_ids": [5, 6, 7, 8], "attention_mask": [1, 1, 2, 2]}  # OpenRLHF's packed numbering
    with pytest.raises(ValueError, match=r"record 0 .*not all 1s \(padding's zeros, or the sequence numbers"):
        Collator(**OPTIONS)([numbered])
    no_mask = [{k: v for k, v in row.items() if k != "attention_mask"} for row in HF_ROWS]
    with pytest.raises(
        ValueError,
        match=r"record 0 .*'labels' that differ.*Collator.for_transformers.*loss_mask = labels != -100",
    ):
        Collator(**OPTIONS)(no_mask)


def test_for_transformers_uses_both_fields():
    """The first fix the errors name: HF rows, HF conventions (unshifted labels, padding dropped)."""
    out = Collator.for_transformers(pad_token_id=0)(HF_ROWS)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 0, 0], [1, 8, 9, 2, 3, 4]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert out["labels"].tolist() == [[-100, -100, 6, 7, -100, -100], [-100, 8, 9, 2, 3, 4]]
    assert int((out["labels"] != -100).sum()) == 7


def test_the_named_fix_trains_exactly_the_supervised_tokens():
    fixed = [
        {"input_ids": row["input_ids"], "loss_mask": [int(label != -100) for label in row["labels"]]}
        for row in HF_ROWS
    ]
    out = Collator(**OPTIONS)(fixed)
    assert out["labels"].tolist() == [[-100, 6, 7, -100, -100], [8, 9, 2, 3, 4]]
    assert out["num_valid_tokens"] == 7  # 6, 7 in row 0; 8, 9, 2, 3, 4 in row 1


def test_assistant_masks_are_refused_unless_they_are_the_loss_mask():
    chat = {"input_ids": [1, 5, 6, 7], "assistant_masks": [0, 0, 1, 1]}
    with pytest.raises(
        ValueError, match=r"record 0 .*'assistant_masks' with zeros.*loss_mask = assistant_masks"
    ):
        Collator(**OPTIONS)([chat])
    with pytest.raises(ValueError, match="'assistant_masks' with zeros"):
        Collator(**OPTIONS)([{**chat, "loss_mask": [1, 1, 1, 1]}])
    out = Collator(**OPTIONS)([{**chat, "loss_mask": [0, 0, 1, 1]}])
    assert out["labels"].tolist() == [[-100, 6, 7]] and out["num_valid_tokens"] == 2
    assert Collator(**OPTIONS)([{**chat, "assistant_masks": [1] * 4}])["num_valid_tokens"] == 3


def test_harmless_copies_and_used_fields_pass():
    plain = {"input_ids": [1, 5, 6], "attention_mask": [1, 1, 1], "labels": [1, 5, 6]}
    assert Collator(**OPTIONS)([plain])["labels"].tolist() == [[5, 6]]
    through = batch({"input_ids": [5, 6, 7], "attention_mask": torch.tensor([1, 1, 0])})
    assert through.to_training(extra_fields=["attention_mask"])["attention_mask"].tolist() == [[1, 1, 0]]


def test_packed_labels_are_refused_at_collation():
    """pack_flat carries a labels field into its rows; to_training then refuses it instead of ignoring it."""
    rows = pack_flat(
        [record({"input_ids": [1, 5, 6], "labels": [-100, 5, 6]})], 4, pad_token_id=0, fields=["labels"]
    )
    with pytest.raises(ValueError, match=r"'labels' that differ from its tokens"):
        Collator(**OPTIONS)(rows)


def _without(payloads, names):
    return [{k: v for k, v in p.items() if k not in names} for p in payloads]


def test_to_training_returns_the_pages_result_whatever_else_a_payload_carries():
    """The regression: fields the call does not read never make to_training raise."""
    rows = [{**row, "type_ids": [0] * len(row["input_ids"])} for row in HF_ROWS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no labels: nothing is supervised, so nothing is said
        out = batch(*rows).to_training(extra_fields=["type_ids"])
    assert out["type_ids"].tolist() == [[0] * 6, [0] * 6]
    assert "attention_mask" not in out and "labels" not in out
    options = {"return_labels": True, "flatten": True, "dtype": torch.int32, "return_padding_mask": True}
    with pytest.warns(
        UserWarning, match=r"record 0 .*'attention_mask' that is not all 1s.*for_transformers"
    ) as caught:
        out = batch(*rows).to_training(**options)
    assert len(caught) == 1  # once per call, for the first record
    page = batch(*_without(rows, {"attention_mask", "labels"})).to_training(**options)
    assert as_lists(out) == as_lists(page)
    assert out["input_ids"].dtype == torch.int32 and out["padding_mask"].tolist() == [False] * 10


@pytest.mark.parametrize(
    "extra",
    [
        {"attention_mask": None},
        {"labels": None},
        {"completion_mask": None},
        {"assistant_masks": "n/a"},
        {"labels": [[1, 2], [3]]},
        {"labels": [2**70, 1, 1]},
        {"label_ids": None},
        {"seq_lengths": None},
        {"response_mask": None},
    ],
)
def test_an_unreadable_field_the_call_does_not_use_is_warned_of_not_raised(extra):
    """A value the supervision check cannot read is not the page's business: to_training gives its result."""
    b = batch({"input_ids": [1, 2, 3], **extra})
    with pytest.warns(UserWarning, match=r"record 0 .*the field is not read here"):
        out = b.to_training(return_labels=True)
    assert out["input_ids"].tolist() == [[1, 2]] and out["labels"].tolist() == [[2, 3]]
    with pytest.raises((TypeError, ValueError), match=r"record 0"):  # the Collator's safety refuses it
        Collator(return_labels=True)([{"input_ids": [1, 2, 3], **extra}])


def test_an_unreadable_field_does_not_hide_another_fields_warning():
    """Each field is checked on its own: record 0's mask with zeros is still named."""
    b = batch({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]}, {"input_ids": [4, 5, 6], "labels": None})
    with pytest.warns(UserWarning) as caught:
        out = b.to_training(return_labels=True)
    messages = [str(warning.message) for warning in caught]
    assert any(re.search(r"record 0 .*'attention_mask' that is not all 1s", message) for message in messages)
    assert any(re.search(r"record 1 .*'labels' must be .*not read here", message) for message in messages)
    assert out["labels"].tolist() == [[2, 3], [5, 6]]


def test_the_collator_and_its_presets_keep_refusing():
    rows = [{**row, "type_ids": [0] * 6} for row in HF_ROWS]
    with pytest.raises(ValueError, match=r"record 0 .*'attention_mask' that is not all 1s"):
        Collator(extra_fields=["type_ids"])(rows)
    with pytest.raises(ValueError, match=r"record 0 .*'attention_mask' that is not all 1s"):
        Collator(extra_fields=["type_ids"]).stack(rows)


@pytest.mark.parametrize("name", ["assistant_masks", "assistant_mask", "completion_mask"])
def test_trl_and_chat_template_masks_are_named(name):
    chat = {"input_ids": [1, 5, 6, 7], name: [0, 0, 1, 1]}
    with pytest.raises(ValueError, match=rf"record 0 .*'{name}' with zeros.*loss_mask = {name}"):
        Collator(**OPTIONS)([chat])
    with pytest.warns(UserWarning, match=rf"'{name}' with zeros"):
        out = batch(chat).to_training(**OPTIONS)
    assert out["num_valid_tokens"] == 3  # the page's labels: every token


class Remapped(dict):
    """A dict subclass whose __getitem__ answers differently from dict.get."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return [token + 1 for token in value] if key == "input_ids" else value


def test_payload_mappings_are_read_through_their_mapping_interface():
    payload = Remapped(input_ids=[1, 2, 3], text="hi")
    out = batch(payload).to_training(return_labels=True)
    assert out["input_ids"].tolist() == [[2, 3]] and out["labels"].tolist() == [[3, 4]]
    assert out["texts"] == ["hi"]
    rows = pack_flat([record(Remapped(input_ids=[5, 6], w=[1, 1]))], 3, pad_token_id=0)
    assert rows[0].payload["input_ids"].tolist() == [6, 7, 0] and rows[0].payload["w"].tolist() == [1, 1, 0]


SUPERVISING = {
    "attention_mask": lambda n, draw: [1] * (n - draw) + [0] * draw,
    "labels": lambda n, draw: [-100] * draw + list(range(10, 10 + n - draw)),
    "completion_mask": lambda n, draw: [0] * draw + [1] * (n - draw),
}


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 6), min_size=1, max_size=3).map(lambda ls: [ls[0]] * len(ls)),
    fields=st.sets(st.sampled_from(sorted(SUPERVISING))),
    zeros=st.integers(0, 2),
    labels=st.booleans(),
)
def test_unread_supervising_fields_never_change_to_trainings_result(lengths, fields, zeros, labels):
    """Property: to_training gives the page's result whatever unread fields ride along; it warns
    exactly when labels are made and some field would have changed them."""
    plain = [{"input_ids": list(range(10, 10 + n))} for n in lengths]
    carried = [{**p, **{f: SUPERVISING[f](len(p["input_ids"]), zeros) for f in fields}} for p in plain]
    options = {"return_labels": labels, "return_num_valid_tokens": labels, "return_cu_seqlens": False}
    expected = SampleBatch([record(p, i) for i, p in enumerate(plain)]).to_training(**options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = SampleBatch([record(p, i) for i, p in enumerate(carried)]).to_training(**options)
    assert as_lists(got) == as_lists(expected)
    effective = bool(fields) and zeros > 0
    assert len([w for w in caught if issubclass(w.category, UserWarning)]) == int(labels and effective)
