"""Columnar batches: every input kind equals the row-wise path on the same data, Arrow's edge cases,
the dataset wrapper under DataLoader workers, and columnar packing against pack_flat."""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import (
    Collator,
    ColumnarDataset,
    FlatPacker,
    SampleMeta,
    SampleRecord,
    pack_columns,
    pack_flat,
)
from zephon_collate.read.arrow import ColumnBatch, columns_of
from zephon_collate.read.fields import TensorField

pa = pytest.importorskip("pyarrow")

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = (
    "table",
    "record_batch",
    "chunked",
    "tables",
    "pairs_numpy",
    "pairs_torch",
    "arrays",
    "column_batches",
)


# --- building one batch in every form -----------------------------------------------------------


def _arrow_list(rows: list[np.ndarray], dtype: np.dtype, large: bool, pad: int) -> Any:
    """A list array of ``rows``; with ``pad``, a slice of a longer one (offsets do not start at 0)."""
    value_type = pa.from_numpy_dtype(dtype)
    kind = pa.large_list(value_type) if large else pa.list_(value_type)
    junk = [np.full(3, 7, dtype=dtype)] * pad
    array = pa.array([*junk, *rows, *junk], type=kind)
    return array.slice(pad, len(rows)) if pad else array


def _pair(rows: list[np.ndarray], dtype: np.dtype, wide: bool, pad: int, torch_tensors: bool) -> tuple:
    """``(values, offsets)`` of ``rows``; with ``pad``, junk values before and after the rows."""
    junk = np.full(pad, 7, dtype=dtype)
    values = np.concatenate([junk, *rows, junk]).astype(dtype) if rows else junk.copy()
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64) + pad
    offsets = offsets.astype(np.int64 if wide else np.int32)
    if torch_tensors:
        return torch.from_numpy(values), torch.from_numpy(offsets)
    return values, offsets


def build(fields: dict[str, list[np.ndarray]], kind: str, *, wide: bool, pad: int, cuts: list[int]) -> Any:
    """The batch whose column ``name`` holds the rows ``fields[name]``, as input ``kind``.

    ``wide``: int64 offsets (``large_list``); ``pad``: arrays sliced out of longer ones;
    ``cuts``: where chunked forms split the rows into chunks.
    """
    names = list(fields)
    count = len(fields[names[0]])
    bounds = [0, *sorted({c for c in cuts if 0 < c < count}), count]
    dtype = {name: rows[0].dtype if rows else np.dtype(np.int64) for name, rows in fields.items()}

    def arrays(start: int, end: int) -> dict[str, Any]:
        return {n: _arrow_list(fields[n][start:end], dtype[n], wide, pad) for n in names}

    if kind == "table":
        return pa.table(arrays(0, count))
    if kind == "record_batch":
        return pa.RecordBatch.from_pydict(arrays(0, count))
    if kind == "chunked":
        parts = [arrays(a, b) for a, b in itertools.pairwise(bounds)]
        return {n: pa.chunked_array([p[n] for p in parts], type=parts[0][n].type) for n in names}
    if kind == "tables":
        return [pa.table(arrays(a, b)) for a, b in itertools.pairwise(bounds)]
    if kind == "arrays":  # a dict of plain Arrow arrays
        return arrays(0, count)
    if kind == "column_batches":  # what ColumnarDataset hands over, one batch per chunk
        return [
            ColumnBatch({n: _pair(fields[n][a:b], dtype[n], wide, pad, False) for n in names})
            for a, b in itertools.pairwise(bounds)
        ]
    return {n: _pair(fields[n], dtype[n], wide, pad, kind == "pairs_torch") for n in names}


def assert_same(left: dict[str, Any], right: dict[str, Any]) -> None:
    """Key for key, in order, and dtype for dtype."""
    assert list(left) == list(right)
    for key, value in left.items():
        other = right[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype, key
            assert torch.equal(value, other), key
        elif isinstance(value, np.ndarray):
            assert (
                isinstance(other, np.ndarray) and value.dtype == other.dtype and np.array_equal(value, other)
            )
        else:
            assert value == other, key


def outcome(function: Any, batch: Any) -> tuple[str, Any]:
    try:
        return "ok", function(batch)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)


@st.composite
def column_data(draw: st.DrawFn) -> dict[str, Any]:
    """Rows of SFT data (tokens, labels with -100, an assistant mask, positions) and how to give them."""
    count = draw(st.integers(1, 6))
    lengths = [draw(st.integers(0, 6)) for _ in range(count)]
    token_dtype = np.dtype(draw(st.sampled_from([np.int32, np.int64])))
    tokens = [
        np.array(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), token_dtype) for n in lengths
    ]
    prompts = [draw(st.integers(0, n)) for n in lengths]
    labels = [
        np.where(np.arange(len(t)) < p, -100, t).astype(np.int64)
        for t, p in zip(tokens, prompts, strict=True)
    ]
    masks = [(np.arange(len(t)) >= p).astype(np.int8) for t, p in zip(tokens, prompts, strict=True)]
    positions = [np.arange(len(t), dtype=np.int64) for t in tokens]
    return {
        "tokens": tokens,
        "labels": labels,
        "masks": masks,
        "positions": positions,
        "kind": draw(st.sampled_from(KINDS)),
        "wide": draw(st.booleans()),
        "pad": draw(st.sampled_from([0, 0, 2])),
        "cuts": draw(st.lists(st.integers(0, count), max_size=3)),
    }


def _as(data: dict[str, Any], fields: dict[str, list[np.ndarray]]) -> tuple[Any, list[dict[str, Any]]]:
    """The columnar batch and the same rows as example dicts (NumPy rows of the stored dtypes)."""
    columns = build(fields, data["kind"], wide=data["wide"], pad=data["pad"], cuts=data["cuts"])
    rows = [{name: values[index] for name, values in fields.items()} for index in range(len(data["tokens"]))]
    return columns, rows


