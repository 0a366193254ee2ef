"""Collator.for_preference: hand-worked layouts, TRL's collator on the same pairs, padded sides, bad input."""

from __future__ import annotations

import pickle

import pytest
import torch

from zephon_collate import Collator, SampleMeta, SampleRecord
from zephon_collate.layouts.presets import PreferenceOptions

PAIRS = [
    {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
    {"prompt_input_ids": [7, 8], "chosen_input_ids": [9], "rejected_input_ids": [10, 11, 12]},
]


def lists(batch: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def test_padded_pairs_equal_trls_collator():
    """TRL 1.16's DataCollatorForPreference on the same pairs: the same rows, chosen first; labels are
    input_ids where its completion_mask is 1."""
    trl = pytest.importorskip("trl.trainer.dpo_trainer")
    reference = [dict(e, ref_chosen_logps=-1.5 * i, ref_rejected_logps=-2.5 * i) for i, e in enumerate(PAIRS)]
    trl_pairs = [
        {key.replace("_input_ids", "_ids"): value for key, value in e.items()} for e in reference
    ]  # TRL 1.x spells them prompt_ids, chosen_ids, rejected_ids; both are read
    for multiple in (None, 4):
        theirs = trl.DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=multiple)(trl_pairs)
        for pairs in (reference, trl_pairs):
            ours = Collator.for_preference(pad_token_id=0, pad_to_multiple_of=multiple)(pairs)
            assert torch.equal(ours["input_ids"], theirs["input_ids"])
            assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
            expected = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, -100)
            assert torch.equal(ours["labels"], expected)
            for key in ("ref_chosen_logps", "ref_rejected_logps"):
                assert torch.equal(ours[key], theirs[key]) and ours[key].dtype == torch.float32
            assert ours["chosen_index"].tolist() == [0, 1] and ours["rejected_index"].tolist() == [2, 3]


def test_truncation_equals_trls_collator():
    """max_length cuts each sequence as TRL 1.16's DataCollatorForPreference does, keeping its start or its end;
    every layout holds the same sequences."""
    trl = pytest.importorskip("trl.trainer.dpo_trainer")
    pairs = [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5, 13, 14], "rejected_ids": [6]},
        {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11, 12, 15, 16]},
    ]
    for mode in ("keep_start", "keep_end"):
        theirs = trl.DataCollatorForPreference(pad_token_id=0, max_length=5, truncation_mode=mode)(pairs)
        expected = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, -100)
        ours = Collator.for_preference(pad_token_id=0, max_length=5, truncation_mode=mode)(pairs)
        assert torch.equal(ours["input_ids"], theirs["input_ids"]), mode
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"]), mode
        assert torch.equal(ours["labels"], expected), mode
        flat = Collator.for_preference(padding_free=True, max_length=5, truncation_mode=mode)(pairs)
        kept = [
            row[mask.bool()].tolist()
            for row, mask in zip(theirs["input_ids"], theirs["attention_mask"], strict=True)
        ]
        assert flat["input_ids"][0].tolist() == [token for row in kept for token in row], mode


def test_prompt_and_completion_limits_hand_worked():
    pairs = [{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6, 7], "rejected_ids": [8]}]
    cut = Collator.for_preference(pad_token_id=0, max_prompt_length=2, truncation_mode="keep_end")(pairs)
    assert cut["input_ids"].tolist() == [[3, 4, 5, 6, 7], [3, 4, 8, 0, 0]]
    cut = Collator.for_preference(pad_token_id=0, max_prompt_length=2, max_completion_length=2)(pairs)
    assert cut["input_ids"].tolist() == [[3, 4, 5, 6], [3, 4, 8, 0]]  # the prompt's end, in either mode
    assert cut["labels"].tolist() == [[-100, -100, 5, 6], [-100, -100, 8, -100]]
    shared = Collator.for_preference(padding_free=True, shared_prompt=True, max_length=5)(pairs)
    assert shared["input_ids"].tolist() == [[1, 2, 3, 4, 5, 8]]  # the prompt whole, once; each response cut


