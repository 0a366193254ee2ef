"""Any input, valid or hostile: a documented error, or an output that satisfies every invariant.

The property (:func:`check_case`) runs one generated batch and option set
(``strategies.hostile_batches``: a valid batch with 0 to 3 corruptions) through
every entry point: ``to_training``, ``SampleBatch.to_training``, ``Collator()``
and ``Collator.stack`` + ``finish``. Each call must either

- raise ``ValueError`` or ``TypeError`` from zephon_collate's own code (never a
  raw torch, NumPy or Python error), naming only records that exist, the same
  error from every entry point; or
- return the same output from every entry point, equal to the pure-Python
  reference (``tests/reference.py``) and satisfying the invariants: shapes
  aligned, ``labels[t] == tokens[t + 1]`` wherever not ignored, masks consistent
  with each other and with ``num_valid_tokens``, ``cu_seqlens`` increasing and
  ending at each row's length, positions as requested, containers and dtypes as
  documented, no output sharing memory with another output or a payload.

Warnings other than the documented ``eos_token_id`` ``UserWarning`` fail. After
every call, failed or not, the records are unchanged (values, tensor
``_version``, tags). ``tests/fuzz/fuzz_to_training.py`` runs the same
properties with many more examples.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from helpers import as_lists
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_to_training
from strategies import build_batch, hostile_batches
from tensordict import TensorDict

from zephon_collate import Collator, SampleBatch, SampleMeta, SampleRecord, pack_flat, to_training
from zephon_collate.core.keys import POSITION_IDS, SUPERVISION_MASKS
from zephon_collate.read.rules import misspelled
from zephon_collate.transforms import CuSeqlens, EosMask, LossMask, PaddingMask, Positions, TokenShift

PACKAGE = "/zephon_collate/"
TOKEN_CANDIDATES = ("input_ids", "tokens", "token_ids", "ids")
CI = settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))


# --- snapshots: nothing the call is given changes ------------------------------------------------


def snapshot(value: Any) -> Any:
    """A deep copy of ``value`` with, for each tensor, its ``_version`` (in-place writes bump it)."""
    if isinstance(value, torch.Tensor):
        data = None if value.is_meta or value.layout != torch.strided else value.detach().clone()
        return ("tensor", data, value._version, value.dtype, tuple(value.shape), value.device)
    if isinstance(value, np.ndarray):
        return ("array", value.copy(), value.flags.writeable)
    if isinstance(value, Mapping):
        return ("dict", type(value), {key: snapshot(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [snapshot(item) for item in value])
    if isinstance(value, SampleRecord):
        meta = value.meta
        return ("record", meta.sample_id, snapshot(dict(meta.tags)), meta.lineage, snapshot(value.payload))
    if isinstance(value, SampleBatch):
        return ("batch", [snapshot(record) for record in value.records])
    return ("value", value)  # immutable, or an object only identity can compare


def same_snapshot(before: Any, after: Any) -> bool:
    if type(before) is not type(after):
        return False
    if isinstance(before, torch.Tensor):
        return before.dtype == after.dtype and torch.equal(before, after)
    if isinstance(before, np.ndarray):
        return before.dtype == after.dtype and np.array_equal(
            before, after, equal_nan=before.dtype.kind in "fc"
        )
    if isinstance(before, dict):
        return before.keys() == after.keys() and all(same_snapshot(before[k], after[k]) for k in before)
    if isinstance(before, (list, tuple)):
        return len(before) == len(after) and all(
            same_snapshot(a, b) for a, b in zip(before, after, strict=True)
        )
    if isinstance(before, float) and before != before:
        return after != after
    try:
        return bool(before == after)
    except Exception:  # e.g. an object() payload value: identity is all there is
        return before is after


def assert_unchanged(before: Any, value: Any) -> None:
    assert same_snapshot(before, snapshot(value)), "the call changed what it was given"


# --- errors ---------------------------------------------------------------------------------------


def assert_documented_error(error: BaseException, count: int) -> None:
    """A plain ValueError/TypeError raised by zephon_collate itself, naming only records that exist."""
    assert type(error) in (ValueError, TypeError), f"undocumented {type(error).__name__}: {error}"
    assert len(str(error)) <= 600, f"a {len(str(error))}-character message: {str(error)[:300]}..."
    origin = traceback.extract_tb(error.__traceback__)[-1]
    assert PACKAGE in origin.filename, (
        f"raised outside zephon_collate ({origin.filename}:{origin.lineno}): {error!r}"
    )
    for match in re.finditer(r"record (\d+) \(sample_id", str(error)):
        assert int(match.group(1)) < count, f"names record {match.group(1)} of {count}: {error}"


def call(entry: str, batch: Any, options: dict[str, Any]) -> tuple[str, Any]:
    """``("ok", output)`` or ``("error", exception)``; warnings are checked here."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if entry == "to_training":
                result = ("ok", to_training(batch, **options))
            elif entry == "method":
                result = ("ok", batch.to_training(**options))
            elif entry == "collator":
                result = ("ok", Collator(**options, boundary_safe_labels=False)(list(batch.records)))
            else:
                collator = Collator(**options, boundary_safe_labels=False)
                result = ("ok", collator.finish(collator.stack(list(batch.records))))
        except Exception as error:
            result = ("error", error)
    for warning in caught:  # the documented ones: an EOS id not given, a supervision field misspelled
        message = str(warning.message)
        assert issubclass(warning.category, UserWarning) and (
            "eos_token_id" in message or "which nothing reads: did you mean" in message
        ), f"unexpected warning {warning.category.__name__}: {warning.message}"
    return result