TRANSFORMERS = [
    {"padding_free": True, "return_flash_attn_kwargs": True, "return_seq_idx": True},
    {"padding_free": True, "pad_to_multiple_of": 4, "pad_token_id": 0},
    {"pad_token_id": 0},
    {"pad_token_id": 0, "padding_side": "left", "pad_to_multiple_of": 4},
    {"pad_token_id": 0, "return_tensors": "np", "return_position_ids": True},
]


@SETTINGS
@given(column_data(), st.sampled_from(TRANSFORMERS), st.sampled_from(["labels", "masks", "both"]))
def test_every_columnar_kind_equals_the_row_wise_path_for_transformers(data, options, supervision):
    """for_transformers, both layouts: the columns give the row-wise batch, key for key, dtype for dtype."""
    fields = {"input_ids": data["tokens"]}
    if supervision in ("labels", "both"):
        fields["labels"] = data["labels"]
    if supervision in ("masks", "both"):
        fields["assistant_masks"] = data["masks"]
    columns, rows = _as(data, fields)
    collate = Collator.for_transformers(**options)
    got, want = outcome(collate, columns), outcome(collate, rows)
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        assert_same(got[1], want[1])


NATIVE = [
    {"return_labels": True, "return_cu_seqlens": True, "return_num_valid_tokens": True, "pad_token_id": 0},
    {"return_labels": True, "return_loss_mask": True, "extra_fields": ("positions",), "pad_token_id": 0},
    {"return_labels": True, "flatten": True, "return_cu_seqlens": True, "pad_token_id": 0},
    {"dtype": None},
    {"dtype": torch.int32, "pad_token_id": 0, "return_padding_mask": True},
]


@SETTINGS
@given(column_data(), st.sampled_from(NATIVE))
def test_every_columnar_kind_equals_the_row_wise_path_for_the_collator(data, options):
    """The native Collator: columns with positions and a loss_mask give the row-wise output."""
    fields = {"input_ids": data["tokens"], "positions": data["positions"], "loss_mask": data["masks"]}
    columns, rows = _as(data, fields)
    collate = Collator(**options)
    got, want = outcome(collate, columns), outcome(collate, rows)
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        assert_same(got[1], want[1])


@SETTINGS
@given(
    column_data(),
    st.integers(1, 9),
    st.sampled_from(["greedy", "best_fit"]),
    st.sampled_from(["split", "truncate", "auto"]),
    st.none() | st.integers(1, 5),
)
def test_pack_columns_gives_pack_flats_rows(data, seq_len, strategy, overflow, buffer_size):
    """pack_columns (vectorised) packs the rows pack_flat packs from the same documents, and pack_flat of
    the columns gives the records it gives for the documents as plain payloads."""
    fields = {"input_ids": data["tokens"], "loss_mask": data["masks"]}
    columns, rows = _as(data, fields)
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), row) for i, row in enumerate(rows)]
    options = {"pad_token_id": 3, "strategy": strategy, "overflow": overflow, "buffer_size": buffer_size}
    want = outcome(lambda r: pack_flat(r, seq_len, **options), records)
    got = outcome(lambda c: pack_columns(c, seq_len, **options), columns)
    assert got[0] == want[0], (got, want)
    if want[0] != "ok":
        return
    packed, expected = got[1], want[1]
    assert len(packed) == len(expected)
    for index, row in enumerate(expected):
        assert list(packed.fields) == list(row.payload)
        for name, values in row.payload.items():
            assert packed.fields[name].dtype == values.dtype and np.array_equal(
                packed.fields[name][index], values
            )
        assert packed.padding_length[index] == row.meta.padding_length
        pieces = slice(packed.offsets[index], packed.offsets[index + 1])
        refs = row.meta.contributors
        assert packed.documents[pieces].tolist() == [ref.cursor.chunk_offset for ref in refs]
        assert packed.parts[pieces].tolist() == [ref.cursor.lineage[-1] for ref in refs]
        assert packed.closes[pieces].tolist() == [ref.is_last_child for ref in refs]
    for left, right in zip(pack_flat(columns, seq_len, **options), expected, strict=True):
        assert left.meta == right.meta and list(left.payload) == list(right.payload)
        assert all(np.array_equal(left.payload[k], v) for k, v in right.payload.items())


# --- Arrow's edge cases -------------------------------------------------------------------------

ROWS = [np.array([5, 6, 7], np.int32), np.array([8], np.int32), np.array([9, 10], np.int32)]


def _flat(batch: Any) -> dict[str, Any]:
    return Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)(batch)


