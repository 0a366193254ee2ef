"""Ray Data, for real, on one local cluster for the module: the Arrow collate, packing as map_batches,
streaming_split across ranks and a rank's balanced plan, against the plain DataLoader."""

from __future__ import annotations

import itertools
import json
import os
import threading

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")

from engine_pipelines import BALANCE, COLLATOR, PADDED, digest  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from zephon_collate import BalancedBatchSampler, Collator, pack_columns, pack_flat  # noqa: E402
from zephon_collate.engines.ray import ArrowCollateFn, PackBatches, balanced_micro_batches  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # batches in the table's order: comparable, replayable
    context.enable_progress_bars = False
    yield
    ray.shutdown()


def _table(count: int = 120, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 11, count)
    return pa.table(
        {
            "id": [f"doc-{i}" for i in range(count)],
            "input_ids": [[i + 1] * int(n) for i, n in enumerate(lengths)],
            "loss_mask": [[0] + [1] * (int(n) - 1) for n in lengths],
        }
    )


def _documents(table):
    return table.drop_columns(["id"])


def _digests(batches) -> list[str]:
    return [digest(batch) for batch in batches]


def test_arrow_collate_equals_the_collator_on_rows_and_on_dicts_of_arrays():
    table = _documents(_table(10))
    arrow = ArrowCollateFn(PADDED)(table)
    rows = PADDED(table.to_pylist())
    numpy = PADDED([{name: np.asarray(value) for name, value in row.items()} for row in table.to_pylist()])
    assert digest(arrow) == digest(rows) == digest(numpy)


def test_iter_torch_batches_equals_the_dataloader_key_for_key():
    table = _documents(_table())
    ours = ray.data.from_arrow(table).iter_torch_batches(batch_size=8, collate_fn=ArrowCollateFn(PADDED))
    plain = DataLoader(table.to_pylist(), batch_size=8, collate_fn=PADDED)
    assert _digests(ours) == _digests(plain)


def _packed(table, batch_size: int = 40, **options):
    stage = {"seq_len": 32, "pad_token_id": 0, **options}
    return ray.data.from_arrow(table).map_batches(
        PackBatches, fn_constructor_kwargs=stage, batch_format="pyarrow", batch_size=batch_size
    )


def test_pack_stage_rows_are_pack_columns_rows_of_each_batch_and_collate_as_the_dataloader():
    table = _documents(_table())
    expected = []
    for start in range(0, len(table), 40):  # a row never holds documents of two Ray batches
        rows = pack_columns(table.slice(start, 40), 32, pad_token_id=0, strategy="best_fit")
        expected += [rows.__getitems__([r])[0] for r in range(len(rows))]
    plain = DataLoader(expected, batch_size=3, collate_fn=COLLATOR)
    ours = _packed(table, strategy="best_fit").iter_torch_batches(
        batch_size=3, collate_fn=ArrowCollateFn(COLLATOR)
    )
    assert _digests(ours) == _digests(plain)


