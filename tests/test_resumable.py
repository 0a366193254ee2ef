"""Resumable loading: a run resumed from a saved state sees exactly the batches an uninterrupted run sees next.

PackedStream (FlatPacker over a shard of a record source) with torch's DataLoader (num_workers=0), and
torchdata's StatefulDataLoader (workers, samplers); the states survive torch.save/torch.load(weights_only=True).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from zephon_collate import Collator, FlatPacker, SampleMeta, SampleRecord, pack_flat
from zephon_collate.packing.stream import PackedStream

SEQ_LEN = 16
PACKING = {
    "seq_len": SEQ_LEN,
    "pad_token_id": 0,
    "strategy": "best_fit",
    "buffer_size": 5,
    "overflow": "split",
}
COLLATE = Collator(return_labels=True, return_num_valid_tokens=True, return_cu_seqlens=True, flatten=True)


def documents(count: int = 40, seed: int = 0) -> list[SampleRecord]:
    """Documents of 2..30 tokens (some longer than a row, so split), with loss masks; now and then a flush."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        meta = SampleMeta((0, i % 3, i), lane_id=0, chunk_id=i // 10, chunk_offset=i % 10)
        if i % 17 == 16:
            records.append(
                SampleRecord(
                    SampleMeta(meta.sample_id, 0, meta.chunk_id, meta.chunk_offset, tags={"_flush": True}), {}
                )
            )
            continue
        length = int(rng.integers(2, 31))
        payload = {
            "input_ids": rng.integers(3, 100, length),
            "loss_mask": (np.arange(length) >= rng.integers(0, length)).astype(np.int8),
        }
        records.append(SampleRecord(meta, payload))
    return records


def saved(state):
    """The state after a round trip through torch.save/torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def summary(batches):
    """What a run saw: each batch's ids and tokens."""
    return [(batch["ids"], batch["input_ids"].tolist()) for batch in batches]


def rows(stream):
    return [(row.meta.sample_id, row.payload["input_ids"].tolist()) for row in stream]


def test_stream_equals_flat_packer():
    """One shard: the stream's rows are FlatPacker's over the whole source."""
    records = documents()
    expected = rows(FlatPacker(**PACKING).pack(records))
    assert rows(PackedStream(records, **PACKING)) == expected
    assert rows(PackedStream(lambda shard, shards, epoch: iter(records), **PACKING)) == expected


@pytest.mark.parametrize("source_kind", ["sequence", "callable"])
def test_dataloader_resume_at_every_batch(source_kind):
    """torch's DataLoader (num_workers=0): stop after k batches, save, resume: the rest is the same."""
    records = documents()
    source = records if source_kind == "sequence" else (lambda shard, shards, epoch: records[shard::shards])

    def loader(stream):
        return DataLoader(stream, batch_size=3, collate_fn=COLLATE)

    expected = summary(loader(PackedStream(source, **PACKING)))
    assert len(expected) >= 5
    for stop in range(len(expected) + 1):
        stream = PackedStream(source, **PACKING)
        batches = iter(loader(stream))
        seen = summary(next(batches) for _ in range(stop))
        state = saved(stream.state_dict())
        resumed = PackedStream(source, **PACKING)
        resumed.load_state_dict(state)
        assert seen + summary(loader(resumed)) == expected, f"resumed after {stop} batches"
        # the next epoch starts over
        assert summary(loader(resumed)) == expected


def test_state_content_and_cursor_keys():
    """The state holds the packer's state (arrays as tensors, dtypes kept) and the last record's cursor key."""
    records = documents()
    stream = PackedStream(records, **PACKING)
    assert stream.state_dict()["packer"] is None  # before any row
    iterator = iter(stream)
    next(iterator)
    state = stream.state_dict()
    consumed = state["packer"]["records_consumed"]
    assert state["last_cursor"] == records[consumed - 1].meta.as_cursor_key()
    pieces = [piece for piece in state["packer"]["pending"]]
    assert pieces and all(isinstance(piece["tokens"], torch.Tensor) for piece in pieces)
    assert {piece["fields"]["loss_mask"].dtype for piece in pieces} == {torch.int8}
    assert saved(state)["last_cursor"] == state["last_cursor"]
    # a loaded, unused state is what state_dict returns
    resumed = PackedStream(records, **PACKING)
    resumed.load_state_dict(saved(state))
    assert resumed.state_dict()["last_cursor"] == state["last_cursor"]


def test_ranks_partition_the_source():
    """Ranks read disjoint shards whose union is the whole source; each shard resumes on its own."""
    records = documents(30)
    seen = set()
    for rank in range(2):
        stream = PackedStream(records, rank=rank, world_size=2, **PACKING)
        shard_rows = list(stream)
        for row in shard_rows:
            seen.update(ref.cursor.sample_id for ref in row.meta.contributors)
        assert rows(shard_rows) == rows(FlatPacker(**PACKING).pack(records[rank::2]))
        iterator = iter(stream)
        head = [next(iterator) for _ in range(2)]
        resumed = PackedStream(records, rank=rank, world_size=2, **PACKING)
        resumed.load_state_dict(saved(stream.state_dict()))
        assert rows(head) + rows(resumed) == rows(shard_rows)
    assert seen == {r.meta.sample_id for r in records if not r.meta.is_sentinel}