def test_sliced_arrays_whose_offsets_do_not_start_at_zero():
    array = pa.array([[1, 1], *ROWS, [2, 2, 2]], type=pa.list_(pa.int32())).slice(1, 3)
    assert array.offsets.to_pylist()[0] == 2  # the slice's offsets start inside the buffer
    out = _flat(pa.table({"input_ids": array}))
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 4, 6]
    values = np.array([0, 0, 5, 6, 7, 8, 9, 10, 0])
    pair = _flat({"input_ids": (values, np.array([2, 5, 6, 8]))})  # a pair sliced the same way
    assert pair["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("kind", ["list", "large_list", "fixed_size_list"])
def test_int32_and_int64_offsets(kind):
    rows = [[5, 6], [7, 8], [9, 10]]
    types = {
        "list": pa.list_(pa.int64()),  # int32 offsets
        "large_list": pa.large_list(pa.int64()),  # int64 offsets
        "fixed_size_list": pa.list_(pa.int64(), 2),  # no offsets: rows of one length
    }
    table = pa.table({"input_ids": pa.array(rows, type=types[kind])})
    assert _flat(table)["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert _flat(table.slice(1))["input_ids"].tolist() == [[7, 8, 9, 10]]
    out = Collator(return_labels=True)(table)
    assert out["input_ids"].tolist() == [[5], [7], [9]] and out["labels"].tolist() == [[6], [8], [10]]


class WatchedChunks:
    """A chunked column that records how it is read: chunk by chunk; it refuses to be combined."""

    __module__ = "pyarrow.lib"  # read as an Arrow object

    def __init__(self, chunked: Any) -> None:
        self.chunked, self.reads = chunked, 0
        self.num_chunks = chunked.num_chunks

    def chunk(self, index: int) -> Any:
        self.reads += 1
        return self.chunked.chunk(index)

    def __len__(self) -> int:
        return len(self.chunked)

    def combine_chunks(self) -> Any:
        raise AssertionError("combine_chunks was called")


def test_chunked_columns_are_read_chunk_by_chunk_without_combine_chunks():
    chunked = pa.chunked_array([pa.array([r], type=pa.list_(pa.int32())).slice(0) for r in ROWS])
    table = pa.table({"input_ids": chunked})
    assert table.column("input_ids").num_chunks == 3
    assert _flat(table)["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    watched = WatchedChunks(pa.chunked_array([pa.array(ROWS[:2]), pa.array(ROWS[2:]).slice(0)]))
    out = _flat({"input_ids": watched})  # any use of combine_chunks would raise
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]] and watched.reads == 2  # each chunk once
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 4, 6]


def test_null_entries_are_refused_naming_the_row():
    with_null_row = pa.table({"input_ids": pa.array([[1, 2], None, [3]], type=pa.list_(pa.int64()))})
    with_null_value = pa.table({"input_ids": pa.array([[1, 2], [3], [4, None]], type=pa.list_(pa.int64()))})
    for collate in (Collator.for_transformers(padding_free=True), Collator(dtype=None)):
        with pytest.raises(ValueError, match=r"example 1: field 'input_ids' is null"):
            collate(with_null_row)
        with pytest.raises(ValueError, match=r"example 2: field 'input_ids' holds a null at input_ids\[1\]"):
            collate(with_null_value)
    with pytest.raises(ValueError, match="example 1: field 'input_ids' is null"):
        pack_flat(with_null_row, 4, pad_token_id=0)
    labels = pa.table(
        {"input_ids": [[1, 2], [3]], "labels": pa.array([[1, 2], None], type=pa.list_(pa.int64()))}
    )
    with pytest.raises(ValueError, match="example 1: field 'labels' is null"):
        Collator.for_transformers(pad_token_id=0)(labels)
    for name, column in [  # a null inside a supervising field: named as a null, with the fix
        ("labels", pa.array([[-100, 2], [-100, None]])),
        ("completion_mask", pa.array([[0, 1], [0, None]], pa.list_(pa.int8()))),
        ("assistant_masks", pa.array([[False, True], [False, None]])),
    ]:
        rollouts = [] if name == "labels" else [Collator.for_rollouts(padding_free=True)]
        for collate in (Collator.for_transformers(pad_token_id=0), *rollouts):
            with pytest.raises(
                ValueError, match=rf"example 1: field '{name}' holds a null at {name}\[1\]; .*fill"
            ):
                collate(pa.table({"input_ids": [[1, 2], [3, 4]], name: column}))