# --- invariants -----------------------------------------------------------------------------------


def _row_values(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return value.cpu().tolist()
    return np.asarray(value).tolist()


def _tokens_field(records: list[SampleRecord], options: dict[str, Any]) -> str:
    explicit = options.get("tokens_field", "auto")
    if explicit != "auto":
        return explicit
    dicts = [r.payload for r in records if isinstance(r.payload, Mapping)]
    return next(c for c in TOKEN_CANDIDATES if all(c in p for p in dicts))


def _field(record: SampleRecord, name: str, tokens_field: str) -> list | None:
    payload = record.payload
    if isinstance(payload, Mapping):
        return _row_values(payload[name]) if name in payload else None
    return _row_values(payload) if name == tokens_field else None


def _split(values: list, lengths: list[int]) -> list[list]:
    rows, start = [], 0
    for length in lengths:
        rows.append(values[start : start + length])
        start += length
    assert start == len(values), "flattened output does not hold the rows' tokens"
    return rows


def check_containers(out: dict[str, Any], emitted: dict[str, str], options: dict[str, Any]) -> None:
    """Container kinds and dtypes of the page and DECISIONS."""
    dtype = options.get("dtype", "auto")
    auto = isinstance(dtype, str) and dtype == "auto"
    kind = "list" if dtype is None else "torch" if auto or isinstance(dtype, torch.dtype) else "numpy"
    special = {"loss_mask": "float", "cu_seqlens": "int32", "max_seqlen": "int32", "padding_mask": "bool"}
    for name, value in out.items():
        key = emitted[name]
        if key in ("ids", "texts"):
            assert isinstance(value, list)
            continue
        if key == "num_valid_tokens" or (key == "max_seqlen" and options.get("flatten")):
            assert type(value) is int
            continue
        expected = special.get(key) if (key != "loss_mask" or options.get("return_loss_mask")) else None
        if kind == "torch":
            assert isinstance(value, torch.Tensor) and value.is_contiguous() and not value.requires_grad, key
            want = {"float": torch.float32, "int32": torch.int32, "bool": torch.bool}.get(expected)
            want = want or (torch.long if auto else dtype)
            assert value.dtype == want, (key, value.dtype, want)
        elif kind == "numpy":
            assert isinstance(value, np.ndarray) and value.flags.c_contiguous, key
            want = {"float": np.float32, "int32": np.int32, "bool": np.bool_}.get(expected, np.dtype(dtype))
            assert value.dtype == np.dtype(want), (key, value.dtype, want)
        else:
            assert isinstance(value, list), key


def check_independent(out: dict[str, Any], records: list[SampleRecord]) -> None:
    """No output shares memory with another output or with a payload."""
    tensors = [v for v in out.values() if isinstance(v, torch.Tensor) and v.numel()]
    payloads = [
        value
        for record in records
        for value in (record.payload.values() if isinstance(record.payload, Mapping) else [record.payload])
        if isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_meta
        and value.numel()
    ]
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(pointers)) == len(pointers), "two outputs share memory"
    assert not set(pointers) & {p.untyped_storage().data_ptr() for p in payloads}, (
        "an output shares a payload's memory"
    )
    arrays = [v for v in out.values() if isinstance(v, np.ndarray) and v.size]
    for a, b in ((a, b) for i, a in enumerate(arrays) for b in arrays[i + 1 :]):
        assert not np.shares_memory(a, b), "two outputs share memory"


