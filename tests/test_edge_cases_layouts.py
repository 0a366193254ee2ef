"""Edge cases of the Hugging Face and post-training layouts, each with its hand-worked answer: cut
examples keep their documents apart, the page's ``positions`` is read wherever ``position_ids`` is,
an EOS put back keeps its own values, empty examples keep their number, a shared prompt keeps a value
its sequences agree on, and transforms of yours fail by name in every mode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from zephon_collate import Collator, FloatField, Transform, pack_flat, sequence_logprobs, unpack
from zephon_collate.transforms.base import UndeclaredKeyError


def _lists(batch: dict[str, Any]) -> dict[str, Any]:
    return {key: value.tolist() if hasattr(value, "tolist") else value for key, value in batch.items()}


@pytest.mark.parametrize(
    "packed",
    [
        {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [3, 3]},
        {"input_ids": [1, 2, 3, 4, 5, 6], "position_ids": [0, 1, 2, 0, 1, 2]},
        {"input_ids": [1, 2, 3, 4, 5, 6], "positions": [0, 1, 2, 0, 1, 2]},
    ],
)
def test_keep_end_cut_of_a_packed_example_keeps_the_examples_apart(packed: dict[str, Any]) -> None:
    """keep_end keeps [5, 6] of the packed example (its second document, cut): the kept part starts
    a document again, so labels do not run from one example into the next."""
    collate = Collator.for_transformers(
        padding_free=True, max_length=2, truncation_mode="keep_end", return_flash_attn_kwargs=True
    )
    batch = _lists(collate([packed, {"input_ids": [7, 8, 9]}]))
    assert batch["input_ids"] == [[5, 6, 8, 9]]
    assert batch["position_ids"] == [[0, 1, 0, 1]]
    assert batch["labels"] == [[-100, 6, -100, 9]]
    assert batch["cu_seq_lens_q"] == [0, 2, 4]


def test_keep_end_cut_inside_a_document_restarts_only_that_document() -> None:
    """[1 2 3 | 4 5] cut to its last 4 tokens: [2 3 | 4 5], positions [0 1 | 0 1]; the loss helpers
    find the same sequences as the collator."""
    batch = Collator.for_transformers(padding_free=True, max_length=4, truncation_mode="keep_end")(
        [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}, {"input_ids": [7, 8, 9]}]
    )
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1, 2]]
    assert [u.tolist() for u in unpack(batch["input_ids"], batch)] == [[2, 3], [4, 5], [7, 8, 9]]
    assert sequence_logprobs(torch.zeros(1, 7, 10), batch).counts.tolist() == [1, 1, 2]


def test_packed_rows_as_payloads_keep_their_documents() -> None:
    """pack_flat's rows handed over as payload dicts: their ``positions`` (the page's name) mark the
    documents, as ``position_ids`` would; the padding (one token here) is a document of its own. A payload
    dict does not carry the padding its meta counts: longer padding is trained (docs/bad_input.md row 194)."""
    rows = pack_flat([{"input_ids": [1, 5, 2]}, {"input_ids": [1, 6, 6, 2]}], 8, pad_token_id=0)
    collate = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
    batch = _lists(collate([row.payload for row in rows]))
    assert batch["labels"] == [[-100, 5, 2, -100, 6, 6, 2, -100]]
    assert batch["position_ids"] == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert batch["cu_seq_lens_q"] == [0, 3, 7, 8]


def test_positions_and_position_ids_that_differ_are_refused_in_rows_and_columns() -> None:
    ids, offsets = np.array([1, 5, 2, 1, 6, 2]), np.array([0, 6])
    hf, page = np.array([0, 1, 2, 0, 1, 2]), np.arange(6)
    message = "has both 'positions' and 'position_ids'"
    collate = Collator(return_labels=True, return_cu_seqlens=True)
    with pytest.raises(ValueError, match=message):
        collate([{"input_ids": ids, "position_ids": hf, "positions": page}])
    with pytest.raises(ValueError, match=message):
        collate({"input_ids": (ids, offsets), "position_ids": (hf, offsets), "positions": (page, offsets)})
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(padding_free=True)(
            [{"input_ids": ids, "position_ids": hf, "positions": page}]
        )


def test_rollouts_refuse_the_pages_positions_as_they_refuse_position_ids() -> None:
    """Positions that restart inside a rollout (documents packed) are refused under either name; positions
    counting the tokens from 0 (verl's, padding dropped) say nothing more and are read."""
    rollout = {"input_ids": [1, 5, 2, 1, 6], "positions": [0, 1, 2, 0, 1], "completion_mask": [0, 1, 1, 0, 1]}
    for name in ("positions", "position_ids"):
        given = {**rollout, name: rollout["positions"]} if name == "position_ids" else rollout
        if name == "position_ids":
            given = {key: value for key, value in given.items() if key != "positions"}
        with pytest.raises(
            ValueError, match=r"example 0: its positions \('position_ids' or 'positions'\) do"
        ):
            Collator.for_rollouts(padding_free=True)([given])
    verl = {"input_ids": [0, 5, 2, 1, 6], "attention_mask": [0, 1, 1, 1, 1], "position_ids": [0, 0, 1, 2, 3]}
    out = Collator.for_rollouts(padding_free=True)([{**verl, "completion_mask": [0, 0, 0, 1, 1]}])
    assert out["input_ids"].tolist() == [[5, 2, 1, 6]] and out["position_ids"].tolist() == [[0, 1, 2, 3]]


def test_an_eos_put_back_keeps_its_own_values() -> None:
    """lp[5] = 0.6 is the EOS's own value; as a label-aligned field, lp[4] = 0.5 is the prediction of
    the EOS, which after the cut is made at the place before it."""
    example = {
        "input_ids": [1, 2, 3, 4, 5, 6],
        "labels": [-100, -100, 3, 4, 5, 6],
        "lp": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
    }
    options: dict[str, Any] = dict(
        padding_free=True, max_length=4, truncation_mode="keep_start", keep_eos=True, eos_token_id=6
    )
    batch = Collator.for_transformers(float_fields=["lp"], **options)([example])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6]]
    assert batch["labels"].tolist() == [[-100, -100, 3, 6]]
    assert batch["lp"][0].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.6])
    by_label = Collator.for_transformers(float_fields=[FloatField("lp", align="label")], **options)([example])
    assert by_label["lp"][0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.5])