def test_datasets_extension_columns_read_as_their_storage():
    # datasets' Array2D (a per-token top-k) is an Arrow extension type: read as the lists it stores.
    import datasets

    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "top": datasets.Array2D((None, 2), "float32")}
    )
    top = [[[-1.0, -2.0], [-3.0, -4.0]], [[-1.5, -2.5], [-3.5, -4.5], [-5.5, -6.5]]]
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5]], "top": top}, features=features)
    collate = Collator.for_transformers(padding_free=True, float_fields=[TensorField("top", shape=(2,))])
    expected = [[*top[0], *top[1]]]
    arrow = dataset.with_format("arrow")[0:2]
    for batch in (arrow, arrow.to_batches(), {name: arrow.column(name) for name in ("input_ids", "top")}):
        assert collate(batch)["top"].tolist() == expected
    assert collate(ColumnarDataset(dataset).__getitems__([0, 1]))["top"].tolist() == expected
    assert collate([dataset[0], dataset[1]])["top"].tolist() == expected
    # Arrow's own fixed_shape_tensor stores each [2, 2] value flat: refused, not read as 4 numbers
    tensors = pa.FixedShapeTensorArray.from_numpy_ndarray(np.arange(8, dtype=np.float32).reshape(2, 2, 2))
    table = pa.table({"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "m": tensors})
    with pytest.raises(
        TypeError, match=r"field 'm' is an Arrow column of type extension<arrow.fixed_shape_tensor"
    ):
        Collator.for_transformers(padding_free=True, float_fields=["m"])(table)


def _read_only_lists(rows: list[np.ndarray]) -> Any:
    """A list array over immutable buffers (bytes), as a memory-mapped dataset's are."""
    data = pa.py_buffer(np.concatenate(rows).astype(np.int64).tobytes())
    values = pa.Array.from_buffers(pa.int64(), sum(len(r) for r in rows), [None, data])
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, values)


def test_read_only_buffers_are_never_written_and_raise_no_warning():
    column = _read_only_lists(ROWS)
    table = pa.table({"input_ids": column, "labels": _read_only_lists(ROWS)})
    before = table.column("input_ids").to_pylist()
    buffer = np.frombuffer(column.buffers()[3], dtype=np.int64)
    assert not buffer.flags.writeable and not column.values.buffers()[1].is_mutable
    outputs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a non-writable array
        outputs.append(_flat(table))
        outputs.append(Collator.for_transformers(pad_token_id=0)(table))
        outputs.append(Collator(return_labels=True, pad_token_id=0)(table.select(["input_ids"])))
        packed = pack_columns(table.select(["input_ids"]), 4, pad_token_id=0)
    for out in outputs:
        for value in out.values():
            if isinstance(value, torch.Tensor):
                assert not np.shares_memory(value.numpy(), buffer)
                value.add_(1)  # outputs are the caller's to write
    assert not np.shares_memory(packed.fields["input_ids"], buffer)
    assert table.column("input_ids").to_pylist() == before


def test_int32_storage_is_read_as_a_view_and_widened_once_on_the_way_out():
    table = pa.table({"input_ids": pa.array(ROWS, type=pa.list_(pa.int32()))})
    buffer = np.frombuffer(table.column("input_ids").chunk(0).buffers()[3], dtype=np.int32)
    field = columns_of(table).ragged("input_ids", "ids")
    assert field.values.dtype == np.int32 and np.shares_memory(field.values, buffer)  # read, not copied
    assert not field.values.flags.writeable
    out = _flat(table)
    assert out["input_ids"].dtype == torch.int64 and out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert Collator(dtype=torch.int32)(table.slice(1, 1))["input_ids"].dtype == torch.int32
    assert pack_columns(table, 4, pad_token_id=0).fields["input_ids"].dtype == np.int64


class ArrowStream:
    """An object with the Arrow C stream interface only (as a polars DataFrame has)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self.table.__arrow_c_stream__(requested_schema)


def test_arrow_c_stream_objects_are_read_as_tables():
    table = pa.table({"input_ids": pa.array(ROWS, type=pa.list_(pa.int32()))})
    assert_same(_flat(ArrowStream(table)), _flat(table))


def test_without_pyarrow_columnar_input_names_the_arrow_extra(monkeypatch):
    table = pa.table({"input_ids": pa.array(ROWS, type=pa.list_(pa.int32()))})
    rows = [{"input_ids": row} for row in ROWS]
    values, offsets = np.concatenate(ROWS), np.array([0, 3, 4, 6])
    expected = _flat(rows)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now fails
    for batch in (table, ArrowStream(table), [table], {"input_ids": table.column("input_ids")}):
        with pytest.raises(ImportError, match=r"zephon_collate\[arrow\]"):
            _flat(batch)
    with pytest.raises(ImportError, match=r"zephon_collate\[arrow\]"):
        pack_flat(table, 4, pad_token_id=0)
    assert_same(_flat(rows), expected)  # everything else works
    assert_same(_flat({"input_ids": (values, offsets)}), expected)
    assert pack_columns({"input_ids": (values, offsets)}, 4, pad_token_id=0).fields["input_ids"].shape == (
        2,
        4,
    )


# --- what datasets hands over, and the wrapper ----------------------------------------------------

datasets = pytest.importorskip("datasets")


def _dataset(count: int = 40, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 500, rng.integers(1, 12)).tolist() for _ in range(count)]
    labels = [[-100 if i < len(r) // 3 else t for i, t in enumerate(r)] for r in ids]
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "labels": labels, "text": [f"t{i}" for i in range(count)]}
    )


def test_datasets_arrow_batches_equal_its_rows():
    dataset = _dataset()
    collate = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
    indices = [7, 3, 21, 3]
    arrow = dataset.with_format("arrow")
    assert_same(collate(arrow[indices]), collate([dataset[i] for i in indices]))
    assert_same(collate(arrow[5:13]), collate(dataset[5:13]))
    for batch, start in zip(arrow.iter(batch_size=16), range(0, 40, 16), strict=True):
        assert_same(collate(batch), collate([dataset[i] for i in range(start, min(start + 16, 40))]))
    streaming = dataset.to_iterable_dataset(num_shards=2).with_format("arrow")
    first = next(iter(streaming.iter(batch_size=8)))
    assert_same(collate(first), collate([dataset[i] for i in range(8)]))


def test_columnar_dataset_honours_the_indices_mapping():
    dataset = _dataset().shuffle(seed=3).select(range(5, 25))
    wrapper = ColumnarDataset(dataset, columns=["input_ids", "labels"])
    assert len(wrapper) == 20
    [batch] = wrapper.__getitems__([0, 19, 4, -1])
    values, offsets = batch["input_ids"]
    rows = [values[a:b].tolist() for a, b in itertools.pairwise(offsets)]
    assert rows == [dataset[i]["input_ids"] for i in (0, 19, 4, 19)]
    assert list(batch) == ["input_ids", "labels"] and not isinstance(batch, dict)
    [text] = ColumnarDataset(dataset, columns=["text"]).__getitems__([3, 0])
    assert text["text"].to_pylist() == [dataset[3]["text"], dataset[0]["text"]]  # other columns: Arrow
    with pytest.raises(IndexError, match="index 20 is out of range for 20 rows"):
        wrapper.__getitems__([20])


@pytest.mark.parametrize("workers", [0, 2])
def test_columnar_dataset_under_a_shuffling_dataloader_with_workers(workers):
    """DataLoader(wrapper, batch_size=8, shuffle=True, num_workers=2, collate_fn=collator): __getitems__
    hands the collator one columnar batch; every example arrives once, batches equal the row-wise ones."""
    dataset = _dataset(60).shuffle(seed=1)
    collate = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
    loaders = [
        torch.utils.data.DataLoader(
            source,
            batch_size=8,
            shuffle=True,
            num_workers=workers,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(0),
        )
        for source in (ColumnarDataset(dataset, columns=["input_ids", "labels"]), dataset)
    ]
    seen = 0
    for columnar, rows in zip(*loaders, strict=True):
        assert_same(columnar, rows)
        seen += len(columnar["cu_seq_lens_q"]) - 1
    assert seen == 60


def test_columnar_batches_pass_trainers_remove_columns_collator():
    """Trainer wraps the collator in RemoveColumnsCollator (the wrapper is no datasets.Dataset): it drops
    unnamed keys of example dicts only, so the table arrives with its assistant_masks."""
    from transformers.trainer_utils import RemoveColumnsCollator

    dataset = _dataset().map(lambda e: {"assistant_masks": [int(t != -100) for t in e["labels"]]})
    wrapper = ColumnarDataset(dataset, columns=["input_ids", "assistant_masks"])
    collate = Collator.for_transformers(padding_free=True, supervision="assistant_masks")
    wrapped = RemoveColumnsCollator(collate, signature_columns=["input_ids", "labels"])
    indices = [3, 1, 4]
    expected = collate([{k: dataset[i][k] for k in ("input_ids", "assistant_masks")} for i in indices])
    assert_same(wrapped(wrapper.__getitems__(indices)), expected)
    with pytest.raises(TypeError, match="remove_unused_columns=False"):
        wrapped(pa.table({"input_ids": [[1, 2]]}))  # a bare table: iterated into nameless columns


# --- columns in the packers ---------------------------------------------------------------------


def _documents(count: int = 30, seed: int = 0) -> tuple[Any, list[SampleRecord]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 14, count)
    tokens = [rng.integers(1, 90, n).astype(np.int32) for n in lengths]
    masks = [np.ones(n, np.int8) for n in lengths]
    table = pa.table(
        {
            "input_ids": pa.array(tokens, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
        }
    )
    records = [
        SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": t, "loss_mask": m})
        for i, (t, m) in enumerate(zip(tokens, masks, strict=True))
    ]
    return table, records


def _same_rows(left: list[SampleRecord], right: list[SampleRecord]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.meta == b.meta and list(a.payload) == list(b.payload)
        for key, value in b.payload.items():
            assert a.payload[key].dtype == value.dtype and np.array_equal(a.payload[key], value)


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_flat_packer_streams_columnar_batches_and_resumes(strategy):
    table, records = _documents()
    options = {"pad_token_id": 0, "strategy": strategy, "buffer_size": 7}
    batches = [table.slice(0, 11), table.slice(11, 9), table.slice(20)]  # as dataset.iter(batch_size) yields
    expected = list(FlatPacker(8, **options).pack(records))
    _same_rows(list(FlatPacker(8, **options).pack(batches)), expected)
    packer = FlatPacker(8, **options)
    stream = packer.pack(batches[:1])
    first = [next(stream), next(stream)]
    state = packer.state_dict()
    resumed = FlatPacker(8, **options)
    resumed.load_state_dict(state)
    rest = table.slice(state["records_consumed"])
    _same_rows([*first, *resumed.pack([rest])], expected)


def test_packed_columns_feed_the_collator_as_pack_flats_records_do():
    table, _ = _documents(60, seed=2)
    rows = pack_flat(table, 16, pad_token_id=0, strategy="best_fit")
    packed = pack_columns(table, 16, pad_token_id=0, strategy="best_fit")
    assert len(packed) == len(rows)
    options = {"return_labels": True, "return_cu_seqlens": True, "return_num_valid_tokens": True}
    collate = Collator(**options, return_padding_mask=True, return_loss_mask=True)
    loader = torch.utils.data.DataLoader(packed, batch_size=4, collate_fn=collate)
    for index, batch in enumerate(loader):
        want = collate(rows[4 * index : 4 * index + 4])
        want["ids"] = batch["ids"]  # rows of PackedColumns are named by their place in the batch
        assert_same(batch, want)


def test_pack_columns_hits_the_goal_shape():
    """Lognormal documents into rows of 2048: best fit pads under 1% (the benchmark's workload)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(5.5, 1.0, 2500)), 1, 32768).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = rng.integers(3, 50_000, int(offsets[-1])).astype(np.int32)
    packed = pack_columns({"input_ids": (values, offsets)}, 2048, pad_token_id=0, strategy="best_fit")
    assert packed.padding_length.sum() / packed.fields["input_ids"].size < 0.01
    tokens = packed.fields["input_ids"]
    assert (tokens >= 3).sum() == values.size and np.array_equal(
        np.sort(tokens[tokens >= 3]), np.sort(values)
    )


# --- bad columnar input -------------------------------------------------------------------------


FLAT = Collator.for_transformers(padding_free=True)


def test_columns_mixed_with_python_lists_are_refused():
    with pytest.raises(
        TypeError, match="field 'labels' is a list, while the batch's other fields are columns"
    ):
        FLAT({"input_ids": (np.array([1, 2]), np.array([0, 2])), "labels": [[1, 2]]})


def test_pair_offsets_that_do_not_fit_their_values_name_the_row():
    with pytest.raises(ValueError, match="example 1: field 'input_ids': the offsets of its"):
        FLAT({"input_ids": (np.array([1, 2, 3]), np.array([0, 2, 1]))})
    with pytest.raises(ValueError, match=r"the offsets of its .* at most the 3 values"):
        FLAT({"input_ids": (np.array([1, 2, 3]), np.array([0, 2, 4]))})
    with pytest.raises(
        TypeError, match="offsets of a \\(values, offsets\\) pair must be a 1-D integer array"
    ):
        FLAT({"input_ids": (np.array([1, 2, 3]), np.array([0.0, 3.0]))})


def test_columns_that_are_not_lists_of_numbers_are_refused():
    with pytest.raises(TypeError, match="Arrow column of type string"):
        FLAT(pa.table({"input_ids": ["a", "b"]}))
    with pytest.raises(TypeError, match="a list of lists per example"):
        FLAT(pa.table({"input_ids": [[[1, 2]], [[3]]]}))
    with pytest.raises(TypeError, match="integer token ids"):
        FLAT(pa.table({"input_ids": [[1.5, 2.0]]}))
    with pytest.raises(TypeError, match="a column of one int64 per example"):
        FLAT(pa.table({"input_ids": [1, 2]}))


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="the columns of the batch differ in length"):
        FLAT({"input_ids": pa.array([[1], [2]]), "labels": pa.array([[1]])})


def test_a_table_iterated_into_nameless_columns_names_remove_unused_columns():
    with pytest.raises(TypeError, match="a list of Arrow columns without their names"):
        FLAT(list(pa.table({"input_ids": [[1, 2]]})))


def test_empty_columnar_batches_and_missing_token_columns():
    with pytest.raises(ValueError, match="the batch holds no examples"):
        FLAT(pa.table({"input_ids": pa.array([], type=pa.list_(pa.int64()))}))
    with pytest.raises(ValueError, match="example 0: has no 'input_ids'"):
        FLAT(pa.table({"ids_": [[1, 2]]}))
    assert Collator()(pa.table({"input_ids": pa.array([], type=pa.list_(pa.int64()))}))["input_ids"] == []
    with pytest.raises(ValueError, match="example 0: payload lacks field 'positions'"):
        Collator(return_cu_seqlens=True)(pa.table({"input_ids": [[1, 2]]}))


def test_packers_and_the_wrapper_refuse_what_is_not_columns():
    with pytest.raises(TypeError, match="pack_columns: documents must be a columnar batch"):
        pack_columns([{"input_ids": [1, 2]}], 4, pad_token_id=0)
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset or a pyarrow\.Table"):
        ColumnarDataset([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="the dataset has no column 'labels'"):
        ColumnarDataset(pa.table({"input_ids": [[1]]}), columns=["labels"])
    with pytest.raises(IndexError, match="index 3 is out of range for 1 rows"):
        ColumnarDataset(pa.table({"input_ids": [[1]]})).__getitems__([0, 3])


def test_the_packers_pack_float_and_tensor_fields_from_columns_as_from_records():
    top = pa.list_(pa.list_(pa.float32(), 2))
    table = pa.table(
        {
            "input_ids": [[1, 2, 3], [4, 5], [6]],
            "advantages": [[0.5, 0.5, 0.5], [1.0, 1.0], [2.0]],
            "top": pa.array(
                [[[0, -1], [-2, -3], [-4, -5]], [[0.5, -1.5], [-2.5, -3.5]], [[0.25, -0.75]]], type=top
            ),
            "group": [0, 0, 1],
        }
    )
    specs = ["advantages", TensorField("top", align="label", fill=float("-inf"), shape=(2,))]
    records = pack_flat(table.to_pylist(), 4, pad_token_id=0, float_fields=specs)
    columns = pack_columns(table, 4, pad_token_id=0, float_fields=specs)
    streamed = list(FlatPacker(4, pad_token_id=0, float_fields=specs).pack([table]))
    for name in ("input_ids", "advantages", "top", "positions"):
        want = np.stack([row.payload[name] for row in records])
        assert np.array_equal(columns.fields[name], want), name
        assert np.array_equal(np.stack([row.payload[name] for row in streamed]), want), name
    assert columns.fields["top"].shape == (2, 4, 2) and columns.fields["top"][1, 3].tolist() == [-np.inf] * 2
    message = "are read example by example, not from columns; give the batch as a list of examples"
    with pytest.raises(ValueError, match=f"pack_flat: group_key groups {message}"):
        pack_flat(table, 4, pad_token_id=0, group_key="group")


def test_the_collators_read_float_and_tensor_fields_from_columns_as_from_rows():
    top = pa.list_(pa.list_(pa.float32(), 2))  # a fixed-size top-k per token
    table = pa.table(
        {
            "input_ids": [[1, 2], [3]],
            "advantages": [[0.5, 0.5], [1.0]],
            "top": pa.array([[[0.0, -1.0], [-2.0, float("-inf")]], [[-0.5, -0.25]]], type=top),
            "routes": [[[1, 2], [3, 4]], [[5, 6]]],  # list<list<int64>>: equal inner lists
        }
    )
    specs = [
        "advantages",
        TensorField("top", align="label", fill=float("-inf"), shape=(2,)),
        TensorField("routes", dtype=torch.int16, shape=(2,)),
    ]
    for collate in (
        Collator(return_labels=True, pad_token_id=0, float_fields=specs),
        Collator.for_transformers(padding_free=True, float_fields=specs),
        Collator.for_transformers(pad_token_id=0, float_fields=specs),
    ):
        columns, rows = collate(table), collate(table.to_pylist())
        assert sorted(columns) == sorted(rows)
        for key, value in rows.items():
            same = (
                torch.equal(columns[key], value) if isinstance(value, torch.Tensor) else columns[key] == value
            )
            assert same, key
    padded = Collator(return_labels=True, pad_token_id=0, float_fields=specs)(table)
    assert padded["advantages"].tolist() == [[0.5], [0.0]]
    assert padded["top"].tolist() == [[[0.0, -1.0]], [[-0.5, -0.25]]]  # the prediction at each input
    assert padded["routes"].dtype == torch.int16 and padded["routes"].tolist() == [[[3, 4]], [[0, 0]]]
    ragged = pa.table({"input_ids": [[1, 2]], "top": [[[0.0, -1.0], [-2.0]]]})
    with pytest.raises(ValueError, match=r"example 0: field 'top' holds 1 values at top\[1\], but 2 at"):
        Collator(return_labels=True, float_fields=specs[1:2])(ragged)


def test_padding_length_column_is_checked_like_meta_padding_length():
    batch = {
        "input_ids": (np.array([5, 6, 0, 7, 8, 9]), np.array([0, 3, 6])),
        "_padding_length": np.array([1, 4]),
    }
    with pytest.raises(ValueError, match=r"example 1: meta.padding_length is 4 but must be an int from 0"):
        Collator(return_labels=True, return_num_valid_tokens=True)(batch)
    batch["_padding_length"] = np.array([1, 0])
    out = Collator(return_labels=True, return_num_valid_tokens=True)(batch)
    assert out["num_valid_tokens"] == 3  # the padded token's label is not counted


def test_trl_packed_rows_and_other_hf_fields_as_columns():
    """seq_lengths, position_ids, token_type_ids, attention_mask as columns: the row-wise batch."""
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2], "token_type_ids": [0, 0, 0, 1, 1]},
        {"input_ids": [1, 2, 3, 4], "seq_lengths": [4], "token_type_ids": [1, 1, 1, 1]},
    ]
    table = pa.table({name: [row[name] for row in rows] for name in rows[0]})
    for options in ({"padding_free": True, "return_flash_attn_kwargs": True}, {"padding_free": True}):
        collate = Collator.for_transformers(**options)
        assert_same(collate(table), collate(rows))
    positions = [{"input_ids": [5, 6, 7], "position_ids": [0, 1, 0]}, {"input_ids": [8], "position_ids": [0]}]
    table = pa.table({name: [row[name] for row in positions] for name in positions[0]})
    collate = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
    assert_same(collate(table), collate(positions))
    masked = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 0]},
        {"input_ids": [8, 9], "attention_mask": [1, 1]},
    ]
    table = pa.table({name: [row[name] for row in masked] for name in masked[0]})
    for options in ({"pad_token_id": 0}, {"padding_free": True}):
        collate = Collator.for_transformers(**options)
        assert_same(collate(table), collate(masked))
    bad = pa.table({"input_ids": [[5, 6, 7], [8]], "seq_lengths": [[3], [2]]})
    with pytest.raises(ValueError, match=r"example 1: 'seq_lengths' \[2\] must be lengths >= 0 that add up"):
        collate(bad)


