"""Collator.for_rollouts: hand-worked layouts, shared GRPO prompts, float fields, unpack(pack(x)) round trips."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FloatField, unpack

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECS = ["old", FloatField("value", "label"), FloatField("adv", "sequence", broadcast=True)]


def rollout(prompt: list[int], completion: list[int], adv: float = 0.0, **fields) -> dict:
    n = len(prompt) + len(completion)
    return {
        "input_ids": prompt + completion,
        "completion_mask": [0] * len(prompt) + [1] * len(completion),
        "old": [0.0] * len(prompt) + [-0.25 * (k + 1) for k in range(len(completion))],
        "value": [float(t) for t in range(n)],
        "adv": adv,
        **fields,
    }


GROUP = [
    rollout([1, 2], [3, 4], 1.0),
    rollout([1, 2], [5], -1.0),
    rollout([1, 2], [6, 7, 8], 0.5),
    rollout([9], [10], 2.0),
]


def lists(batch: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def test_a_grpo_group_shares_its_prompt():
    out = lists(Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=SPECS)(GROUP))
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert out["position_ids"] == [[0, 1, 2, 3, 2, 2, 3, 4, 0, 1]]
    assert out["branch_ids"] == [[0, 0, 1, 1, 2, 3, 3, 3, 0, 1]]
    assert out["document_ids"] == [[0] * 8 + [1] * 2]
    assert out["logits_index"] == [[-1, 0, 1, 2, 1, 1, 5, 6, -1, 8]]
    assert out["sequence_index"] == [[-1, -1, 0, 0, 1, 2, 2, 2, -1, 3]]
    assert out["labels"] == [[-100, -100, 3, 4, 5, 6, 7, 8, -100, 10]]
    assert out["old"] == [[0.0, 0.0, -0.25, -0.5, -0.25, -0.25, -0.5, -0.75, 0.0, -0.25]]
    # 0 on a prompt shared by sequences of different values; a lone rollout's prompt keeps its own (2.0)
    assert out["adv"] == [[0.0, 0.0, 1.0, 1.0, -1.0, 0.5, 0.5, 0.5, 2.0, 2.0]]
    # value[t] belongs to the prediction made at t: moved to the token it scores, per sequence
    assert out["value"] == [[0.0, 0.0, 1.0, 2.0, 1.0, 1.0, 2.0, 3.0, 0.0, 0.0]]
    assert out["num_sequences"] == 4


def test_unshared_layouts_hand_worked():
    padded = lists(Collator.for_rollouts(pad_token_id=0, float_fields=SPECS)(GROUP[1:3]))
    assert padded["input_ids"] == [[1, 2, 5, 0, 0], [1, 2, 6, 7, 8]]
    assert padded["labels"] == [[-100, -100, 5, -100, -100], [-100, -100, 6, 7, 8]]
    assert padded["adv"] == [[-1.0, -1.0, -1.0, 0.0, 0.0], [0.5] * 5]  # the whole sequence, unshared
    assert padded["logits_index"] == [[-1, 0, 1, -1, -1], [-1, 0, 1, 2, 3]]
    flat = lists(Collator.for_rollouts(padding_free=True, return_flash_attn_kwargs=True)(GROUP[1:3]))
    assert flat["position_ids"] == [[0, 1, 2, 0, 1, 2, 3, 4]] and flat["cu_seq_lens_q"] == [0, 3, 8]
    per_rollout = Collator.for_rollouts(padding_free=True, float_fields=[FloatField("adv", "sequence")])(
        GROUP
    )
    assert per_rollout["adv"].tolist() == [1.0, -1.0, 0.5, 2.0] and per_rollout["adv"].dtype == torch.float32


def test_a_prompt_is_shared_only_where_the_rollouts_agree_on_it():
    differs = [GROUP[0], dict(GROUP[1], old=[0.5, 0.0, -0.25])]  # another float value on the prompt
    out = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=["old"])(differs)
    assert out["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    empty = [rollout([1, 2], [3]), rollout([1, 2], []), rollout([], [4, 5])]  # no completion; no prompt
    out = Collator.for_rollouts(padding_free=True, shared_prompt=True)(empty)
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2]] and out["branch_ids"].tolist() == [
        [0, 0, 1] + [1] * 4
    ]


def test_padding_masks_and_the_worker_transfer():
    padded = [dict(r, attention_mask=[1] * len(r["input_ids"])) for r in GROUP]
    padded[1] = {
        key: value + [0] * 2 if isinstance(value, list) else value for key, value in padded[1].items()
    }
    collate = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=SPECS)
    assert lists(collate(padded)) == lists(collate(GROUP))
    arrived = collate.finish(pickle.loads(pickle.dumps(collate.stack(GROUP))))
    assert lists(arrived) == lists(collate(GROUP))
    assert lists(Collator.for_rollouts(padding_free=True, supervision="labels")(
        [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    ))["labels"] == [[-100, 2, 3]]  # fmt: skip


@pytest.mark.parametrize(
    ("examples", "options", "match"),
    [
        ([{"input_ids": [1, 2]}], {}, "nothing says which tokens are the completion"),
        (
            [{"input_ids": [1, 2], "completion_mask": [0, 1], "seq_lengths": [1, 1]}],
            {},
            "one rollout per example",
        ),
        (
            [{"input_ids": [1, 2], "completion_mask": [0, 1], "token_type_ids": [0, 0]}],
            {},
            "example 0 carries .token_type_ids",
        ),
        (
            [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "position_ids": [0, 1, 0]}],
            {},
            "do not count its",
        ),
        (
            [{"input_ids": [1, 2], "completion_mask": [0, 2]}],
            {},
            "example 0: field 'completion_mask' must hold",
        ),
        ([{"input_ids": [1, 2], "completion_mask": [0, 1]}], {"float_fields": ["old"]}, "lacks field 'old'"),
        (
            [{"input_ids": [1, 2], "completion_mask": [0, 1], "old": [0.0, float("inf")]}],
            {"float_fields": ["old"]},
            r"'old' holds inf at old\[1\]",
        ),
    ],
)
def test_bad_rollouts_name_the_example_and_the_fix(examples, options, match):
    with pytest.raises(ValueError, match=match):
        Collator.for_rollouts(padding_free=True, **options)(examples)


def test_bad_rollout_options():
    with pytest.raises(ValueError, match=r"Collator\.for_rollouts: supervision must name"):
        Collator.for_rollouts(padding_free=True, supervision="attention_mask")
    with pytest.raises(ValueError, match="collides"):
        Collator.for_rollouts(padding_free=True, float_fields=["labels"])
    with pytest.raises(ValueError, match="cannot describe"):
        Collator.for_rollouts(padding_free=True, shared_prompt=True, return_seq_idx=True)


ROLLOUTS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(0, 5), st.floats(-3, 3, width=32)),
    min_size=1,
    max_size=8,
)


@FAST
@given(
    rollouts=ROLLOUTS,
    layout=st.sampled_from(
        [
            {"pad_token_id": 0},
            {"padding_free": True},
            {"padding_free": True, "pad_token_id": 0, "pad_to_multiple_of": 8},
        ]
    ),
    shared=st.booleans(),
)
def test_unpack_of_the_batch_round_trips_every_field(rollouts, layout, shared):
    """Prompts drawn from a few (consecutive ones shared), completions of any length: unpack gives back
    every rollout's tokens and each per-token field exactly (a broadcast value: 0 on a shared prompt)."""
    prompts = [[], [1, 2, 3], [4]]
    examples = []
    for p, extra, n, adv in rollouts:
        prompt = prompts[p] + [20 + k for k in range(extra if p else 0)]
        examples.append(rollout(prompt, [30 + k for k in range(n)], adv))
    examples = examples if any(e["input_ids"] for e in examples) else [rollout([1], [2])]  # empty ones too
    batch = Collator.for_rollouts(shared_prompt=shared, float_fields=SPECS, **layout)(examples)
    assert batch["num_sequences"] == len(examples)
    tokens = unpack(batch["input_ids"], batch)
    old = unpack(batch["old"], batch)
    adv = unpack(batch["adv"], batch)
    labels = unpack(batch["labels"], batch, padded=True, padding_value=-7)
    for i, example in enumerate(examples):
        assert tokens[i].tolist() == example["input_ids"]
        assert old[i].tolist() == pytest.approx(example["old"])
        mask = example["completion_mask"]
        if not mask:
            assert adv[i].numel() == 0 and labels[i].tolist() == [-7] * labels.shape[1]
            continue
        prompt = mask.index(1) if 1 in mask else len(mask)
        got = adv[i].tolist()
        assert got[prompt:] == pytest.approx([example["adv"]] * (len(mask) - prompt))
        assert got[:prompt] in ([0.0] * prompt, pytest.approx([example["adv"]] * prompt))  # shared or not
        expected = [t if m else -100 for t, m in zip(example["input_ids"], mask, strict=True)]
        if layout.get("padding_free"):
            expected[0] = -100  # a sequence's first label predicts nothing (boundary-safe labels)
        row = labels[i].tolist()
        assert row[: len(expected)] == expected and set(row[len(expected) :]) <= {-7}
    assert np.isfinite(batch["old"].numpy()).all()