def check_labels(
    tokens: np.ndarray, labels: np.ndarray, supervision: list | None, pad: int, options: dict
) -> None:
    """``labels[t] == tokens[t + 1]`` except exactly where the page ignores it: trailing padding,
    ``loss_mask[t + 1] == 0`` (per element for a non-scalar mask), predictions from EOS."""
    ignore = options.get("ignore_index", -100)
    targets = tokens[1:]
    if not targets.size:  # as lists, an empty [0, C] row reads back as []
        assert not labels.size, "labels are not tokens[1:]"
        return
    assert labels.shape == targets.shape, "labels are not tokens[1:]"
    must = np.zeros(targets.shape, dtype=bool)
    steps = len(targets)
    must[max(steps - pad, 0) :] = True
    if supervision is not None:
        drop = np.asarray(supervision)[1:] == 0
        must |= drop.reshape(drop.shape + (1,) * (targets.ndim - drop.ndim))
    if options.get("eos_mask_loss"):
        must[tokens[:-1] == options["eos_token_id"]] = True
    expected = np.where(must, ignore, targets)
    assert np.array_equal(labels, expected), f"labels {labels.tolist()} != {expected.tolist()}"


def read_only_what_the_call_reads(records: list[SampleRecord], options: dict[str, Any]) -> list[SampleRecord]:
    """The records as the call sees them: payload positions it does not read and a padding tag it does
    not read (however bad) dropped, so the reference reads the same."""
    reads_positions = (
        options.get("position_mode", "preserve") == "preserve"
        or options.get("return_cu_seqlens")
        or "positions" in options.get("extra_fields", ())
    )
    reads_padding = options.get("return_labels") or options.get("return_padding_mask")
    seen = []
    for r in records:
        payload = r.payload
        if not reads_positions and isinstance(payload, Mapping) and "positions" in payload:
            payload = {key: value for key, value in payload.items() if key != "positions"}
        tags = (
            r.meta.tags if reads_padding else {k: v for k, v in r.meta.tags.items() if k != "_padding_length"}
        )
        meta = SampleMeta(r.meta.sample_id, r.meta.lane_id, r.meta.chunk_id, r.meta.chunk_offset, tags=tags)
        seen.append(SampleRecord(meta, payload))
    return seen


