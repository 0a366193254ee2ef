"""Collator.for_transformers beside the collators it replaces, on the same examples: equal batches.

Each peer gets the same examples as ``Collator.for_transformers`` with the
same options, and the two batches must hold the same keys with values of the
same type, dtype, shape and content; where the peer fails, ours fails too, with
a ``ValueError``. The peers:

- ``transformers.DataCollatorForSeq2Seq(tokenizer, ...)``: right and left padding,
  ``padding`` True / ``"longest"`` / ``"max_length"`` / False, ``max_length``,
  ``pad_to_multiple_of``, ``label_pad_token_id``, ``return_tensors`` ``"pt"`` / ``"np"``,
  ``token_type_ids``;
- ``transformers.DataCollatorWithFlattening(...)`` with each of its switches;
- ``transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)``, dicts and raw rows;
- TRL 1.16's ``DataCollatorForLanguageModeling``, padded and padding-free, with
  ``seq_lengths`` (TRL's packed rows, also straight from ``trl.pack_dataset``),
  ``pad_to_multiple_of``, ``return_position_ids`` and ``completion_mask`` /
  ``assistant_masks`` (applied as TRL's dataset preparation applies them).

Where this package deliberately differs, the property checks its documented
behaviour instead (README, "Coming from Hugging Face"): labels made from the
tokens where ``DataCollatorForSeq2Seq`` returns ``labels: None``; a token equal
to the pad id trained (``DataCollatorForLanguageModeling`` ignores it); an
``attention_mask`` returned for raw rows; ``token_type_ids`` kept in the flat row
(``DataCollatorWithFlattening`` drops it); a padded row of several packed
documents refused (TRL pads it as one). ``hf_cases`` and ``check_hf_case`` also
run in the fuzz campaign (``tests/fuzz/fuzz_to_training.py --property hf``).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
trl_collators = pytest.importorskip("trl.trainer.sft_trainer")

VOCAB = 40
PAD = 0
TRL_PADDING_FREE = {"return_flash_attn_kwargs": True, "return_seq_idx": True}


@functools.cache
def tokenizer(side: str = "right") -> Any:
    """A word-level tokenizer built in memory (pad id 0), padding on ``side``; nothing downloaded."""
    vocab = {"<pad>": PAD, **{f"w{i}": i for i in range(1, VOCAB)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", padding_side=side)


def assert_same_batch(ours: dict, theirs: dict, skip: tuple[str, ...] = ()) -> None:
    """Key for key: the same keys; arrays of the same kind, dtype, shape and values; equal Python ints."""
    assert sorted(set(ours) - set(skip)) == sorted(set(theirs) - set(skip))
    for key, value in theirs.items():
        if key in skip:
            continue
        mine = ours[key]
        if isinstance(value, (torch.Tensor, np.ndarray)):
            assert type(mine) is type(value), key
            assert mine.dtype == value.dtype and tuple(mine.shape) == tuple(value.shape), key
            assert mine.tolist() == value.tolist(), key
        else:
            assert type(mine) is type(value) and mine == value, key


def _call(collate: Any, examples: list) -> tuple[dict | None, Exception | None]:
    try:
        return dict(collate(examples)), None
    except (ValueError, TypeError, KeyError, IndexError) as error:
        return None, error


# -- the cases --------------------------------------------------------------------------------------


def _rows(draw: st.DrawFn, min_length: int, count: int | None = None) -> list[list[int]]:
    count = draw(st.integers(1, 4)) if count is None else count
    tokens = st.integers(1, VOCAB - 1)
    return [draw(st.lists(tokens, min_size=min_length, max_size=8)) for _ in range(count)]


def _labels(draw: st.DrawFn, ids: list[int]) -> list[int]:
    kept = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    return [token if keep else -100 for token, keep in zip(ids, kept, strict=True)]


def _flags(draw: st.DrawFn, n: int) -> list[int]:
    return draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))


def _split(draw: st.DrawFn, n: int) -> list[int]:
    """A random partition of ``n`` tokens into packed documents (TRL's seq_lengths)."""
    cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [b - a for a, b in itertools.pairwise(bounds) if b > a] or [n]


@st.composite
def seq2seq_cases(draw: st.DrawFn) -> tuple:
    padding = draw(st.sampled_from([True, "longest", "max_length", False]))
    options: dict[str, Any] = {
        "padding": padding,
        "pad_to_multiple_of": None if padding is False else draw(st.sampled_from([None, 1, 4, 8])),
        "label_pad_token_id": draw(st.sampled_from([-100, -1])),
        "return_tensors": draw(st.sampled_from(["pt", "np"])),
        "max_length": draw(st.integers(1, 10)) if padding == "max_length" else None,
        "side": draw(st.sampled_from(["right", "left"])),
    }
    rows = _rows(draw, min_length=1)
    with_labels, with_mask, with_types = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    examples = []
    for ids in rows:
        example: dict[str, Any] = {"input_ids": ids}
        if with_labels:
            example["labels"] = _labels(draw, ids)
        if with_mask:
            example["attention_mask"] = [1] * len(ids)
        if with_types:
            example["token_type_ids"] = _flags(draw, len(ids))
        examples.append(example)
    return "seq2seq", options, examples


@st.composite
def flattening_cases(draw: st.DrawFn) -> tuple:
    options: dict[str, Any] = {
        "return_position_ids": draw(st.booleans()),
        "return_flash_attn_kwargs": draw(st.booleans()),
        "return_seq_idx": draw(st.booleans()),
        "position_ids_start": draw(st.sampled_from([0, 2])),
        "return_tensors": draw(st.sampled_from(["pt", "np"])),
    }
    separator = draw(st.sampled_from([None, -100, -1, 7]))
    if separator is not None:
        options["separator_id"] = separator
    rows = _rows(draw, min_length=0)
    with_labels, with_mask, with_types = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    examples = []
    for ids in rows:
        example: dict[str, Any] = {"input_ids": ids}
        if with_labels:
            example["labels"] = _labels(draw, ids)
        if with_mask:
            example["attention_mask"] = [1] * len(ids)
        if with_types:
            example["token_type_ids"] = _flags(draw, len(ids))
        examples.append(example)
    return "flattening", options, examples


@st.composite
def language_modeling_cases(draw: st.DrawFn) -> tuple:
    options = {
        "pad_to_multiple_of": draw(st.sampled_from([None, 4, 8])),
        "return_tensors": draw(st.sampled_from(["pt", "np"])),
        "side": draw(st.sampled_from(["right", "left"])),
    }
    rows = [
        [draw(st.integers(0, VOCAB - 1)) if draw(st.booleans()) else t for t in ids] for ids in _rows(draw, 1)
    ]
    raw = draw(st.booleans())
    return "language_modeling", options, [list(ids) if raw else {"input_ids": ids} for ids in rows]


@st.composite
def trl_cases(draw: st.DrawFn) -> tuple:
    padding_free = draw(st.booleans())
    options = {
        "pad_token_id": draw(st.sampled_from([0, 999])),
        "padding_free": padding_free,
        "return_position_ids": draw(st.booleans()),
        "pad_to_multiple_of": draw(st.sampled_from([None, 4, 8])),
    }
    mask_field = draw(st.sampled_from([None, "completion_mask", "assistant_masks"]))
    packed = draw(st.booleans())
    examples = []
    for ids in _rows(draw, min_length=1):
        example: dict[str, Any] = {"input_ids": ids}
        if draw(st.booleans()):  # TRL reads labels example by example
            example["labels"] = _labels(draw, ids)
        if mask_field is not None:
            example[mask_field] = _flags(draw, len(ids))
        if packed:
            example["seq_lengths"] = _split(draw, len(ids))
        examples.append(example)
    return "trl", options, examples


def hf_cases() -> st.SearchStrategy[tuple]:
    """``(peer, options, examples)``: Hugging Face field combinations for one of the peers."""
    return st.one_of(seq2seq_cases(), flattening_cases(), language_modeling_cases(), trl_cases())


# -- the check --------------------------------------------------------------------------------------


def _as_trl_prepares(example: dict) -> dict:
    """What TRL 1.16's SFTTrainer hands its collator: the masks folded into labels at preparation."""
    labels = list(example.get("labels", example["input_ids"]))
    for name in ("completion_mask", "assistant_masks"):
        if name in example:
            labels = [label if keep else -100 for label, keep in zip(labels, example[name], strict=True)]
    return {**example, "labels": labels}


def _with_text(examples: list) -> list:
    """The examples with a text column, which this collator must ignore (the peers cannot take one)."""
    return [
        {**e, "text": "a text column", "idx": i} if isinstance(e, dict) else e for i, e in enumerate(examples)
    ]


def check_hf_case(peer: str, options: dict, examples: list) -> str:
    """Run ``peer`` and ``Collator.for_transformers`` on ``examples``; return ``"equal"``, ``"documented"``
    (a deliberate difference, checked) or ``"refused"`` (both fail); raise ``AssertionError`` otherwise."""
    options = dict(options)
    skip: tuple[str, ...] = ()
    given = examples
    left = options.get("side") == "left"
    if peer == "seq2seq":
        tok = tokenizer(options.pop("side"))
        theirs_collate = transformers.DataCollatorForSeq2Seq(tok, **options)
        ours_collate = Collator.for_transformers(tok, **options)
    elif peer == "flattening":
        theirs_collate = transformers.DataCollatorWithFlattening(**options)
        if not options["return_position_ids"] and not options["return_flash_attn_kwargs"]:
            # Documented: nothing in the row would separate its documents; refused, naming the fix.
            with pytest.raises(ValueError, match="leaves nothing in the row that separates its documents"):
                Collator.for_transformers(padding_free=True, **options)
            return "documented"
        ours_collate = Collator.for_transformers(padding_free=True, **options)
        if "token_type_ids" in examples[0]:
            skip = ("token_type_ids",)
    elif peer == "language_modeling":
        tok = tokenizer(options.pop("side"))
        theirs_collate = transformers.DataCollatorForLanguageModeling(tok, mlm=False, **options)
        ours_collate = Collator.for_transformers(tok, **options)
    else:
        theirs_collate = trl_collators.DataCollatorForLanguageModeling(**options)
        if options["padding_free"]:
            options.update(TRL_PADDING_FREE, return_position_ids=None)
        ours_collate = Collator.for_transformers(**options)
        given = [_as_trl_prepares(example) for example in examples]
    theirs, their_error = _call(theirs_collate, given)
    ours, our_error = _call(ours_collate, _with_text(examples))
    if their_error is not None:
        assert isinstance(our_error, ValueError), (their_error, our_error, ours)
        return "refused"
    assert theirs is not None
    if (
        peer == "trl"
        and not options["padding_free"]
        and any(len(e.get("seq_lengths", [])) > 1 for e in examples)
    ):
        assert isinstance(our_error, ValueError) and "holds several documents" in str(our_error)
        return "documented"  # TRL pads a packed row as one document; its documents would see each other
    if any(isinstance(v, np.ndarray) and v.dtype == object for v in theirs.values()):
        # Documented: NumPy output of ragged rows is an array of objects (padding=False, or an example
        # longer than padding="max_length"'s length); refused here, naming the fix.
        assert isinstance(our_error, ValueError) and (
            "needs examples of one length" in str(our_error) or "truncation_mode" in str(our_error)
        )
        return "documented"
    if peer == "seq2seq" and options["padding"] == "max_length":
        multiple = options["pad_to_multiple_of"] or 1
        width = -(-options["max_length"] // multiple) * multiple
        if max(len(e["input_ids"]) for e in examples) > width:
            # Documented: padding="max_length" promises rows of that length; the tokenizer passes a longer
            # example on as it is (and fails later on ragged labels); this collator refuses it, naming the fix.
            assert isinstance(our_error, ValueError) and "truncation_mode" in str(our_error)
            return "documented"
    assert our_error is None, our_error
    assert ours is not None
    firsts = None
    if left:  # Documented: a left-padded row's first token is not trained (the shift would predict it
        # from the padding); the peers keep its label
        real = np.asarray(ours["attention_mask"]) == 1
        firsts = (np.arange(real.shape[1]) == real.argmax(1)[:, None]) & real
        assert (np.asarray(ours["labels"])[firsts] == -100).all()
        if theirs.get("labels") is not None:
            theirs["labels"] = _as_tensor_like(
                np.where(firsts, -100, np.asarray(theirs["labels"])), theirs["labels"]
            )
    if peer == "flattening" and skip:
        flat = np.concatenate([np.asarray(e["token_type_ids"], dtype=np.int64) for e in examples])
        assert np.asarray(ours["token_type_ids"]).tolist() == [flat.tolist()]
    if peer == "seq2seq" and theirs["labels"] is None:
        # Documented: labels made from the tokens (a causal LM's), where DataCollatorForSeq2Seq gives None.
        mask, ids = np.asarray(theirs["attention_mask"]), np.asarray(theirs["input_ids"])
        expected = np.where(mask == 1, ids, options["label_pad_token_id"])
        if firsts is not None:
            expected[firsts] = -100
        assert np.asarray(ours.pop("labels")).tolist() == expected.tolist()
        theirs.pop("labels")
        assert_same_batch(ours, theirs, skip)
        return "documented"
    if peer == "language_modeling":
        # Documented: a real token equal to the pad id is trained; raw rows get an attention_mask too.
        ids, labels = np.asarray(theirs["input_ids"]), np.asarray(theirs["labels"])
        real = np.asarray(ours["attention_mask"]) == 1
        trained = real if firsts is None else real & ~firsts
        assert np.asarray(ours["labels"]).tolist() == np.where(trained, ids, -100).tolist()
        if "attention_mask" not in theirs:
            skip = ("attention_mask",)
        theirs["labels"] = ours["labels"]
        assert_same_batch(ours, theirs, skip)
        assert np.where(real, -100, labels).tolist() == np.full(labels.shape, -100).tolist()
        return "documented" if ((ids == PAD) & real).any() or skip or left else "equal"
    assert_same_batch(ours, theirs, skip)
    return "documented" if skip or left else "equal"


def _as_tensor_like(values: np.ndarray, like: object) -> object:
    """``values`` as the peer gave its labels: a tensor of their dtype, or a NumPy array."""
    return (
        torch.as_tensor(values, dtype=like.dtype)
        if isinstance(like, torch.Tensor)
        else values.astype(like.dtype)
    )


def test_documented_differences_from_language_modeling_and_flattening() -> None:
    """Labels given are applied (``DataCollatorForLanguageModeling`` overwrites them with the tokens); an
    example's ``position_ids`` counted from 2 are refused (the peers ignore them; here they mark documents)."""
    examples = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9, 4], "labels": [-100, 9, 4]},
    ]
    theirs = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)(examples)
    assert theirs["labels"].tolist() == [[5, 6, 7], [8, 9, 4]]
    ours = Collator.for_transformers(tokenizer())(examples)
    assert ours["labels"].tolist() == [[-100, 6, 7], [-100, 9, 4]]
    shifted = [{"input_ids": [5, 6, 7], "position_ids": [2, 3, 4]}]
    assert transformers.DataCollatorWithFlattening()(shifted)["position_ids"].tolist() == [[0, 1, 2]]
    for options in ({"pad_token_id": PAD}, {"padding_free": True}):
        with pytest.raises(
            ValueError, match=r"example 0: 'position_ids' must start at 0 .* \(they start at 2\)"
        ):
            Collator.for_transformers(**options)(shifted)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hf_cases())
