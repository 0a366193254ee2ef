"""A supervision field under a near-miss name is refused by every entry point that reads supervision.

A mask spelled ``loss_maks`` or ``completion_msk`` was read under no name, so
every token (the prompt, the padding) was trained without a word. Every entry
point that reads supervision from a field name now refuses a name close to one
it reads or checks (case, separators and one or two edits apart), naming the
record, the field and the right name; ``to_training`` keeps the reference
page's result and warns (labels requested). Names of fields of their own
(``label``, ``action_mask``, ``prompt_attention_mask``...) and the fields a call
is told to read (``float_fields``, ``extra_fields``, the packer's ``fields``)
are never refused.
"""

from __future__ import annotations

import re
import warnings

import pyarrow as pa
import pytest
import torch
from helpers import batch, record
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FlatPacker, pack_columns, pack_flat, to_training
from zephon_collate.read.rules import SUPERVISION_NAMES, misspelled

TOKENS = [5, 6, 7]
MASK = [0, 1, 1]
"""A mask with a prompt: read under no name, token 0 would be trained."""
NEAR = "which nothing reads: did you mean"

# (kind of slip, the name given, the name meant)
SLIPS = [
    ("transposition", "loss_maks", "loss_mask"),
    ("transposition", "compleiton_mask", "completion_mask"),
    ("transposition", "lables", "labels"),
    ("missing letter", "completion_msk", "completion_mask"),
    ("missing letter", "los_mask", "loss_mask"),
    ("missing letter", "atention_mask", "attention_mask"),
    ("case", "Loss_Mask", "loss_mask"),
    ("case", "COMPLETION_MASK", "completion_mask"),
    ("case", "Labels", "labels"),
    ("no underscore", "lossmask", "loss_mask"),
    ("no underscore", "completionmask", "completion_mask"),
    ("no underscore", "assistantmasks", "assistant_masks"),
    ("extra char", "loss_mask5", "loss_mask"),
    ("extra char", "completion_maskk", "completion_mask"),
    ("extra char", "response_mask_", "response_mask"),
]


def _values(name: str) -> list[int]:
    """What the misspelled field holds: labels with -100 on the prompt, else a mask with a prompt."""
    return [-100, 6, 7] if "labl" in name.lower() else MASK


def _payloads(bad: str, **more) -> list[dict]:
    """Two examples, the second carrying ``bad``: the refusal must name the second."""
    return [{"input_ids": TOKENS, **more}, {"input_ids": TOKENS, bad: _values(bad), **more}]


def _arrow(bad: str) -> dict:
    """A columnar batch (a dict of Arrow columns): every row carries the column."""
    return {"input_ids": pa.array([TOKENS, TOKENS]), bad: pa.array([_values(bad), _values(bad)])}


ENTRIES = {
    "Collator": (lambda bad: Collator(return_labels=True)(_payloads(bad)), "record 1"),
    "for_transformers padded": (
        lambda bad: Collator.for_transformers(pad_token_id=0)(_payloads(bad)),
        "example 1",
    ),
    "for_transformers padding-free": (
        lambda bad: Collator.for_transformers(padding_free=True)(_payloads(bad)),
        "example 1",
    ),
    "for_rollouts beside completion_mask": (
        lambda bad: Collator.for_rollouts(padding_free=True)(_payloads(bad, completion_mask=MASK)),
        "example 1",
    ),
    "pack_flat": (lambda bad: pack_flat(_payloads(bad), 8, pad_token_id=0), "record 1"),
    "FlatPacker": (
        lambda bad: list(
            FlatPacker(8, pad_token_id=0).pack([record(p, i) for i, p in enumerate(_payloads(bad))])
        ),
        "record 1",
    ),
    "Collator columnar": (lambda bad: Collator(return_labels=True)(_arrow(bad)), "example 0"),
    "for_transformers columnar": (
        lambda bad: Collator.for_transformers(padding_free=True)(_arrow(bad)),
        "example 0",
    ),
    "pack_columns": (lambda bad: pack_columns(_arrow(bad), 8, pad_token_id=0), "example 0"),
}


def _refused(call, bad: str, meant: str, where: str) -> str:
    with pytest.raises(ValueError) as info:
        call(bad)
    message = str(info.value)
    assert message.startswith(where), message
    assert f"'{bad}'" in message and NEAR in message and f"'{meant}'" in message, message
    return message


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("kind, bad, meant", SLIPS, ids=[f"{k}:{b}" for k, b, _ in SLIPS])
def test_a_misspelled_supervision_field_is_refused(entry, kind, bad, meant):
    call, where = ENTRIES[entry]
    message = _refused(call, bad, meant, where)
    assert f"did you mean '{meant}'?" in message  # the right name, as the fix