def test_an_empty_example_keeps_its_number_padding_free() -> None:
    examples = [
        {"input_ids": [5, 6, 7], "adv": 1.0},
        {"input_ids": [], "adv": 2.0},
        {"input_ids": [8, 9], "adv": 3.0},
    ]
    floats = [FloatField("adv", align="sequence")]
    padded = Collator.for_transformers(pad_token_id=0, float_fields=floats)(examples)
    free = Collator.for_transformers(padding_free=True, return_sequence_map=True, float_fields=floats)(
        examples
    )
    for batch in (padded, free):
        assert [u.tolist() for u in unpack(batch["input_ids"], batch)] == [[5, 6, 7], [], [8, 9]]
        assert sequence_logprobs(torch.zeros(*batch["input_ids"].shape, 10), batch).counts.tolist() == [
            2,
            0,
            1,
        ]
    assert free["sequence_index"].tolist() == [[0, 0, 0, 2, 2]]
    assert int(free["num_sequences"]) == 3


def test_a_shared_prompt_keeps_the_value_its_sequences_agree_on() -> None:
    floats = [FloatField("adv", align="sequence", broadcast=True)]
    lone = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "adv": 0.5}]
    for shared in (False, True):
        batch = Collator.for_rollouts(padding_free=True, shared_prompt=shared, float_fields=floats)(lone)
        assert batch["adv"].tolist() == [[0.5, 0.5, 0.5]]
    pair = [
        {"input_ids": [1, 2, 3], "completion_mask": [0, 0, 1], "adv": 0.5},
        {"input_ids": [1, 2, 4], "completion_mask": [0, 0, 1], "adv": -0.5},
        {"input_ids": [7, 8, 9], "completion_mask": [0, 0, 1], "adv": 2.0},
        {"input_ids": [7, 8, 5], "completion_mask": [0, 0, 1], "adv": 2.0},
    ]
    batch = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=floats)(pair)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 7, 8, 9, 5]]
    # the first prompt belongs to 0.5 and -0.5 (0), the second to 2.0 and 2.0 (2.0)
    assert batch["adv"].tolist() == [[0.0, 0.0, 0.5, -0.5, 2.0, 2.0, 2.0, 2.0]]