def test_pack_stage_keeps_each_group_row_whole():
    # One Ray row per group (a prompt's completions): a group never straddles two batches.
    rng = np.random.default_rng(1)
    groups = [[[g * 10 + m + 1] * int(rng.integers(2, 8)) for m in range(1 + g % 3)] for g in range(30)]
    table = pa.table({"group": list(range(30)), "input_ids": groups})
    members = [{"group": g, "input_ids": seq} for g, group in enumerate(groups) for seq in group]
    expected = []
    for start in range(0, 30, 10):
        part = [m for m in members if start <= m["group"] < start + 10]
        expected += [row.payload for row in pack_flat(part, 32, pad_token_id=0, group_key="group")]
    got = _packed(table, batch_size=10, group_key="group").take_all()
    for name in ("input_ids", "positions"):
        assert [np.asarray(row[name]).tolist() for row in got] == [row[name].tolist() for row in expected]
    rows_of: dict[int, set[int]] = {}  # every group's members in one row
    for place, row in enumerate(got):
        for token in row["input_ids"]:
            if token:
                rows_of.setdefault((int(token) - 1) // 10, set()).add(place)
    assert sorted(rows_of) == list(range(30)) and all(len(rows) == 1 for rows in rows_of.values())
    # each row is its own group, also where consecutive rows hold the same key (two groups of 10 tokens)
    same = pa.table({"group": [2, 2], "input_ids": [[[1] * 5] * 2, [[2] * 5] * 2]})
    rows = PackBatches(seq_len=16, pad_token_id=0, group_key="group")(same)
    assert [sorted(set(row) - {0}) for row in rows.column("input_ids").to_pylist()] == [[1], [2]]


KINDS = (("input_ids", np.int32), ("loss_mask", np.uint8), ("tag", np.int16))


def test_a_group_rows_fields_keep_their_dtypes_as_pack_flat_keeps_them():
    def column(rows: list, kind: object) -> object:
        return pa.array(rows, type=pa.list_(pa.list_(kind)))

    table = pa.table(  # a slice: its list columns start inside their buffers
        {
            "g": [9, 0, 1],
            "input_ids": column([[[1]], [[11, 12, 13], [21, 22]], [[31]]], pa.int32()),
            "loss_mask": column([[[1]], [[0, 1, 1], [0, 1]], [[1]]], pa.uint8()),
            "tag": column([[[1]], [[7, 7, 7], [9, 9]], [[5]]], pa.int16()),
        }
    ).slice(1, 2)
    members = [
        {"g": g, **{name: np.asarray(table.column(name)[g].as_py()[m], kind) for name, kind in KINDS}}
        for g, m in ((0, 0), (0, 1), (1, 0))
    ]
    rows = PackBatches(seq_len=8, pad_token_id=0, group_key="g")(table)
    expected = pack_flat(members, 8, pad_token_id=0, group_key="g")
    for name, _ in KINDS:
        assert rows.column(name).type.value_type == pa.from_numpy_dtype(expected[0].payload[name].dtype)
        assert rows.column(name).to_pylist() == [row.payload[name].tolist() for row in expected]
    assert [str(rows.column(name).type.value_type) for name in ("loss_mask", "tag")] == ["uint8", "int16"]


def test_streaming_split_gives_every_document_exactly_once_across_ranks():
    table = _documents(_table())
    splits = _packed(table).streaming_split(2, equal=False)
    seen: list[list[int]] = [[], []]

    def consume(rank: int) -> None:  # streaming_split's ranks read at the same time
        for row in splits[rank].iter_rows():
            seen[rank] += [int(token) for token in row["input_ids"] if token]

    threads = [threading.Thread(target=consume, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    counts = np.bincount(seen[0] + seen[1], minlength=len(table) + 1)[1:]
    assert counts.tolist() == [len(ids) for ids in table.column("input_ids").to_pylist()]


def _sampler(table, rank: int) -> BalancedBatchSampler:
    lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
    return BalancedBatchSampler(lengths, BALANCE, num_replicas=2, rank=rank, seed=3)


@pytest.mark.parametrize("rank", [0, 1])
def test_balanced_micro_batches_equal_the_dataloader_with_the_balanced_sampler(rank):
    table = _documents(_table())
    plain = DataLoader(table.to_pylist(), batch_sampler=_sampler(table, rank), collate_fn=PADDED)
    micro = balanced_micro_batches(table, _sampler(table, rank))
    assert micro.context.execution_options.preserve_order  # the plan's order, whatever the global setting
    ours = micro.iter_torch_batches(batch_size=1, collate_fn=ArrowCollateFn(PADDED))
    assert _digests(ours) == _digests(plain)


def test_balanced_plan_gives_every_document_once_across_ranks_and_reports_its_tail():
    table = _documents(_table())
    planned = [i for rank in range(2) for batch in _sampler(table, rank) for i in batch]
    dropped = {i for plan in _sampler(table, 0).plans() for i in plan.dropped}
    assert sorted(planned + sorted(dropped)) == list(range(len(table)))


def test_balanced_plan_resumes_at_every_step_from_its_saved_state():
    """Ray saves no iterator position; the sampler's state (JSON) rebuilds the rest of the plan."""
    table = _documents(_table(60))
    collate = ArrowCollateFn(PADDED)
    full = _digests(
        balanced_micro_batches(table, _sampler(table, 1)).iter_torch_batches(batch_size=1, collate_fn=collate)
    )
    assert len(full) >= 4
    for step in range(len(full) + 1):
        running = _sampler(table, 1)
        for _ in itertools.islice(iter(running), step):
            pass
        state = json.loads(json.dumps(running.state_dict()))
        resumed = _sampler(table, 1)
        resumed.load_state_dict(state)
        rest = balanced_micro_batches(table, resumed).iter_torch_batches(batch_size=1, collate_fn=collate)
        assert _digests(rest) == full[step:], step


def test_packed_rows_replay_exactly_by_skipping_the_steps_done():
    """With preserve_order the pipeline is deterministic: a restart skips the batches already trained."""
    table = _documents(_table())
    batches = _digests(_packed(table).iter_torch_batches(batch_size=4, collate_fn=ArrowCollateFn(COLLATOR)))
    replay = _packed(table).iter_torch_batches(batch_size=4, collate_fn=ArrowCollateFn(COLLATOR))
    assert _digests(itertools.islice(replay, 3, None)) == batches[3:]


def test_a_bad_document_is_named_by_its_id():
    table = _table(50)
    ids = table.column("input_ids").to_pylist()
    ids[17] = [3, -4, 5]
    table = table.set_column(1, "input_ids", pa.array(ids))
    stage = {"seq_len": 32, "pad_token_id": 0, "id_column": "id"}
    rows = ray.data.from_arrow(table).map_batches(
        PackBatches, fn_constructor_kwargs=stage, batch_format="pyarrow", batch_size=25
    )
    with pytest.raises(
        Exception,
        match=r"PackBatches: id='doc-17' \(row 17 of a Ray batch of 25\): field 'input_ids' token ids must be >= 0",
    ) as raised:
        rows.take_all()
    assert "ValueError: PackBatches: id='doc-17'" in str(raised.value)  # ours, inside Ray's task error


def test_options_are_checked_when_the_stage_is_built():
    with pytest.raises(ValueError, match="strategy"):
        PackBatches(seq_len=8, pad_token_id=0, strategy="first_fit")
    with pytest.raises(ValueError, match=r"group_key 'grp' is no column of the Ray batch"):
        PackBatches(seq_len=8, pad_token_id=0, group_key="grp")(pa.table({"g": [0], "input_ids": [[[1]]]}))
    with pytest.raises(ValueError, match=r"id_column 'doc_id' is no column of the Ray batch .*'input_ids'"):
        PackBatches(seq_len=8, pad_token_id=0, id_column="doc_id")(pa.table({"input_ids": [[1]]}))
    with pytest.raises(ValueError, match="one length per document"):
        balanced_micro_batches(_documents(_table(10)), _sampler(_documents(_table(12)), 0))


@pytest.mark.parametrize("grouped", [False, True])
def test_rows_packed_without_positions_keep_their_documents_apart(grouped):
    """Without positions the rows carry ``seq_lengths``: labels that would cross documents are refused,
    as for pack_flat's rows, unless boundary-safe labels are turned off."""
    if grouped:
        table, options = pa.table({"g": [0], "input_ids": [[[11, 12, 13], [21, 22]]]}), {"group_key": "g"}
    else:
        table, options = pa.table({"input_ids": [[11, 12, 13], [21, 22]]}), {}
    rows = PackBatches(seq_len=6, pad_token_id=0, emit_positions=False, **options)(table)
    assert rows.column("seq_lengths").to_pylist() == [[3, 2]]
    with pytest.raises(
        ValueError, match=r"example 0: carries 'seq_lengths' \(2 documents packed in one row\)"
    ):
        ArrowCollateFn(COLLATOR)(rows)
    crossing = ArrowCollateFn(Collator(return_labels=True, boundary_safe_labels=False))(rows)
    assert crossing["labels"].tolist() == [[12, 13, 21, 22, -100]]
    positioned = PackBatches(seq_len=6, pad_token_id=0, **options)(table)
    assert "seq_lengths" not in positioned.column_names
    assert ArrowCollateFn(COLLATOR)(positioned)["labels"].tolist() == [[12, 13, -100, 22, -100]]


def test_balanced_micro_batches_are_read_one_at_a_time():
    """Two planned micro-batches in one Ray batch would be one step over the plan's budget: refused."""
    table = _documents(_table(40))
    micro = balanced_micro_batches(table, _sampler(table, 0))
    with pytest.raises(Exception, match=r"a Ray batch of 2 balanced micro-batches .*\(batch_size=1"):
        list(micro.iter_torch_batches(batch_size=2, collate_fn=ArrowCollateFn(PADDED)))