PAIR = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3, 0], "rejected_input_ids": [4, 5]}
PAIR_SLIPS = [
    ("transposition", "chosen_attention_maks", "chosen_attention_mask"),
    ("missing letter", "chosen_attention_msk", "chosen_attention_mask"),
    ("case", "Rejected_Attention_Mask", "rejected_attention_mask"),
    ("no underscore", "promptattentionmask", "prompt_attention_mask"),
    ("extra char", "chosen_attention_mask1", "chosen_attention_mask"),
    ("supervision", "completion_msk", "completion_mask"),
]


@pytest.mark.parametrize("kind, bad, meant", PAIR_SLIPS, ids=[f"{k}:{b}" for k, b, _ in PAIR_SLIPS])
def test_a_misspelled_side_mask_of_a_pair_is_refused(kind, bad, meant):
    pairs = [dict(PAIR), {**PAIR, bad: [1, 0]}]
    message = _refused(lambda _: Collator.for_preference(pad_token_id=0)(pairs), bad, meant, "example 1")
    assert f"did you mean '{meant}'?" in message  # the right name, as the fix
    _refused(lambda _: Collator.for_preference(padding_free=True)(pairs), bad, meant, "example 1")
    rewards = [{"chosen_ids": [1, 3, 0], "rejected_ids": [1, 4, 5], bad: [1, 1, 0]}]
    _refused(lambda _: Collator.for_rewards(pad_token_id=0)(rewards), bad, meant, "example 0")


@pytest.mark.parametrize(
    "name", ["prompt_mask", "chosen_mask", "chosen_loss_mask", "loss_mask_chosen", "chosen_completion_mask"]
)
def test_a_side_mask_under_another_stacks_name_is_refused(name):
    """A side's mask under a name no format reads (TRL's ``prompt_mask``, ``chosen_loss_mask``): with
    a 0 it would change what is trained, so it is refused; all 1s change nothing and are accepted."""
    values = [1, 0] if name.startswith("prompt") else [0, 1]
    pairs = [dict(PAIR), {**PAIR, name: values}]
    with pytest.raises(ValueError, match=rf"^example 1: carries '{name}', which this collator does not read"):
        Collator.for_preference(pad_token_id=0)(pairs)
    kto = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "label": True, "KL_completion_ids": [4, 5]}
    with pytest.raises(ValueError, match=rf"^example 0: carries '{name}'"):
        Collator.for_preference(padding_free=True)([{**kto, name: values}])
    ones = [dict(PAIR), {**PAIR, name: [1, 1]}]
    plain = Collator.for_preference(pad_token_id=0)([dict(PAIR), dict(PAIR)])
    out = Collator.for_preference(pad_token_id=0)(ones)
    assert out.keys() == plain.keys()
    assert all(torch.equal(torch.as_tensor(out[k]), torch.as_tensor(plain[k])) for k in out)


def test_a_name_with_its_words_reordered_is_a_near_miss():
    assert misspelled(["mask_loss"], SUPERVISION_NAMES) == ("mask_loss", "loss_mask")
    assert misspelled(["Mask-Completion"], SUPERVISION_NAMES) == ("Mask-Completion", "completion_mask")
    pairs = [dict(PAIR), {**PAIR, "attention_mask_chosen": [1, 0]}]
    _refused(
        lambda _: Collator.for_preference(pad_token_id=0)(pairs),
        "attention_mask_chosen",
        "chosen_attention_mask",
        "example 1",
    )


def test_a_misspelled_side_mask_of_a_kto_example_is_refused():
    example = {"prompt_ids": [1, 2], "completion_ids": [3, 0], "label": True, "KL_completion_ids": [4, 5]}
    for bad, meant in (
        ("completion_attention_msk", "completion_attention_mask"),
        ("kl_attention_mask", "KL_attention_mask"),
    ):
        examples = [dict(example), {**example, bad: [1, 0]}]
        _refused(lambda _, e=examples: Collator.for_preference(pad_token_id=0)(e), bad, meant, "example 1")
    good = [{**example, "completion_attention_mask": [1, 0], "KL_attention_mask": [1, 1]}]
    out = Collator.for_preference(padding_free=True)(good)
    assert out["input_ids"].tolist() == [[1, 2, 3, 1, 2, 4, 5]]  # the padding dropped


