"""Grain, for real: the packer and the balanced plan as Grain stages against the plain DataLoader, resumed
from Grain's JSON state at every step in a fresh process, with 0 and 2 worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

grain = pytest.importorskip("grain")

from engine_pipelines import (  # noqa: E402  (after the skip)
    COLLATOR,
    PACKERS,
    PADDED,
    balanced,
    build,
    digest,
    documents,
    packed,
    sampler,
)
from torch.utils.data import DataLoader  # noqa: E402

from zephon_collate import Collator, PackedStream, SampleMeta, SampleRecord  # noqa: E402
from zephon_collate.engines.grain import BalancedIterDataset, PackIterDataset, as_torch  # noqa: E402
from zephon_collate.engines.state import from_json, to_json  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _loader_packed(name: str, workers: int, docs=None) -> list:
    stream = PackedStream(docs or documents(), **PACKERS[name])
    return list(DataLoader(stream, batch_size=3, collate_fn=COLLATOR, num_workers=workers))


def _loader_balanced(rank: int, epochs: int = 1) -> list:
    docs, out = documents(), []
    plan = sampler(rank, docs)
    for epoch in range(epochs):
        plan.set_epoch(epoch)
        out += list(DataLoader(docs, batch_sampler=plan, collate_fn=PADDED))
    return out


def _digests(batches) -> list[str]:
    return [digest(batch) for batch in batches]


def _states_and_batches(dataset) -> tuple[list, list[str]]:
    """The JSON state before every step (and after the last), and the batches, of one run."""
    iterator = iter(dataset)
    states, batches = [json.loads(json.dumps(iterator.get_state()))], []
    for batch in iterator:
        batches.append(digest(batch))
        states.append(json.loads(json.dumps(iterator.get_state())))
    iterator.close()
    return states, batches


def _restarted(pipeline: str, workers: int, states: list, tmp_path: Path) -> list[list[str]]:
    """Each state restored in one fresh process; the batches after each."""
    states_path, out_path = tmp_path / "states.json", tmp_path / "rests.json"
    states_path.write_text(json.dumps(states))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(TESTS / "engine_pipelines.py"), pipeline, str(workers)]
    subprocess.run([*command, str(states_path), str(out_path)], check=True, env=env, timeout=600)
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("name", sorted(PACKERS))
def test_packer_stage_equals_the_dataloader_key_for_key(name):
    assert _digests(packed(name, 0)) == _digests(_loader_packed(name, 0))


def test_packer_stage_in_two_grain_workers_equals_the_dataloader_with_two():
    # Each worker packs its own slice (documents w, w + 2, ...), as a DataLoader worker packs its shard.
    assert _digests(packed("greedy", 2)) == _digests(_loader_packed("greedy", 2))


@pytest.mark.parametrize("name", ["greedy", "best_fit"])
def test_numpy_from_two_grain_workers_then_as_torch_equals_the_dataloader(name):
    # The workers collate to NumPy, which Grain's shared memory carries; as_torch gives the tensors the
    # torch collator gives, dtypes included. Closed mid-epoch, the pipeline shuts down cleanly.
    ds = PackIterDataset(grain.MapDataset.source(documents()).to_iter_dataset(), **PACKERS[name])
    ds = ds.batch(3, batch_fn=Collator(return_labels=True, dtype=np.int64))
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)).map(as_torch)
    batches = list(ds)
    assert _digests(batches) == _digests(_loader_packed(name, 2))
    assert all(isinstance(batch["input_ids"], torch.Tensor) for batch in batches)
    iterator = iter(ds)
    assert digest(next(iterator)) == digest(batches[0])
    iterator.close()


def test_groups_are_not_split_across_workers():
    """A worker's slice takes every other record: consecutive group members would land in different rows,
    so group_key with several workers is refused, by Grain's stage and by PackedStream alike."""
    with pytest.raises(Exception, match=r"group_key keeps consecutive records together.*split each group"):
        list(packed("groups", 2))
    with pytest.raises(Exception, match=r"group_key keeps consecutive records together.*split each group"):
        _loader_packed("groups", 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_balanced_stage_equals_the_dataloader_with_the_balanced_sampler(rank):
    assert _digests(balanced(rank, 0, num_epochs=2)) == _digests(_loader_balanced(rank, epochs=2))


def test_balanced_stage_in_two_grain_workers_keeps_the_plan_order():
    assert _digests(balanced(1, 2)) == _digests(_loader_balanced(1))


@pytest.mark.parametrize("pipeline", ["packed:greedy", "packed:best_fit", "packed:groups", "balanced:0"])
def test_stop_at_every_step_and_restart_in_a_new_process(pipeline, tmp_path):
    states, batches = _states_and_batches(build(pipeline, 0))
    assert len(batches) >= 4
    rests = _restarted(pipeline, 0, states, tmp_path)
    assert rests == [batches[step:] for step in range(len(states))]


@pytest.mark.parametrize("pipeline", ["packed:best_fit", "balanced:1"])
def test_two_workers_stop_and_restart_in_a_new_process(pipeline, tmp_path):
    """Grain's multi-process state holds each worker's stage state; a few steps of a short epoch."""
    states, batches = _states_and_batches(build(pipeline, 2))
    picked = [0, 1, len(states) // 2, len(states) - 1]
    rests = _restarted(pipeline, 2, [states[i] for i in picked], tmp_path)
    assert rests == [batches[i:] for i in picked]


def test_the_packer_state_is_json_and_keeps_open_rows_exactly():
    docs = documents()
    iterator = iter(PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), **PACKERS["best_fit"]))
    next(iterator)
    state = iterator.get_state()
    packer = from_json(json.loads(json.dumps(state))["packer"])
    assert packer["pending"] or packer["ready"]  # rows still open or held back: the hard case
    assert json.loads(json.dumps(to_json(packer))) == json.loads(json.dumps(state["packer"]))