def test_stack_and_finish_take_columns_and_never_share_the_inputs_memory():
    """Collator.stack (workers) then finish; the inputs' arrays are neither written nor flagged nor shared."""
    values, offsets = np.array([5, 6, 7, 8, 9, 10]), np.array([0, 3, 6])
    positions = np.array([0, 1, 2, 0, 1, 2])
    batch = {"input_ids": (values, offsets), "positions": (positions, offsets)}
    collate = Collator(return_labels=True, return_cu_seqlens=True)
    want = collate(batch)
    assert_same(collate.finish(collate.stack(batch)), want)
    flat = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10]}]
    assert_same(flat.finish(flat.stack(pa.table({"input_ids": [[5, 6, 7], [8, 9, 10]]}))), flat(rows))
    for out in (want, flat({"input_ids": (values, offsets)})):
        for value in out.values():
            if isinstance(value, torch.Tensor):
                assert not np.shares_memory(value.numpy(), values)
                value.add_(1)
    assert values.tolist() == [5, 6, 7, 8, 9, 10] and values.flags.writeable and offsets.tolist() == [0, 3, 6]


def test_a_positions_column_with_segments_is_refused_by_every_packer():
    segmented = pa.table({"input_ids": [[1, 2, 3, 4], [5, 6]], "positions": [[0, 1, 0, 1], [0, 1]]})
    message = r"example 0: field 'positions' does not count 0, 1, \.\.\. over the document's tokens"
    with pytest.raises(ValueError, match=message):
        pack_columns(segmented, 8, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        pack_flat(segmented, 8, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        list(FlatPacker(8, pad_token_id=0).pack([segmented]))
    # as records the segments are kept: positions restart inside the first document
    rows = pack_flat(segmented.to_pylist(), 8, pad_token_id=0)
    assert rows[0].payload["positions"].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    # positions of one segment per document change nothing: the rows packed without the column
    plain = pa.table({"input_ids": [[1, 2, 3, 4], [5, 6]], "positions": [[0, 1, 2, 3], [0, 1]]})
    packed = pack_columns(plain, 8, pad_token_id=0)
    assert packed.fields["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert packed.fields["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]


def test_auto_overflow_reads_an_unpacked_loss_mask_column_as_records_do():
    table = pa.table(
        {
            "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]],
            "loss_mask": [[0, 1, 1], [1, 1], [0, 0, 1, 1, 1]],
        }
    )
    message = "example 2: has 5 tokens, more than seq_len=4, and a prompt"
    with pytest.raises(ValueError, match=r"record 2 .*has 5 tokens, more than seq_len=4, and a prompt"):
        pack_flat(table.to_pylist(), 4, pad_token_id=0, fields=())
    for pack in (
        lambda: pack_columns(table, 4, pad_token_id=0, fields=()),
        lambda: pack_flat(table, 4, pad_token_id=0, fields=()),
        lambda: list(FlatPacker(4, pad_token_id=0, fields=()).pack([table])),
        lambda: pack_columns(table, 4, pad_token_id=0),  # packed too
    ):
        with pytest.raises(ValueError, match=message):
            pack()
    # split as asked: rows [1, 2, 3], [4, 5], [6, 7, 8, 9], [10] (greedy, one open row), as from the records
    split = pack_columns(table, 4, pad_token_id=0, fields=(), overflow="split").fields["input_ids"]
    assert split.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 0, 0, 0]]
    records = pack_flat(table.to_pylist(), 4, pad_token_id=0, fields=(), overflow="split")
    assert [row.payload["input_ids"].tolist() for row in records] == split.tolist()


