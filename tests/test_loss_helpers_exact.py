"""The loss helpers read sequences from what the collator wrote, never a guess, and refuse what they cannot read.

Each sequence is scored alone as the reference (its own logits, ``log_softmax`` by hand): a
``Collator.for_transformers`` batch, padded or padding-free, with any ``position_ids_start``, must
give the same log-probs, sequences and losses. Where padding-free padding cannot be told apart from
one-token sequences, the helpers that return sequences refuse, naming ``return_sequence_map=True``;
a batch that cannot be read at all is a ``ValueError`` / ``TypeError`` naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch

from zephon_collate import (
    Collator,
    aggregate_loss,
    global_loss_count,
    sequence_logprobs,
    token_logprobs,
    unpack,
)
from zephon_collate.losses import MODES, sequence_means

VOCAB = 10
LOG_TENTH = math.log(0.1)
EXAMPLES = [
    {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
    {"input_ids": [5, 6], "completion_mask": [0, 1]},
    {"input_ids": [7, 8, 9], "completion_mask": [0, 0, 1]},
]
# A per-token loss for the padding-free row [1 2 3 4 | 5 6 | 7 8 9]: supervised are 1 2 3 | 6 | 9, so the
# sequences' sums are 6, 6, 9 over 3, 1, 1 tokens; every unsupervised place holds a loss that would show.
LOSS_ROW = [100.0, 1.0, 2.0, 3.0, 100.0, 6.0, 100.0, 100.0, 9.0]
WANT = {
    "token-mean": 21 / 5,
    "seq-mean-token-sum": 21 / 3,
    "seq-mean-token-mean": (6 / 3 + 6 / 1 + 9 / 1) / 3,
    "seq-mean-token-sum-norm": 21 / 3 / 8,
    "token-sum": 21,
}
AMBIGUOUS = "cannot tell padding from one-token sequences"


def tables(seed: int = 0) -> list[torch.Tensor]:
    """Each example's own logits ``[len_i, V]``: what a model gives the example alone."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(len(e["input_ids"]), VOCAB, generator=generator, dtype=torch.float64) for e in EXAMPLES
    ]


def flat_logits(width: int) -> torch.Tensor:
    """The examples' logits one after the other in one row; padding gets logits that would show if read."""
    out = torch.full((1, width, VOCAB), 50.0, dtype=torch.float64)
    out[0, :9] = torch.cat(tables())
    return out


def padded_logits() -> torch.Tensor:
    out = torch.full((3, 4, VOCAB), 50.0, dtype=torch.float64)
    for row, table in enumerate(tables()):
        out[row, : len(table)] = table
    return out


def alone() -> list[list[tuple[float, bool]]]:
    """The reference: each example scored alone, ``(log p(token | its own history), supervised)`` per token."""
    out = []
    for example, table in zip(EXAMPLES, tables(), strict=True):
        ids, mask = example["input_ids"], example["completion_mask"]
        scores = torch.log_softmax(table, dim=-1)
        out.append(
            [(0.0, False)] + [(float(scores[t - 1, ids[t]]), mask[t] == 1) for t in range(1, len(ids))]
        )
    return out


def reference(per_token: list[list[tuple[float, bool]]], mode: str, normalizer: float) -> float:
    """verl's ``agg_loss`` formulas over per-sequence lists of ``(loss, supervised)``."""
    sums = [sum(v for v, m in seq if m) for seq in per_token]
    counts = [sum(1 for _, m in seq if m) for seq in per_token]
    kept = [i for i, n in enumerate(counts) if n]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in kept) / len(kept)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in kept) / len(kept)
    if mode == "seq-mean-token-sum-norm":
        return sum(sums[i] for i in kept) / len(kept) / normalizer
    return sum(sums)


# --- 1. logits narrower than the token ids --------------------------------------------------------------


