"""Context-parallel sharding: the load-balanced THD split of Megatron/TransformerEngine.

Gathering every rank's shard gives back the batch (once the added padding is removed); on every rank each
token keeps its own input id, label and position, padding is ignored by the loss, and the boundaries are
those varlen attention with context parallelism expects.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FULL_OPTIONS, PAD, PackedRecords, record
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import segment_positions
from tensordict import TensorDict

from zephon_collate import Chain, Collator
from zephon_collate.functional.context_parallel import cp_partition_index
from zephon_collate.parallel.context_parallel import gather_context_parallel
from zephon_collate.transforms import LossMask, TokenShift, context_parallel
from zephon_collate.transforms.context_parallel import ContextParallelShard

OPTIONS = FULL_OPTIONS
PER_TOKEN = ("input_ids", "labels", "positions", "loss_mask", "padding_mask")


def records(rows=4, length=24):
    data = PackedRecords(rows, length)
    return [data[i] for i in range(rows)]


def reference_partition(lengths, cp_size, cp_rank):
    """Plain-Python reference: pad each document to a multiple of 2 * cp_size, take chunks r and 2cp-1-r.

    Returns the local tokens as (document, offset in the padded document, is real) triples."""
    out = []
    for doc, length in enumerate(lengths):
        padded = -(-length // (2 * cp_size)) * 2 * cp_size
        chunk = padded // (2 * cp_size)
        for which in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out += [(doc, o, o < length) for o in range(which * chunk, (which + 1) * chunk)]
    return out


def doc_lengths(cu):
    return [int(b - a) for a, b in itertools.pairwise(cu) if b > a]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("flatten", [False, True])
def test_gathered_shards_give_back_the_batch(cp_size, flatten):
    """Gather(shards) minus the added padding == the flattened batch; local counts add up to the batch's."""
    recs = records()
    out = Collator(flatten=flatten, **OPTIONS)(recs)
    flat = Collator(flatten=True, **OPTIONS)(recs)
    shards = [ContextParallelShard(cp_size, rank).shard(out) for rank in range(cp_size)]
    gathered = gather_context_parallel(shards)
    assert sorted(gathered.keys()) == sorted(PER_TOKEN)
    for key in PER_TOKEN:
        assert torch.equal(gathered[key], flat[key]), key
    assert sum(int(s["num_valid_tokens"]) for s in shards) == flat["num_valid_tokens"]
    for shard in shards:
        assert shard["ids"] == out["ids"] and shard["texts"] == out["texts"]
        assert shard["ids"] is not out["ids"] and shard["texts"] is not out["texts"]  # a rank's own lists
        assert torch.equal(shard["cu_seqlens"], flat["cu_seqlens"])  # global, real boundaries
        padded = shard["cu_seqlens_padded"].diff()
        real = shard["cu_seqlens"].diff()
        assert bool((padded % (2 * cp_size) == 0).all() and (padded >= real).all())
        assert bool((padded - real < 2 * cp_size).all())
        assert int(shard["max_seqlen"]) == int(padded.max())
        assert shard["cu_seqlens"].dtype == shard["cu_seqlens_padded"].dtype == torch.int32
        assert shard["input_ids"].shape == (int(shard["cu_seqlens_padded"][-1]) // cp_size,)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_every_rank_keeps_ids_labels_and_positions(cp_size):
    """On each rank, a real token has the input id, label and position it had in the batch (its label is
    the next token of the original row, even at a chunk's edge); an added token is ignored padding whose
    positions continue its document's."""
    recs = records(3, 20)
    out = Collator(flatten=True, **OPTIONS)(recs)
    tokens = torch.stack([torch.as_tensor(r.payload["input_ids"]) for r in recs])  # [B, S], unshifted
    next_token = tokens[:, 1:].reshape(-1)  # the label of flattened input token i, before masking
    lengths = doc_lengths(out["cu_seqlens"].tolist())
    starts = out["cu_seqlens"].tolist()
    for rank in range(cp_size):
        shard = ContextParallelShard(cp_size, rank, pad_token_id=PAD).shard(out)
        expected = reference_partition(lengths, cp_size, rank)
        assert len(expected) == shard["input_ids"].numel()
        for i, (doc, offset, real) in enumerate(expected):
            assert bool(shard["cp_padding_mask"][i]) is not real
            if real:
                source = starts[doc] + offset
                for key in PER_TOKEN:
                    assert shard[key][i] == out[key][source], (rank, i, key)
                label = int(shard["labels"][i])
                assert label in (-100, int(next_token[source]))
            else:
                assert int(shard["input_ids"][i]) == PAD and int(shard["labels"][i]) == -100
                assert float(shard["loss_mask"][i]) == 0.0 and bool(shard["padding_mask"][i])
            # positions number the padded document 0, 1, ... (documents start at position 0)
            assert int(shard["positions"][i]) == offset


def test_labels_are_made_before_sharding():
    """Unmasked labels on each rank are the next token of the document, across chunk edges."""
    row = [1, 11, 12, 13, 14, 15, 16, 17, 18]  # one document of 9 tokens: 8 inputs, 8 labels
    out = Collator(return_labels=True, return_num_valid_tokens=True)(
        [{"input_ids": row, "positions": list(range(9))}]
    )
    for rank in range(2):
        shard = ContextParallelShard(2, rank).shard(out)
        inputs, labels = shard["input_ids"].tolist(), shard["labels"].tolist()
        for token, label, added in zip(inputs, labels, shard["cp_padding_mask"].tolist(), strict=True):
            assert label == (-100 if added else row[row.index(token) + 1])


def test_example_layout():
    """The worked example: A (5 tokens) padded to 8, B (3) to 4, over two ranks."""
    td = TensorDict(
        input_ids=torch.tensor([[11, 12, 13, 14, 15, 21, 22, 23]]),
        labels=torch.tensor([[12, 13, 14, 15, -100, 22, 23, -100]]),
        positions=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]),
        batch_size=[1],
    )
    shards = [ContextParallelShard(2, r)(td) for r in range(2)]
    assert shards[0]["input_ids"].tolist() == [11, 12, 0, 0, 21, 0]
    assert shards[1]["input_ids"].tolist() == [13, 14, 15, 0, 22, 23]
    assert shards[0]["cp_padding_mask"].tolist() == [False, False, True, True, False, True]
    assert shards[1]["num_valid_tokens"].dtype == torch.int64
    local = shards[0]["cu_seqlens_padded"] // 2
    assert local.tolist() == [0, 4, 6]  # the boundaries of each local shard