@pytest.mark.parametrize("kind, bad, meant", SLIPS, ids=[f"{k}:{b}" for k, b, _ in SLIPS])
def test_to_training_warns_and_keeps_the_page_result(kind, bad, meant):
    records = [record({"input_ids": TOKENS}, 0), record({"input_ids": TOKENS, bad: _values(bad)}, 1)]
    want = [[6, 7], [6, 7]]
    for run in (
        lambda: to_training(records, return_labels=True),
        lambda: batch({"input_ids": TOKENS}, {"input_ids": TOKENS, bad: _values(bad)}).to_training(
            return_labels=True
        ),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run()
        assert out["labels"].tolist() == want  # the reference page's result
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        near = [m for m in messages if NEAR in m]
        assert len(near) == 1, messages  # once per call
        assert "record 1" in near[0] and f"'{bad}'" in near[0] and f"'{meant}'" in near[0], near[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without labels nothing is supervised: nothing is said
        to_training(records)


# -- fields of their own ---------------------------------------------------------------------------

LEGITIMATE = [
    "label", "Label", "attention_mask", "action_mask", "Action_Mask", "position_ids", "positions",
    "token_type_ids", "prompt_attention_mask", "chosen_attention_mask", "rejected_attention_mask",
    "completion_attention_mask", "KL_attention_mask", "kl_attention_mask", "reject_attention_mask",
    "completion_ids", "mm_token_type_ids", "response_ids", "seq_lengths", "loss_weights", "loss_weight",
    "label_ids", "levels", "labeled", "attn_mask", "padding_mask", "image_mask", "chosen_labels",
    "rejected_labels", "prompt_ids", "advantages", "old_log_probs", "ref_logps", "input_ids", "text",
]  # fmt: skip


def _legitimate_value(name: str) -> object:
    if name in ("position_ids", "positions"):
        return [0, 1, 2]
    if name == "seq_lengths":
        return [3]
    if name == "input_ids":
        return TOKENS
    if name == "text":
        return "abc"
    if name in ("label", "Label"):
        return True
    if "label" in name:
        return [5, 6, 7]
    return [1, 1, 1]


LEGITIMATE_ENTRIES = {
    "Collator": lambda p: Collator(return_labels=True)(p),
    "for_transformers": lambda p: Collator.for_transformers(padding_free=True)(p),
    "for_rollouts": lambda p: Collator.for_rollouts(padding_free=True)(
        [{**x, "completion_mask": MASK} for x in p]
    ),
    "pack_flat": lambda p: pack_flat(p, 8, pad_token_id=0),
    "to_training": lambda p: to_training([record(x, i) for i, x in enumerate(p)], return_labels=True),
}


@pytest.mark.parametrize("name", LEGITIMATE)
def test_fields_of_their_own_are_never_near_misses(name):
    assert misspelled([name], SUPERVISION_NAMES) is None
    payloads = [{"input_ids": TOKENS, name: _legitimate_value(name)}]
    for entry, call in LEGITIMATE_ENTRIES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call(payloads)
            except (TypeError, ValueError) as error:  # refused for another, documented reason
                assert NEAR not in str(error), (entry, str(error))
        assert not [w for w in caught if NEAR in str(w.message)], entry
    if name != "mm_token_type_ids":  # a vision-language field: the text layouts refuse it (no media)
        Collator(return_labels=True)(payloads)  # where nothing else refuses it, both take it
        pack_flat(payloads, 8, pad_token_id=0)


def test_fields_a_call_is_told_to_read_are_never_refused():
    floats = [{"input_ids": TOKENS, "loss_maks": [0.5, 0.25, 1.0]}]
    out = Collator(return_labels=True, float_fields=["loss_maks"])(floats)
    assert out["loss_maks"].tolist() == [[0.25, 1.0]]
    hf = Collator.for_transformers(padding_free=True, float_fields=["completion_msk"])
    assert hf([{"input_ids": TOKENS, "completion_msk": [0.5, 0.25, 1.0]}])["completion_msk"].shape == (1, 3)
    rollouts = Collator.for_rollouts(padding_free=True, float_fields=["Loss_Mask"])
    rollouts([{"input_ids": TOKENS, "completion_mask": MASK, "Loss_Mask": [0.5, 0.25, 1.0]}])
    extra = Collator(return_labels=True, extra_fields=["loss_maks"])(
        [{"input_ids": TOKENS, "loss_maks": MASK}]
    )
    assert extra["loss_maks"].tolist() == [[0, 1]]  # input-aligned, as extra fields are
    packed = pack_flat([{"input_ids": TOKENS, "loss_maks": MASK}], 4, pad_token_id=0, fields=("loss_maks",))
    assert packed[0].payload["loss_maks"].tolist() == [0, 1, 1, 0]


def test_the_rule():
    """Case and separators never matter; one edit (a transposition is one) for a short name, two for a
    longer one; a name at least as close to a field of its own is that field's."""
    assert misspelled(["loss-mask"], SUPERVISION_NAMES) == ("loss-mask", "loss_mask")
    assert misspelled(["LOSSMASK"], SUPERVISION_NAMES) == ("LOSSMASK", "loss_mask")
    assert misspelled(["lsos_mask"], SUPERVISION_NAMES) == ("lsos_mask", "loss_mask")
    assert misspelled(["los_mak"], SUPERVISION_NAMES) == ("los_mak", "loss_mask")  # two edits
    assert misspelled(["lo_mak"], SUPERVISION_NAMES) is None  # three
    assert misspelled(["lbels"], SUPERVISION_NAMES) == ("lbels", "labels")
    assert misspelled(["lbls"], SUPERVISION_NAMES) is None  # two edits of a short name
    assert misspelled(["lable"], SUPERVISION_NAMES) is None  # one from 'label', two from 'labels'
    assert misspelled(["action_msk"], SUPERVISION_NAMES) is None
    assert misspelled(["assistant_mask5"], SUPERVISION_NAMES) == (
        "assistant_mask5",
        "assistant_masks",
    )  # a tie
    assert misspelled(["KL_attention_mask", "reject_attention_mask"], SUPERVISION_NAMES) is None
    assert (
        misspelled(["z", "loss_maks", "completion_msk"], SUPERVISION_NAMES)[0] == "completion_msk"
    )  # sorted
    assert misspelled(["loss_maks"], SUPERVISION_NAMES, ["loss_maks"]) is None  # read by the call
    assert misspelled([3, None, "input_ids"], SUPERVISION_NAMES) is None


# -- the property ----------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _distance(a: str, b: str) -> int:
    """Optimal string alignment distance (a transposition of neighbours is one edit), the textbook way."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        d[i][0] = i
    for j in range(len(b) + 1):
        d[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _limit(name: str) -> int:
    return 1 if len(_canonical(name)) <= 6 else 2


@st.composite
def _edited(draw, names: tuple[str, ...]) -> tuple[str, str]:
    """A name within its limit of edits of one of ``names``: inserts, deletions, substitutions,
    transpositions, case changes."""
    meant = draw(st.sampled_from(names))
    name = meant
    for _ in range(draw(st.integers(1, _limit(meant)))):
        kind = draw(st.sampled_from(["insert", "delete", "substitute", "transpose", "case"]))
        place = draw(st.integers(0, len(name) - 1))
        char = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789_"))
        if kind == "insert":
            name = name[:place] + char + name[place:]
        elif kind == "delete" and len(name) > 1:
            name = name[:place] + name[place + 1 :]
        elif kind == "substitute":
            name = name[:place] + char + name[place + 1 :]
        elif kind == "transpose" and place + 1 < len(name):
            name = name[:place] + name[place + 1] + name[place] + name[place + 2 :]
        else:
            name = name[:place] + name[place].swapcase() + name[place + 1 :]
    return meant, name


def _is_near_miss(name: str, meant: str, known: tuple[str, ...]) -> bool:
    """The rule, by the test's own means: a near miss of ``meant``, nearer to it than to any field of its
    own."""
    if name in known or name in LEGITIMATE:
        return False
    given = _canonical(name)
    distance = _distance(given, _canonical(meant))
    return distance <= _limit(meant) and all(
        _distance(given, _canonical(other)) > distance for other in LEGITIMATE if other not in known
    )


PROPERTY_ENTRIES = {
    "Collator": ENTRIES["Collator"],
    "for_transformers": ENTRIES["for_transformers padding-free"],
    "for_rollouts": ENTRIES["for_rollouts beside completion_mask"],
    "pack_flat": ENTRIES["pack_flat"],
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(edit=_edited(SUPERVISION_NAMES), entry=st.sampled_from(list(PROPERTY_ENTRIES)))
def test_names_near_a_supervision_field_are_refused(edit, entry):
    meant, name = edit
    assume(_is_near_miss(name, meant, SUPERVISION_NAMES))
    call, where = PROPERTY_ENTRIES[entry]
    with pytest.raises(ValueError) as info:
        call(name)
    message = str(info.value)
    assert message.startswith(where) and f"'{name}'" in message and NEAR in message, message


SIDES = ("prompt_attention_mask", "chosen_attention_mask", "rejected_attention_mask")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(edit=_edited(SIDES))
def test_names_near_a_side_mask_are_refused(edit):
    meant, name = edit
    assume(_is_near_miss(name, meant, SIDES))
    pairs = [dict(PAIR), {**PAIR, name: [1, 0]}]
    with pytest.raises(ValueError) as info:
        Collator.for_preference(pad_token_id=0)(pairs)
    message = str(info.value)
    assert message.startswith("example 1") and f"'{name}'" in message and NEAR in message, message
