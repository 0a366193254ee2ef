"""The packers read supervision only as ``loss_mask``: documents that spell it otherwise (``labels`` with
-100 on a prompt, a chat template's ``assistant_masks``, TRL's ``completion_mask``, a padding
``attention_mask``) are refused at pack time, harmless copies are accepted and left out of the rows, and
``ColumnarDataset`` refuses a dataset whose transform it would skip."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from zephon_collate import Collator, ColumnarDataset, FlatPacker, PackedStream, pack_columns, pack_flat
from zephon_collate.packing.columns import PackedColumns

TOKENS = [[1, 2, 3], [5, 6, 7, 8]]
PAD = 9  # not 0: labels equal to the tokens would differ from them on a row's padding if packed
PROMPTED = {  # each name's supervision with a two-token prompt on document 1 (document 0 is all trained)
    "labels": [[1, 2, 3], [-100, -100, 7, 8]],
    "assistant_masks": [[1, 1, 1], [0, 0, 1, 1]],
    "assistant_mask": [[1, 1, 1], [0, 0, 1, 1]],
    "completion_mask": [[1, 1, 1], [0, 0, 1, 1]],
}
PROMPT_NAMES = sorted(PROMPTED)
Docs = list[dict[str, list[int]]]


def _docs(**fields: list[list[int]]) -> Docs:
    return [
        {"input_ids": TOKENS[i], **{name: rows[i] for name, rows in fields.items()}}
        for i in range(len(TOKENS))
    ]


def _columns(docs: Docs) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The documents as a columnar batch: a ``(values, offsets)`` pair per field."""
    offsets = np.cumsum([0, *(len(doc["input_ids"]) for doc in docs)])
    return {name: (np.concatenate([doc[name] for doc in docs]), offsets) for name in docs[0]}


def _rows(packed: PackedColumns) -> Any:
    return packed.__getitems__(range(len(packed)))


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "pack_flat": lambda docs, **kw: pack_flat(docs, **kw),
    "pack_flat(columns)": lambda docs, **kw: pack_flat(_columns(docs), **kw),
    "FlatPacker": lambda docs, **kw: list(FlatPacker(**kw).pack(docs)),
    "FlatPacker(columns)": lambda docs, **kw: list(FlatPacker(**kw).pack([_columns(docs)])),
    "PackedStream": lambda docs, **kw: list(PackedStream(docs, **kw)),
    "pack_columns": lambda docs, **kw: _rows(pack_columns(_columns(docs), **kw)),
}
COLUMNAR = ("pack_flat(columns)", "FlatPacker(columns)", "pack_columns")


def _named(entry: str, index: int) -> str:
    return f"example {index}" if entry in COLUMNAR else rf"record {index} \(sample_id \(0, 0, {index}\)\)"


@pytest.mark.parametrize("name", PROMPT_NAMES)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_supervision_under_another_name_is_refused_at_pack_time(entry: str, name: str) -> None:
    """The reproduction: these documents were packed (their prompt field as plain data, so overflow='auto'
    cut document 1 at seq_len=2); now packing refuses them, naming the document, the field and the fix."""
    fix = (
        r"loss_mask = \[int\(l != -100\) for l in labels\]" if name == "labels" else rf"loss_mask = {name}\b"
    )
    pattern = (
        rf"^{_named(entry, 1)}: payload has '{name}' .*{fix}.*trl\.pack_dataset.*Collator\.for_transformers"
    )
    for seq_len in (8, 2):  # a whole document, and one overflow='auto' would cut
        with pytest.raises(ValueError, match=pattern):
            ENTRY_POINTS[entry](_docs(**{name: PROMPTED[name]}), seq_len=seq_len, pad_token_id=PAD)


HARMLESS = {
    "labels": {"labels": TOKENS},
    "assistant_masks": {"assistant_masks": [[1] * 3, [1] * 4]},
    "completion_mask (= loss_mask)": {"completion_mask": [[1, 1, 1], [0, 0, 1, 1]]},
    "attention_mask": {"attention_mask": [[1] * 3, [1] * 4]},
}
LOSS_MASK = [[1, 1, 1], [0, 0, 1, 1]]