def test_hf_field_combinations_against_transformers_and_trl(case: tuple) -> None:
    check_hf_case(*case)


# -- TRL's packing, straight from trl.pack_dataset ----------------------------------------------------


@st.composite
def packed_datasets(draw: st.DrawFn) -> tuple[list[dict], int, int | None]:
    documents = []
    rows = _rows(draw, min_length=0, count=draw(st.integers(1, 8)))
    rows[0] = rows[0] or [5]  # trl.pack_dataset fails on a dataset whose sequences are all empty
    for ids in rows:
        documents.append({"input_ids": ids, "labels": _labels(draw, ids)})
    return documents, draw(st.integers(2, 12)), draw(st.sampled_from([None, 8]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packed_datasets())
def test_trl_bfd_packed_rows_equal_trl_padding_free(case: tuple) -> None:
    datasets = pytest.importorskip("datasets")
    from trl import pack_dataset

    datasets.disable_progress_bars()
    documents, seq_length, multiple = case
    column = datasets.List(datasets.Value("int32"))  # the Arrow type a tokenized dataset carries
    features = datasets.Features({"input_ids": column, "labels": column})
    packed = pack_dataset(
        datasets.Dataset.from_list(documents, features=features), seq_length, strategy="bfd"
    )
    rows = list(packed)
    assert all("seq_lengths" in row for row in rows)
    theirs = trl_collators.DataCollatorForLanguageModeling(
        pad_token_id=PAD, padding_free=True, pad_to_multiple_of=multiple
    )
    ours = Collator.for_transformers(
        pad_token_id=PAD, padding_free=True, pad_to_multiple_of=multiple, **TRL_PADDING_FREE
    )
    if not rows:
        return
    assert_same_batch(ours(rows), theirs(rows))
    tensors = list(packed.with_format("torch"))  # int64 tensors, seq_lengths included
    assert_same_batch(ours(tensors), theirs(rows))


def test_trl_packed_rows_from_sft_preparation() -> None:
    """The rows SFTTrainer(packing=True) prepares (probe of trl 1.16), documents kept apart as TRL keeps them."""
    rows = [
        {"input_ids": [3, 4, 5, 6, 12, 1], "labels": [3, 4, 5, 6, 12, 1], "seq_lengths": [6]},
        {
            "input_ids": [3, 8, 5, 9, 1, 11, 10, 1],
            "labels": [3, 8, 5, 9, 1, 11, 10, 1],
            "seq_lengths": [5, 3],
        },
    ]
    theirs = trl_collators.DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(rows)
    ours = Collator.for_transformers(pad_token_id=PAD, padding_free=True, **TRL_PADDING_FREE)(rows)
    assert_same_batch(ours, theirs)
    assert ours["labels"].tolist() == [[-100, 4, 5, 6, 12, 1, -100, 8, 5, 9, 1, -100, 10, 1]]
    assert ours["cu_seq_lens_q"].tolist() == [0, 6, 11, 14] and ours["seq_idx"].dtype == torch.int32


# -- one field at a time: each supervising field used, text columns ignored ---------------------------------


@pytest.mark.parametrize("name", ["completion_mask", "assistant_mask", "assistant_masks", "loss_mask"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_each_mask_field_is_applied_like_the_labels_trl_prepares(name: str, padding_free: bool) -> None:
    examples = [{"input_ids": [5, 6, 7, 8], name: [0, 0, 1, 1]}, {"input_ids": [9, 10], name: [0, 1]}]
    prepared = [{"input_ids": e["input_ids"], "labels": _as_trl_prepares({**e, "completion_mask": e[name]})["labels"]}
                for e in examples]  # fmt: skip
    options = {"pad_token_id": PAD, "padding_free": padding_free}
    theirs = trl_collators.DataCollatorForLanguageModeling(**options)(prepared)
    ours = Collator.for_transformers(**options, **(TRL_PADDING_FREE if padding_free else {}))(examples)
    assert_same_batch(ours, theirs)
    expected = (
        [[-100, -100, 7, 8, -100, 10]] if padding_free else [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    )
    assert ours["labels"].tolist() == expected


def test_text_columns_and_unrelated_fields_are_ignored() -> None:
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    noisy = [
        {**e, "text": "hello", "messages": [{"role": "user", "content": "x"}], "idx": i, "score": 0.5}
        for i, e in enumerate(examples)
    ]
    for options in ({"pad_token_id": PAD}, {"padding_free": True, **TRL_PADDING_FREE}):
        collate = Collator.for_transformers(**options)
        assert_same_batch(collate(noisy), collate(examples))


def test_seq2seq_labels_of_none_count_as_absent() -> None:
    examples = [{"input_ids": [5, 6, 7], "labels": None}, {"input_ids": [8, 9], "labels": None}]
    theirs = transformers.DataCollatorForSeq2Seq(tokenizer())(examples)
    ours = Collator.for_transformers(tokenizer())(examples)
    assert theirs["labels"] is None
    assert ours["labels"].tolist() == [[5, 6, 7], [8, 9, -100]]


def test_left_padding_is_seq2seqs_but_the_first_label_and_keeps_positions_consistent() -> None:
    # Documented difference: left-padded, each row's first token is not trained (the model's shift would
    # predict it from the padding place before it); right-padded, the shift drops it anyway.
    tok = tokenizer("left")
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12]}]
    examples[1]["labels"] = [8, 9, 10, 11, 12]
    for multiple, max_length, padding in (
        (None, None, True),
        (4, None, True),
        (None, 7, "max_length"),
        (4, 6, "max_length"),
    ):
        options = {"pad_to_multiple_of": multiple, "max_length": max_length, "padding": padding}
        theirs = dict(transformers.DataCollatorForSeq2Seq(tok, **options)(examples))
        ours = Collator.for_transformers(tok, **options)(examples)
        first = ours["attention_mask"].argmax(1)
        rows = torch.arange(len(examples))
        assert theirs["labels"][rows, first].tolist() == [-100, 8] and ours["labels"][
            rows, first
        ].tolist() == [-100, -100]
        theirs["labels"][rows, first] = -100
        assert_same_batch(ours, theirs)
        kept = Collator.for_transformers(tok, boundary_safe_labels=False, **options)(examples)
        assert kept["labels"][rows, first].tolist() == [-100, 8]  # as the peer, where asked
        positions = Collator.for_transformers(tok, return_position_ids=True, **options)(examples)[
            "position_ids"
        ]
        mask = ours["attention_mask"]
        # each real token's position counts the real tokens before it; padding is at position 0
        assert positions.tolist() == ((mask.cumsum(-1) - 1).clamp(min=0) * mask).tolist()
    assert ours["input_ids"][0, -3:].tolist() == [5, 6, 7] and ours["labels"][0, -2:].tolist() == [6, 7]


def test_a_left_padding_tokenizer_does_not_stop_padding_free() -> None:
    tok = tokenizer("left")
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    assert_same_batch(
        Collator.for_transformers(tok, padding_free=True, return_flash_attn_kwargs=True)(examples), theirs
    )
    with pytest.raises(ValueError, match="padding_side='left' pad rows of a padded batch"):
        Collator.for_transformers(tok, padding_free=True, padding_side="left")


def test_left_padded_examples_are_read() -> None:
    """Examples tokenized with a left-padding tokenizer (0s first in attention_mask): the padding is dropped."""
    tok = tokenizer("left")
    encoded = tok(["w5 w6 w7", "w8 w9"], padding=True)
    examples = [{key: encoded[key][i] for key in ("input_ids", "attention_mask")} for i in range(2)]
    assert examples[1]["attention_mask"] == [0, 1, 1]
    theirs = dict(transformers.DataCollatorForSeq2Seq(tok)(examples))
    ours = Collator.for_transformers(tok)(examples)
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist() == [[5, 6, 7], [0, 8, 9]]
    assert ours["attention_mask"].tolist() == theirs["attention_mask"].tolist()
    assert ours["labels"].tolist() == [[-100, 6, 7], [-100, -100, 9]]  # each row's first token untrained
    right = Collator.for_transformers(pad_token_id=PAD)(examples)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]


