"""pack_columns' rows with value fields of any shape (a top-k ``[K]``, MoE routes ``[layers, k]``, a jagged
top-k ``shape=(None,)``) feed the Collator as pack_flat's records of the same documents do: through
``__getitem__``, ``__getitems__``, iteration, a DataLoader (with and without workers), and the worker split
``Collator.stack`` / ``Collator.finish``; and ``ColumnarDataset`` hands tensor fields over whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, ColumnarDataset, TensorField, pack_columns, pack_flat
from zephon_collate.packing.columns import PackedColumns
from zephon_collate.read.arrow import ColumnBatch
from zephon_collate.read.fields import Spread

pa = pytest.importorskip("pyarrow")

INF = float("-inf")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ------------------------------------------------------------------------------------


def _pairs(docs: list[dict[str, Any]], dtypes: dict[str, Any] | None = None) -> dict[str, tuple]:
    """The documents as ``(values, offsets)`` pairs, a value field's values ``[N, ...]``."""
    offsets = np.cumsum([0, *(len(doc["input_ids"]) for doc in docs)]).astype(np.int64)
    out: dict[str, tuple] = {}
    for name in docs[0]:
        dtype = (dtypes or {}).get(name, np.int64 if name == "input_ids" else None)
        rows = [np.asarray(doc[name], dtype=dtype) for doc in docs]
        trailing = next((row.shape[1:] for row in rows if row.size), ())
        rows = [row.reshape(len(doc["input_ids"]), *trailing) for row, doc in zip(rows, docs, strict=True)]
        out[name] = (np.concatenate(rows), offsets)
    return out


