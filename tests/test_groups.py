"""Groups the packer never separates, records' own segments kept, float fields packed.

Hand-worked rows for pairs and GRPO groups, a hypothesis property over strategies, buffer sizes,
overflow modes and lengths (every group contiguous and in order, in one row whenever it fits), and
the packer's state resumed in the middle of a group.
"""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FlatPacker, FloatField, PackedStream, SampleBatch, pack_flat
from zephon_collate.packing.rows import row_segments
from zephon_collate.types import SampleMeta, SampleRecord

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rec(i: int, tokens: list[int], **fields) -> SampleRecord:
    return SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": tokens, **fields})


def ids(row: SampleRecord) -> list[int]:
    return row.payload["input_ids"].tolist()


def segments(row: SampleRecord) -> list[tuple[int, int, int, int]]:
    return [(s.sample_id[2], s.side, s.start, s.length) for s in row_segments(row)]


def pairs() -> list[SampleRecord]:
    """Three pairs, chosen then rejected, keyed by "pair": lengths (3, 2), (1, 4), (5, 1)."""
    lengths = [(3, 2), (1, 4), (5, 1)]
    records = []
    for p, (c, r) in enumerate(lengths):
        records.append(rec(2 * p, [10 * p + 1] * c, pair=p))
        records.append(rec(2 * p + 1, [10 * p + 2] * r, pair=p))
    return records


def test_best_fit_keeps_each_pair_in_one_row_chosen_first():
    ungrouped = pack_flat(pairs(), 6, pad_token_id=0, strategy="best_fit")
    assert segments(ungrouped[0]) == [(4, 0, 0, 5), (2, 0, 5, 1)]  # two pairs mixed, one split
    rows = pack_flat(pairs(), 6, pad_token_id=0, strategy="best_fit", group_key="pair")
    assert [ids(r) for r in rows] == [[21, 21, 21, 21, 21, 22], [1, 1, 1, 2, 2, 0], [11, 12, 12, 12, 12, 0]]
    assert [segments(r) for r in rows] == [
        [(4, 0, 0, 5), (5, 1, 5, 1)],
        [(0, 0, 0, 3), (1, 1, 3, 2)],
        [(2, 0, 0, 1), (3, 1, 1, 4)],
    ]
    greedy = pack_flat(pairs(), 6, pad_token_id=0, group_key="pair")
    assert [segments(r) for r in greedy] == [segments(r) for r in (rows[1], rows[2], rows[0])]
    assert greedy[0].payload["positions"].tolist() == [0, 1, 2, 0, 1, 0]


def test_a_pair_in_one_record_stays_two_segments():
    """Positions that restart inside a record are its segments: kept, recorded, and found by to_training."""
    pair = rec(0, [5, 6, 7, 5, 6, 8, 9], positions=[0, 1, 2, 0, 1, 2, 3])
    rows = pack_flat([rec(1, [3, 3]), pair], 10, pad_token_id=0)
    assert rows[0].payload["positions"].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 0]
    assert segments(rows[0]) == [(1, 0, 0, 2), (0, 0, 2, 3), (0, 1, 5, 4)]
    out = SampleBatch(rows).to_training(return_cu_seqlens=True, flatten=True)
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 9, 10]
    with pytest.raises(ValueError, match=r"7 tokens, more than seq_len=5, in 2 segments.*overflow="):
        pack_flat([pair], 5, pad_token_id=0)  # cut, one side would be trained without the other
    split = pack_flat([pair], 5, pad_token_id=0, overflow="split")
    assert [r.payload["positions"].tolist() for r in split] == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert [segments(r) for r in split] == [[(0, 0, 0, 3), (0, 1, 3, 2)], [(0, 1, 0, 2)]]
    with pytest.raises(ValueError, match="'positions' has 2 entries for 3 tokens"):
        pack_flat([rec(0, [1, 2, 3], positions=[0, 1])], 4, pad_token_id=0)


def test_a_records_own_positions_of_one_segment_are_kept_as_given():
    """Positions with gaps (a document trimmed inside, RoPE offsets) are kept, as the Collator keeps them;
    a split starts each piece's numbering again, as for every split document."""
    gapped = rec(0, [5, 6, 7, 8, 9], positions=[0, 1, 5, 6, 7])
    rows = pack_flat([gapped, rec(1, [3, 3])], 8, pad_token_id=0)
    assert rows[0].payload["positions"].tolist() == [0, 1, 5, 6, 7, 0, 1, 0]
    assert Collator()([gapped.payload])["positions"].tolist() == [[0, 1, 5, 6, 7]]
    split = pack_flat([gapped], 3, pad_token_id=0)  # one segment: split as any document of one
    assert [r.payload["positions"].tolist() for r in split] == [[0, 1, 2], [0, 1, 0]]