def test_truncation_refusals():
    pairs = [{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5], "rejected_ids": [8]}]
    with pytest.raises(
        ValueError, match=r"example 0: its prompt of 4 tokens fills max_length=4.*max_prompt_length"
    ):
        Collator.for_preference(pad_token_id=0, max_length=4)(pairs)
    with pytest.raises(ValueError, match="would keep a different part of the prompt for each response"):
        Collator.for_preference(
            padding_free=True, shared_prompt=True, max_length=4, truncation_mode="keep_end"
        )
    with pytest.raises(ValueError, match="truncation_mode must be 'keep_start' or 'keep_end'"):
        Collator.for_preference(pad_token_id=0, max_length=4, truncation_mode="start")
    with pytest.raises(ValueError, match="max_length"):
        Collator.for_preference(pad_token_id=0, max_length=0)


def test_padding_free_layout_hand_worked():
    out = lists(
        Collator.for_preference(padding_free=True, return_flash_attn_kwargs=True, return_seq_idx=True)(PAIRS)
    )
    # TRL's order in every layout: every chosen sequence, then every rejected one.
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 7, 8, 9, 1, 2, 3, 6, 7, 8, 10, 11, 12]]
    assert out["labels"] == [
        [-100, -100, -100, 4, 5, -100, -100, 9, -100, -100, -100, 6, -100, -100, 10, 11, 12]
    ]
    assert out["position_ids"] == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]]
    assert out["cu_seq_lens_q"] == [0, 5, 8, 12, 17] and out["max_length_q"] == 5
    assert out["seq_idx"] == [[0] * 5 + [1] * 3 + [2] * 4 + [3] * 5]
    assert out["document_ids"] == out["seq_idx"] and out["branch_ids"] == [[1] * 17]
    assert out["logits_index"] == [[-1, 0, 1, 2, 3, -1, 5, 6, -1, 8, 9, 10, -1, 12, 13, 14, 15]]
    assert out["chosen_index"] == [0, 1] and out["rejected_index"] == [2, 3] and out["num_sequences"] == 4


