"""Collator.for_transformers against the real thing: transformers' collators, a GPT-2's loss, Trainer.

Skipped where ``transformers`` is not installed (``pip install -e .[hf]``); CI installs it.
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, SampleMeta, SampleRecord

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FLAT_OPTIONS = {"return_position_ids": True, "return_flash_attn_kwargs": True, "return_seq_idx": True}
VOCAB = 32
PAD = 0


def assert_same_batch(ours: dict, theirs: dict) -> None:
    """Key for key: the same keys, tensors of equal dtype, shape and values, equal Python ints."""
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert ours[key].tolist() == value.tolist(), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key


def pad_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A right-padding word-level tokenizer built in memory (nothing downloaded)."""
    vocab = {"<pad>": PAD, **{f"w{i}": i for i in range(1, VOCAB)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>")


@st.composite
def hf_examples(draw: st.DrawFn, min_length: int = 0, labels: bool | None = None) -> list[dict]:
    """1-4 examples; all with labels (-100 on a random subset of tokens) or none."""
    with_labels = draw(st.booleans()) if labels is None else labels
    examples = []
    for _ in range(draw(st.integers(1, 4))):
        ids = draw(st.lists(st.integers(1, VOCAB - 1), min_size=min_length, max_size=7))
        example: dict = {"input_ids": ids}
        if with_labels:
            kept = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
            example["labels"] = [token if keep else -100 for token, keep in zip(ids, kept, strict=True)]
        examples.append(example)
    return examples


@settings(max_examples=150, deadline=None)
@given(hf_examples())
def test_padding_free_equals_data_collator_with_flattening(examples: list[dict]) -> None:
    theirs = transformers.DataCollatorWithFlattening(**FLAT_OPTIONS)
    ours = Collator.for_transformers(padding_free=True, **FLAT_OPTIONS)
    if all(not example["input_ids"] for example in examples):
        with pytest.raises(ValueError, match="every example"):
            theirs(examples)
        with pytest.raises(ValueError, match="every example of the batch is empty"):
            ours(examples)
        return
    assert_same_batch(ours(examples), theirs(examples))


@settings(max_examples=100, deadline=None)
@given(hf_examples(min_length=1, labels=True), st.sampled_from([None, 1, 4, 8]))
def test_padded_equals_data_collator_for_seq2seq(examples: list[dict], multiple: int | None) -> None:
    theirs = transformers.DataCollatorForSeq2Seq(
        pad_tokenizer(), label_pad_token_id=-100, pad_to_multiple_of=multiple
    )
    ours = Collator.for_transformers(pad_token_id=PAD, pad_to_multiple_of=multiple)
    assert_same_batch(ours(examples), dict(theirs(examples)))


@settings(max_examples=50, deadline=None)
@given(hf_examples(min_length=1, labels=False))
def test_padded_equals_data_collator_for_language_modeling_when_no_token_is_the_pad_id(
    examples: list[dict],
) -> None:
    theirs = transformers.DataCollatorForLanguageModeling(pad_tokenizer(), mlm=False)
    assert_same_batch(Collator.for_transformers(pad_token_id=PAD)(examples), dict(theirs(examples)))


def test_tensor_rows_and_a_batched_dict_of_lists_give_the_same_batch() -> None:
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    collate = Collator.for_transformers(pad_token_id=PAD)
    expected = collate(examples)
    as_tensors = [{key: torch.tensor(value) for key, value in example.items()} for example in examples]
    batched = {key: [example[key] for example in examples] for key in ("input_ids", "labels")}
    for given_as in (as_tensors, batched):
        assert_same_batch(collate(given_as), expected)


def test_masks_of_any_dtype_and_a_2d_tensor_batch() -> None:
    example = {"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32)}
    for mask in (torch.tensor([0.0, 1.0, 1.0], dtype=torch.bfloat16), np.array([False, True, True])):
        out = Collator.for_transformers(pad_token_id=PAD)([{**example, "loss_mask": mask}])
        assert out["labels"].tolist() == [[-100, 6, 7]] and out["input_ids"].dtype == torch.int64
    batched = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 9, PAD]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    out = Collator.for_transformers(padding_free=True)(batched)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and out["labels"].tolist() == [
        [-100, 6, 7, -100, 9]
    ]


def test_attention_mask_loss_mask_and_assistant_masks_are_all_applied() -> None:
    example = {
        "input_ids": [3, 4, 5, 6, 7, PAD, PAD],
        "attention_mask": [1, 1, 1, 1, 1, 0, 0],
        "labels": [3, 4, 5, 6, -100, PAD, PAD],
        "loss_mask": [1, 1, 1, 1, 1, 1, 1],
        "assistant_masks": [0, 0, 1, 1, 1, 0, 0],
    }
    padded = Collator.for_transformers(pad_token_id=PAD)([example, {"input_ids": [9]}])
    assert padded["input_ids"].tolist() == [[3, 4, 5, 6, 7], [9, PAD, PAD, PAD, PAD]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert padded["labels"].tolist() == [[-100, -100, 5, 6, -100], [9, -100, -100, -100, -100]]
    flat = Collator.for_transformers(padding_free=True, **FLAT_OPTIONS)([{"input_ids": [9, 8]}, example])
    assert flat["input_ids"].tolist() == [[9, 8, 3, 4, 5, 6, 7]]
    assert flat["labels"].tolist() == [[-100, 8, -100, -100, 5, 6, -100]]
    assert flat["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 4]]
    assert flat["seq_idx"].tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    assert flat["cu_seq_lens_k"].tolist() == [0, 2, 7] and flat["max_length_q"] == 5


@st.composite
def masked_examples(draw: st.DrawFn) -> list[dict]:
    """Examples carrying any of the supervising fields, with right padding in some."""
    fields = draw(st.sets(st.sampled_from(["attention_mask", "labels", "loss_mask", "assistant_masks"])))
    examples = []
    for _ in range(draw(st.integers(1, 4))):
        real = draw(st.integers(1, 6))
        padding = draw(st.integers(0, 3)) if "attention_mask" in fields else 0
        ids = draw(st.lists(st.integers(1, VOCAB - 1), min_size=real, max_size=real)) + [PAD] * padding
        example: dict = {"input_ids": ids}
        flags = st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids))
        for name in fields - {"attention_mask"}:
            keep = draw(flags)
            example[name] = (
                [t if k else -100 for t, k in zip(ids, keep, strict=True)] if name == "labels" else keep
            )
        if "attention_mask" in fields:
            example["attention_mask"] = [1] * real + [0] * padding
        examples.append(example)
    return examples


def reference_labels(example: dict) -> tuple[list[int], list[int]]:
    """The real tokens and their unshifted labels, one token at a time."""
    real = sum(example.get("attention_mask", [1] * len(example["input_ids"])))
    tokens, labels = example["input_ids"][:real], []
    for t, token in enumerate(tokens):
        trained = example.get("labels", tokens)[t] != -100
        trained = trained and example.get("loss_mask", [1] * real)[t] == 1
        trained = trained and example.get("assistant_masks", [1] * real)[t] == 1
        labels.append(token if trained else -100)
    return tokens, labels


@settings(max_examples=150, deadline=None)
@given(masked_examples(), st.booleans())
def test_every_supervising_field_is_applied(examples: list[dict], boundary_safe: bool) -> None:
    read = [reference_labels(example) for example in examples]
    width = max(len(tokens) for tokens, _ in read)
    padded = Collator.for_transformers(pad_token_id=PAD, boundary_safe_labels=boundary_safe)(examples)
    assert padded["input_ids"].tolist() == [tokens + [PAD] * (width - len(tokens)) for tokens, _ in read]
    assert padded["labels"].tolist() == [labels + [-100] * (width - len(labels)) for _, labels in read]
    assert padded["attention_mask"].tolist() == [[1] * len(t) + [0] * (width - len(t)) for t, _ in read]
    flat = Collator.for_transformers(padding_free=True, boundary_safe_labels=boundary_safe)(examples)
    first = -100 if boundary_safe else None
    expected = [
        label if i or first is None else first for _, labels in read for i, label in enumerate(labels)
    ]
    assert flat["labels"].tolist() == [expected]
    assert flat["position_ids"].tolist() == [[i for tokens, _ in read for i in range(len(tokens))]]


def test_the_collator_pickles_for_dataloader_workers() -> None:
    collate = Collator.for_transformers(pad_token_id=PAD, pad_to_multiple_of=4)
    copy = pickle.loads(pickle.dumps(collate))
    assert_same_batch(copy([{"input_ids": [5, 6, 7]}]), collate([{"input_ids": [5, 6, 7]}]))
    assert "pad_token_id=0" in repr(copy)


def test_labels_under_the_padding_are_not_read() -> None:
    example = {"input_ids": [5, 6, PAD], "attention_mask": [1, 1, 0], "labels": [5, 6, 12345]}
    assert Collator.for_transformers(pad_token_id=PAD)([example])["labels"].tolist() == [[5, 6]]


def test_boundary_safe_labels_off_keeps_each_first_label_in_the_flat_row() -> None:
    flat = Collator.for_transformers(padding_free=True, boundary_safe_labels=False)
    assert flat([{"input_ids": [5, 6]}, {"input_ids": [7, 8]}])["labels"].tolist() == [[5, 6, 7, 8]]


@pytest.mark.parametrize(
    ("examples", "error", "match"),
    [
        ([{"input_ids": [5, 6], "labels": [6, -100]}], ValueError, r"example 0: labels\[0\] is 6, neither"),
        ([{"input_ids": [5]}, {"input_ids": [5, 6], "labels": [5]}], ValueError, "example 1: field 'labels'"),
        ([{"input_ids": [5, 6, 7], "attention_mask": [1, 0, 1]}], ValueError, "example 0: .*a hole"),
        (
            [{"input_ids": [4]}, {"input_ids": [5, 6, 7, 8], "attention_mask": [0, 1, 0, 1]}],
            ValueError,
            "example 1: .*a hole",
        ),
        ([{"input_ids": [5, 6], "attention_mask": [1, 2]}], ValueError, "'attention_mask' must hold only 0"),
        ([{"input_ids": [5, 6], "loss_mask": [0.5, 1]}], ValueError, "'loss_mask' must hold only 0 and 1"),
        ([{"input_ids": [5, 6], "position_ids": [0, 0]}], ValueError, "example 0: holds several documents"),
        (
            [{"input_ids": [5, 6], "position_ids": [1, 2]}],
            ValueError,
            "example 0: 'position_ids' must start at 0",
        ),
        ([{"input_ids": [5, -6]}], ValueError, "example 0: field 'input_ids' token ids must be >= 0"),
        ([{"input_ids": [[5, 6]]}], ValueError, "a batch of one row, as tokenizer"),
        (
            [{"input_ids": [[5, 6], [7, 8]]}],
            ValueError,
            r"field 'input_ids' must be 1-D \(one entry per token\), got shape \(2, 2\)",
        ),
        (  # the first example is the odd one: both are named, not the well-formed one alone
            [{"input_ids": [[5], [6], [7]]}, {"input_ids": [8, 9]}],
            ValueError,
            r"example 1: field 'input_ids' has shape \(2,\), but example 0 has \(3, 1\)",
        ),
        ([{"text": "hi"}], ValueError, "example 0: has no 'input_ids'"),
        ([5, 6], TypeError, "example 0: must be a dict"),
        ([{"input_ids": [5]}, [5, 6]], TypeError, "example 1: must be a dict"),
        ([SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [5]})], TypeError, "pass the payloads"),
        (  # a packed row's padding is in its meta only: its payload alone would train it, so not offered
            [
                SampleRecord(
                    SampleMeta((0, 0, 0), 0, 0, tags={"_padding_length": 2}), {"input_ids": [5, 0, 0]}
                )
            ],
            TypeError,
            r"is a SampleRecord.*Collator\(\.\.\.\), which reads the 2 tokens of padding",
        ),
        ({"input_ids": [5, 6]}, ValueError, "one example .* not a batch"),
        ({"input_ids": [[5, 6]], "labels": []}, ValueError, "'labels' does not hold one entry per example"),
        ("input_ids", TypeError, "expected a list of example dicts"),
        ([], ValueError, "holds no examples"),
    ],
)
def test_bad_examples_are_named(examples: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Collator.for_transformers(pad_token_id=PAD)(examples)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "needs pad_token_id"),
        (
            {"padding_free": True, "pad_to_multiple_of": 8},
            ValueError,
            "pad_to_multiple_of pads with pad_token_id",
        ),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be an int >= 0"),
        ({"pad_token_id": 0, "pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be an int >= 1"),
        ({"padding_free": 1}, TypeError, "padding_free must be a bool"),
        (
            {"padding_free": True, "separator_id": 2.5},
            TypeError,
            "for_transformers: separator_id must be an int",
        ),
        ({"pad_token_id": 0, "label_pad_token_id": "x"}, TypeError, "label_pad_token_id must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Collator.for_transformers(**kwargs)


def test_examples_are_not_changed() -> None:
    ids, labels = torch.tensor([5, 6, 7]), np.array([-100, 6, 7])
    for padding_free in (False, True):
        out = Collator.for_transformers(padding_free=padding_free, pad_token_id=PAD)(
            [{"input_ids": ids, "labels": labels}]
        )
        out["labels"].fill_(1)
        out["input_ids"].fill_(1)
        assert ids.tolist() == [5, 6, 7] and labels.tolist() == [-100, 6, 7]


# A causal LM's loss: the double shift is gone, padding and prompts are not trained.


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


CHATS = [  # (tokens, loss mask): a prompt, then the trained response
    ([4, 5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 1]),
    ([10, 11, 12], [0, 1, 1]),
    ([13, 14, 15, 16, 17], [0, 0, 1, 1, 0]),
]


def hand_loss(model: transformers.GPT2LMHeadModel) -> torch.Tensor:
    """Next-token cross-entropy over exactly the supervised tokens, each example run alone."""
    losses = []
    for tokens, mask in CHATS:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
        for t in range(1, len(tokens)):
            if mask[t]:
                losses.append(-torch.log_softmax(logits[t - 1], -1)[tokens[t]])
    assert len(losses) == 7
    return torch.stack(losses).mean()


@pytest.mark.parametrize("padding_free", [False, True])
def test_gpt2_loss_is_the_next_token_loss_over_supervised_tokens(padding_free: bool) -> None:
    model = tiny_gpt2()
    examples = [{"input_ids": tokens, "loss_mask": mask} for tokens, mask in CHATS]
    layout = {"padding_free": True} if padding_free else {"pad_token_id": PAD, "pad_to_multiple_of": 8}
    batch = Collator.for_transformers(**layout)(examples)
    with torch.no_grad():
        loss = model(**batch).loss
    torch.testing.assert_close(loss, hand_loss(model))


def test_trainer_runs_on_a_datasets_dataset(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    model = tiny_gpt2().train()
    rows = [{"input_ids": tokens, "labels": [t if m else -100 for t, m in zip(tokens, mask, strict=True)]}
            for tokens, mask in CHATS * 4]  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    for padding_free in (False, True):
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=Collator.for_transformers(padding_free=padding_free, pad_token_id=PAD),
        )
        result = trainer.train()
        assert result.global_step == 3 and np.isfinite(result.training_loss)


# Hugging Face and TRL fields: each used as its peer uses it, or refused with the fix named.


def test_trl_seq_lengths_restart_positions_and_mask_each_document_start() -> None:
    """TRL's packed rows (SFTTrainer(packing=True), bfd) keep their documents apart."""
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]},
        {"input_ids": [10, 11], "seq_lengths": [2]},
    ]
    flat = Collator.for_transformers(padding_free=True)(rows)
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert flat["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11]]
    assert Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)(rows)[
        "cu_seq_lens_q"
    ].tolist() == [0, 3, 5, 7]
    with pytest.raises(ValueError, match=r"example 0: 'seq_lengths' .* add up to the example's 5 tokens"):
        Collator.for_transformers(padding_free=True)([{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 3]}])