def test_a_group_longer_than_a_row_follows_overflow():
    group = [rec(0, [1] * 4, g="a"), rec(1, [2] * 3, g="a"), rec(2, [3] * 2, g="a"), rec(3, [4], g="b")]
    with pytest.raises(
        ValueError, match=r"record 0 .* starts a group of 3 records \(group key 'a'\) with 9 tokens"
    ):
        pack_flat(group, 6, pad_token_id=0, group_key="g")
    cut = pack_flat(group, 6, pad_token_id=0, group_key="g", overflow="truncate")
    assert [ids(r) for r in cut] == [[1, 1, 2, 2, 3, 3], [4, 0, 0, 0, 0, 0]]  # 4+3+2 -> 2+2+2
    spread = pack_flat(group, 6, pad_token_id=0, group_key="g", overflow="split", strategy="best_fit")
    assert [ids(r) for r in spread] == [[1, 1, 1, 1, 0, 0], [2, 2, 2, 3, 3, 4]]  # consecutive rows, whole
    assert [segments(r) for r in spread][1] == [(1, 1, 0, 3), (2, 2, 3, 2), (3, 0, 5, 1)]
    with pytest.raises(ValueError, match="more than seq_len=2 tokens can hold one each"):
        pack_flat(group, 2, pad_token_id=0, group_key="g", overflow="truncate")


def test_float_fields_are_packed_in_their_dtype_and_broadcast():
    docs = [
        rec(0, [1, 2], lp=[-0.5, -1.0], adv=0.25, pair=0),
        rec(1, [3, 4, 5], lp=[0.0, -2.0, -3.0], adv=-1.0, pair=0),
    ]
    specs = ["lp", FloatField("adv", "sequence", broadcast=True)]
    (row,) = pack_flat(docs, 6, pad_token_id=0, float_fields=specs, group_key="pair")
    assert list(row.payload) == ["input_ids", "lp", "adv", "positions"]
    assert row.payload["lp"].dtype == np.float32 and row.payload["adv"].dtype == np.float32
    assert row.payload["adv"].tolist() == [0.25, 0.25, -1.0, -1.0, -1.0, 0.0]
    assert row.payload["lp"].tolist() == [-0.5, -1.0, 0.0, -2.0, -3.0, 0.0]
    half = pack_flat(docs, 6, pad_token_id=0, float_fields=[FloatField("lp", dtype=torch.float64)])
    assert half[0].payload["lp"].dtype == np.float64
    with pytest.raises(ValueError, match="broadcast=True"):
        pack_flat(docs, 6, pad_token_id=0, float_fields=[FloatField("adv", "sequence")])
    with pytest.raises(ValueError, match=r"record 1 .*'lp' holds nan"):
        pack_flat([docs[0], rec(1, [3], lp=[float("nan")])], 6, pad_token_id=0, float_fields=["lp"])
    with pytest.raises(ValueError, match="lacks float field 'lp'"):
        pack_flat([docs[0], rec(1, [3])], 6, pad_token_id=0, float_fields=["lp"])