def _plain(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch without ``ids``: PackedColumns' rows are named by their place in the batch, pack_flat's by
    their first document."""
    return {key: value for key, value in batch.items() if key != "ids"}


def assert_same(got: dict[str, Any], want: dict[str, Any], where: Any = "") -> None:
    """Key for key (in order, ``ids`` aside), dtype, shape and value (a NaN nowhere, -inf equal)."""
    got, want = _plain(dict(got)), _plain(dict(want))
    assert list(got) == list(want), (where, list(got), list(want))
    for key, expected in want.items():
        value = got[key]
        if isinstance(expected, torch.Tensor):
            assert isinstance(value, torch.Tensor), (where, key)
            assert value.dtype == expected.dtype, (where, key, value.dtype, expected.dtype)
            assert value.shape == expected.shape, (where, key, tuple(value.shape), tuple(expected.shape))
            assert torch.equal(value, expected), (where, key, value, expected)
        else:
            assert value == expected, (where, key, value, expected)


def _check_every_way(
    packed: PackedColumns, records: list[Any], collate: Collator, batch_size: int, where: Any = ""
) -> None:
    """``__getitem__``, ``__getitems__``, iteration and a DataLoader of 0 workers give, collated, what the
    records give."""
    assert len(packed) == len(records), where
    for index in range(len(packed)):
        assert_same(collate(packed[index]), collate([records[index]]), (where, "getitem", index))
    for start in range(0, len(packed), batch_size):
        indices = list(range(start, min(start + batch_size, len(packed))))
        want = collate([records[i] for i in indices])
        assert_same(collate(packed.__getitems__(indices)), want, (where, "getitems", indices))
    backwards = list(range(len(packed)))[::-1]
    if backwards:
        want = collate([records[i] for i in backwards])
        assert_same(collate(packed.__getitems__(backwards)), want, (where, "getitems reversed"))
    rows = list(packed)  # iteration: __getitem__ until IndexError
    assert len(rows) == len(records), where
    for index, row in enumerate(rows):
        assert_same(collate(row), collate([records[index]]), (where, "iter", index))
    loaders = [
        torch.utils.data.DataLoader(source, batch_size=batch_size, collate_fn=collate)
        for source in (packed, records)
    ]
    count = 0
    for got, want in zip(*loaders, strict=True):
        assert_same(got, want, (where, "DataLoader", count))
        count += 1
    assert count == -(-len(records) // batch_size), where


# --- the found case, checked by hand ------------------------------------------------------------

TOPK = [
    {"input_ids": [1, 2, 3], "top": [[0.0, -1.0, -2.0], [-0.5, -1.5, -2.5], [-0.25, -0.75, -1.0]]},
    {"input_ids": [4, 5], "top": [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]},
]
TOPK_SPECS = [TensorField("top", align="label", fill=INF, shape=(3,))]


def test_a_teachers_top_k_packed_as_columns_reaches_the_collator_whole():
    """The report: TensorField('top', shape=(3,)) packed by pack_columns was refused by the Collator
    ("holds shape (8,), declared (3,)"): __getitems__ flattened each row's [seq_len, K] values."""
    packed = pack_columns(_pairs(TOPK), 4, pad_token_id=0, float_fields=TOPK_SPECS)
    assert packed.fields["top"].shape == (2, 4, 3)
    [batch] = packed.__getitems__([0, 1])
    values, offsets = batch["top"]
    assert values.shape == (8, 3) and offsets.tolist() == [0, 4, 8]
    assert values[3].tolist() == [INF] * 3 and values[:3].tolist() == TOPK[0]["top"]
    out = Collator(return_labels=True, float_fields=TOPK_SPECS)([batch])
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert out["labels"].tolist() == [[2, 3, -100], [5, -100, -100]]
    # Label-aligned: out["top"][:, j] is the prediction scored against labels[:, j] (the row's first S - 1).
    assert out["top"].dtype == torch.float32 and out["top"].shape == (2, 3, 3)
    assert out["top"].tolist() == [
        [[0.0, -1.0, -2.0], [-0.5, -1.5, -2.5], [-0.25, -0.75, -1.0]],
        [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [INF, INF, INF]],
    ]
    records = pack_flat(TOPK, 4, pad_token_id=0, float_fields=TOPK_SPECS)
    assert_same(out, Collator(return_labels=True, float_fields=TOPK_SPECS)(records))


def test_one_row_and_a_list_of_rows_keep_the_value_dims():
    """packed[i] is a batch of one row; a list of such rows is one batch, their rows one after the other."""
    packed = pack_columns(_pairs(TOPK), 4, pad_token_id=0, float_fields=TOPK_SPECS)
    collate = Collator(return_labels=True, float_fields=TOPK_SPECS)
    records = pack_flat(TOPK, 4, pad_token_id=0, float_fields=TOPK_SPECS)
    [one] = packed[1]
    assert one["top"][0].shape == (4, 3)
    assert_same(collate(packed[1]), collate(records[1:]))
    assert_same(collate([*packed[1], *packed[0]]), collate([records[1], records[0]]))


# --- every declared shape, dtype and fill -------------------------------------------------------

EXPERTS = 5


def _documents(lengths: list[int], k: int, layers: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        docs.append(
            {
                "input_ids": rng.integers(3, 60, n).tolist(),
                "loss_mask": rng.integers(0, 2, n).tolist(),
                "top_ids": rng.integers(0, 60, (n, k)).tolist(),
                "top_lp": (-rng.integers(0, 16, (n, k)) / 4).tolist(),
                "routes": rng.integers(0, EXPERTS, (n, layers, k)).tolist(),
                "weight": (rng.integers(0, 8, n) / 8).tolist(),
            }
        )
    return docs


def _specs(
    align: Any, float_dtype: torch.dtype, int_dtype: torch.dtype, k: int, layers: int, spread: bool
) -> list[Any]:
    return [
        TensorField("top_ids", align=align, dtype=int_dtype, shape=(k,)),
        TensorField("top_lp", align=align, dtype=float_dtype, fill=INF, shape=(k,)),
        TensorField("routes", dtype=int_dtype, shape=(layers, k), fill=Spread(EXPERTS) if spread else 0),
        TensorField("weight", dtype=float_dtype, fill=0.5),
    ]


@pytest.mark.parametrize("float_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int16, torch.uint8])
@pytest.mark.parametrize("align", ["token", "label"])
@pytest.mark.parametrize("spread", [False, True])
def test_value_fields_of_every_shape_dtype_and_fill_collate_as_pack_flats_records(
    float_dtype, int_dtype, align, spread
):
    docs = _documents([5, 3, 9, 1, 4, 7, 2], k=3, layers=2, seed=7)
    specs = _specs(align, float_dtype, int_dtype, 3, 2, spread)
    options = {"pad_token_id": 0, "float_fields": specs, "strategy": "best_fit", "overflow": "split"}
    packed = pack_columns(_pairs(docs), 8, **options)
    records = pack_flat(docs, 8, **options)
    assert packed.fields["routes"].shape == (len(records), 8, 2, 3)
    collate = Collator(return_labels=True, return_cu_seqlens=True, return_loss_mask=True, float_fields=specs)
    _check_every_way(packed, records, collate, batch_size=3)
    out = collate(packed.__getitems__(range(len(packed))))
    assert out["routes"].dtype == int_dtype and out["routes"].shape[2:] == (2, 3)
    assert out["top_lp"].dtype == float_dtype and out["top_lp"].shape[2:] == (3,)


@pytest.mark.parametrize(
    "options",
    [
        {"flatten": True},
        {"return_padding_mask": True, "return_num_valid_tokens": True},
        {"pad_to_multiple_of": 8, "pad_token_id": 0},
        {"return_labels": False},
    ],
    ids=["flatten", "padding_mask", "pad_to_multiple_of", "no_labels"],
)
def test_the_collators_options_keep_the_value_dims(options):
    docs = _documents([6, 2, 5, 3], k=2, layers=3, seed=3)
    specs = _specs("label", torch.float32, torch.int64, 2, 3, True)
    packed = pack_columns(_pairs(docs), 7, pad_token_id=0, float_fields=specs)
    records = pack_flat(docs, 7, pad_token_id=0, float_fields=specs)
    collate = Collator(**{"return_labels": True, **options}, float_fields=specs)
    _check_every_way(packed, records, collate, batch_size=2)


def test_arrow_documents_pack_as_pairs_do():
    """Documents as an Arrow table (fixed-size lists per token, and lists of lists as datasets stores
    Sequence(Sequence(...))) pack to the rows their pairs give."""
    docs = _documents([4, 6, 1, 3], k=2, layers=2, seed=5)
    specs = _specs("label", torch.float32, torch.int16, 2, 2, True)
    table = pa.table(
        {
            "input_ids": pa.array([d["input_ids"] for d in docs], pa.list_(pa.int32())),
            "loss_mask": [d["loss_mask"] for d in docs],
            "top_ids": pa.array([d["top_ids"] for d in docs], pa.list_(pa.list_(pa.int64(), 2))),
            "top_lp": pa.array([d["top_lp"] for d in docs], pa.large_list(pa.list_(pa.float32()))),
            "routes": [d["routes"] for d in docs],
            "weight": [d["weight"] for d in docs],
        }
    )
    packed = pack_columns(table, 5, pad_token_id=0, float_fields=specs, overflow="split")
    records = pack_flat(docs, 5, pad_token_id=0, float_fields=specs, overflow="split")
    _check_every_way(packed, records, Collator(return_labels=True, float_fields=specs), batch_size=2)


def test_a_jagged_top_k_packs_to_the_batchs_largest_k_as_pack_flat_of_the_columns_does():
    """shape=(None,): pack_columns pads every token's entries to the documents' largest K with the fill, as
    pack_flat of the same columns does; the Collator reads those rows as it reads pack_flat's."""
    docs = [
        {"input_ids": [1, 2, 3], "lp": [[0.0, -1.0], [-0.5], [-0.25, -0.75, -1.0]]},
        {"input_ids": [4, 5], "lp": [[-1.0], [-4.0]]},
        {"input_ids": [6, 7, 8, 9], "lp": [[-2.0], [-3.0, -0.5], [-1.0], [-0.125]]},
    ]
    specs = [TensorField("lp", align="label", fill=INF, shape=(None,))]
    table = pa.Table.from_pylist(docs)
    packed = pack_columns(table, 5, pad_token_id=0, float_fields=specs)
    assert packed.fields["lp"].shape == (len(packed), 5, 3)
    records = pack_flat(table, 5, pad_token_id=0, float_fields=specs)
    _check_every_way(packed, records, Collator(return_labels=True, float_fields=specs), batch_size=2)


def test_a_dataloader_with_workers_and_the_worker_split_keep_the_value_dims():
    """DataLoader(packed, num_workers=2, collate_fn=collator), and collate_fn=collator.stack in the workers
    with collator.finish in the main process, give pack_flat's records' batches."""
    docs = _documents([5, 3, 9, 1, 4, 7, 2, 6, 6, 3], k=3, layers=2, seed=11)
    specs = _specs("label", torch.bfloat16, torch.int16, 3, 2, True)
    packed = pack_columns(_pairs(docs), 8, pad_token_id=0, float_fields=specs, overflow="split")
    records = pack_flat(docs, 8, pad_token_id=0, float_fields=specs, overflow="split")
    collate = Collator(return_labels=True, return_cu_seqlens=True, float_fields=specs)
    want = [collate(records[i : i + 3]) for i in range(0, len(records), 3)]

    def loader(collate_fn: Any) -> Any:
        return torch.utils.data.DataLoader(packed, batch_size=3, num_workers=2, collate_fn=collate_fn)

    got = list(loader(collate))
    assert len(got) == len(want)
    for index, (left, right) in enumerate(zip(got, want, strict=True)):
        assert_same(left, right, ("workers", index))
    split = [collate.finish(stacked) for stacked in loader(collate.stack)]
    for index, (left, right) in enumerate(zip(split, want, strict=True)):
        assert_same(left, right, ("stack/finish", index))
    local = [
        collate.finish(collate.stack(packed.__getitems__(range(i, min(i + 3, len(packed))))))
        for i in range(0, len(packed), 3)
    ]
    for index, (left, right) in enumerate(zip(local, want, strict=True)):
        assert_same(left, right, ("stack/finish in process", index))


def test_packed_rows_are_still_refused_by_for_transformers_naming_the_fix():
    """Collator.for_transformers does not lay out packed columns (a _padding_length column): refused, value
    fields or not, naming the native Collator."""
    packed = pack_columns(_pairs(TOPK), 4, pad_token_id=0, float_fields=TOPK_SPECS)
    collate = Collator.for_transformers(padding_free=True, float_fields=TOPK_SPECS)
    with pytest.raises(ValueError, match="_padding_length"):
        collate(packed.__getitems__([0, 1]))


def test_columnar_dataset_hands_tensor_fields_over_whole():
    """ColumnarDataset over a table with a [K], a [layers, k] and a jagged field: each batch collates as
    the same rows given as dicts."""
    docs = _documents([4, 6, 1, 3, 5], k=2, layers=2, seed=9)
    for doc, width in zip(docs, [1, 2, 3, 1, 2], strict=True):
        doc["jag"] = [[-0.5] * (1 + (width + t) % 3) for t in range(len(doc["input_ids"]))]
    specs = [
        *_specs("label", torch.float32, torch.int16, 2, 2, True),
        TensorField("jag", align="label", fill=INF, shape=(None,)),
    ]
    table = pa.table(
        {
            "input_ids": [d["input_ids"] for d in docs],
            "top_ids": pa.array([d["top_ids"] for d in docs], pa.list_(pa.list_(pa.int64(), 2))),
            "top_lp": [d["top_lp"] for d in docs],
            "routes": [d["routes"] for d in docs],
            "weight": [d["weight"] for d in docs],
            "jag": [d["jag"] for d in docs],
        }
    )
    dataset = ColumnarDataset(table)
    collate = Collator(return_labels=True, pad_token_id=0, float_fields=specs)
    for indices in ([0, 1], [4, 2, 3], [1]):
        rows = [{k: v for k, v in docs[i].items() if k != "loss_mask"} for i in indices]
        [batch] = dataset.__getitems__(indices)
        assert batch["routes"][0].shape[1:] == (2, 2)
        assert_same(collate([batch]), collate(rows), indices)
    assert_same(collate(dataset[3]), collate([{k: v for k, v in docs[3].items() if k != "loss_mask"}]))


# --- the property --------------------------------------------------------------------------------


@st.composite
def packed_documents(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 6))
    lengths = [draw(st.integers(0, 7)) for _ in range(count)]
    k, layers = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    docs = []
    for n in lengths:
        ids = draw(st.lists(st.integers(3, 40), min_size=n, max_size=n))
        flat = draw(st.lists(st.integers(0, 40), min_size=n * k, max_size=n * k))
        lps = draw(st.lists(st.integers(-16, 0), min_size=n * k, max_size=n * k))
        routes = draw(st.lists(st.integers(0, EXPERTS - 1), min_size=n * layers * k, max_size=n * layers * k))
        docs.append(
            {
                "input_ids": ids,
                "loss_mask": draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
                "top_ids": np.array(flat, np.int64).reshape(n, k).tolist(),
                "top_lp": (np.array(lps, np.float64).reshape(n, k) / 4).tolist(),
                "routes": np.array(routes, np.int64).reshape(n, layers, k).tolist(),
                "weight": [0.25 * (i % 4) for i in range(n)],
            }
        )
    return {
        "docs": docs,
        "k": k,
        "layers": layers,
        "seq_len": draw(st.integers(1, 9)),
        "strategy": draw(st.sampled_from(["greedy", "best_fit"])),
        "overflow": draw(st.sampled_from(["split", "truncate", "auto"])),
        "buffer_size": draw(st.none() | st.integers(1, 4)),
        "emit_positions": draw(st.booleans()),
        "align": draw(st.sampled_from(["token", "label"])),
        "float_dtype": draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        "int_dtype": draw(st.sampled_from([torch.int64, torch.int16])),
        "spread": draw(st.booleans()),
        "batch_size": draw(st.integers(1, 4)),
        "flatten": draw(st.booleans()),
    }


@SETTINGS
@given(packed_documents())
def test_pack_columns_rows_collate_as_pack_flats_records(case):
    """Random documents with a [K] and a [layers, k] field: pack_columns -> Collator equals pack_flat (same
    documents, same options) -> Collator, key for key, through __getitem__, __getitems__, iteration and a
    DataLoader."""
    specs = _specs(
        case["align"], case["float_dtype"], case["int_dtype"], case["k"], case["layers"], case["spread"]
    )
    options = {
        "pad_token_id": 0,
        "float_fields": specs,
        "strategy": case["strategy"],
        "overflow": case["overflow"],
        "buffer_size": case["buffer_size"],
        "emit_positions": case["emit_positions"],
    }
    try:
        records = pack_flat(case["docs"], case["seq_len"], **options)
    except ValueError as error:  # overflow='auto' refuses to cut a prompted document: both entry points
        with pytest.raises(ValueError, match="more than seq_len"):
            pack_columns(_pairs(case["docs"]), case["seq_len"], **options)
        assert "more than seq_len" in str(error)
        event("refused: overflow='auto' with a prompt")
        return
    packed = pack_columns(_pairs(case["docs"]), case["seq_len"], **options)
    if not any(doc["input_ids"] for doc in case["docs"]):
        assert len(packed) == len(records) == 0
        event("no tokens: no rows")
        return
    event("collated")
    trailing = {"top_ids": (case["k"],), "top_lp": (case["k"],), "routes": (case["layers"], case["k"])}
    for name, shape in trailing.items():
        assert packed.fields[name].shape == (len(records), case["seq_len"], *shape)
        [batch] = packed.__getitems__([0])
        assert batch[name][0].shape == (case["seq_len"], *shape)
    if not case["emit_positions"] and any(len(r.meta.tags["_segments"]) > 1 for r in records):
        with pytest.raises(ValueError, match="without positions, so its labels would cross"):
            Collator(return_labels=True)(records)  # boundary-safe labels find documents by positions
    collate = Collator(  # cu_seqlens need the positions (refused without them, records and columns alike)
        return_labels=True,
        boundary_safe_labels=case["emit_positions"],  # without positions: labels across, as asked
        return_cu_seqlens=case["emit_positions"],
        flatten=case["flatten"],
        float_fields=specs,
    )
    _check_every_way(packed, records, collate, case["batch_size"], where=case)


def test_column_batches_are_what_getitems_returns():
    packed = pack_columns(_pairs(TOPK), 4, pad_token_id=0, float_fields=TOPK_SPECS)
    [batch] = packed.__getitems__([1])
    assert type(batch) is ColumnBatch and list(batch) == ["input_ids", "top", "positions", "_padding_length"]


def test_rows_packed_without_positions_carry_their_documents():
    """``emit_positions=False``: the rows carry ``seq_lengths``, so the Collator refuses labels that would
    cross documents, as it refuses ``pack_flat``'s rows (opt out with ``boundary_safe_labels=False``)."""
    ids = (np.array([11, 12, 13, 21, 22, 31, 32, 33, 34]), np.array([0, 3, 5, 9]))
    packed = pack_columns({"input_ids": ids}, 5, pad_token_id=0, emit_positions=False)
    assert packed.sizes.tolist() == [3, 2, 4]
    (batch,) = packed.__getitems__([1, 0])
    values, offsets = batch["seq_lengths"]
    assert [part.tolist() for part in np.split(values, offsets[1:-1])] == [[4], [3, 2]]
    assert packed[-1][0]["seq_lengths"][0].tolist() == [4]  # counted from the end, as every field
    with pytest.raises(ValueError, match=r"2 documents packed in one row.*emit_positions=True"):
        Collator(return_labels=True)(packed.__getitems__([0, 1]))
    records = pack_flat([{"input_ids": [11, 12, 13]}, {"input_ids": [21, 22]}], 5, pad_token_id=0,
                        emit_positions=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"emit_positions=True"):
        Collator(return_labels=True)(records)
    crossing = Collator(return_labels=True, boundary_safe_labels=False)(packed.__getitems__([0, 1]))
    assert crossing["labels"].tolist() == [[12, 13, 21, 22], [32, 33, 34, -100]]
    positioned = pack_columns({"input_ids": ids}, 5, pad_token_id=0)
    assert "seq_lengths" not in positioned.__getitems__([0])[0]