def test_boundaries_from_cu_seqlens_with_sequence_positions():
    """With position_mode="sequence" the positions no longer restart: cu_seqlens gives the documents."""
    recs = records()
    preserve = Collator(flatten=True, **OPTIONS)(recs)
    sequence = Collator(flatten=True, position_mode="sequence", **OPTIONS)(recs)
    rows = Collator(position_mode="sequence", **OPTIONS)(recs)  # [B, K] boundaries
    for rank in range(2):
        a = ContextParallelShard(2, rank).shard(preserve)
        b = ContextParallelShard(2, rank).shard(sequence)
        c = ContextParallelShard(2, rank).shard(rows)
        for key in ("input_ids", "labels", "cu_seqlens", "cu_seqlens_padded", "cp_padding_mask"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), key
        assert torch.equal(b["positions"], c["positions"])
    # without cu_seqlens, sequence positions make each row one document
    no_cu = {k: v for k, v in sequence.items() if k not in ("cu_seqlens", "max_seqlen")}
    whole = ContextParallelShard(2, 0).shard(no_cu)
    assert whole["cu_seqlens"].tolist() == [i * 23 for i in range(5)]


def test_inside_a_chain_and_on_the_collators_tensordict():
    """As the last step of a chain, and on the chain's own [B, S] TensorDict (per-row entries dropped)."""
    td = TensorDict(
        input_ids=torch.tensor([[1, 5, 6, 2, 1, 7, 2, 0], [1, 8, 9, 3, 4, 2, 0, 0]]),
        positions=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 1]]),
        padding_length=torch.tensor([1, 2]),
        weights=torch.rand(2, 8, 3),
        batch_size=[2],
    )
    chain = Chain(
        TokenShift(input_keys=["positions", "weights"]),
        LossMask(supervision_key=None),
        ContextParallelShard(2, 1),
    )
    out = chain(td)
    assert out.batch_size == torch.Size([]) and "padding_length" not in out
    assert out["weights"].shape == (out["input_ids"].numel(), 3)
    stream = chain[1](chain[0](td))
    gathered = gather_context_parallel([ContextParallelShard(2, r)(stream) for r in range(2)])
    assert torch.equal(gathered["weights"], stream["weights"].reshape(-1, 3))
    assert torch.equal(gathered["labels"], stream["labels"].reshape(-1))
    assert int(out["num_valid_tokens"]) == int((out["labels"] != -100).sum())