def test_token_logprobs_refuses_logits_narrower_than_the_token_ids():
    """V <= the largest id was a raw IndexError (a device-side assert on CUDA); now a ValueError naming both."""
    batch = Collator.for_transformers(padding_free=True)(EXAMPLES)  # largest id: 9
    for width in (5, 9):
        logits = torch.zeros(1, 9, width)
        for helper in (token_logprobs, sequence_logprobs):
            with pytest.raises(ValueError, match=r"\(1, 9, " + str(width) + r"\)") as raised:
                helper(logits, batch)
            message = str(raised.value)
            assert "largest token id in input_ids is 9" in message and "whole vocabulary" in message
    # V = 10 covers id 9: every scored token is log(1/10) under uniform logits.
    scores = token_logprobs(torch.zeros(1, 9, VOCAB), batch)
    assert scores[0].tolist() == pytest.approx([0.0, *[LOG_TENTH] * 3, 0.0, LOG_TENTH, 0.0, *[LOG_TENTH] * 2])


def test_negative_token_ids_and_an_empty_vocabulary_are_refused():
    """A negative id indexed the logits from the end (a silent wrong log-prob); V = 0 scores nothing."""
    batch = {"input_ids": [[1, -2, 3]], "attention_mask": [[1, 1, 1]], "labels": [[-100, 2, 3]]}
    with pytest.raises(ValueError, match=r"negative token id -2"):
        token_logprobs(torch.zeros(1, 3, 5), batch)
    with pytest.raises(ValueError, match=r"no vocabulary"):
        token_logprobs(torch.zeros(1, 4, 0), Collator.for_transformers(padding_free=True)(EXAMPLES[:1]))


def test_a_native_batch_of_shifted_labels_is_refused_not_read_one_token_off():
    # The native Collator's labels[t] is input_ids[t + 1]; beside an attention_mask (extra_fields) the
    # helpers read the batch as a padded one and counted each token trained by the next one's label.
    native = Collator(pad_token_id=0, return_labels=True, extra_fields=["attention_mask"])(
        [
            {"input_ids": [1, 2, 3, 4], "attention_mask": [1, 1, 1, 1]},
            {"input_ids": [5, 6], "attention_mask": [1, 1]},
        ]
    )
    assert native["labels"].tolist() == [[2, 3, 4], [6, -100, -100]]
    logits, per_token = torch.zeros(2, 3, 8), torch.ones(2, 3)
    for read_labels in (
        lambda: sequence_logprobs(logits, native),
        lambda: aggregate_loss(per_token, native, mode="token-mean"),
        lambda: sequence_means(per_token, native),
        lambda: global_loss_count(native, mode="token-mean"),
    ):
        with pytest.raises(
            ValueError, match=r"neither -100 nor the token at their place: labels shifted already"
        ):
            read_labels()
    # What reads no labels takes the batch as it is (the labels may be a loss of your own).
    assert token_logprobs(logits, native).shape == (2, 3)
    assert [row.tolist() for row in unpack(native["input_ids"], native)] == [[1, 2, 3], [5, 6]]
    aligned = {**native, "labels": torch.tensor([[-100, 2, 3], [-100, 6, -100]])}  # token-aligned: read
    assert sequence_logprobs(logits, aligned).counts.tolist() == [2, 1]


# --- 2. sequences that are all empty ---------------------------------------------------------------------