def test_changed_source_or_shard_is_refused():
    records = documents()
    stream = PackedStream(records, **PACKING)
    iterator = iter(stream)
    next(iterator)
    state = saved(stream.state_dict())
    consumed = state["packer"]["records_consumed"]
    shifted = [records[1], records[0], *records[2:]] if consumed <= 2 else records[1:]
    resumed = PackedStream(shifted, **PACKING)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="source changed"):
        next(iter(resumed))
    short = PackedStream(lambda shard, shards, epoch: records[: consumed - 1], **PACKING)
    short.load_state_dict(state)
    with pytest.raises(ValueError, match="source changed"):
        next(iter(short))
    other = PackedStream(records, rank=1, world_size=2, **PACKING)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="shard 0 of 1"):
        next(iter(other))
    with pytest.raises(ValueError, match="other options"):
        different = PackedStream(records, **{**PACKING, "buffer_size": 6})
        different.load_state_dict(state)
        next(iter(different))


def test_bad_arguments():
    with pytest.raises(TypeError, match="source"):
        PackedStream(42, **PACKING)
    with pytest.raises(ValueError, match="both"):
        PackedStream([], rank=0, **PACKING)
    with pytest.raises(ValueError, match="rank"):
        PackedStream([], rank=2, world_size=2, **PACKING)
    with pytest.raises(ValueError, match="seq_len"):
        PackedStream([], seq_len=0, pad_token_id=0)
    with pytest.raises(ValueError, match="version"):
        PackedStream([], **PACKING).load_state_dict({"version": 0})
    with pytest.raises(TypeError, match="dict"):
        PackedStream([], **PACKING).load_state_dict([])


def test_epoch_reaches_a_callable_source():
    calls = []

    def source(shard, shards, epoch):
        calls.append(epoch)
        return documents(6, seed=epoch)

    stream = PackedStream(source, **PACKING)
    stream.set_epoch(3)
    first = rows(stream)
    assert calls == [3] and first == rows(FlatPacker(**PACKING).pack(documents(6, seed=3)))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_plain_dataloader_with_workers_refuses_to_save(num_workers):
    """A plain DataLoader iterates copies of the stream in its workers: the main process cannot see their
    progress, so state_dict() refuses (naming StatefulDataLoader) instead of saving the start state,
    which would replay every batch already seen; a resume from a saved start names the way out too."""
    stream = PackedStream(documents(), **PACKING)
    start = stream.state_dict()  # before any iteration: the start, legitimately
    assert start["packer"] is None and start["last_cursor"] is None
    loader = DataLoader(stream, batch_size=2, collate_fn=COLLATE, num_workers=num_workers)
    batches = iter(loader)
    next(batches)
    with pytest.raises(ValueError, match=r"iterated in DataLoader worker processes.*StatefulDataLoader"):
        stream.state_dict()
    del batches
    resumed = PackedStream(documents(), **PACKING)
    resumed.load_state_dict(start)
    if num_workers == 2:  # the start was saved as shard 0 of 1, the workers are shards of 2
        with pytest.raises(ValueError, match=r"shard 0 of 1 .*StatefulDataLoader"):
            next(iter(DataLoader(resumed, batch_size=2, collate_fn=COLLATE, num_workers=num_workers)))


# --- torchdata's StatefulDataLoader (pip install "torchdata>=0.11"; skipped without it) -------------

# torchdata 0.11 calls torch.set_vital, deprecated in recent torch: harmless.
no_vital_warning = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@no_vital_warning
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_packed_stream(num_workers):
    """StatefulDataLoader saves each worker's stream state; a resumed loader yields the same next batches."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", exc_type=ImportError)
    records = documents(60)

    def loader():
        return stateful.StatefulDataLoader(
            PackedStream(records, **PACKING), batch_size=2, collate_fn=COLLATE, num_workers=num_workers
        )

    expected = summary(loader())
    assert len(expected) >= 6
    for stop in (0, 1, 3, len(expected) - 1):
        first = loader()
        batches = iter(first)
        seen = summary(next(batches) for _ in range(stop))
        state = saved(first.state_dict())
        del batches
        resumed = loader()
        resumed.load_state_dict(state)
        assert seen + summary(resumed) == expected, f"resumed after {stop} batches"


@no_vital_warning
def test_stateful_dataloader_with_distributed_sampler():
    """Map-style packed rows, torchdata's StatefulDistributedSampler (rank 1 of 2, shuffled), mid-epoch resume."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", exc_type=ImportError)
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    packed = pack_flat(documents(60), **PACKING)

    def loader():
        sampler = StatefulDistributedSampler(packed, num_replicas=2, rank=1, shuffle=True, seed=5)
        return stateful.StatefulDataLoader(packed, batch_size=2, sampler=sampler, collate_fn=COLLATE)

    expected = summary(loader())
    first = loader()
    batches = iter(first)
    seen = summary(next(batches) for _ in range(3))
    resumed = loader()
    resumed.load_state_dict(saved(first.state_dict()))
    assert seen + summary(resumed) == expected


def test_a_source_of_records_and_plain_payloads_resumes_after_either():
    """The cursor is the last item's: none after a plain payload, so a resume there checks none."""
    source = [SampleRecord(SampleMeta((0, 0, 100), 0, 0, 0), {"input_ids": [5, 5, 5]})]
    source += [{"input_ids": [i + 1] * 3} for i in range(1, 8)]
    full = [row.payload["input_ids"].tolist() for row in PackedStream(source, 4, pad_token_id=0)]
    for stop in range(len(full) + 1):
        stream = PackedStream(source, 4, pad_token_id=0)
        rows = iter(stream)
        head = [next(rows).payload["input_ids"].tolist() for _ in range(stop)]
        state = stream.state_dict()
        resumed = PackedStream(source, 4, pad_token_id=0)
        resumed.load_state_dict(state)
        assert head + [row.payload["input_ids"].tolist() for row in resumed] == full, stop