def check_invariants(records: list[SampleRecord], options: dict[str, Any], out: dict[str, Any]) -> None:
    """Every invariant of a successful call (see the module docstring)."""
    check_independent(out, records)
    records = read_only_what_the_call_reads(records, options)
    renames = dict(options.get("rename_fields") or {})
    inverse = {new: old for old, new in renames.items()}
    emitted = {name: inverse.get(name, name) for name in out}
    if records:
        check_containers(out, emitted, options)
    values = {emitted[name]: as_lists(value) for name, value in out.items()}
    labels_on, flatten = options.get("return_labels", False), options.get("flatten", False)
    ignore = options.get("ignore_index", -100)
    excluded = set(options.get("exclude_fields", ()))
    if not records:
        for key, value in values.items():
            if key == "num_valid_tokens":
                assert value == 0
            elif key in ("cu_seqlens", "max_seqlen") and flatten:
                assert value == ([0] if key == "cu_seqlens" else 0)
            else:
                assert value == [], key
        return
    field = _tokens_field(records, options)
    tokens = [_field(r, field, field) for r in records]
    scalar = all(np.asarray(row).ndim == 1 for row in tokens)
    lengths = [max(len(row) - 1, 0) if labels_on else len(row) for row in tokens]

    def rows(key: str) -> list | None:
        if key not in values:
            return None
        return _split(values[key], lengths) if flatten else values[key]

    assert values.get("ids", [r.meta.sample_id for r in records]) == [r.meta.sample_id for r in records]
    inputs = rows("input_ids")
    labels = rows("labels")
    loss_mask = rows("loss_mask") if options.get("return_loss_mask") else None
    padding_mask = rows("padding_mask")
    positions = rows("positions")
    for index, (record, row) in enumerate(zip(records, tokens, strict=True)):
        length = lengths[index]
        if inputs is not None:
            assert inputs[index] == row[:length], "input_ids are not the tokens (cut when labelled)"
        extras = tuple(options.get("extra_fields", ())) if labels_on or flatten else ()
        for key in ("labels", "positions", "padding_mask", "loss_mask", *extras):
            per_row = rows(key)
            if per_row is not None:
                assert len(per_row[index]) == length, f"{key} is not aligned with input_ids"
        pad = record.meta.padding_length or 0
        if labels is not None:
            check_labels(
                np.asarray(row), np.asarray(labels[index]), _field(record, "loss_mask", field), pad, options
            )
        if loss_mask is not None and labels is not None:
            assert np.array_equal(
                np.asarray(loss_mask[index]), (np.asarray(labels[index]) != ignore).astype(float)
            )
        if padding_mask is not None:
            full = [t >= len(row) - pad for t in range(len(row))]
            assert padding_mask[index] == full[:length]
        if positions is not None:
            if options.get("position_mode") == "sequence":
                assert positions[index] == list(range(length))
            else:
                assert positions[index] == _field(record, "positions", field)[:length]
        if "cu_seqlens" in values and not flatten:
            bounds, top = values["cu_seqlens"][index], values["max_seqlen"][index]
            payload_positions = _field(record, "positions", field)[:length]
            starts = [t for t, p in enumerate(payload_positions) if p == 0]
            assert bounds[: len(starts) + 1] == [*starts, length] and set(bounds[len(starts) :]) == {length}
            assert all(a < b for a, b in pairwise(bounds[: len(starts) + 1])), "cu_seqlens not increasing"
            assert top == max((b - a for a, b in pairwise(bounds)), default=0)
    if "cu_seqlens" in values and flatten:
        bounds = values["cu_seqlens"]
        assert bounds[0] == 0 and bounds[-1] == sum(lengths)
        assert all(a < b for a, b in pairwise(bounds)) or sum(lengths) == 0, "cu_seqlens not increasing"
        assert values["max_seqlen"] == max((b - a for a, b in pairwise(bounds)), default=0)
    if "num_valid_tokens" in values and labels is not None:
        assert values["num_valid_tokens"] == sum(
            np.sum(np.asarray(row) != ignore) if np.asarray(row).size else 0 for row in labels
        )
    if "num_valid_tokens" in values and loss_mask is not None:
        assert values["num_valid_tokens"] == sum(np.sum(row) for row in loss_mask)
    extras_are_rows = all(
        np.ndim(_field(r, name, field)) >= 1 for r in records for name in options.get("extra_fields", ())
    )
    if scalar and extras_are_rows:  # the reference (per-token rows only), one record at a time, in Python
        expected = reference_to_training(records, **{k: v for k, v in options.items() if k != "dtype"})
        finals = {renames.get(key, key) for key in expected} - excluded
        assert set(out) == finals, (sorted(out), sorted(finals))
        for key, value in values.items():
            assert value == as_lists(expected[key]), key  # texts are copies: compare their contents


# --- the property ---------------------------------------------------------------------------------


def check_case(spec: dict[str, Any]) -> str:
    """Run one case through every entry point; ``"ok"`` or ``"error"`` (an assertion fails otherwise)."""
    batch = build_batch(spec)
    options = dict(spec["options"])
    before = snapshot(batch)
    if not isinstance(batch, SampleBatch):
        kind, result = call("to_training", batch, options)
        assert kind == "error", "to_training accepted something that is not a batch"
        assert_documented_error(result, 0)
        assert_unchanged(before, batch)
        return "error"
    records = list(batch.records)
    results = {entry: call(entry, batch, options) for entry in ("to_training", "method", "collator", "split")}
    assert_unchanged(before, batch)
    split_kind, split_error = results["split"]
    if split_kind == "error" and "Collator.stack: rows of unequal length" in str(split_error):
        del results["split"]  # documented: the split path needs equal rows (ragged lists: Collator() only)
    if _collator_reads_more(records):
        # Documented: the Collator reads Hugging Face's position_ids as positions, and refuses a misspelled
        # supervision field that to_training warns of; each side must still agree with itself.
        collator = {entry: results.pop(entry) for entry in ("collator", "split") if entry in results}
        check_entries(collator, records, options, invariants=False)
    return check_entries(results, records, options, invariants=True)


def _collator_reads_more(records: list[SampleRecord]) -> bool:
    payloads = [r.payload for r in records if isinstance(r.payload, dict)]
    fields = {name for payload in payloads for name in payload}
    return POSITION_IDS in fields or misspelled(fields, SUPERVISION_MASKS) is not None