def test_unpack_of_a_batch_whose_sequences_are_all_empty():
    """A padded batch of one empty rollout is [1, 0] with one sequence: unpack raised IndexError."""
    batch = Collator.for_rollouts(pad_token_id=0)([{"input_ids": [], "completion_mask": []}])
    assert tuple(batch["input_ids"].shape) == (1, 0) and batch["num_sequences"] == 1
    out = unpack(batch["input_ids"], batch)
    assert isinstance(out, list) and [tuple(t.shape) for t in out] == [(0,)]
    assert tuple(unpack(batch["input_ids"], batch, padded=True).shape) == (1, 0)
    features = torch.zeros(1, 0, 3)
    assert [tuple(t.shape) for t in unpack(features, batch)] == [(0, 3)]
    assert tuple(unpack(features, batch, padded=True).shape) == (1, 0, 3)
    pairs = Collator.for_preference(pad_token_id=0)(
        [{"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}]
    )
    assert [tuple(t.shape) for t in unpack(pairs["input_ids"], pairs)] == [(0,), (0,)]
    assert tuple(unpack(pairs["input_ids"], pairs, padded=True).shape) == (2, 0)
    logprobs = sequence_logprobs(torch.zeros(2, 0, VOCAB), pairs)
    assert logprobs.sums.tolist() == [0.0, 0.0] and logprobs.counts.tolist() == [0, 0]


def test_unpack_of_a_batch_without_sequences():
    empty = torch.zeros(0, 0, dtype=torch.int64)
    batch = {"input_ids": empty, "logits_index": empty, "sequence_index": empty, "labels": empty}
    assert unpack(empty, batch) == []
    assert tuple(unpack(empty, batch, padded=True).shape) == (0, 0)
    row = torch.zeros(1, 0, dtype=torch.int64)  # a padding-free row of no tokens: no sequence starts
    flat = {"input_ids": row, "position_ids": row, "labels": row}
    assert unpack(row, flat) == [] and tuple(unpack(torch.zeros(1, 0, 2), flat, padded=True).shape) == (
        0,
        0,
        2,
    )
    out = sequence_logprobs(torch.zeros(1, 0, VOCAB), flat)
    assert out.sums.shape == (0,) and out.counts.shape == (0,)


# --- 3. for_transformers batches: position_ids_start, pad_to_multiple_of --------------------------------


LAYOUTS = {
    "flat-0": {"padding_free": True},
    "flat-1": {"padding_free": True, "position_ids_start": 1},
    "flat-5": {"padding_free": True, "position_ids_start": 5},
    "padded-1": {"pad_token_id": 0, "position_ids_start": 1},
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_transformers_batches_give_each_sequence_scored_alone(layout):
    """Every position_ids_start reads the three examples as three sequences (it was one for a start > 0)."""
    batch = Collator.for_transformers(**layout)(EXAMPLES)
    logits = flat_logits(9) if layout.get("padding_free") else padded_logits()
    want = alone()
    out = sequence_logprobs(logits, batch)
    assert out.counts.tolist() == [3, 1, 1]
    assert out.sums.tolist() == pytest.approx([sum(v for v, m in seq if m) for seq in want], rel=1e-12)
    scores = unpack(token_logprobs(logits, batch), batch)
    assert [s.tolist() for s in scores] == [pytest.approx([v for v, _ in seq], rel=1e-12) for seq in want]
    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [e["input_ids"] for e in EXAMPLES]
    assert unpack(batch["input_ids"], batch, padded=True, padding_value=-1).tolist() == [
        [1, 2, 3, 4],
        [5, 6, -1, -1],
        [7, 8, 9, -1],
    ]
    lp = token_logprobs(logits, batch)
    for mode in MODES:
        got = float(aggregate_loss(-lp, batch, mode=mode, normalizer=8.0))
        assert got == pytest.approx(reference([[(-v, m) for v, m in s] for s in want], mode, 8.0), rel=1e-12)
    assert int(global_loss_count(batch, mode="seq-mean-token-mean")) == 3
    assert int(global_loss_count(batch)) == 5


@pytest.mark.parametrize("start", [0, 1, 5])
def test_aggregate_loss_hand_worked_for_every_position_ids_start(start):
    """Sequence sums 6, 6, 9 over 3, 1, 1 supervised tokens (a start > 0 read them as one sequence of 21 / 5)."""
    batch = Collator.for_transformers(padding_free=True, position_ids_start=start)(EXAMPLES)
    loss = torch.tensor([LOSS_ROW], dtype=torch.float64)
    for mode in MODES:
        assert float(aggregate_loss(loss, batch, mode=mode, normalizer=8.0)) == pytest.approx(WANT[mode]), (
            mode
        )
    out = sequence_logprobs(torch.zeros(1, 9, VOCAB), batch)  # uniform: log(1/10) per supervised token
    assert out.counts.tolist() == [3, 1, 1]
    assert out.sums.tolist() == pytest.approx([3 * LOG_TENTH, LOG_TENTH, LOG_TENTH])


@pytest.mark.parametrize("start", [0, 1])
def test_pad_to_multiple_of_padding_free_is_refused_where_sequences_are_returned(start):
    """The padding tokens (each a one-token segment, label -100) were read as extra sequences."""
    collate = Collator.for_transformers(
        padding_free=True, pad_token_id=0, pad_to_multiple_of=16, position_ids_start=start
    )
    batch = collate(EXAMPLES)
    assert batch["input_ids"].shape == (1, 16) and batch["position_ids"][0, 9:].tolist() == [start] * 7
    logits = flat_logits(16)
    for call in (
        lambda: sequence_logprobs(logits, batch),
        lambda: unpack(batch["input_ids"], batch),
        lambda: unpack(batch["input_ids"], batch, padded=True),
    ):
        with pytest.raises(ValueError, match=AMBIGUOUS) as raised:
            call()
        message = str(raised.value)
        assert "ends with 7 one-token" in message
        assert "return_sequence_map=True" in message and "pad_to_multiple_of" in message
    # The token-level helpers and the losses do not depend on where the padding is: still exact.
    loss = torch.tensor([LOSS_ROW + [100.0] * 7], dtype=torch.float64)
    for mode in MODES:
        assert float(aggregate_loss(loss, batch, mode=mode, normalizer=8.0)) == pytest.approx(WANT[mode]), (
            mode
        )
    assert (
        int(global_loss_count(batch, mode="seq-mean-token-sum")) == 3 and int(global_loss_count(batch)) == 5
    )
    scores = token_logprobs(logits, batch)
    assert scores[0, 9:].tolist() == [0.0] * 7
    assert scores[0, :9].tolist() == pytest.approx([v for seq in alone() for v, _ in seq], rel=1e-12)


def test_a_trailing_one_token_example_is_refused_and_one_inside_the_row_is_read():
    """At the end of the row a one-token example looks like padding; anywhere else it is a sequence."""
    one = {"input_ids": [7]}
    collate = Collator.for_transformers(padding_free=True, position_ids_start=1)
    with pytest.raises(ValueError, match=AMBIGUOUS + r".*return_sequence_map=True"):
        sequence_logprobs(torch.zeros(1, 5, VOCAB), collate([EXAMPLES[0], one]))
    inside = collate([EXAMPLES[0], one, EXAMPLES[1]])
    assert inside["input_ids"].tolist() == [[1, 2, 3, 4, 7, 5, 6]]
    out = sequence_logprobs(torch.zeros(1, 7, VOCAB), inside)
    assert out.counts.tolist() == [3, 0, 1]
    assert out.sums.tolist() == pytest.approx([3 * LOG_TENTH, 0.0, LOG_TENTH])
    assert [t.tolist() for t in unpack(inside["input_ids"], inside)] == [[1, 2, 3, 4], [7], [5, 6]]


def test_a_padding_free_row_read_from_its_first_position():
    """Hand-built rows: a sequence starts at each place whose position equals the row's first one."""
    batch = {
        "input_ids": [[1, 2, 3, 7], [4, 5, 6, 8]],
        "position_ids": [[3, 4, 3, 4], [2, 3, 2, 3]],
        "labels": [[-100, 2, -100, 7], [-100, 5, -100, 8]],
    }
    out = sequence_logprobs(torch.zeros(2, 4, VOCAB), batch)
    assert out.counts.tolist() == [1, 1, 1, 1]
    assert out.sums.tolist() == pytest.approx([LOG_TENTH] * 4)
    assert [t.tolist() for t in unpack(torch.tensor(batch["input_ids"]), batch)] == [
        [1, 2],
        [3, 7],
        [4, 5],
        [6, 8],
    ]
    scores = token_logprobs(torch.zeros(2, 4, VOCAB), batch)
    assert scores.reshape(-1).tolist() == pytest.approx(
        [0.0, LOG_TENTH, 0.0, LOG_TENTH, 0.0, LOG_TENTH, 0.0, LOG_TENTH]  # rows 0 and 1
    )
    # A row ending in a one-token sequence, even one labelled with its own id: padding labelled with the
    # pad id (label_pad_token_id = pad_token_id) looks the same, so the sequences are refused, the tokens not
    ending = {
        **batch,
        "position_ids": [[3, 4, 5, 3], [2, 3, 2, 3]],
        "labels": [[-100, 2, 3, 7], [-100, 5, -100, 8]],
    }
    with pytest.raises(ValueError, match=AMBIGUOUS):
        sequence_logprobs(torch.zeros(2, 4, VOCAB), ending)
    with pytest.raises(ValueError, match=AMBIGUOUS):
        unpack(torch.tensor(ending["input_ids"]), ending)
    assert token_logprobs(torch.zeros(2, 4, VOCAB), ending).reshape(-1).tolist() == pytest.approx(
        [0.0, LOG_TENTH, LOG_TENTH, 0.0, 0.0, LOG_TENTH, 0.0, LOG_TENTH]  # 7 opens a sequence: unscored
    )


def test_hand_built_sequence_maps_are_read_exactly():
    """The map wins over position_ids (here all 1, which would read as one sequence, or as four)."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 0]]),
        "position_ids": torch.tensor([[1, 1, 1, 1, 1, 1]]),
        "labels": torch.tensor([[-100, 2, 3, -100, 5, -100]]),
        "logits_index": torch.tensor([[-1, 0, 1, -1, 3, -1]]),
        "sequence_index": torch.tensor([[0, 0, 0, 1, 1, -1]]),
        "num_sequences": 2,
    }
    out = sequence_logprobs(torch.zeros(1, 6, VOCAB), batch)
    assert out.counts.tolist() == [2, 1] and out.sums.tolist() == pytest.approx([2 * LOG_TENTH, LOG_TENTH])
    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [[1, 2, 3], [4, 5]]
    loss = torch.tensor([[100.0, 1.0, 2.0, 100.0, 6.0, 100.0]])
    got = [float(aggregate_loss(loss, batch, mode=m, normalizer=4.0)) for m in MODES]
    assert got == pytest.approx([9 / 3, 9 / 2, (3 / 2 + 6) / 2, 9 / 2 / 4, 9])
    # Without num_sequences: the largest sequence_index + 1.
    del batch["num_sequences"]
    assert sequence_logprobs(torch.zeros(1, 6, VOCAB), batch).counts.tolist() == [2, 1]
    # A shared prompt: [p p | a | b b], each response predicted from the prompt's last token.
    shared = {
        "input_ids": [[1, 2, 3, 4, 5]],
        "labels": [[-100, -100, 3, 4, 5]],
        "logits_index": [[-1, 0, 1, 1, 3]],
        "sequence_index": [[-1, -1, 0, 1, 1]],
        "document_ids": [[0, 0, 0, 0, 0]],
        "branch_ids": [[0, 0, 1, 2, 2]],
        "num_sequences": 2,
    }
    assert [t.tolist() for t in unpack(torch.tensor(shared["input_ids"]), shared)] == [
        [1, 2, 3],
        [1, 2, 4, 5],
    ]
    logits = torch.zeros(1, 5, VOCAB)
    logits[0, 1, 3] = logits[0, 1, 4] = math.log(4.5)  # after the prompt: 3 or 4, each 4.5 / 17
    out = sequence_logprobs(logits, shared)
    assert out.counts.tolist() == [1, 2]
    assert out.sums.tolist() == pytest.approx([math.log(4.5 / 17), math.log(4.5 / 17) + LOG_TENTH])


# --- 4. batches the helpers cannot read ------------------------------------------------------------------


def test_missing_labels_are_named():
    """Missing labels were a raw KeyError; the helpers that read supervision name the field."""
    batch = dict(Collator.for_rollouts(padding_free=True)(EXAMPLES))
    del batch["labels"]
    for call in (
        lambda: sequence_logprobs(torch.zeros(1, 9, VOCAB), batch),
        lambda: aggregate_loss(torch.zeros(1, 9), batch),
        lambda: global_loss_count([batch]),
    ):
        with pytest.raises(ValueError, match=r"no 'labels'.*-100"):
            call()
    # token_logprobs and unpack read no labels.
    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [e["input_ids"] for e in EXAMPLES]
    assert float(token_logprobs(torch.zeros(1, 9, VOCAB), batch).sum()) == pytest.approx(6 * LOG_TENTH)


def test_arguments_that_are_not_tensors_are_named():
    batch = Collator.for_transformers(padding_free=True)(EXAMPLES)
    with pytest.raises(TypeError, match=r"logits must be a torch.Tensor"):
        token_logprobs([[[0.0] * VOCAB] * 9], batch)
    with pytest.raises(TypeError, match=r"logits must be a torch.Tensor"):
        sequence_logprobs(None, batch)
    with pytest.raises(TypeError, match=r"unpack: tensor must be a torch.Tensor"):
        unpack([[1, 2, 3]], batch)
    with pytest.raises(TypeError, match=r"per_token_loss must be a torch.Tensor"):
        aggregate_loss([LOSS_ROW], batch)
    with pytest.raises(TypeError, match=r"global_loss_count: batches must be"):
        global_loss_count(3)


def test_fields_of_the_wrong_kind_are_named():
    """Float ids were a raw IndexError, a ragged list a torch message naming no field."""
    batch = dict(Collator.for_transformers(padding_free=True)(EXAMPLES))
    with pytest.raises(TypeError, match=r"batch\['input_ids'\] holds torch.float32"):
        token_logprobs(torch.zeros(1, 9, VOCAB), {**batch, "input_ids": batch["input_ids"].float()})
    with pytest.raises(TypeError, match=r"batch\['position_ids'\] holds torch.float32"):
        unpack(batch["input_ids"], {**batch, "position_ids": batch["position_ids"].float()})
    with pytest.raises(TypeError, match=r"batch\['input_ids'\] must be .*integers"):
        token_logprobs(torch.zeros(1, 9, VOCAB), {**batch, "input_ids": [[1, 2], [3]]})
    with pytest.raises(TypeError, match=r"batch\['labels'\] must be .*integers"):
        aggregate_loss(torch.zeros(1, 9), {**batch, "labels": None})


def test_sequence_map_fields_that_do_not_fit_are_named():
    """A document_ids of another shape was a raw RuntimeError; an index past the map's end a RuntimeError
    (or, at num_sequences exactly, a silently dropped sequence)."""
    pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}]
    batch = dict(Collator.for_preference(padding_free=True, shared_prompt=True)(pairs))
    with pytest.raises(ValueError, match=r"batch\['document_ids'\] has shape \(1, 4\)"):
        unpack(batch["input_ids"], {**batch, "document_ids": batch["document_ids"][:, :4]})
    logits = torch.zeros(1, 5, VOCAB)
    for count in (1, 0):  # sequence_index holds 1
        with pytest.raises(ValueError, match=r"sequence_index.*1.*num_sequences.*" + str(count)):
            sequence_logprobs(logits, {**batch, "num_sequences": count})
    with pytest.raises(ValueError, match=r"sequence_index.*7.*num_sequences"):
        unpack(batch["input_ids"], {**batch, "sequence_index": torch.tensor([[-1, -1, 0, 1, 7]])})
    with pytest.raises(ValueError, match=r"logits_index.*5.*row of 5"):
        token_logprobs(logits, {**batch, "logits_index": torch.tensor([[-1, 0, 1, 1, 5]])})
    with pytest.raises(ValueError, match=r"logits_index.*5.*row of 5"):
        aggregate_loss(torch.zeros(1, 5), {**batch, "logits_index": torch.tensor([[-1, 0, 1, 1, 5]])})
    with pytest.raises(TypeError, match=r"batch\['num_sequences'\] must be an int"):
        sequence_logprobs(logits, {**batch, "num_sequences": "2"})
    with pytest.raises(ValueError, match=r"batch\['num_sequences'\] must be >= 0"):
        sequence_logprobs(logits, {**batch, "num_sequences": -1})