def test_every_document_exactly_once_across_ranks():
    docs = documents()
    seen = []
    for rank in range(2):  # torchtitan's sharding: each rank a slice of the documents
        shard = grain.MapDataset.source(docs)[rank::2].to_iter_dataset()
        for row in PackIterDataset(shard, **PACKERS["greedy"]):
            seen += [int(ref.cursor.sample_id[2]) for ref in row.meta.contributors]
    assert sorted(seen) == list(range(len(docs)))
    planned, dropped = [], set()
    for rank in range(2):
        planned += [doc.meta.sample_id[2] for batch in balanced_docs(rank) for doc in batch]
        dropped |= {index for plan in sampler(rank).plans() for index in plan.dropped}
    assert sorted(planned + sorted(dropped)) == list(range(len(docs)))  # the plan's tail is reported


def balanced_docs(rank: int) -> list:
    docs = documents()
    return list(BalancedIterDataset(grain.MapDataset.source(docs), sampler(rank, docs)))


def test_a_bad_document_is_named_in_the_main_process_and_from_a_worker():
    docs = documents(12)
    bad = SampleRecord(SampleMeta((0, 0, 5), 0, 0, 5), {"input_ids": [1.5, 2.0], "loss_mask": [0, 1]})
    docs[5] = bad
    for workers in (0, 2):
        with pytest.raises(TypeError, match=r"sample_id \(0, 0, 5\).*input_ids.*integer token ids") as raised:
            list(packed("greedy", workers, docs=docs))
        assert "Traceback" not in str(raised.value).splitlines()[0]


def test_plain_documents_are_named_and_numbered_by_their_index_in_the_source():
    """A worker reads every n-th document: a dict is still named (and its rows' ids numbered) by its own
    index in the source, in Grain's workers as in the DataLoader's."""
    docs = [{"input_ids": [i + 1] * 3} for i in range(10)]
    for workers in (0, 2):
        ds = PackIterDataset(grain.MapDataset.source(docs), seq_len=3, pad_token_id=0).batch(
            1, batch_fn=Collator()
        )
        if workers:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        batches = list(ds)
        assert sorted((batch["ids"][0], int(batch["input_ids"][0, 0])) for batch in batches) == [
            ((0, 0, i), i + 1) for i in range(10)
        ]
        loader = DataLoader(PackedStream(docs, seq_len=3, pad_token_id=0), collate_fn=Collator(),
                            num_workers=workers)  # fmt: skip
        assert sorted(batch["ids"][0] for batch in loader) == [(0, 0, i) for i in range(10)]
    docs[7] = {"input_ids": [3, -4, 5]}
    for workers in (0, 2):
        ds = PackIterDataset(grain.MapDataset.source(docs), seq_len=8, pad_token_id=0).batch(
            2, batch_fn=Collator()
        )
        with pytest.raises(
            ValueError, match=r"record 7 \(sample_id \(0, 0, 7\)\): field 'input_ids' token ids"
        ):
            list(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds)
        loader = DataLoader(PackedStream(docs, seq_len=8, pad_token_id=0), batch_size=2, collate_fn=Collator(),
                            num_workers=workers)  # fmt: skip
        with pytest.raises(ValueError, match=r"record 7 \(sample_id \(0, 0, 7\)\): field 'input_ids'"):
            list(loader)


