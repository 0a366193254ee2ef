"""Inputs that once gave a wrong answer without a word, or a raw error: each is now exact or refused.

Every test here failed on the code before the fix: a rollout without the
supervision the others carry, a pair spelling a side twice, open-instruct's
labels beside the sides, the padding-free preference order, float values
beyond their dtype, float fields named like a preset's keys, Hugging Face's
``position_ids`` in the native Collator, padding already in the rows,
misspelled supervision masks, empty batches blaming another preset,
``np.memmap`` rows, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` sharing storage, other stacks' supervision
(``shift_labels``, ``label_ids``, ``action_mask``), ``token_type_ids`` in int8 or missing, packed rows
without positions or with TRL's ``seq_lengths``, the Collator's padding after a packed row's, a payload's
``_padding_length``, trajectories as turns of float ids, the root marker as a node id and margins beyond
float32.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from zephon_collate import (
    Collator,
    FloatField,
    SampleMeta,
    SampleRecord,
    TensorField,
    pack_flat,
    sequence_logprobs,
    to_training,
    unpack,
)


def record(payload, index=0, padding=None):
    tags = {} if padding is None else {"_padding_length": padding}
    return SampleRecord(SampleMeta((0, 0, index), 0, 0, tags=tags), payload)


# -- rollouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["completion_mask", "labels", "loss_mask"])
def test_a_rollout_without_the_supervision_the_others_carry_is_refused(field):
    given = {"completion_mask": [0, 1, 1], "labels": [-100, 2, 3], "loss_mask": [0, 1, 1]}[field]
    rollouts = [{"input_ids": [1, 2, 3], field: given}, {"input_ids": [4, 5, 6]}]
    for layout in (
        {"padding_free": True},
        {"pad_token_id": 0},
        {"padding_free": True, "shared_prompt": True},
    ):
        with pytest.raises(ValueError, match=rf"example 1: lacks '{field}', which example 0 carries"):
            Collator.for_rollouts(**layout)(rollouts)


def test_a_rollout_whose_labels_are_none_is_refused_beside_labelled_ones():
    rollouts = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": None}]
    with pytest.raises(ValueError, match="example 1: lacks 'labels'"):
        Collator.for_rollouts(padding_free=True)(rollouts)


# -- preference pairs -------------------------------------------------------------------------------


def test_a_pair_spelling_a_side_twice_must_agree():
    pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [5], "rejected_input_ids": [6]}
    with pytest.raises(ValueError, match="carries both 'prompt_input_ids' and 'prompt_ids'"):
        Collator.for_preference(padding_free=True)([{**pair, "prompt_ids": [3, 4]}])
    with pytest.raises(ValueError, match="carries both 'chosen_input_ids' and 'chosen_ids'"):
        Collator.for_preference(pad_token_id=0)([{**pair, "chosen_ids": [7]}])
    same = Collator.for_preference(padding_free=True)([{**pair, "prompt_ids": [1, 2], "chosen_ids": [5]}])
    assert (
        same["input_ids"].tolist() == Collator.for_preference(padding_free=True)([pair])["input_ids"].tolist()
    )


def test_open_instruct_labels_beside_the_sides_are_refused():
    pair = {
        "prompt_input_ids": [1, 2],
        "chosen_input_ids": [1, 2, 5],
        "rejected_input_ids": [1, 2, 6],
        "chosen_labels": [-100, -100, 5],
        "rejected_labels": [-100, -100, 6],
    }
    with pytest.raises(ValueError, match="carries 'chosen_labels' \\(open-instruct's packed DPO format"):
        Collator.for_preference(padding_free=True)([pair])
    batched = {key: [value] for key, value in pair.items()}
    with pytest.raises(ValueError, match="chosen_labels"):
        Collator.for_preference(pad_token_id=0)(batched)


PAIRS = [
    {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
    {"prompt_input_ids": [7, 8], "chosen_input_ids": [9], "rejected_input_ids": [10, 11, 12]},
    {"prompt_input_ids": [7, 8], "chosen_input_ids": [13, 14], "rejected_input_ids": [15]},
]
LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padding-free": {"padding_free": True},
    "shared-padded": {"pad_token_id": 0, "shared_prompt": True},
    "shared-padding-free": {"padding_free": True, "shared_prompt": True},
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_every_preference_layout_numbers_chosen_then_rejected(layout):
    """TRL's ``chunk(2)`` habit holds in every layout: per-sequence results are every chosen sequence, then
    every rejected one."""
    batch = Collator.for_preference(**LAYOUTS[layout])(PAIRS)
    assert batch["chosen_index"].tolist() == [0, 1, 2] and batch["rejected_index"].tolist() == [3, 4, 5]
    sequences = [row.tolist() for row in unpack(batch["input_ids"], batch)]
    chosen = [p["prompt_input_ids"] + p["chosen_input_ids"] for p in PAIRS]
    rejected = [p["prompt_input_ids"] + p["rejected_input_ids"] for p in PAIRS]
    assert sequences == chosen + rejected
    vocabulary = 16
    logits = torch.zeros(*batch["input_ids"].shape, vocabulary)  # uniform: log(1/16) per supervised token
    sums = sequence_logprobs(logits, batch).sums
    chosen_sums, rejected_sums = sums.chunk(2)
    expect = -math.log(vocabulary)
    assert chosen_sums.tolist() == pytest.approx([expect * len(p["chosen_input_ids"]) for p in PAIRS])
    assert rejected_sums.tolist() == pytest.approx([expect * len(p["rejected_input_ids"]) for p in PAIRS])


# -- float fields -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, value, largest",
    [
        (torch.float16, 70000.0, "65504"),
        (torch.bfloat16, 3.5e38, "3.38953e\\+38"),
        (torch.float32, 1e39, "3.40282e\\+38"),
    ],
)
def test_a_float_beyond_its_dtype_is_refused_naming_the_overflow(dtype, value, largest):
    message = rf"'w' holds .* at w\[1\], beyond {dtype} \(largest {largest}\): it would overflow"
    payload = {"input_ids": [1, 2, 3], "w": [0.5, value, 1.0]}
    with pytest.raises(ValueError, match=message):
        Collator(return_labels=True, float_fields=[FloatField("w", dtype=dtype)])([payload])
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(padding_free=True, float_fields=[FloatField("w", dtype=dtype)])([payload])
    rollout = {**payload, "completion_mask": [0, 1, 1]}
    with pytest.raises(ValueError, match=message):
        Collator.for_rollouts(padding_free=True, float_fields=[FloatField("w", dtype=dtype)])([rollout])
    with pytest.raises(ValueError, match=message):
        pack_flat([record(payload)], seq_len=4, pad_token_id=0, float_fields=[FloatField("w", dtype=dtype)])
    one = {"input_ids": [1, 2], "completion_mask": [0, 1], "w": value}
    spec = FloatField("w", "sequence", dtype=dtype)
    with pytest.raises(ValueError, match=r"'w' holds .* beyond"):
        Collator.for_rollouts(padding_free=True, float_fields=[spec])([one])


def test_a_float_at_the_edge_of_its_dtype_is_kept_and_a_real_infinity_is_named_as_one():
    payload = {"input_ids": [1, 2, 3], "w": [0.5, 65504.0, -65504.0]}
    out = Collator(float_fields=[FloatField("w", dtype=torch.float16)])([payload])
    assert out["w"].tolist() == [[0.5, 65504.0, -65504.0]]
    with pytest.raises(ValueError, match=r"'w' holds inf at w\[1\]; give finite values"):
        Collator(float_fields=["w"])([{"input_ids": [1, 2, 3], "w": [0.5, math.inf, 1.0]}])


@pytest.mark.parametrize(
    "name", ["sequence_index", "logits_index", "document_ids", "num_sequences", "max_length_q"]
)
def test_a_float_field_may_not_take_a_key_the_preset_writes(name):
    with pytest.raises(ValueError, match=f"float field '{name}' collides"):
        Collator.for_rollouts(padding_free=True, float_fields=[name])
    with pytest.raises(ValueError, match=f"float field '{name}' collides"):
        Collator.for_transformers(padding_free=True, float_fields=[name])


# -- the native Collator ----------------------------------------------------------------------------


def test_hf_position_ids_are_read_as_positions_by_the_collator():
    """Dropped, ``position_ids`` would let the label of a document's last token be the next one's first."""
    payload = {"input_ids": [1, 5, 6, 1, 7], "position_ids": [0, 1, 2, 0, 1]}
    out = Collator(return_labels=True)([payload])
    assert out["labels"].tolist() == [[5, 6, -100, 7]]
    spelled = Collator(return_labels=True)([{"input_ids": [1, 5, 6, 1, 7], "positions": [0, 1, 2, 0, 1]}])
    assert out["positions"].tolist() == spelled["positions"].tolist() == [[0, 1, 2, 0]]
    boundaries = Collator(return_labels=True, return_cu_seqlens=True)([payload])
    assert boundaries["cu_seqlens"].tolist() == [[0, 3, 4]]
    with pytest.raises(ValueError, match="has both 'positions' and 'position_ids'"):
        Collator(return_labels=True)([{**payload, "positions": [0, 1, 2, 3, 4]}])
    columns = {
        "input_ids": (np.array([1, 5, 6, 1, 7]), np.array([0, 5])),
        "position_ids": (np.array([0, 1, 2, 0, 1]), np.array([0, 5])),
    }
    assert Collator(return_labels=True)(columns)["labels"].tolist() == [[5, 6, -100, 7]]


def test_padding_already_in_the_rows_is_refused():
    rows = [{"input_ids": [5, 6, 7, 0, 0]}, {"input_ids": [5, 6, 7, 8, 9]}]
    with pytest.raises(ValueError, match=r"record 0 .*: ends in pad_token_id 0 and declares no padding"):
        Collator(pad_token_id=0, return_labels=True)(rows)
    with pytest.raises(ValueError, match="ends in pad_token_id 0"):
        Collator(pad_token_id=0, return_padding_mask=True)(rows)
    declared = [record(rows[0]["input_ids"], 0, padding=2), record(rows[1]["input_ids"], 1, padding=0)]
    out = Collator(pad_token_id=0, return_labels=True)(declared)
    assert out["labels"].tolist() == [[6, 7, -100, -100], [6, 7, 8, 9]]
    ragged = Collator(pad_token_id=0, return_labels=True)([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6]}])
    assert ragged["labels"].tolist() == [[6, 7], [6, -100]]
    columns = {"input_ids": (np.array([5, 6, 0, 5, 6, 7]), np.array([0, 3, 6]))}
    with pytest.raises(ValueError, match="example 0: ends in pad_token_id 0"):
        Collator(pad_token_id=0, return_labels=True)(columns)


@pytest.mark.parametrize(
    "name, meant", [("loss_masks", "loss_mask"), ("completion_masks", "completion_mask")]
)
def test_a_misspelled_supervision_mask_is_refused(name, meant):
    payload = {"input_ids": [5, 6, 7], name: [0, 1, 1]}
    message = f"has '{name}', which nothing reads: did you mean '{meant}'"
    with pytest.raises(ValueError, match=message):
        Collator(return_labels=True)([payload])
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(pad_token_id=0)([payload])
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(padding_free=True)({key: [value] for key, value in payload.items()})
    with pytest.raises(ValueError, match=message):
        Collator.for_rollouts(padding_free=True)([{**payload, "completion_mask": [0, 1, 1]}])
    columns = {
        "input_ids": (np.array([5, 6, 7]), np.array([0, 3])),
        name: (np.array([0, 1, 1]), np.array([0, 3])),
    }
    with pytest.raises(ValueError, match=message):
        Collator(return_labels=True)(columns)
    with pytest.raises(ValueError, match=message):
        Collator.for_transformers(padding_free=True)(columns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = to_training([record(payload)], return_labels=True)
    assert out["labels"].tolist() == [[6, 7]]  # the page's result, and a warning naming the field
    assert any(message.split(":")[0] in str(w.message) and meant in str(w.message) for w in caught)


def test_fields_that_only_look_like_masks_are_not_refused():
    payload = {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "action_mask": [1, 1, 1]}
    assert Collator(return_labels=True)([payload])["labels"].tolist() == [[6, 7]]
    rollout = {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1], "tool_mask": [1, 1], "prompt_mask": [1]}
    out = Collator.for_rollouts(padding_free=True)([rollout])  # all 1s: no tool output, no padding
    assert out["labels"].tolist() == [[-100, 6, 7]]
    trl_rows = {"input_ids": [0, 5, 6, 7], "attention_mask": [0, 1, 1, 1], "prompt_mask": [0, 1]}
    trl_rows["completion_mask"] = [0, 0, 1, 1]  # TRL's rows: the prompt's padding in the attention_mask too
    out = Collator.for_rollouts(padding_free=True)([trl_rows])
    assert out["input_ids"].tolist() == [[5, 6, 7]] and out["labels"].tolist() == [[-100, 6, 7]]
    payload = {"input_ids": [5, 6, 7], "label_ids": [5, 6, 7]}  # the tokens: nothing is lost
    assert Collator.for_transformers(padding_free=True)([payload])["labels"].tolist() == [[-100, 6, 7]]


OTHER_STACKS = [
    ("shift_labels", [-100, 7, -100], "transformers' pre-shifted targets"),
    ("label_ids", [-100, 6, 7], "default_data_collator renames"),
    ("action_mask", [0, 1, 1], "OpenRLHF's mask"),
    ("tool_mask", [0, 1, 1], "TRL's mask of a completion's tool output"),
    ("env_mask", [0, 1, 1], "TRL's mask of a completion's tool output"),
    ("prompt_mask", [0, 1, 1], "TRL's mask of a prompt's padding"),
]


@pytest.mark.parametrize(("name", "value", "said"), OTHER_STACKS)
def test_other_stacks_supervision_is_used_nowhere_so_refused_everywhere(name, value, said):
    # Each changes what is trained in its own stack; read by no call here, it was dropped without a word.
    payload = {"input_ids": [5, 6, 7], name: value}
    pair = {"prompt_input_ids": [5], "chosen_input_ids": [6], "rejected_input_ids": [7], name: value[:1]}
    calls = {
        "Collator": lambda: Collator(return_labels=True)([record(payload)]),
        "padded": lambda: Collator.for_transformers(pad_token_id=0)([payload]),
        "padding-free": lambda: Collator.for_transformers(padding_free=True)([payload]),
        "rollouts": lambda: Collator.for_rollouts(padding_free=True)([payload]),
        "packer": lambda: pack_flat([record(payload)], 4, pad_token_id=0),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=rf"carries '{name}' \(.*{said}"):
            call()
    with pytest.raises(ValueError, match=rf"carries '{name}', .* each side's tokens are trained whole"):
        Collator.for_preference(padding_free=True)([pair])
    with pytest.warns(UserWarning, match=rf"carries '{name}'"):
        out = to_training([record(payload)], return_labels=True)
    assert out["labels"].tolist() == [[6, 7]]  # the reference page's result


def test_open_instructs_numbered_attention_masks_get_the_fix_that_applies():
    # Renaming it 'attention_mask', the near miss's fix alone, would only meet the next refusal.
    rollout = {"input_ids": [1, 2, 3, 4], "attention_masks": [1, 1, 2, 2], "completion_mask": [0, 1, 0, 1]}
    with pytest.raises(
        ValueError, match=r"did you mean 'attention_mask'.*\(open-instruct\), give one example"
    ):
        Collator.for_rollouts(padding_free=True)([rollout])


@pytest.mark.parametrize("name", ["images", "image", "multi_modal_inputs"])
def test_media_no_processor_has_read_are_refused_everywhere(name):
    # TRL's and datasets' raw images, verl's dict of a processor's outputs: collated as text, the images were
    # dropped and their placeholder tokens trained as text.
    from zephon_collate.layouts.vision import MRope

    payload = {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1], name: [[0.5]]}
    qwen = MRope()
    pair = {"prompt_ids": [5], "chosen_ids": [6], "rejected_ids": [7]}
    calls = {
        "Collator": lambda: Collator(return_labels=True)([record({"input_ids": [5, 6, 7], name: [[0.5]]})]),
        "padded": lambda: Collator.for_transformers(pad_token_id=0)([payload]),
        "mrope": lambda: Collator.for_transformers(padding_free=True, mrope=qwen)([payload]),
        "rollouts": lambda: Collator.for_rollouts(padding_free=True)([payload]),
        "trees": lambda: Collator.for_trees()([payload]),
        "pairs": lambda: Collator.for_preference(padding_free=True)([{**pair, name: [[0.5]]}]),
        "rewards": lambda: Collator.for_rewards(padding_free=True)([{**pair, name: [[0.5]]}]),
        "packer": lambda: pack_flat([record({"input_ids": [5, 6, 7], name: [[0.5]]})], 4, pad_token_id=0),
    }
    for which, call in calls.items():
        with pytest.raises(ValueError, match=rf"(example|record) 0.*carries '{name}', a vision-language"):
            call()
        if which == "mrope":
            with pytest.raises(ValueError, match=r"not the media \(run the model's processor on them first"):
                call()


# -- raw errors -------------------------------------------------------------------------------------


def test_empty_batches_name_their_own_preset():
    with pytest.raises(ValueError, match=r"^Collator\.for_rollouts: the batch holds no rollouts"):
        Collator.for_rollouts(padding_free=True)([])
    with pytest.raises(ValueError, match=r"^Collator\.for_rollouts: every rollout of the batch is empty"):
        Collator.for_rollouts(padding_free=True)([{"input_ids": [], "completion_mask": []}])
    empty = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}
    with pytest.raises(ValueError, match=r"^Collator\.for_preference: every pair of the batch is empty"):
        Collator.for_preference(padding_free=True)([empty])


def test_memmap_rows_are_read_like_arrays(tmp_path):
    rows = np.memmap(tmp_path / "tokens.bin", dtype=np.int64, mode="w+", shape=(2, 4))
    rows[:] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    plain = np.array(rows)
    want = [[2, 3, 4], [6, 7, 8]]
    assert Collator(return_labels=True)([rows[0], rows[1]])["labels"].tolist() == want
    assert Collator(return_labels=True)([{"input_ids": r} for r in rows])["labels"].tolist() == want
    records = [record(rows[0]), record(rows[1], 1)]
    assert to_training(records, return_labels=True)["labels"].tolist() == want
    hf = Collator.for_transformers(pad_token_id=0)([{"input_ids": r} for r in rows])
    assert hf["input_ids"].tolist() == plain.tolist()
    masked = np.ma.masked_array([5, 6, 7], mask=[False, True, False])
    with pytest.raises(ValueError, match="masked array with masked entries"):
        Collator(return_labels=True)([{"input_ids": masked}])


@pytest.mark.parametrize("tensors", ["pt", "np"])
def test_cu_seq_lens_q_and_k_are_two_outputs(tensors):
    collate = Collator.for_transformers(
        padding_free=True, return_flash_attn_kwargs=True, return_tensors=tensors
    )
    out = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    query, key = out["cu_seq_lens_q"], out["cu_seq_lens_k"]
    query[1] = 99
    assert key.tolist() == [0, 3, 5]


def test_return_sequence_map_makes_padding_free_batches_exact_for_the_loss_helpers():
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}, {"input_ids": [5, 6]}]
    collate = Collator.for_transformers(
        padding_free=True,
        return_sequence_map=True,
        pad_token_id=0,
        pad_to_multiple_of=8,
        position_ids_start=1,
    )
    batch = collate(examples)
    assert batch["sequence_index"].tolist() == [[0, 0, 0, 1, 2, 2, -1, -1]]
    assert batch["logits_index"].tolist() == [[-1, 0, 1, -1, -1, 4, -1, -1]]
    assert batch["num_sequences"] == 3
    assert [row.tolist() for row in unpack(batch["input_ids"], batch)] == [[1, 2, 3], [4], [5, 6]]
    counts = sequence_logprobs(torch.zeros(1, 8, 10), batch).counts
    assert counts.tolist() == [2, 0, 1]
    with pytest.raises(
        ValueError, match="return_sequence_map=True describes the sequences of a padding-free row"
    ):
        Collator.for_transformers(pad_token_id=0, return_sequence_map=True)


# -- token_type_ids, packed rows --------------------------------------------------------------------


@pytest.mark.parametrize("padding_free", [False, True])
def test_token_type_ids_are_int64_and_an_example_without_them_is_one_segment(padding_free):
    # A datasets column stores token_type_ids as int8: transformers' collators give int64 (an Embedding
    # refuses int8); an example without them was filled with 1s, the second segment.
    collator = Collator.for_transformers(pad_token_id=0, padding_free=padding_free)
    rows = [
        {"input_ids": np.array([5, 6, 7, 8], np.int32), "token_type_ids": np.array([0, 0, 1, 1], np.int8)},
        {"input_ids": [8, 9]},
    ]
    out = collator(rows)
    assert out["token_type_ids"].dtype == torch.int64
    want = [[0, 0, 1, 1, 0, 0]] if padding_free else [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert out["token_type_ids"].tolist() == want
    transformers = pytest.importorskip("transformers")
    peer = transformers.DataCollatorForSeq2Seq(_pad_tokenizer(transformers))(rows[:1])
    assert peer["token_type_ids"].dtype == collator(rows[:1])["token_type_ids"].dtype


def _pad_tokenizer(transformers):
    from tokenizers import Tokenizer, models

    model = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>")


def test_a_packed_row_without_positions_is_refused_by_boundary_safe_labels():
    # Without positions the Collator saw one document, and the label of the first document's last token
    # was the next document's first token.
    docs = [record({"input_ids": [1, 5, 6, 2]}), record({"input_ids": [1, 7, 2]}, 1)]
    rows = pack_flat(docs, 8, pad_token_id=0, emit_positions=False)
    with pytest.raises(ValueError, match=r"record 0 .*a packed row of 2 documents .*emit_positions=True"):
        Collator(return_labels=True)(rows)
    kept = Collator(return_labels=True)(pack_flat(docs, 8, pad_token_id=0))
    assert kept["labels"].tolist() == [[5, 6, 2, -100, 7, 2, -100]]
    across = Collator(return_labels=True, boundary_safe_labels=False)(rows)
    assert across["labels"].tolist() == [[5, 6, 2, 1, 7, 2, -100]]
    one = pack_flat(docs[:1], 8, pad_token_id=0, emit_positions=False)  # one document: nothing to cross
    assert Collator(return_labels=True)(one)["labels"].tolist() == [[5, 6, 2] + [-100] * 4]


def test_the_collators_padding_continues_a_packed_rows_padding_segment():
    # A row of 4 with one pad token, padded to 6 by the Collator: its padding was two segments.
    short = pack_flat([record({"input_ids": [1, 2, 3]})], 4, pad_token_id=0)
    long = pack_flat([record({"input_ids": [4, 5, 6, 7, 8]}, 1)], 6, pad_token_id=0)
    collator = Collator(pad_token_id=0, return_labels=True, return_cu_seqlens=True, return_padding_mask=True)
    assert collator.stack(short + long).td["positions"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 0]]
    out = collator(short + long)
    assert out["cu_seqlens"].tolist() == [[0, 3, 5], [0, 5, 5]]
    assert out["padding_mask"].tolist() == [[False, False, False, True, True], [False] * 5]


def test_seq_lengths_without_positions_are_refused_where_not_read():
    # TRL's packed rows: the Collator and the packers took the row for one document.
    row = {"input_ids": [5, 6, 7, 8, 9, 10], "seq_lengths": [3, 3]}
    with pytest.raises(ValueError, match=r"record 0 .*carries 'seq_lengths' \(2 documents"):
        Collator(return_labels=True)([record(row)])
    with pytest.raises(ValueError, match=r"carries 'seq_lengths' .*record of its own"):
        pack_flat([record(row)], 8, pad_token_id=0)
    read = Collator.for_transformers(padding_free=True)([row])  # reads them
    assert read["labels"].tolist() == [[-100, 6, 7, -100, 9, 10]]
    marked = {**row, "position_ids": [0, 1, 2, 0, 1, 2]}  # positions find the documents
    assert Collator(return_labels=True)([marked])["labels"].tolist() == [[6, 7, -100, 9, 10]]
    one = {"input_ids": [5, 6, 7], "seq_lengths": [3]}
    assert Collator(return_labels=True)([one])["labels"].tolist() == [[6, 7]]


@pytest.mark.parametrize(
    "name, value",
    [
        ("packed_seq_lens", [2, 2]),  # OpenRLHF's
        ("cu_seqlens", [0, 2, 4]),  # verl's, flash-attn's
        ("cu_seq_lens_q", [0, 2, 4]),  # transformers' flash kwargs
        ("seq_idx", [0, 0, 1, 1]),  # a document number per token
    ],
)
def test_other_stacks_marks_of_packed_documents_are_refused(name, value):
    """Read as one document, 11 -> 12 | 21 -> 22 would train 12 -> 21: every entry point refuses it."""
    row = {"input_ids": [11, 12, 21, 22], name: value}
    where = {"Collator": r"record 0 .*", "examples": r"example 0: "}
    message = rf"carries '{name}' \(2 documents packed in one row\), which is not read here"
    with pytest.raises(ValueError, match=where["Collator"] + message):
        Collator(return_labels=True)([record(row)])
    with pytest.raises(ValueError, match=where["Collator"] + message):
        pack_flat([record(row)], 8, pad_token_id=0)
    for collate in (
        Collator.for_transformers(padding_free=True),
        Collator.for_transformers(pad_token_id=0),
        Collator.for_rollouts(padding_free=True),
    ):
        with pytest.raises(ValueError, match=where["examples"] + message):
            collate([row])
    marked = {**row, "position_ids": [0, 1, 0, 1]}  # positions find the documents: read, not refused
    assert Collator.for_transformers(padding_free=True)([marked])["labels"].tolist() == [[-100, 12, -100, 22]]
    one = {"input_ids": [11, 12], name: {"packed_seq_lens": [2], "seq_idx": [0, 0]}.get(name, [0, 2])}
    assert Collator(return_labels=True)([record(one)])["labels"].tolist() == [[12]]


def test_pack_flat_never_packs_a_misspelled_mask_as_data():
    docs = [record({"input_ids": [1, 2, 3], "loss_masks": [0, 1, 1]})]
    with pytest.raises(ValueError, match=r"has 'loss_masks', which nothing reads: did you mean 'loss_mask'"):
        pack_flat(docs, 4, pad_token_id=0)
    rows = pack_flat(docs, 4, pad_token_id=0, fields=["loss_masks"])  # listed: data, as asked
    assert rows[0].payload["loss_masks"].tolist() == [0, 1, 1, 0]


def test_a_payloads_padding_length_is_read_as_a_columns_is():
    pa = pytest.importorskip("pyarrow")
    rows = [
        {"input_ids": [5, 6, 7, 0], "_padding_length": 1},
        {"input_ids": [8, 9, 0, 0], "_padding_length": 2},
    ]
    collator = Collator(return_labels=True, return_num_valid_tokens=True)
    want = [[6, 7, -100], [9, -100, -100]]
    for given in (rows, pa.Table.from_pylist(rows)):
        out = collator(given)
        assert out["labels"].tolist() == want and out["num_valid_tokens"] == 3
    with pytest.raises(ValueError, match=r"'_padding_length'\) is 5 but must be an int from 0"):
        collator([{"input_ids": [5, 6, 7, 0], "_padding_length": 5}])


def test_trajectories_as_turns_check_their_ids_as_flat_rows_do():
    trees = Collator.for_trees(padding_free=True)
    mask = [[0, 0], [1, 1]]
    with pytest.raises(TypeError, match=r"example 0, turn 1: field 'input_ids' has dtype float64"):
        trees([{"input_ids": [[1, 2], [3.7, 4.2]], "completion_mask": mask}])
    with pytest.raises(TypeError, match=r"example 0: 'input_ids' given as turns holds NoneType at turn 1"):
        trees([{"input_ids": [[1, 2], None], "completion_mask": mask}])
    flat = list(torch.tensor([1, 2, 3]))  # 0-d tensors: one flat row, as the other presets read it
    assert trees([{"input_ids": flat, "completion_mask": [0, 1, 1]}])["input_ids"].tolist() == [[1, 2, 3]]


def test_explicit_trees_refuse_the_root_marker_as_a_node_id():
    nodes = [
        {"node_id": -1, "parent_id": -1, "input_ids": [1, 2], "completion_mask": [0, 0]},
        {"node_id": 1, "parent_id": -1, "input_ids": [3], "completion_mask": [1]},
    ]
    with pytest.raises(ValueError, match=r"example 0: node_id is -1, which marks a root's parent_id"):
        Collator.for_trees(padding_free=True)(nodes)


def test_a_reward_margin_beyond_float32_is_refused():
    pair = {"chosen_ids": [3, 2], "rejected_ids": [4, 2], "margin": 1e39}
    with pytest.raises(ValueError, match=r"example 0: 'margin' is 1e\+39, beyond float32"):
        Collator.for_rewards(pad_token_id=0)([pair])


def test_an_empty_reward_side_is_named_as_given():
    pair = {"chosen_input_ids": [], "rejected_input_ids": [4, 2]}
    with pytest.raises(ValueError, match=r"its chosen side \('chosen_input_ids'\) holds no tokens"):
        Collator.for_rewards(pad_token_id=0)([pair])


def test_a_stream_of_arrow_batches_is_refused_by_packed_stream():
    # Its state counts records: resumed after 3 documents, it skipped 3 whole tables (17 rows of 33).
    pa = pytest.importorskip("pyarrow")
    from zephon_collate import PackedStream

    tables = [pa.table({"input_ids": [[i + 1] * 3 for i in range(8)]}) for _ in range(2)]
    with pytest.raises(TypeError, match=r"PackedStream: item 0 of the source is a batch of columns"):
        next(iter(PackedStream(tables, seq_len=16, pad_token_id=0)))


def test_what_the_refusals_leave_alone():
    # A per-example 'label_ids' (a class), one-row tables as a stream's items (one document each), and
    # TRL's seq_lengths where no output depends on the documents: accepted, as before the refusals.
    pa = pytest.importorskip("pyarrow")
    from zephon_collate import PackedStream

    classes = [{"input_ids": [1, 2, 3], "label_ids": 1}, {"input_ids": [4, 5, 6], "label_ids": 0}]
    assert Collator(return_labels=True)(classes)["labels"].tolist() == [[2, 3], [5, 6]]
    assert Collator.for_transformers(pad_token_id=0)(classes)["labels"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert Collator(return_labels=True)(pa.Table.from_pylist(classes))["labels"].tolist() == [[2, 3], [5, 6]]
    assert len(pack_flat([record(example) for example in classes], 8, pad_token_id=0)) == 1
    one_row = [pa.table({"input_ids": [[i + 1] * n]}) for i, n in enumerate([3, 5, 6])]
    rows = [r.payload["input_ids"].tolist() for r in PackedStream(one_row, seq_len=8, pad_token_id=0)]
    assert rows == [[1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 0, 0]]
    packed = {"input_ids": [5, 6, 7, 8], "seq_lengths": [2, 2]}
    assert Collator(pad_token_id=0)([packed])["input_ids"].tolist() == [[5, 6, 7, 8]]


def test_integers_stay_exact_and_sums_never_wrap():
    """A list of NumPy uint64 beside ints (NumPy reads it as float64) keeps every integer exactly; a
    position_ids_start that would pass int64 and seq_lengths whose sum would wrap are refused by name."""
    big = 2**53 + 1  # float64 would read it as 2**53
    row = [np.uint64(big), 1, 2]
    assert Collator()([{"input_ids": row}])["input_ids"].tolist() == [[big, 1, 2]]
    routes = TensorField("r", dtype=torch.int64)
    assert Collator(float_fields=[routes])([{"input_ids": [1, 2, 3], "r": row}])["r"].tolist() == [
        [big, 1, 2]
    ]
    packed = pack_flat([{"input_ids": [1, 2, 3], "r": row}], 4, pad_token_id=0, fields=("r",))
    assert packed[0].payload["r"].tolist() == [big, 1, 2, 0]
    with pytest.raises(ValueError, match=r"record 0 .*: field 'input_ids' holds values beyond int64"):
        Collator()([{"input_ids": [np.uint64(2**63 + 5), 1]}])
    start = Collator.for_transformers(
        position_ids_start=2**63 - 3, return_position_ids=True, padding_free=True
    )
    with pytest.raises(ValueError, match=r"example 0: positions up to .* position_ids_start=\d+ pass int64"):
        start([{"input_ids": [5, 6, 7, 8, 9]}])
    for padding_free in (True, False):
        lengths = {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": np.array([2**63 - 1, 2**63 - 1, 7])}
        with pytest.raises(ValueError, match=r"example 0: 'seq_lengths' .* add up to the example's 5 tokens"):
            Collator.for_transformers(padding_free=padding_free, pad_token_id=0)([lengths])