@pytest.mark.parametrize(
    ("records", "kwargs", "error", "match"),
    [
        ([rec(0, [1]), rec(1, [2])], {}, ValueError, "lacks the group key 'g'"),
        ([rec(0, [1], g=1.5)], {}, TypeError, "must be an int or a str"),
        ([rec(0, [1], g=[1])], {}, TypeError, "must be an int or a str"),
        ([SampleRecord(SampleMeta((0, 0, 0), 0, 0), [1, 2])], {}, ValueError, "an array payload"),
        ([rec(0, [1], g=1)], {"group_key": 3}, TypeError, "group_key must be"),
        ([rec(0, [1], g=1)], {"group_key": "lp", "float_fields": ["lp"]}, ValueError, "packed beside"),
    ],
)
def test_bad_group_keys(records, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_flat(records, 4, pad_token_id=0, **{"group_key": "g", **kwargs})


def test_group_keys_of_numpy_and_torch_scalars_and_runs():
    """Equal keys in a row form a group; a key seen again later starts another one."""
    docs = [
        rec(0, [1] * 3, g=np.int64(7)),
        rec(1, [2] * 3, g=torch.tensor(7)),
        rec(2, [3], g=8),
        rec(3, [4], g=7),
    ]
    rows = pack_flat(docs, 6, pad_token_id=0, group_key="g", strategy="best_fit")
    assert [ids(r) for r in rows] == [[1, 1, 1, 2, 2, 2], [3, 4, 0, 0, 0, 0]]


def test_the_packer_resumes_inside_a_group():
    docs = list(itertools.chain.from_iterable(
        [rec(3 * g + k, [g * 10 + k + 1] * (1 + (g + k) % 4), g=g, lp=[0.5] * (1 + (g + k) % 4)) for k in range(3)]
        for g in range(5)
    ))  # fmt: skip
    options = {
        "pad_token_id": 0,
        "group_key": "g",
        "float_fields": ["lp"],
        "strategy": "best_fit",
        "buffer_size": 4,
    }
    whole = list(FlatPacker(9, **options).pack(docs))
    for stop in range(1, len(docs)):
        packer = FlatPacker(9, **options)
        seen = []
        for row in packer.pack(iter(docs)):
            seen.append(row)
            if packer.records_consumed >= stop:
                break
        state = packer.state_dict()
        resumed = FlatPacker(9, **options)
        resumed.load_state_dict(state)
        rest = list(resumed.pack(docs[state["records_consumed"] :]))
        assert [ids(r) for r in seen + rest] == [ids(r) for r in whole]
        assert [segments(r) for r in seen + rest] == [segments(r) for r in whole]
    stream = PackedStream(docs, 9, **options)
    rows = iter(stream)
    next(rows)
    buffer = io.BytesIO()
    torch.save(stream.state_dict(), buffer)
    buffer.seek(0)
    again = PackedStream(docs, 9, **options)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert [ids(r) for r in again] == [ids(r) for r in rows]


GROUPS = st.lists(st.lists(st.integers(1, 10), min_size=1, max_size=4), min_size=1, max_size=10)


@FAST
@given(
    groups=GROUPS,
    seq_len=st.integers(4, 24),
    strategy=st.sampled_from(["greedy", "best_fit"]),
    buffer_size=st.integers(1, 8),
    overflow=st.sampled_from(["auto", "split", "truncate"]),
)
def test_no_strategy_separates_a_group(groups, seq_len, strategy, buffer_size, overflow):
    """Every group's segments are contiguous across the rows and in order; one row whenever it fits."""
    records, owner = [], {}
    for g, lengths in enumerate(groups):
        for k, n in enumerate(lengths):
            owner[len(records)] = (g, k)
            records.append(rec(len(records), [1000 * (g + 1) + 10 * k + t for t in range(n)], g=g))
    too_long = [g for g, lengths in enumerate(groups) if sum(lengths) > seq_len and len(lengths) > 1]
    options = {"pad_token_id": 0, "group_key": "g", "strategy": strategy, "buffer_size": buffer_size}
    if too_long and overflow == "auto":
        with pytest.raises(ValueError, match="starts a group"):
            pack_flat(records, seq_len, overflow=overflow, **options)
        return
    rows = pack_flat(records, seq_len, overflow=overflow, **options)
    assert all(row.payload["input_ids"].size == seq_len for row in rows)
    stream = [(r, s) for r, row in enumerate(rows) for s in row_segments(row)]
    order = [owner[s.sample_id[2]][0] for _, s in stream]
    runs = [g for g, _ in itertools.groupby(order)]
    assert len(runs) == len(set(runs))  # each group one contiguous run of segments
    for g, lengths in enumerate(groups):
        mine = [(r, s) for r, s in stream if owner[s.sample_id[2]][0] == g]
        members = [owner[s.sample_id[2]][1] for _, s in mine]
        assert members == sorted(members) and set(members) == set(range(len(lengths)))  # in order, all
        assert [s.side for _, s in mine] == sorted(s.side for _, s in mine)
        if sum(lengths) <= seq_len or overflow == "truncate":
            assert len({r for r, _ in mine}) == 1  # one row
        for r, s in mine:
            got = rows[r].payload["input_ids"][s.start : s.start + s.length]
            k = owner[s.sample_id[2]][1]
            assert (got // 10 == 100 * (g + 1) + k).all()  # the member's own tokens
        kept = {
            k: sum(s.length for _, s in mine if owner[s.sample_id[2]][1] == k) for k in range(len(lengths))
        }
        if overflow != "truncate" or sum(lengths) <= seq_len:
            assert kept == dict(enumerate(lengths))  # every token, once
        else:
            assert sum(kept.values()) == seq_len and all(0 < kept[k] <= n for k, n in enumerate(lengths))


def test_groups_do_not_apply_to_a_balanced_stream_and_corrupt_group_states_are_named():
    from zephon_collate import BalanceOptions, CostModel

    balance = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=16, micro_batches=1)
    with pytest.raises(ValueError, match="group_key do not apply with balance="):
        PackedStream(pairs(), 8, pad_token_id=0, group_key="pair", balance=balance)
    packer = FlatPacker(8, pad_token_id=0, group_key="pair")
    rows = packer.pack(iter(pairs()))
    next(rows)
    state = packer.state_dict()
    assert state["group"] is not None and state["group"]["key"] in (0, 1, 2)
    for corrupt, match in [
        ({"key": 1.5, "where": "x", "members": state["group"]["members"]}, "wrong type"),
        ({"key": 1, "where": "x", "members": []}, "non-empty list"),
        ({"key": 1}, "keys"),
        (
            {**state["group"], "members": [{**state["group"]["members"][0], "opens": 7}]},
            r"\['opens'\] must be",
        ),
        (
            {**state["group"], "members": [{**state["group"]["members"][0], "positions": [1, 2, 3]}]},
            "positions",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            FlatPacker(8, pad_token_id=0, group_key="pair").load_state_dict({**state, "group": corrupt})