def test_restarting_position_ids_beside_seq_lengths_are_refused_not_merged():
    """An example's own restarting position_ids, in a batch whose other examples give seq_lengths: its
    documents were read as one (its labels crossing between them); refused now."""
    collate = Collator.for_transformers(padding_free=True)
    lengths = {"input_ids": [1, 10, 11, 2, 1, 20, 2], "seq_lengths": [4, 3]}
    positions = {"input_ids": [1, 5, 2, 1, 6, 7, 2], "position_ids": [0, 1, 2, 0, 1, 2, 3]}
    with pytest.raises(ValueError, match=r"example 1: its position_ids restart .* no 'seq_lengths'"):
        collate([lengths, positions])
    one = {"input_ids": [1, 5, 2], "position_ids": [0, 1, 2]}  # one document: read as one
    assert collate([lengths, one])["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
    assert collate([positions])["labels"].tolist() == [[-100, 5, 2, -100, 6, 7, 2]]  # alone: its documents


def test_a_left_padding_tokenizer_trains_what_trl_trains_in_a_model() -> None:
    # SFTTrainer(data_collator=Collator.for_transformers(tokenizer)) with a left-padding tokenizer: TRL's
    # collator pads right whatever the tokenizer says; here the rows pad left, and the model's loss, its
    # count of trained predictions and its gradients are TRL's all the same.
    from transformers import LlamaConfig, LlamaForCausalLM

    examples = [
        {"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [10, 11], "completion_mask": [0, 1]},
        {"input_ids": [12, 13, 14], "completion_mask": [1, 1, 1]},
    ]
    theirs = trl_collators.DataCollatorForLanguageModeling(pad_token_id=PAD)(
        [_as_trl_prepares(example) for example in examples]
    )
    ours = Collator.for_transformers(tokenizer("left"), return_position_ids=True)(examples)
    assert ours["input_ids"][1].tolist() == [0, 0, 0, 10, 11]  # padded on the left
    count = {
        name: int((batch["labels"][:, 1:] != -100).sum())
        for name, batch in (("ours", ours), ("theirs", theirs))
    }
    assert count == {"ours": 6, "theirs": 6}  # 7 where 12, after the padding, was trained
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    losses, grads = [], []
    for batch in (ours, theirs):
        model.zero_grad()
        loss = model(**{key: value for key, value in batch.items() if key != "completion_mask"}).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-10)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-10)