@pytest.mark.parametrize("case", sorted(HARMLESS))
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_harmless_copies_are_accepted_left_out_and_the_collator_takes_the_rows(entry: str, case: str) -> None:
    """Labels equal to the tokens, a mask of ones, a mask equal to the loss_mask: accepted as the Collator
    accepts them, and not packed (padded with 0s they would no longer be harmless), so the rows collate
    exactly as the same documents without them."""
    docs = _docs(loss_mask=LOSS_MASK, **HARMLESS[case])
    plain = _docs(loss_mask=LOSS_MASK)
    pack = ENTRY_POINTS[entry]
    rows, expected = pack(docs, seq_len=8, pad_token_id=PAD), pack(plain, seq_len=8, pad_token_id=PAD)
    [name] = HARMLESS[case]
    payloads = [row.payload for row in rows] if entry != "pack_columns" else rows
    assert all(name not in payload for payload in payloads)
    collate = Collator(return_labels=True, return_num_valid_tokens=True)
    out = collate(rows)
    assert out["labels"].tolist() == collate(expected)["labels"].tolist()
    assert out["num_valid_tokens"] == 4  # 2, 3 of document 0; 7, 8 of document 1 (5 -> 6 is the prompt)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_unlisted_supervision_is_refused_whatever_fields_lists(entry: str) -> None:
    """As the Collator refuses a supervising field it does not read, the packer refuses one it does not
    pack (fields=('loss_mask',) would drop the labels silently)."""
    docs = _docs(loss_mask=LOSS_MASK, labels=PROMPTED["labels"])
    with pytest.raises(ValueError, match=rf"^{_named(entry, 1)}: payload has 'labels' that differ"):
        ENTRY_POINTS[entry](docs, seq_len=8, pad_token_id=PAD, fields=("loss_mask",))


@pytest.mark.parametrize("name", PROMPT_NAMES)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_listed_field_is_packed_as_data_and_overflow_auto_keeps_its_prompt_whole(
    entry: str, name: str
) -> None:
    """Decision: fields=(name,) packs the field as the data field asked for (the Collator reads it with
    extra_fields=[name], else refuses it); overflow='auto' still reads its prompt, as a loss_mask's,
    and refuses to cut the document."""
    docs = _docs(**{name: PROMPTED[name]})
    pack = ENTRY_POINTS[entry]
    rows = pack(docs, seq_len=8, pad_token_id=PAD, fields=(name,))
    out = Collator(extra_fields=[name])(rows)
    assert out[name].tolist() == [[*PROMPTED[name][0], *PROMPTED[name][1], 0]]
    marker = "-100" if name == "labels" else "0s"
    with pytest.raises(
        ValueError,
        match=rf"^{_named(entry, 1)}: has 4 tokens, more than seq_len=3, and a prompt \({marker} in its "
        rf"'{name}'\).*overflow='truncate'",
    ):
        pack(docs, seq_len=3, pad_token_id=PAD, fields=(name,))
    split = pack(docs, seq_len=3, pad_token_id=PAD, fields=(name,), overflow="split")
    assert Collator(extra_fields=[name])(split)[name].tolist()[1:] == [
        PROMPTED[name][1][:3],
        [PROMPTED[name][1][3], 0, 0],
    ]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_padding_attention_mask_is_refused(entry: str) -> None:
    """Padding inside a document (an attention_mask with zeros) would be packed as real tokens."""
    docs = _docs(attention_mask=[[1, 1, 1], [1, 1, 1, 0]])
    with pytest.raises(
        ValueError,
        match=rf"^{_named(entry, 1)}: payload has an 'attention_mask' with zeros.*padding.*trl\.pack_dataset",
    ):
        ENTRY_POINTS[entry](docs, seq_len=8, pad_token_id=PAD)


def test_records_and_columns_are_refused_by_one_rule() -> None:
    """The same documents give the same refusal as records and as columns (only the name differs)."""
    for name in PROMPT_NAMES:
        docs = _docs(loss_mask=[[1, 1, 1], [1, 1, 1, 1]], **{name: PROMPTED[name]})
        messages = []
        for entry in ("pack_flat", "pack_columns"):
            with pytest.raises(ValueError) as caught:
                ENTRY_POINTS[entry](docs, seq_len=8, pad_token_id=PAD)
            messages.append(re.sub(r"^(record 1 \(sample_id \(0, 0, 1\)\)|example 1)", "", str(caught.value)))
        assert messages[0] == messages[1]