def check_entries(
    results: dict[str, tuple[str, Any]],
    records: list[SampleRecord],
    options: dict[str, Any],
    *,
    invariants: bool,
) -> str:
    """The entry points in ``results`` agree: one error, or equal batches (checked against the page)."""
    kinds = {kind for kind, _ in results.values()}
    assert len(kinds) == 1, f"entry points disagree: { {e: (k, r) for e, (k, r) in results.items()} }"
    kind, first = next(iter(results.values()))
    if kind == "error":
        assert_documented_error(first, len(records))
        for entry, (_, error) in results.items():
            assert (type(error), str(error)) == (type(first), str(first)), f"{entry}: {error!r} vs {first!r}"
        return "error"
    if invariants:
        check_invariants(records, options, first)
    for entry, (_, out) in results.items():
        assert as_lists(out) == as_lists(first), f"{entry} differs from {next(iter(results))}"
    return "ok"


@CI
@given(spec=hostile_batches())
def test_any_input_gives_a_documented_error_or_a_correct_batch(spec):
    check_case(spec)


@CI
@given(spec=hostile_batches(max_corruptions=0))
def test_valid_inputs_of_every_container_and_dtype_satisfy_the_invariants(spec):
    """Valid specs only (every container, integer dtype and stride, rows of 0 or 1 token): no error at all."""
    assert check_case(spec) == "ok"


# --- pack_flat / FlatPacker on hostile documents --------------------------------------------------


def check_pack_case(spec: dict[str, Any], seq_len: int, strategy: str) -> str:
    """pack_flat either raises a documented error or gives rows that to_training accepts, tokens intact."""
    batch = build_batch(spec)
    before = snapshot(batch)
    try:
        rows = pack_flat(batch, seq_len, pad_token_id=0, strategy=strategy)
    except Exception as error:
        assert_unchanged(before, batch)
        assert_documented_error(error, len(spec["records"]) if isinstance(batch, SampleBatch) else 0)
        return "error"
    assert_unchanged(before, batch)
    documents = [r for r in batch.records if not r.meta.is_sentinel]
    field = _tokens_field(documents, {}) if documents else "input_ids"
    packed = sorted(t for r in rows for t in r.payload[field][: seq_len - r.meta.padding_length].tolist())
    expected = sorted(t for r in documents for t in np.ravel(_field(r, field, field)).tolist())
    assert packed == expected, "pack_flat lost or invented tokens"
    for row in rows:
        assert all(len(v) == seq_len for v in row.payload.values())
    options = {
        "return_labels": True,
        "return_cu_seqlens": True,
        "return_num_valid_tokens": True,
        "flatten": True,
    }
    check_invariants(rows, options, to_training(rows, **options))
    return "ok"


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    spec=hostile_batches(max_corruptions=2),
    seq_len=st.integers(1, 9),
    strategy=st.sampled_from(["greedy", "best_fit"]),
)
def test_pack_flat_on_any_documents(spec, seq_len, strategy):
    spec.pop("not_records", None)
    check_pack_case(spec, seq_len, strategy)


# --- transforms on hostile TensorDicts ------------------------------------------------------------

TRANSFORMS = [
    TokenShift(input_keys=["positions"]),
    PaddingMask(),
    EosMask(2),
    LossMask(),
    LossMask(supervision_key=None),
    CuSeqlens(),
    CuSeqlens(flatten=True),
    CuSeqlens(num_boundaries=8),
    Positions("sequence"),
]


@st.composite
def hostile_tensordicts(draw: st.DrawFn) -> TensorDict:
    """TensorDicts whose entries have random ranks, sizes and dtypes (some keys absent)."""
    rows = draw(st.integers(0, 3))
    data = {}
    for key in ("input_ids", "labels", "positions", "loss_mask", "padding_length"):
        if draw(st.integers(0, 5)) == 0:
            continue
        shape = [rows, *draw(st.lists(st.integers(0, 4), max_size=2))]
        dtype = draw(st.sampled_from([torch.long, torch.int32, torch.int8, torch.bool, torch.float32]))
        data[key] = torch.randint(0, 3, shape).to(dtype)
    if "padding_length" in data and data["padding_length"].dim() == 1:
        data["padding_length"] = data["padding_length"].long()
    return TensorDict(data, batch_size=[rows])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(td=hostile_tensordicts(), index=st.integers(0, len(TRANSFORMS) - 1))
def test_transforms_raise_documented_errors_on_any_tensordict(td, index):
    """Transforms check keys and shapes (not values): a documented error, or an output, never a raw error."""
    check_transform_case(td, index)


def check_transform_case(td: TensorDict, index: int) -> None:
    before = {key: (value.clone(), value._version) for key, value in td.items()}
    try:
        out = TRANSFORMS[index](td)
    except Exception as error:
        assert_documented_error(error, 0)
    else:
        assert out is not td
    for key, (value, version) in before.items():
        assert torch.equal(td.get(key), value) and td.get(key)._version == version, key