def test_supervision_that_is_not_a_column_is_refused_beside_columns():
    values, offsets = np.array([1, 2, 3, 4, 5]), np.array([0, 3, 5])
    collate = Collator(pad_token_id=0, return_labels=True)
    message = "field '{}' is not a list column .* so what it supervises cannot be checked"
    with pytest.raises(TypeError, match=message.format("labels")):
        collate({"input_ids": (values, offsets), "labels": [[-100, 2, 3], [4, 5]]})
    with pytest.raises(TypeError, match=message.format("attention_mask")):
        collate({"input_ids": (values, offsets), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])})
    with pytest.raises(TypeError, match=message.format("labels")):
        collate(pa.table({"input_ids": [[1, 2], [3, 4]], "labels": [3, 4]}))
    # the rows say what is wrong too: a per-example label is not a token field
    with pytest.raises(
        ValueError, match=r"record 0 .*field 'labels' is one value \(3\), but it is read as a row"
    ):
        collate([{"input_ids": [1, 2], "labels": 3}, {"input_ids": [3, 4], "labels": 4}])


@pytest.mark.parametrize(
    "offsets", [np.array([[0, 3, 5]]), np.array([], dtype=np.int64), np.array([0.0, 3.0, 5.0])]
)
def test_offsets_that_are_not_one_integer_row_are_refused_by_every_entry_point(offsets):
    batch = {"input_ids": (np.array([1, 2, 3, 4, 5]), offsets)}
    message = "the offsets of a \\(values, offsets\\) pair must be a 1-D integer array"
    for collate in (
        Collator(pad_token_id=0, return_labels=True),
        Collator.for_transformers(padding_free=True),
        lambda b: pack_columns(b, 4, pad_token_id=0),
        lambda b: pack_flat(b, 4, pad_token_id=0),
    ):
        with pytest.raises(TypeError, match=message):
            collate(batch)