def test_input_is_never_changed():
    out = Collator(flatten=True, **OPTIONS)(records())
    before = {k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)}
    shard = ContextParallelShard(3, 2).shard(out)
    shard["labels"].fill_(7)
    shard["positions"].fill_(7)
    assert all(torch.equal(out[k], v) for k, v in before.items())


def test_rows_that_do_not_start_a_document_and_explicit_keys():
    td = TensorDict(
        input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]),
        positions=torch.tensor([[3, 4, 5], [0, 1, 2]]),  # row 0 continues a document from elsewhere
        extra=torch.tensor([[1, 1, 1], [2, 2, 2]]),
        batch_size=[2],
    )
    shard = ContextParallelShard(1, 0, keys=["input_ids"])(td)
    assert shard["cu_seqlens"].tolist() == [0, 3, 6] and "extra" not in shard
    # positions come along (always), and numbering continues over the added padding
    assert shard["positions"].tolist() == [3, 4, 5, 6, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="needs 'nope'"):
        ContextParallelShard(1, 0, keys=["nope"])(td)
    with_row = TensorDict({**td.to_dict(), "row": torch.zeros(2, 5)}, batch_size=[2])
    with pytest.raises(ValueError, match="not per-token"):
        ContextParallelShard(1, 0, keys=["row"])(with_row)


def test_empty_and_fill_values():
    out = Collator(return_labels=True, return_num_valid_tokens=True)([{"input_ids": [1], "positions": [0]}])
    shard = ContextParallelShard(2, 1).shard(out)  # one-token rows give empty inputs
    assert shard["input_ids"].shape == (0,) and shard["cu_seqlens"].tolist() == [0]
    assert int(shard["num_valid_tokens"]) == 0 and int(shard["max_seqlen"]) == 0
    td = TensorDict(positions=torch.tensor([0, 1, 2]), mask=torch.tensor([True, True, True]), batch_size=[])
    filled = ContextParallelShard(2, 0, fill_values={"mask": True})(td)  # chunks 0 and 3: [0], [pad]
    assert filled["mask"].tolist() == [True, True]
    assert ContextParallelShard(2, 0)(td)["mask"].tolist() == [True, False]