def test_shared_prompt_layouts_hand_worked():
    """The prompt once, both responses after it, positions continuing from the prompt in each."""
    flat = lists(Collator.for_preference(padding_free=True, shared_prompt=True)(PAIRS))
    assert flat["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert flat["position_ids"] == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 2, 3, 4]]
    assert flat["labels"] == [[-100, -100, -100, 4, 5, 6, -100, -100, 9, 10, 11, 12]]
    assert flat["branch_ids"] == [[0, 0, 0, 1, 1, 2, 0, 0, 1, 2, 2, 2]]
    assert flat["document_ids"] == [[0] * 6 + [1] * 6]
    assert flat["logits_index"] == [[-1, 0, 1, 2, 3, 2, -1, 6, 7, 7, 9, 10]]  # 6 and 10 from the prompt's end
    assert flat["sequence_index"] == [[-1, -1, -1, 0, 0, 2, -1, -1, 1, 3, 3, 3]]  # chosen 0, 1; rejected 2, 3
    padded = lists(Collator.for_preference(pad_token_id=0, shared_prompt=True, pad_to_multiple_of=8)(PAIRS))
    assert padded["input_ids"] == [[1, 2, 3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12, 0, 0]]
    assert "attention_mask" not in padded  # a padding mask would let a response see its sibling
    assert padded["document_ids"] == [[0] * 6 + [-1] * 2, [1] * 6 + [-1] * 2]
    assert padded["position_ids"] == [[0, 1, 2, 3, 4, 3, 0, 0], [0, 1, 2, 2, 3, 4, 0, 0]]
    assert padded["branch_ids"] == [[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 1, 2, 2, 2, -1, -1]]
    assert padded["logits_index"] == [[-1, 0, 1, 2, 3, 2, -1, -1], [-1, 0, 1, 1, 3, 4, -1, -1]]
    assert padded["chosen_index"] == [0, 1] and padded["rejected_index"] == [2, 3]


def test_consecutive_pairs_of_one_prompt_share_it_once():
    pairs = [dict(PAIRS[0], chosen_input_ids=[4]), dict(PAIRS[0], rejected_input_ids=[9, 9])]
    out = lists(Collator.for_preference(padding_free=True, shared_prompt=True)(pairs))
    assert out["input_ids"] == [[1, 2, 3, 4, 6, 4, 5, 9, 9]]
    assert out["branch_ids"] == [[0, 0, 0, 1, 2, 3, 3, 4, 4]] and out["num_sequences"] == 4


def test_a_padded_side_never_moves_the_other_sides_sequences():
    """Pre-padded sides (padding anywhere but inside): the batch equals that of the unpadded pairs.

    open-instruct's packed DPO collator derived the rejected side's boundaries from the chosen
    side's padded length; here every sequence is built from its side's own tokens."""
    padded = [
        {"prompt_input_ids": [0, 0, 1, 2, 3], "prompt_attention_mask": [0, 0, 1, 1, 1],
         "chosen_input_ids": [4, 5, 0, 0], "chosen_attention_mask": [1, 1, 0, 0],
         "rejected_input_ids": [6, 0, 0, 0], "rejected_attention_mask": [1, 0, 0, 0]},
        {"prompt_input_ids": [0, 0, 0, 7, 8], "prompt_attention_mask": [0, 0, 0, 1, 1],
         "chosen_input_ids": [9, 0, 0, 0], "chosen_attention_mask": [1, 0, 0, 0],
         "rejected_input_ids": [10, 11, 12, 0], "rejected_attention_mask": [1, 1, 1, 0]},
    ]  # fmt: skip
    for options in (
        {"pad_token_id": 0},
        {"padding_free": True},
        {"padding_free": True, "shared_prompt": True},
    ):
        collate = Collator.for_preference(**options)
        assert lists(collate(padded)) == lists(collate(PAIRS)), options
    hole = [dict(padded[0], chosen_attention_mask=[1, 0, 1, 0]), padded[1]]
    with pytest.raises(
        ValueError,
        match=r"example 0: .chosen_attention_mask. must be 1 on the tokens, .* it has 0s between 1s",
    ):
        Collator.for_preference(padding_free=True)(hole)


def test_batched_dicts_workers_and_the_tokenizer():
    batched = {key: [p[key] for p in PAIRS] for key in PAIRS[0]}
    collate = Collator.for_preference(padding_free=True, shared_prompt=True)
    assert lists(collate(batched)) == lists(collate(PAIRS))
    arrived = collate.finish(pickle.loads(pickle.dumps(collate.stack(PAIRS))))
    assert lists(arrived) == lists(collate(PAIRS))

    class Tokenizer:
        pad_token_id = 3

    assert Collator.for_preference(Tokenizer())(PAIRS)["input_ids"][1].tolist() == [7, 8, 9, 3, 3]
    assert type(collate) is Collator and collate.layout.OWNER == "Collator.for_preference"  # one class


@pytest.mark.parametrize(
    ("pairs", "error", "match"),
    [
        ([], ValueError, "holds no pairs"),
        ([{"prompt_input_ids": [1], "chosen_input_ids": [2]}], ValueError, "no rejected tokens"),
        (
            [PAIRS[0], {"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_ids": [3]}],
            ValueError,
            r"example 1: payload lacks field 'rejected_input_ids'",
        ),
        ([dict(PAIRS[0], chosen_input_ids=[4, -5])], ValueError, r"example 0: .*'chosen_input_ids'.*>= 0"),
        ([dict(PAIRS[0], chosen_input_ids=[[4, 5]])], ValueError, "a batch of one row"),
        (
            [dict(PAIRS[0], chosen_input_ids=[[4, 5], [6, 7]])],
            ValueError,
            r"must be 1-D \(one entry per token\)",
        ),
        ([dict(PAIRS[0], chosen_input_ids=[4.5])], TypeError, "integer token ids"),
        (
            [dict(PAIRS[0], chosen_attention_mask=[1])],
            ValueError,
            "has shape .1,., but 'chosen_input_ids' has 2",
        ),
        ([dict(PAIRS[0], ref_chosen_logps=-1.0)], ValueError, "carry 'ref_chosen_logps' but not"),
        ([dict(PAIRS[0], ref_chosen_logps=float("nan"), ref_rejected_logps=0.0)], ValueError, "finite"),
        ([SampleRecord(SampleMeta((0, 0, 0), 0, 0), PAIRS[0])], TypeError, "must be a dict"),
    ],
)
def test_bad_pairs_name_the_example_and_the_fix(pairs, error, match):
    with pytest.raises(error, match=match):
        Collator.for_preference(padding_free=True)(pairs)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, r"Collator.for_preference: the padded layout needs pad_token_id"),
        ({"padding_free": True, "shared_prompt": True, "return_flash_attn_kwargs": True}, "cannot describe"),
        ({"padding_free": True, "shared_prompt": True, "return_seq_idx": True}, "cannot describe"),
        ({"padding_free": True, "shared_prompt": True, "return_position_ids": False}, "needs position_ids"),
        ({"pad_token_id": 0, "return_flash_attn_kwargs": True}, "padding_free=True"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        Collator.for_preference(**options)
    with pytest.raises(TypeError, match="shared_prompt"):
        PreferenceOptions(shared_prompt=1, padding_free=True)
    with pytest.raises(TypeError, match="did you mean 'shared_prompt'"):
        Collator.for_preference(padding_free=True, share_prompt=True)


OPEN_INSTRUCT = [
    {"chosen_input_ids": [1, 2, 3, 4, 5], "chosen_labels": [-100, -100, -100, 4, 5],
     "rejected_input_ids": [1, 2, 3, 6], "rejected_labels": [-100, -100, -100, 6]},
    {"chosen_input_ids": [7, 8, 9], "chosen_labels": [-100, -100, 9],
     "rejected_input_ids": [7, 8, 10, 11, 12], "rejected_labels": [-100, -100, 10, 11, 12]},
]  # fmt: skip
OPENRLHF = [
    {"chosen_ids": [1, 2, 3, 4, 5], "reject_ids": [1, 2, 3, 6], "extra": 3},
    {"chosen_ids": [7, 8, 9], "reject_ids": [7, 8, 10, 11, 12], "extra": 2},
]


@pytest.mark.parametrize(
    "layout", [{"pad_token_id": 0}, {"padding_free": True}, {"padding_free": True, "shared_prompt": True}]
)
def test_open_instruct_and_openrlhf_pairs_read_as_trls(layout):
    """Whole sequences with -100 on the prompt (open-instruct) and with the prompt's length in 'extra'
    (OpenRLHF) give the batch of the same pairs in TRL's format, in every layout."""
    want = lists(Collator.for_preference(**layout)(PAIRS))
    assert lists(Collator.for_preference(**layout)(OPEN_INSTRUCT)) == want
    assert lists(Collator.for_preference(**layout)(OPENRLHF)) == want


def test_other_formats_refusals():
    multi_turn = [dict(OPEN_INSTRUCT[0], chosen_labels=[-100, 2, -100, 4, 5])]
    with pytest.raises(
        ValueError, match=r"example 0: 'chosen_labels' is not -100 on a prompt, then the tokens"
    ):
        Collator.for_preference(pad_token_id=0)(multi_turn)
    apart = [dict(OPEN_INSTRUCT[0], rejected_input_ids=[1, 2, 9, 6])]
    with pytest.raises(ValueError, match="start with different prompts"):
        Collator.for_preference(pad_token_id=0)(apart)
    with pytest.raises(ValueError, match="without 'extra'"):
        Collator.for_preference(pad_token_id=0)([{"chosen_ids": [1, 2], "reject_ids": [1, 3]}])
    with pytest.raises(ValueError, match=r"'extra' is 5, but it must be the prompt's length"):
        Collator.for_preference(pad_token_id=0)([dict(OPENRLHF[0], extra=5)])
    with pytest.raises(ValueError, match=r"differ in their first 3 tokens"):
        Collator.for_preference(pad_token_id=0)([dict(OPENRLHF[0], reject_ids=[1, 2, 9, 6])])
    with pytest.raises(ValueError, match=r"beside prompt ids \(TRL's format\)"):
        Collator.for_preference(pad_token_id=0)([dict(OPENRLHF[0], prompt_ids=[1, 2, 3])])


@pytest.mark.parametrize("name", ["loss_mask", "assistant_masks"])
def test_a_pairs_loss_mask_is_refused_not_ignored(name):
    """A side's tokens are trained whole: a loss_mask with zeros (which nothing reads) was ignored, so
    the tokens it leaves out were trained; now refused, naming the example and the field."""
    pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3, 4], "rejected_input_ids": [5], name: [0, 1]}
    with pytest.raises(ValueError, match=rf"example 1: carries '{name}', which this collator does not read"):
        Collator.for_preference(padding_free=True)([{k: v for k, v in pair.items() if k != name}, pair])
    reward = {"chosen_ids": [1, 3, 4], "rejected_ids": [1, 5], name: [0, 1, 1]}
    with pytest.raises(ValueError, match=rf"example 0: carries '{name}'"):
        Collator.for_rewards(pad_token_id=0)([reward])
    ones = {**pair, name: [1, 1]}  # all trained: nothing left out, read as the whole side
    assert Collator.for_preference(padding_free=True)([ones])["input_ids"].tolist() == [[1, 2, 3, 4, 1, 2, 5]]