@pytest.mark.parametrize("name", ["completion_mask", "assistant_mask", "assistant_masks", "loss_mask"])
def test_every_mask_field_is_applied_like_loss_mask(name: str) -> None:
    examples = [{"input_ids": [5, 6, 7], name: [0, 1, 1]}, {"input_ids": [8, 9], name: [0, 1]}]
    padded = Collator.for_transformers(pad_token_id=PAD)(examples)
    assert padded["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    flat = Collator.for_transformers(padding_free=True, boundary_safe_labels=False)(examples)
    assert flat["labels"].tolist() == [[-100, 6, 7, -100, 9]]


def test_token_type_ids_are_padded_and_passed_on() -> None:
    examples = [
        {"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1]},
        {"input_ids": [8, 9], "token_type_ids": [1, 1]},
    ]
    padded = Collator.for_transformers(pad_token_id=PAD)(examples)
    assert list(padded) == ["input_ids", "token_type_ids", "attention_mask", "labels"]
    assert padded["token_type_ids"].tolist() == [[0, 0, 1], [1, 1, 0]]
    flat = Collator.for_transformers(padding_free=True)(examples)
    assert flat["token_type_ids"].tolist() == [[0, 0, 1, 1, 1]]


@pytest.mark.parametrize(
    ("example", "match"),
    [
        ({"input_ids": [5, 6], "labels": 1}, "example 0: carries one label for the whole example"),
        (
            {"input_ids": [5, 6], "labels": torch.tensor(1)},
            "example 0: carries one label for the whole example",
        ),
        ({"input_ids": [5, 6], "label": 1}, r"example 0: carries one label .*DataCollatorWithPadding"),
        ({"input_ids": [5, 6], "label": "cat"}, r"example 0: carries one label .*or drop the column"),
        ({"input_ids": [5, 6], "label": True}, r"example 0: carries one label .*or drop the column"),
        (
            {"input_ids": [5, 6], "label": [5, 6]},
            "example 0: carries 'label' of one value per token.*'labels'",
        ),
        (
            {"input_ids": [5, 6], "decoder_input_ids": [0, 5]},
            "example 0: carries 'decoder_input_ids'.*causal LMs",
        ),
        ({"input_ids": [5, 6, 7], "labels": [8, 9]}, "labels of their own length: an encoder-decoder target"),
        (
            {"input_ids": torch.tensor([5, 6], device="meta")},
            "example 0: field 'input_ids' is a tensor on the 'meta'",
        ),
        (
            {"input_ids": [5, 6], "labels": torch.tensor([5, 6], device="meta")},
            "example 0: field 'labels' is a tensor on the 'meta' device",
        ),
    ],
)
@pytest.mark.parametrize("padding_free", [False, True])
def test_supervising_fields_nobody_reads_are_refused_with_the_fix(
    example: dict, match: str, padding_free: bool
) -> None:
    with pytest.raises(ValueError, match=match):
        Collator.for_transformers(pad_token_id=PAD, padding_free=padding_free)(
            [{"input_ids": [4]}, example][1:]
        )


def test_plain_position_ids_are_one_document() -> None:
    example = {"input_ids": [5, 6, 7], "position_ids": [0, 1, 2]}
    padded = Collator.for_transformers(pad_token_id=PAD, return_position_ids=True)(
        [example, {"input_ids": [8]}]
    )
    assert padded["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    with pytest.raises(ValueError, match="example 0: holds several documents"):
        Collator.for_transformers(pad_token_id=PAD)([{"input_ids": [5, 6, 7], "position_ids": [0, 1, 0]}])


def test_declared_supervision_missing_names_remove_unused_columns() -> None:
    collate = Collator.for_transformers(pad_token_id=PAD, supervision="assistant_masks")
    with pytest.raises(ValueError, match=r"example 0: lacks 'assistant_masks'.*remove_unused_columns=False"):
        collate([{"input_ids": [5, 6, 7]}])
    out = collate([{"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 1]}])
    assert out["labels"].tolist() == [[-100, 6, 7]]
    with pytest.raises(ValueError, match="supervision must name a field"):
        Collator.for_transformers(pad_token_id=PAD, supervision="assistant_mask_")


def test_trainer_dropping_the_supervision_column_is_refused(tmp_path) -> None:
    """transformers.Trainer drops a column its model's forward does not name (remove_unused_columns=True, the
    default): the declared field then arrives missing, and the first batch says how to keep it."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    rows = [{"input_ids": tokens, "assistant_masks": mask} for tokens, mask in CHATS * 4]
    collate = Collator.for_transformers(pad_token_id=PAD, supervision="assistant_masks")
    for keep in (False, True):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
            report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=not keep,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=tiny_gpt2().train(),
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=collate,
        )
        if not keep:
            with pytest.raises(ValueError, match=r"lacks 'assistant_masks'.*remove_unused_columns=False"):
                trainer.train()
        else:
            assert trainer.train().global_step == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"pad_token_id": 0, "truncation_mode": "keep_start"},
            "truncation_mode='keep_start' needs max_length",
        ),
        ({"pad_token_id": 0, "padding": "max_length"}, "padding='max_length' needs max_length"),
        ({"pad_token_id": 0, "padding": "maximum"}, "padding must be True/'longest'"),
        ({"pad_token_id": 0, "padding": False, "pad_to_multiple_of": 8}, "padding=False pads nothing"),
        (
            {"padding_free": True, "padding": "max_length", "max_length": 8},
            "padding_free=True puts the batch",
        ),
        ({"padding_free": True, "padding_side": "left"}, "padding_free=True puts the batch"),
        (
            {"pad_token_id": 0, "keep_eos": True, "max_length": 4, "truncation_mode": "keep_end"},
            "keep_eos=True",
        ),
        (
            {"pad_token_id": 0, "keep_eos": True, "max_length": 4, "truncation_mode": "keep_start"},
            "eos_token_id",
        ),
        ({"padding_free": True, "separator_id": 7, "boundary_safe_labels": False}, "separator_id"),
        ({"pad_token_id": 0, "return_flash_attn_kwargs": True}, "pass padding_free=True"),
        ({"pad_token_id": 0, "return_seq_idx": True}, "pass padding_free=True"),
        ({"pad_token_id": 0, "return_tensors": "tf"}, "return_tensors must be one of"),
        ({"pad_token_id": 0, "return_tensors": "np", "compile": True}, "need torch output"),
        ({"pad_token_id": 0, "pad_to_multiple_of": 2**40}, "pad_to_multiple_of must be an int"),
        ({"pad_token_id": 0, "max_length": 0}, "max_length must be an int >= 1"),
        ({"pad_token_id": 0, "padding_side": "top"}, "padding_side must be one of"),
        ({"pad_token_id": 0, "label_pad_token_id": 1.5}, "label_pad_token_id must be an int"),
    ],
)
def test_contradicting_or_bad_options_are_refused_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        Collator.for_transformers(**kwargs)


def test_options_by_hand() -> None:
    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}, {"input_ids": [10, 11]}]
    out = Collator.for_transformers(pad_token_id=PAD, label_pad_token_id=-1, return_tensors="np")(examples)
    assert isinstance(out["labels"], np.ndarray) and out["labels"].dtype == np.int64
    assert out["labels"].tolist() == [[-100, -100, 7, 8, 9], [10, 11, -1, -1, -1]]
    static = Collator.for_transformers(
        pad_token_id=PAD, padding="max_length", max_length=6, pad_to_multiple_of=4
    )
    assert static(examples)["input_ids"].shape == (2, 8)
    cut = Collator.for_transformers(
        pad_token_id=PAD, max_length=3, truncation_mode="keep_end", padding_side="left"
    )
    assert cut(examples)["input_ids"].tolist() == [[7, 8, 9], [0, 10, 11]]
    assert cut(examples)["labels"].tolist() == [[-100, 8, 9], [-100, -100, 11]]  # first tokens untrained
    flat = Collator.for_transformers(
        pad_token_id=PAD, padding_free=True, pad_to_multiple_of=4, return_seq_idx=True
    )
    out = flat(examples)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert out["labels"].tolist() == [[-100, -100, 7, 8, 9, -100, 11, -100]]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 2]]


def test_static_boundary_count_is_checked_in_every_path():
    """num_boundaries is checked where the batch is read: in one call as in stack/finish, on the host
    pass and the torch chain alike (a call used to lose the documents beyond the count silently)."""
    from zephon_collate import use_host_pass

    collate = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True, num_boundaries=3)
    three = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}]
    for host in (True, False):
        with use_host_pass(host):
            with pytest.raises(ValueError, match="3 segments, more than num_boundaries - 1 = 2"):
                collate(three)
            with pytest.raises(ValueError, match="3 segments"):
                collate.stack(three)
            assert collate(three[:2])["cu_seq_lens_q"].tolist() == [0, 3, 5]


def test_a_chain_of_yours_names_the_outputs_it_makes():
    """chain= replaces the built-in chain: it runs on the stacked batch (Hugging Face's names:
    ``position_ids``), and the outputs are the keys it leaves, as it names them."""
    from zephon_collate.transforms import CuSeqlens, UnshiftedLabels

    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    yours = CuSeqlens("position_ids", flatten=True, out_key="cu_seq_lens_q", max_key="max_length_q")
    flat = Collator.for_transformers(padding_free=True, chain=[yours])
    out = flat(examples)
    assert list(out) == ["input_ids", "position_ids", "cu_seq_lens_q", "max_length_q"]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5] and out["max_length_q"] == 3
    padded = Collator.for_transformers(pad_token_id=0, chain=[UnshiftedLabels()])(examples)
    assert list(padded) == ["input_ids", "labels"]
    assert padded["labels"].tolist() == [[1, 2, 3], [4, 5, 0]]  # no LossMask in your chain: nothing masked


def test_separator_id_marks_documents_not_padding():
    """separator_id goes on each document's first label; padding (pad_to_multiple_of, each pad a
    segment of its own) keeps label_pad_token_id, on the host pass and the torch chain."""
    from zephon_collate import use_host_pass

    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    for host in (True, False):
        with use_host_pass(host):
            collate = Collator.for_transformers(
                padding_free=True, pad_token_id=0, pad_to_multiple_of=8, separator_id=-7
            )
            assert collate(examples)["labels"].tolist() == [[-7, 6, 7, -7, 9, -100, -100, -100]]
            np_out = Collator.for_transformers(
                padding_free=True, pad_token_id=0, pad_to_multiple_of=8, separator_id=-7, return_tensors="np"
            )(examples)
            assert np_out["labels"].tolist() == [[-7, 6, 7, -7, 9, -100, -100, -100]]


def test_hugging_face_left_padding_positions_are_read_on_the_kept_tokens() -> None:
    """Left padding as Hugging Face writes it: ``position_ids = attention_mask.cumsum(-1) - 1``, its padding
    filled with 1 (``[1, 0, 1, 2]``). The padding's positions are not the example's: read like the same
    examples unpadded, in every mode; positions that start above 0 on the kept tokens too are refused."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert position_ids.tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    padded = [
        {"input_ids": i, "attention_mask": m, "position_ids": p}
        for i, m, p in zip(ids.tolist(), mask.tolist(), position_ids.tolist(), strict=True)
    ]
    plain = [{"input_ids": [5, 6, 7]}, {"input_ids": [4, 5, 6, 7, 8]}]
    for options in ({"padding_free": True}, {"padding_free": False, "return_position_ids": True}):
        collate = Collator.for_transformers(pad_token_id=0, **options)
        out, expected = collate(padded), collate(plain)
        assert out.keys() == expected.keys()
        for key in out:
            assert torch.equal(torch.as_tensor(out[key]), torch.as_tensor(expected[key])), key
    flat = Collator.for_transformers(padding_free=True, pad_token_id=0)(padded)
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert flat["labels"].tolist() == [[-100, 6, 7, -100, 5, 6, 7, 8]]
    # An example without position_ids beside one with them: its positions count its kept tokens, as alone.
    mixed = [
        {"input_ids": [4, 5, 6], "position_ids": [0, 1, 2]},
        {"input_ids": [0, 8, 9], "attention_mask": [0, 1, 1]},
    ]
    for options in ({"padding_free": True}, {"padding_free": False, "return_position_ids": True}):
        collate = Collator.for_transformers(pad_token_id=0, **options)
        out, expected = collate(mixed), collate([{"input_ids": [4, 5, 6]}, {"input_ids": [8, 9]}])
        for key in out:
            assert torch.equal(torch.as_tensor(out[key]), torch.as_tensor(expected[key])), key
    late = {"input_ids": [0, 5, 6], "attention_mask": [0, 1, 1], "position_ids": [1, 1, 2]}
    with pytest.raises(ValueError, match=r"example 0: 'position_ids' must start at 0 .* start at 1"):
        Collator.for_transformers(pad_token_id=0)([late])


def test_positions_the_attention_mask_cuts_must_still_start_at_zero_padding_free() -> None:
    """Leading attention_mask 0s dropped: given positions (or seq_lengths) that counted them would start the
    kept tokens at 1 and, padding-free, continue the example before it; refused by name. The sequence map
    and a float field named like its internal key stay apart."""
    collate = Collator.for_transformers(padding_free=True, return_sequence_map=True)
    for counted in ({"position_ids": [0, 1, 2, 3]}, {"seq_lengths": [4]}):
        cut = {"input_ids": [9, 5, 6, 7], "attention_mask": [0, 1, 1, 1], **counted}
        with pytest.raises(
            ValueError, match=r"example 1: its attention_mask drops its first tokens, .* start at 1"
        ):
            collate([{"input_ids": [8, 9]}, cut])
    kept = {"input_ids": [9, 5, 6, 7], "attention_mask": [0, 1, 1, 1], "position_ids": [0, 0, 1, 2]}
    out = collate([{"input_ids": [8, 9]}, kept, {"input_ids": []}])
    assert out["sequence_index"].tolist() == [[0, 0, 1, 1, 1]] and out["num_sequences"] == 3
    assert out["logits_index"].tolist() == [[-1, 0, -1, 2, 3]]
    with pytest.raises(ValueError, match=r"float field 'example_lengths' collides"):
        Collator.for_transformers(padding_free=True, float_fields=["example_lengths"])