def test_a_worker_that_dies_stops_the_run_instead_of_skipping():
    def dies(record):
        if record.meta.sample_id[2] == 7:
            os._exit(3)
        return record

    ds = grain.MapDataset.source(documents(12)).map(dies).to_iter_dataset()
    ds = PackIterDataset(ds, **PACKERS["greedy"]).batch(2, batch_fn=COLLATOR)
    with pytest.raises(RuntimeError, match="terminated unexpectedly"):
        list(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))


def test_options_are_checked_when_the_stage_is_built_not_in_a_worker():
    source = grain.MapDataset.source(documents(4))
    with pytest.raises(ValueError, match="strategy"):
        PackIterDataset(source, seq_len=8, pad_token_id=0, strategy="first_fit")
    with pytest.raises(ValueError, match="one length per document"):
        BalancedIterDataset(source, sampler(0))
    with pytest.raises(TypeError, match="BalancedBatchSampler"):
        BalancedIterDataset(source, [[0, 1]])


def test_num_epochs_counts_from_the_samplers_epoch():
    """A sampler already at epoch 2 with num_epochs=2 runs epochs 2 and 3, each the plan's own."""
    docs = documents()
    plan = sampler(0, docs)
    want = []
    for epoch in (2, 3):
        plan.set_epoch(epoch)
        want += [list(batch) for batch in plan]
    plan.set_epoch(2)
    got = list(BalancedIterDataset(docs, plan, num_epochs=2))
    assert [[doc.meta.sample_id for doc in batch] for batch in got] == [
        [docs[i].meta.sample_id for i in batch] for batch in want
    ]


def test_a_parent_of_arrow_batches_is_refused():
    """Grain resumes a stage from its parent's state, past a whole batch of columns: refused by name."""
    pa = pytest.importorskip("pyarrow")
    grain = pytest.importorskip("grain")
    tables = [pa.table({"input_ids": [[1, 2, 3], [4, 5]]})]
    with pytest.raises(ValueError, match=r"PackIterDataset: the parent yields a batch of columns"):
        list(PackIterDataset(grain.MapDataset.source(tables), seq_len=4, pad_token_id=0))


def test_json_state_keeps_every_array_shape_and_dtype():
    for value in (
        np.array(5),
        np.array(2.5, np.float32),
        np.arange(6).reshape(2, 3)[:, ::2],
        np.zeros((0, 3)),
    ):
        restored = from_json(json.loads(json.dumps(to_json({"a": value}))))["a"]
        assert restored.shape == value.shape and restored.dtype == value.dtype
        assert np.array_equal(restored, value)


def test_an_older_state_restored_into_the_same_iterator_resumes_from_it():
    """The iterator's own later epoch never wins over the state it is given (epoch 1 was skipped)."""
    from zephon_collate import BalancedBatchSampler, BalanceOptions, CostModel

    lengths = [8, 1, 6, 2, 5, 3, 4, 4, 7, 1, 3, 2]
    options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=8, micro_batches=2)
    sampler = BalancedBatchSampler(lengths, options, num_replicas=1, rank=0, seed=0)
    dataset = BalancedIterDataset(list(range(len(lengths))), sampler, num_epochs=4)
    full, epochs, it = [], [], iter(dataset)
    for batch in it:
        full.append(batch)
        epochs.append(it.get_state()["sampler"]["epoch"])
    end_of_first = epochs.index(1) - 1
    it = iter(dataset)
    for _ in range(end_of_first + 1):
        next(it)
    saved = json.dumps(it.get_state())
    for _ in range(epochs.index(2) + 1 - end_of_first):  # on into epoch 2
        next(it)
    it.set_state(json.loads(saved))
    assert list(it) == full[end_of_first + 1 :]
    finished = BalancedIterDataset(list(range(len(lengths))), sampler, num_epochs=1)
    one = iter(finished)
    for _ in range(end_of_first + 1):
        next(one)
    done = one.get_state()
    restored = iter(finished)
    restored.set_state(done)
    assert list(restored) == []  # its state after a pass that handed out nothing stands at the end too
    after = iter(finished)
    after.set_state(restored.get_state())
    assert list(after) == []