def test_for_transformers_refuses_packed_columns_naming_the_native_collator():
    packed = pack_columns(
        pa.table({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]}), 6, pad_token_id=0
    )
    batch = packed.__getitems__([0, 1])
    with pytest.raises(
        ValueError, match=r"'_padding_length' column: packed rows .* Collator\(return_labels=True"
    ):
        Collator.for_transformers(padding_free=True)(batch)
    labels = Collator(return_labels=True, return_cu_seqlens=True)(batch)["labels"]
    assert labels.tolist() == [[2, 3, -100, 5, -100], [7, 8, 9, 10, -100]]


def test_a_list_of_column_batches_with_scalar_columns_is_one_batch():
    packed = pack_columns(
        pa.table({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]}), 6, pad_token_id=0
    )
    collate = Collator(return_labels=True, return_cu_seqlens=True)
    joined = collate(packed.__getitems__([0]) + packed.__getitems__([1]))
    assert_same(joined, collate(packed.__getitems__([0, 1])))


def test_a_pair_that_is_not_two_arrays_is_named():
    offsets = np.array([0, 3, 5])
    with pytest.raises(
        TypeError, match=r"got a dict; field 'input_ids' looks like a \(values, offsets\) pair"
    ):
        Collator()({"input_ids": ([1, 2, 3, 4, 5], offsets)})
    with pytest.raises(TypeError, match="got a dict; a batch of columns is a dict of Arrow columns"):
        Collator()({"input_ids": [[1, 2, 3], [4, 5]]})