@pytest.mark.parametrize(
    "make",
    [
        lambda spec: Collator.for_transformers(padding_free=True, return_tensors="np", float_fields=[spec]),
        lambda spec: Collator(return_labels=True, dtype=np.int64, float_fields=[spec]),
    ],
)
def test_bfloat16_float_fields_need_torch_output(make: Any) -> None:
    with pytest.raises(ValueError, match=r"float field 'lp' has dtype torch.bfloat16, which numpy output"):
        make(FloatField("lp", dtype=torch.bfloat16))


class _Sneaky(Transform):
    """Reads ``positions`` without declaring it."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels"], ["w"]

    def compute(self, data: Any) -> dict[str, torch.Tensor]:
        return {"w": data["labels"].float() + data["positions"].float()}


class _NotATensor(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels"], ["w"]

    def compute(self, data: Any) -> dict[str, Any]:
        return {"w": 3}


class _WritesMore(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels"], ["w"]

    def compute(self, data: Any) -> dict[str, torch.Tensor]:
        return {"w": data["labels"].float(), "extra": data["labels"]}


ROWS = [{"input_ids": [1, 2, 3], "positions": [0, 1, 2]}]


@pytest.mark.parametrize(
    ("transform", "error", "match"),
    [
        (_Sneaky, UndeclaredKeyError, "_Sneaky reads 'positions', which it does not declare"),
        (_NotATensor, TypeError, "_NotATensor returns 'w' as int, not a tensor"),
        (_WritesMore, ValueError, r"_WritesMore returns 'extra', which is not in its out_keys \['w'\]"),
    ],
)
def test_transforms_of_yours_fail_by_name_eager(transform: type, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Collator(return_labels=True, transforms=[transform()])(ROWS)


def test_an_undeclared_read_fails_by_name_compiled() -> None:
    with pytest.raises(UndeclaredKeyError, match="_Sneaky reads 'positions'"):
        Collator(return_labels=True, transforms=[_Sneaky()], compile=True)(ROWS)


def test_rows_that_spell_their_positions_two_ways_are_refused() -> None:
    """Read under one name, the other rows' positions would be lost and their documents merged."""
    examples = [
        {"input_ids": [1, 2, 3, 4], "positions": [0, 1, 0, 1]},
        {"input_ids": [5, 6, 7, 8], "position_ids": [0, 1, 0, 1]},
    ]
    message = r"example 1: gives its positions as 'position_ids', example 0 as 'positions'"
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(padding_free=True)(examples)
    with pytest.raises(ValueError, match=r"record 1 .*gives its positions as 'position_ids', record 0 "):
        Collator(return_labels=True, return_cu_seqlens=True)(examples)
    both = [examples[0], dict(examples[1], positions=[0, 1, 0, 1])]
    out = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)(both)
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 4, 6, 8]


class _ReturnsPairs(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels"], ["w"]

    def compute(self, data: Any) -> Any:
        return [("w", data["labels"].float())]


@pytest.mark.parametrize(
    ("transform", "error", "match"),
    [
        (_WritesMore, ValueError, r"_WritesMore returns 'extra', which is not in its out_keys \['w'\]"),
        (_ReturnsPairs, TypeError, r"_ReturnsPairs.compute must return a dict"),
        (_NotATensor, TypeError, "_NotATensor returns 'w' as int, not a tensor"),
    ],
)
def test_transforms_of_yours_fail_by_name_compiled(transform: type, error: type, match: str) -> None:
    """A graph that compiles fine still checks what the step returns: the same error as eager."""
    with pytest.raises(error, match=match):
        Collator(return_labels=True, transforms=[transform()], compile=True)(ROWS)