def test_errors():
    with pytest.raises(ValueError, match="cp_rank"):
        ContextParallelShard(2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        ContextParallelShard(0, 0)
    with pytest.raises(TypeError, match="cp_size"):
        ContextParallelShard(2.0, 0)
    with pytest.raises(ValueError, match="pad_token_id"):
        ContextParallelShard(2, 0, pad_token_id=-1)
    with pytest.raises(ValueError, match="distinct"):
        ContextParallelShard(2, 0, padded_key="cu_seqlens")
    with pytest.raises(ValueError, match="metadata"):
        ContextParallelShard(2, 0, keys=["cu_seqlens"])
    with pytest.raises(ValueError, match=r"\[B, S\] or \[N\]"):
        ContextParallelShard(2, 0)(TensorDict(positions=torch.zeros(1, 2, 3), batch_size=[]))
    bad = TensorDict(
        positions=torch.tensor([0, 1, 2, 3]), cu_seqlens=torch.tensor([0, 3, 2, 4]), batch_size=[]
    )
    with pytest.raises(ValueError, match="nondecreasing"):
        ContextParallelShard(2, 0)(bad)
    rows = TensorDict(positions=torch.zeros(2, 4), cu_seqlens=torch.zeros(3, 2), batch_size=[])
    with pytest.raises(ValueError, match="fits neither"):
        ContextParallelShard(2, 0)(rows)
    with pytest.raises(ValueError, match="multiples"):
        cp_partition_index(torch.tensor([0, 6]), 2, 0)
    with pytest.raises(ValueError, match="no shards"):
        gather_context_parallel([])


def test_int32_boundaries_overflow(monkeypatch):
    monkeypatch.setattr(context_parallel, "INT32_MAX", 7)
    with pytest.raises(ValueError, match="int32"):
        ContextParallelShard(2, 0)(TensorDict(positions=torch.arange(5), batch_size=[]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_property_partition_matches_reference(rows, cp_size, data):
    """Random documents and CP sizes: each rank's layout is the reference's, ranks partition the stream."""
    length = data.draw(st.integers(1, 14))
    positions = [data.draw(segment_positions(length)) for _ in range(rows)]
    payloads = [
        {"input_ids": [10 + i for i in range(length)], "positions": p, "loss_mask": [1] * length}
        for p in positions
    ]
    out = Collator(return_labels=False, flatten=True, return_cu_seqlens=True)(
        [record(p, i) for i, p in enumerate(payloads)]
    )
    lengths = doc_lengths(out["cu_seqlens"].tolist())
    starts = out["cu_seqlens"].tolist()
    if data.draw(st.booleans()):  # documents from positions == 0 instead of cu_seqlens
        out = {k: v for k, v in out.items() if k not in ("cu_seqlens", "max_seqlen")}
    seen = []
    for rank in range(cp_size):
        shard = ContextParallelShard(cp_size, rank).shard(out)
        expected = reference_partition(lengths, cp_size, rank)
        got = list(zip(shard["input_ids"].tolist(), shard["cp_padding_mask"].tolist(), strict=True))
        want = [(int(out["input_ids"][starts[d] + o]) if real else 0, not real) for d, o, real in expected]
        assert got == want
        seen += [(d, o) for d, o, real in expected if real]
        index = cp_partition_index(shard["cu_seqlens_padded"], cp_size, rank).tolist()
        assert index == [int(shard["cu_seqlens_padded"][d]) + o for d, o, _ in expected]
    assert sorted(seen) == sorted((d, o) for d, n in enumerate(lengths) for o in range(n))


def test_in_a_chain_the_shard_gives_what_shard_gives():
    # Its declared outputs were assembled whether written or not: without labels no count, and per-row
    # fields dropped, raised KeyError ('num_valid_tokens', 'adv', 'score').
    from zephon_collate import Collator, FloatField
    from zephon_collate.transforms.context_parallel import ContextParallelShard

    rows = [{"input_ids": [5, 6, 7, 8], "positions": [0, 1, 0, 1], "adv": 0.5, "score": 3}]
    for options in (
        {},
        {"return_labels": True, "float_fields": [FloatField("adv", "sequence")]},
        {"extra_fields": ["score"]},
    ):
        chained = Collator(transforms=[ContextParallelShard(2, 0)], **options)
        want = ContextParallelShard(2, 0).shard(Collator(**options)(rows))
        for got in (chained(rows), chained.finish(chained.stack(rows))):
            assert sorted(got) == sorted(want), options
            for key, value in want.items():
                assert (
                    (value == got[key])
                    if not isinstance(value, torch.Tensor)
                    else torch.equal(value, torch.as_tensor(got[key]))
                ), (options, key)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_a_transformers_batch_is_sharded_on_its_shifted_labels(cp_size):
    """for_transformers' labels are the tokens (the model shifts): the docs' recipe shards shift_labels."""
    import torch.nn.functional as F

    examples = [{"input_ids": list(range(1, 8))}, {"input_ids": list(range(20, 25))}, {"input_ids": [30, 31]}]
    batch = dict(Collator.for_transformers(padding_free=True)(examples))
    batch["shift_labels"] = F.pad(batch.pop("labels")[:, 1:], (0, 1), value=-100)
    assert batch["shift_labels"].tolist() == [[2, 3, 4, 5, 6, 7, -100, 21, 22, 23, 24, -100, 31, -100]]
    shards = [
        ContextParallelShard(cp_size, rank, labels_key="shift_labels", positions_key="position_ids").shard(
            batch
        )
        for rank in range(cp_size)
    ]
    for shard in shards:  # each place's target is its own document's next token, on every rank
        for token, target in zip(shard["input_ids"].tolist(), shard["shift_labels"].tolist(), strict=True):
            assert target == -100 or target == token + 1
    assert (
        gather_context_parallel(shards)["shift_labels"].tolist() == batch["shift_labels"].reshape(-1).tolist()
    )
    assert sum(int(shard["num_valid_tokens"]) for shard in shards) == 11


def test_a_post_training_batch_is_refused_by_name():
    """Its labels are read through logits_index, places in the unsharded row: a shard cannot keep them."""
    rollouts = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
        {"input_ids": [5, 6], "completion_mask": [0, 1]},
    ]
    batch = dict(Collator.for_rollouts(padding_free=True)(rollouts))
    shard = ContextParallelShard(2, 0, positions_key="position_ids")
    with pytest.raises(ValueError, match=r"ContextParallelShard: the batch carries 'logits_index'.*shifted"):
        shard.shard(batch)
    keys = ContextParallelShard(2, 0, positions_key="position_ids", keys=["input_ids", "labels"])
    with pytest.raises(ValueError, match=r"the batch carries 'logits_index'"):  # in a chain too
        Collator.for_rollouts(padding_free=True, transforms=[keys])(rollouts)
    del batch["logits_index"], batch["labels"]  # what is left shards as before
    assert shard.shard(batch)["input_ids"].tolist() == [1, 4, 5, 0]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_gathered_model_outputs_drop_the_padding_by_their_boundaries(cp_size):
    # A model's outputs carry no cp_padding_mask; the real boundaries beside the padded ones say which
    # tokens were added, exactly as the mask does.
    out = Collator(flatten=True, **OPTIONS)(records())
    shards = [ContextParallelShard(cp_size, rank).shard(out) for rank in range(cp_size)]
    losses = [
        {
            "loss": s["input_ids"].double() * 0.5,
            "cu_seqlens": s["cu_seqlens"],
            "cu_seqlens_padded": s["cu_seqlens_padded"],
        }
        for s in shards
    ]
    assert gather_context_parallel(losses)["loss"].tolist() == (out["input_ids"].double() * 0.5).tolist()
    masked = gather_context_parallel(
        [{**loss, "cp_padding_mask": s["cp_padding_mask"]} for loss, s in zip(losses, shards, strict=True)]
    )
    assert masked["loss"].tolist() == (out["input_ids"].double() * 0.5).tolist()


def test_gathering_too_few_shards_or_unknown_padding_is_refused():
    td = TensorDict(
        input_ids=torch.tensor([11, 12, 13, 14, 15, 21, 22, 23]),
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
        batch_size=[],
    )
    shards = [ContextParallelShard(3, rank)(td) for rank in range(3)]  # 12 padded tokens, 4 a rank
    with pytest.raises(
        ValueError,
        match=r"2 shards of a stream of 12 padded tokens should hold 6 tokens each, but shard 0's fields hold \[4\]: give every CP rank's shard",
    ):
        gather_context_parallel(shards[:2])
    with pytest.raises(ValueError, match=r"shard 1 lacks 'input_ids' of 4 tokens"):
        gather_context_parallel([shards[0], shards[1].exclude("input_ids"), shards[2]])
    with pytest.raises(ValueError, match=r"shard 0 lacks 'cu_seqlens_padded'"):
        gather_context_parallel([{"loss": torch.zeros(3)}])
    bare = [{"loss": s["input_ids"], "cu_seqlens_padded": s["cu_seqlens_padded"]} for s in shards]
    with pytest.raises(ValueError, match=r"neither 'cp_padding_mask' nor 'cu_seqlens'.*drop_padding=False"):
        gather_context_parallel(bare)
    padded = gather_context_parallel(bare, drop_padding=False)["loss"]
    assert padded.tolist() == [11, 12, 13, 14, 15, 0, 21, 22, 23, 0, 0, 0]