def test_a_table_of_no_chunks_packs_to_no_rows():
    schema = pa.schema([("input_ids", pa.list_(pa.int64()))])
    for empty in (
        pa.table({"input_ids": [[1, 2]]}).filter(pa.array([False])),
        pa.Table.from_batches([], schema),
    ):
        assert pack_columns(empty, 4, pad_token_id=0).fields["input_ids"].shape == (0, 4)
        assert pack_flat(empty, 4, pad_token_id=0) == []
        assert list(FlatPacker(4, pad_token_id=0).pack([empty])) == []


def test_token_rows_of_more_than_one_value_per_token_are_refused_in_one_wording():
    batch = {"input_ids": (np.ones((5, 2), dtype=np.int64), np.array([0, 3, 5]))}
    message = r"example 0: field 'input_ids' must be 1-D \(one entry per token\), got shape \(3, 2\)"
    for collate in (
        Collator.for_transformers(padding_free=True),
        lambda b: pack_columns(b, 4, pad_token_id=0),
        lambda b: pack_flat(b, 4, pad_token_id=0),
    ):
        with pytest.raises(ValueError, match=message):
            collate(batch)


def test_an_empty_nested_row_from_datasets_numpy_format_reads_as_the_table():
    """datasets' NumPy format gives an empty list<list<float>> row as an object array: no values."""
    table = pa.table(
        {
            "input_ids": pa.array([[], [1], [2, 3, 4]], pa.list_(pa.int64())),
            "top": pa.array([[], [[0.5]], [[1.0], [2.0], [3.0]]], pa.list_(pa.list_(pa.float32()))),
        }
    )
    rows = datasets.Dataset(table).with_format("numpy")[0:3]
    assert rows["top"][0].dtype == object and rows["top"][0].size == 0
    collate = Collator.for_transformers(pad_token_id=0, float_fields=[TensorField("top", shape=(1,))])
    want, got = collate(table), collate(rows)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