@pytest.mark.parametrize(
    "sl, sequential", [(None, False), (slice(1, None, 3), False), (slice(1, None, 3), True)]
)
def test_a_sparse_and_sliced_map_dataset_resumes_as_grains_own_reader(sl, sequential):
    """A sparse (filtered) MapDataset, whole or as a worker's slice: the rows and every state equal those
    over Grain's own reader (to_iter_dataset, no read-ahead), and each state resumes the rest."""
    docs = [{"input_ids": [i + 1] * (1 + i % 4)} for i in range(30)]

    def source():
        return grain.MapDataset.source(docs).filter(lambda doc: doc["input_ids"][0] % 5 != 0)

    def run(parent):
        stage = PackIterDataset(parent, seq_len=7, pad_token_id=0, strategy="best_fit", buffer_size=3)
        if sl is not None:
            stage.set_slice(sl, sequential)
        iterator = iter(stage)
        rows, states = [], [iterator.get_state()]
        for row in iterator:
            rows.append(row.payload["input_ids"].tolist())
            states.append(iterator.get_state())
        return rows, states

    ours = run(source())
    grains = run(source().to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    assert ours[0] == grains[0] and len(ours[0]) > 3
    assert [state["parent"] for state in ours[1]] == [state["parent"] for state in grains[1]]
    for step, state in enumerate(ours[1]):  # a fresh stage resumed from each state gives the rest
        stage = PackIterDataset(source(), seq_len=7, pad_token_id=0, strategy="best_fit", buffer_size=3)
        if sl is not None:
            stage.set_slice(sl, sequential)
        resumed = iter(stage)
        resumed.set_state(json.loads(json.dumps(state)))
        assert [row.payload["input_ids"].tolist() for row in resumed] == ours[0][step:]
    with pytest.raises(IndexError, match="Checkpoint `next_index` 99 is out of range"):
        resumed.set_state({**state, "parent": {"next_index": 99}})


def test_as_torch_shares_each_arrays_memory_and_copies_a_read_only_one():
    writable, frozen = np.arange(6).reshape(2, 3), np.arange(3)
    frozen.flags.writeable = False
    batch = as_torch({"input_ids": writable, "labels": frozen, "ids": [(0, 0, 0)]})
    assert batch["input_ids"].data_ptr() == writable.ctypes.data and batch["ids"] == [(0, 0, 0)]
    assert batch["labels"].data_ptr() != frozen.ctypes.data and batch["labels"].tolist() == [0, 1, 2]


def test_in_a_grain_worker_the_collator_sends_one_narrow_buffer_and_the_same_batch(monkeypatch):
    import pickle

    from grain._src.python.dataset.transformations import process_prefetch

    from zephon_collate.collate.transfer import WireOutputs

    rows = list(PackIterDataset(grain.MapDataset.source(documents()), seq_len=16, pad_token_id=0))[:3]
    plain = COLLATOR(rows)
    assert type(plain) is dict  # the main process: Grain's worker flag is off
    monkeypatch.setattr(process_prefetch, "_is_in_worker_process", True)
    sent = COLLATOR(rows)
    assert type(sent) is WireOutputs  # as in a DataLoader worker: the tensors pickle as one buffer
    arrived = pickle.loads(pickle.dumps(sent))
    assert type(arrived) is dict and list(arrived) == list(plain)
    assert digest(arrived) == digest(plain)
    assert all(arrived[k].dtype == v.dtype for k, v in plain.items() if isinstance(v, torch.Tensor))


def test_torch_batches_from_two_grain_workers_equal_the_dataloader_and_close_mid_epoch():
    ds = PackIterDataset(grain.MapDataset.source(documents()), **PACKERS["greedy"])
    ds = ds.batch(3, batch_fn=COLLATOR).mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    batches = list(ds)
    assert _digests(batches) == _digests(_loader_packed("greedy", 2))
    assert all(type(batch) is dict for batch in batches)  # WireOutputs arrives as a plain dict
    iterator = iter(ds)
    assert digest(next(iterator)) == digest(batches[0])
    iterator.close()  # nothing in flight refers to a worker's file descriptors