def test_odd_pairs_are_read_as_their_stack_means_or_refused():
    """A prompt filling max_length is refused with empty responses too (TRL drops such pairs); OpenRLHF's
    per-side masks c_mask / r_mask drop the padding; two rejected sides (TRL's and OpenRLHF's) are refused."""
    full = [{"prompt_ids": [1, 2, 3, 4, 5], "chosen_ids": [], "rejected_ids": []}]
    with pytest.raises(ValueError, match=r"example 0: its prompt of 5 tokens fills max_length=3"):
        Collator.for_preference(pad_token_id=0, max_length=3)(full)
    kto = [{"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [], "label": True}]
    with pytest.raises(ValueError, match=r"example 0: its prompt of 5 tokens fills max_length=3"):
        Collator.for_preference(pad_token_id=0, max_length=3)(kto)
    pair = {"chosen_ids": [1, 2, 3, 4], "reject_ids": [1, 2, 5, 0], "r_mask": [1, 1, 1, 0], "extra": 2}
    padded = Collator.for_preference(pad_token_id=0)([pair])
    assert padded["labels"].tolist() == [[-100, -100, 3, 4], [-100, -100, 5, -100]]  # the pad untrained
    reward = {**pair, "extra": 0.5, "c_mask": [1, 1, 1, 1]}
    assert Collator.for_rewards(padding_free=True)([reward])["last_token_index"].tolist() == [3, 6]
    with pytest.raises(ValueError, match=r"carries both 'reject_attention_mask' and 'r_mask'"):
        Collator.for_preference(pad_token_id=0)([{**pair, "reject_attention_mask": [1, 1, 1, 0]}])
    both = {**pair, "rejected_ids": [1, 2, 6]}
    with pytest.raises(ValueError, match=r"'reject_ids' \(OpenRLHF's rejected side\) beside 'rejected_ids'"):
        Collator.for_preference(pad_token_id=0)([both])
    with pytest.raises(ValueError, match=r"carries 'reject_ids' .* beside 'rejected_ids'"):
        Collator.for_rewards(padding_free=True)([{**both, "extra": 0.5}])