def test_a_later_document_is_checked_when_the_first_fixed_the_fields() -> None:
    """FlatPacker fixes its fields from the first document; the rule still reads every later one."""
    docs = [{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5], "completion_mask": [0, 1, 1]}]
    with pytest.raises(ValueError, match=r"^record 1 .*'completion_mask' with zeros"):
        list(FlatPacker(8, pad_token_id=PAD).pack(docs))
    with pytest.raises(ValueError, match=r"^example 3: payload has 'completion_mask'"):
        batch = {
            "input_ids": (np.array([3, 4, 5]), np.array([0, 3])),
            "completion_mask": (np.array([0, 1, 1]), np.array([0, 3])),
        }
        list(FlatPacker(8, pad_token_id=PAD).pack([*docs[:1], _columns(docs[:1] * 2), batch]))


# --- ColumnarDataset and the dataset's format --------------------------------------------------------


def _dataset() -> Any:
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict(
        {"input_ids": [[5, 6, 7], [8, 9]], "labels": [[-100, 6, 7], [8, 9]], "text": ["a", "b"]}
    )


def _shifted(batch: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": [[token + 1 for token in row] for row in batch["input_ids"]]}


def test_columnar_dataset_refuses_a_transform_it_would_skip() -> None:
    """The reproduction: with_transform's function never ran (the stored columns came back)."""
    dataset = _dataset()
    pattern = r"ColumnarDataset: the dataset has a transform \(_shifted, set by set_transform.*dataset\.map\(_shifted, batched=True\)"
    with pytest.raises(ValueError, match=pattern):
        ColumnarDataset(dataset.with_transform(_shifted))
    mapped = dataset.map(_shifted, batched=True, remove_columns=["labels"])  # the fix the error names
    [batch] = ColumnarDataset(mapped, columns=["input_ids"]).__getitems__([0, 1])
    assert batch["input_ids"][0].tolist() == [6, 7, 8, 9, 10]
    wrapper = ColumnarDataset(dataset)
    dataset.set_transform(_shifted)  # in place, after wrapping: refused when the rows are read
    with pytest.raises(ValueError, match=pattern):
        wrapper.__getitems__([0])


def test_columnar_dataset_hands_over_the_formats_columns() -> None:
    """set_format(columns=[...]) hides the other columns from the dataset's rows; the wrapper hands over
    the same columns (labels it would add change what the Collator trains, or make it refuse)."""
    dataset = _dataset()
    formatted = dataset.with_format(columns=["input_ids"])
    assert list(formatted[0]) == ["input_ids"]
    [batch] = ColumnarDataset(formatted).__getitems__([0, 1])
    assert list(batch) == ["input_ids"]
    every = dataset.with_format("numpy", columns=["input_ids"], output_all_columns=True)
    assert list(ColumnarDataset(every).__getitems__([0])[0]) == ["input_ids", "labels", "text"]
    assert list(ColumnarDataset(formatted, columns=["labels"]).__getitems__([0])[0]) == ["labels"]


@pytest.mark.parametrize("entry", ["pack_flat", "pack_columns"])
def test_one_value_per_document_is_refused_alike_for_records_and_columns(entry: str) -> None:
    """A per-example ``labels`` (sequence classification) says nothing per token: refused, not dropped."""
    docs: Any = [{"input_ids": TOKENS[i], "labels": i} for i in range(2)]
    if entry == "pack_columns":
        docs = {"input_ids": _columns(_docs())["input_ids"], "labels": np.array([0, 1])}
        pack: Callable[..., Any] = pack_columns
    else:
        pack = pack_flat
    with pytest.raises(
        ValueError, match=rf"^{_named(entry, 0)}: field 'labels' holds one value per document"
    ):
        pack(docs, seq_len=8, pad_token_id=PAD)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_listed_attention_mask_is_data_not_a_prompt(entry: str) -> None:
    """fields=('attention_mask',) packs it as asked; its zeros are not a prompt, so overflow='auto' cuts."""
    docs = _docs(attention_mask=[[1, 1, 1], [1, 1, 1, 0]])
    rows = ENTRY_POINTS[entry](docs, seq_len=3, pad_token_id=PAD, fields=("attention_mask",))
    out = Collator(extra_fields=["attention_mask"])(rows)
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