def test_the_presets_never_change_their_inputs():
    """Tensors, arrays and lists in the examples: unchanged (values and tensor versions) after a call."""
    import copy

    rollouts = [
        {
            "input_ids": torch.tensor([1, 2, 3]),
            "completion_mask": np.array([0, 1, 1]),
            "old": torch.tensor([0.0, -1.0, -2.0]),
        },
        {
            "input_ids": [1, 2, 4],
            "completion_mask": [0, 1, 1],
            "old": np.array([0.0, -0.5, -0.5], dtype=np.float64),
        },
    ]
    pairs = [{"prompt_input_ids": np.array([1, 2]), "chosen_input_ids": torch.tensor([3]), "rejected_input_ids": [4, 5],
              "rejected_attention_mask": [1, 1]}]  # fmt: skip
    for examples, collate in (
        (rollouts, Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=["old"])),
        (pairs, Collator.for_preference(padding_free=True, shared_prompt=True)),
    ):
        before = copy.deepcopy(examples)
        versions = [v._version for e in examples for v in e.values() if isinstance(v, torch.Tensor)]
        out = collate(examples)
        for value in out.values():  # writing into the outputs changes no input: they own their memory
            if isinstance(value, torch.Tensor) and value.dtype != torch.bool:
                value.add_(1)
        for got, want in zip(examples, before, strict=True):
            assert set(got) == set(want)
            for key in got:
                assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key
        assert versions == [v._version for e in examples for v in e.values() if isinstance(v, torch.Tensor)]
