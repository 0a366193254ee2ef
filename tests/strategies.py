"""Hypothesis strategies for packed batches, shared by the property tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from helpers import record
from hypothesis import strategies as st

from zephon_collate import SampleBatch

VOCAB = 12


@st.composite
def segment_positions(draw: st.DrawFn, length: int) -> list[int]:
    """Positions restarting at zero at random segment starts (always zero at index 0)."""
    starts = draw(st.lists(st.booleans(), min_size=length, max_size=length))
    positions, current = [], 0
    for index, start in enumerate(starts):
        current = 0 if start or index == 0 else current + 1
        positions.append(current)
    return positions


@st.composite
def packed_batches(draw: st.DrawFn, *, ragged: bool = False, min_length: int = 1) -> SampleBatch:
    """A batch of dict or array payloads with tokens, and (all or none) positions, loss_mask and weights."""
    rows = draw(st.integers(1, 4))
    common = draw(st.integers(min_length, 9))
    lengths = [draw(st.integers(min_length, 9)) if ragged else common for _ in range(rows)]
    with_positions, with_mask, with_weights = (draw(st.booleans()) for _ in range(3))
    array_payloads = not (with_positions or with_mask or with_weights) and draw(st.booleans())
    kind = draw(st.sampled_from(["list", "numpy", "torch"]))
    records = []
    for index, length in enumerate(lengths):
        tokens = draw(st.lists(st.integers(0, VOCAB), min_size=length, max_size=length))
        fields: dict[str, Any] = {"input_ids": tokens}
        if with_positions:
            fields["positions"] = draw(segment_positions(length))
        if with_mask:
            fields["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        if with_weights:
            fields["weights"] = draw(st.lists(st.integers(0, 5), min_size=length, max_size=length))
        if kind == "numpy":
            fields = {key: np.array(value, dtype=np.int64) for key, value in fields.items()}
        elif kind == "torch":
            fields = {key: torch.tensor(value) for key, value in fields.items()}
        padding = draw(st.none() | st.integers(0, length))
        payload = fields["input_ids"] if array_payloads else fields
        records.append(record(payload, index, padding))
    return SampleBatch(records)


@st.composite
def training_options(draw: st.DrawFn, batch: SampleBatch) -> dict[str, Any]:
    """Valid to_training options for ``batch`` (every flag at random)."""
    first = batch.records[0].payload
    has = (lambda name: name in first) if isinstance(first, dict) else (lambda name: False)
    return _flag_options(draw, positions=has("positions"), weights=has("weights"))


def _flag_options(draw: st.DrawFn, *, positions: bool, weights: bool) -> dict[str, Any]:
    """The flags every option strategy draws: labels and their masks, EOS masking, flattening,
    padding mask, position mode, cu_seqlens (only with ``positions``), the ``weights`` extra field."""
    labels = draw(st.booleans())
    options: dict[str, Any] = {
        "return_labels": labels,
        "flatten": draw(st.booleans()),
        "return_padding_mask": draw(st.booleans()),
        "position_mode": draw(st.sampled_from(["preserve", "sequence"])),
        "ignore_index": draw(st.sampled_from([-100, -1, -100, 0])),
        "return_cu_seqlens": positions and draw(st.booleans()),
    }
    if weights:
        options["extra_fields"] = ["weights"]
    if labels:
        options["return_loss_mask"] = draw(st.booleans())
        options["return_num_valid_tokens"] = draw(st.booleans())
        if draw(st.booleans()):
            options.update(eos_mask_loss=True, eos_token_id=draw(st.integers(0, VOCAB)))
    return options


# --- Hostile input: valid batches, then 0 to 3 corruptions (tests/test_invariants.py, tests/fuzz/) -------

INT64_MAX = 2**63 - 1
TOKEN_DTYPES = {
    "numpy": [np.int64, np.int32, np.int16, np.uint8, np.uint16, np.uint32, np.uint64],
    "torch": [torch.int64, torch.int32, torch.int16, torch.uint8],
}


@st.composite
def containers(draw: st.DrawFn, values: list, *, kind: str | None = None) -> Any:
    """``values`` (a list of ints) as a list, tuple, NumPy array or tensor of a random integer dtype,
    sometimes a non-contiguous view (strided, negative stride, storage offset)."""
    kind = kind or draw(st.sampled_from(["list", "tuple", "numpy", "torch"]))
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    fits = [v for v in values if v < 0 or v > 255] == []
    dtypes = TOKEN_DTYPES[kind] if fits else TOKEN_DTYPES[kind][:2]
    dtype = draw(st.sampled_from(dtypes))
    layout = draw(st.sampled_from(["plain", "strided", "offset"]))
    if kind == "numpy":
        array = np.array(values, dtype=dtype)
        if layout == "strided":
            array = np.repeat(array, 2)[::2]
        elif layout == "offset":
            array = np.ascontiguousarray(array[::-1])[::-1]  # a negative stride
        return array
    tensor = torch.tensor(values, dtype=dtype)
    if layout == "strided" and len(values):
        tensor = tensor.repeat_interleave(2)[::2]
    elif layout == "offset":
        tensor = torch.cat([tensor[:1], tensor])[1:]  # a view with a storage offset
    return tensor


@st.composite
def varied_batches(draw: st.DrawFn) -> dict[str, Any]:
    """A valid batch spec: ``{"records": [(meta kwargs, payload)], "options": to_training kwargs}``.

    Payload values come in every container and integer dtype, contiguous or not;
    rows may have 0 or 1 tokens; some sample ids repeat. Build it with :func:`build_batch`.
    """
    rows = draw(st.integers(0, 4))
    ragged = draw(st.booleans()) and draw(st.booleans())
    common = draw(st.integers(0, 8))
    lengths = [draw(st.integers(0, 8)) if ragged else common for _ in range(rows)]
    with_positions, with_mask, with_weights = (draw(st.booleans()) for _ in range(3))
    array_payloads = not (with_positions or with_mask or with_weights) and draw(st.booleans())
    token_name = draw(st.sampled_from(["input_ids", "input_ids", "tokens", "ids"]))
    records = []
    for index, length in enumerate(lengths):
        tokens = draw(st.lists(st.integers(0, VOCAB), min_size=length, max_size=length))
        fields: dict[str, Any] = {token_name: draw(containers(tokens))}
        if with_positions:
            fields["positions"] = draw(containers(draw(segment_positions(length)) if length else []))
        if with_mask:
            mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
            style = draw(st.sampled_from(["int", "bool", "float"]))
            if style == "bool":
                fields["loss_mask"] = (
                    np.array(mask, dtype=bool) if draw(st.booleans()) else torch.tensor(mask).bool()
                )
            elif style == "float":
                fields["loss_mask"] = (
                    [float(m) for m in mask] if draw(st.booleans()) else torch.tensor(mask).float()
                )
            else:
                fields["loss_mask"] = draw(containers(mask))
        if with_weights:
            fields["weights"] = draw(
                containers(draw(st.lists(st.integers(0, 5), min_size=length, max_size=length)))
            )
        if draw(st.integers(0, 5)) == 0:
            fields["text"] = draw(st.text(max_size=3))
        padding = draw(st.none() | st.integers(0, length))
        sample = draw(st.integers(0, index)) if draw(st.integers(0, 4)) == 0 else index  # duplicate ids
        meta = {"sample_id": (0, 0, sample), "lane_id": 0, "chunk_id": 0}
        meta["tags"] = {} if padding is None else {"_padding_length": padding}
        records.append((meta, fields[token_name] if array_payloads else fields))
    options = _flag_options(draw, positions=with_positions, weights=with_weights)
    dtypes = ["auto", torch.int32, np.int64, np.dtype("int16"), None]
    options["dtype"] = draw(st.sampled_from(dtypes)) if not ragged else None
    if token_name != "input_ids" and draw(st.booleans()):
        options["tokens_field"] = token_name
    if draw(st.integers(0, 3)) == 0:
        options["exclude_fields"] = draw(
            st.lists(st.sampled_from(["texts", "ids", "labels", "nothing"]), max_size=2)
        )
    if draw(st.integers(0, 3)) == 0:
        options["rename_fields"] = (
            {"input_ids": "input"} if draw(st.booleans()) else {"texts": "t", "ids": "i"}
        )
    return {"records": records, "options": options}


def _plain(value: Any) -> list | None:
    """``value`` as a flat list of Python numbers, or ``None`` if it is not one (already corrupted)."""
    try:
        plain = np.asarray(value).tolist()
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    numbers = isinstance(plain, list) and all(isinstance(v, (int, float)) for v in plain)
    return plain if numbers and all(-(2**63) <= v <= INT64_MAX for v in plain) else None


def _first_field(spec: dict[str, Any], draw: st.DrawFn, names: tuple[str, ...] | None = None):
    """A (record index, field name) of a dict payload, or None."""
    places = [
        (i, name)
        for i, (_, payload) in enumerate(spec["records"])
        if isinstance(payload, dict)
        for name in payload
        if names is None or name in names
    ]
    return draw(st.sampled_from(places)) if places else None


TOKEN_NAMES = ("input_ids", "tokens", "ids")
BAD_ROWS = [
    lambda n: [float(i) for i in range(n)] or [0.5],
    lambda n: np.arange(n, dtype=np.float32),
    lambda n: torch.arange(n, dtype=torch.float16),
    lambda n: [True] * max(n, 1),
    lambda n: torch.ones(n, dtype=torch.bool),
    lambda n: np.zeros(n, dtype=np.complex64),
    lambda n: np.array(list(range(n)), dtype=object),
    lambda n: [1, None] + [2] * n,
    lambda n: ["a"] * max(n, 1),
    lambda n: "abc",
    lambda n: None,
    lambda n: {"a": 1},
    lambda n: 7,
    lambda n: [2**63] * max(n, 1),
    lambda n: [2**64] * max(n, 1),
    lambda n: np.full(max(n, 1), 2**63, dtype=np.uint64),
    lambda n: [-1] * max(n, 1),
    lambda n: [[1, 2], [3]],
    lambda n: [[1, 2]] * n,
    lambda n: torch.arange(n).to_sparse(),
    lambda n: torch.zeros(n, dtype=torch.long, device="meta"),
    lambda n: list(range(n + 1)),
    lambda n: list(range(max(n - 1, 0))),
    lambda n: [],
    lambda n: torch.tensor([]),
]
BAD_MASKS = [[float("nan")], [2], [-1], [0.5], [float("inf")], ["x"]]
BAD_PADDING = [-1, 10**6, 1.5, "2", True, torch.tensor(1), None, np.int64(1)]


def _mutate(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """Apply one random corruption (or unusual but valid change) to ``spec`` in place."""
    records, options = spec["records"], spec["options"]
    what = draw(st.integers(0, 15))
    if what <= 3 and records:  # a bad value in some field
        place = _first_field(spec, draw)
        if place is not None:
            index, name = place
            payload = records[index][1]
            length = len(payload[name]) if hasattr(payload[name], "__len__") else 1
            maker = draw(st.sampled_from(BAD_ROWS))
            if name == "loss_mask" and draw(st.booleans()):
                payload[name] = list(payload[name]) if hasattr(payload[name], "__len__") else []
                payload[name] = (payload[name] + draw(st.sampled_from(BAD_MASKS)))[-max(length, 1) :]
            else:
                payload[name] = maker(length)
        else:
            index = draw(st.integers(0, len(records) - 1))
            records[index] = (records[index][0], draw(st.sampled_from(BAD_ROWS))(3))
    elif what == 4 and records:  # drop or misspell a field
        place = _first_field(spec, draw)
        if place is not None:
            index, name = place
            value = records[index][1].pop(name)
            if draw(st.booleans()):
                records[index][1][
                    draw(st.sampled_from([name + "s", name[:-1], "position_ids", "loss_masks"]))
                ] = value
    elif what == 5 and records:  # padding tag of a wrong value or type
        index = draw(st.integers(0, len(records) - 1))
        records[index][0]["tags"] = {"_padding_length": draw(st.sampled_from(BAD_PADDING))}
    elif what == 6 and records:  # a sentinel
        index = draw(st.integers(0, len(records) - 1))
        records[index][0]["tags"] = {draw(st.sampled_from(["_tombstone", "_flush"])): True}
    elif what == 7 and records:  # a payload that is not a payload, or an array payload among dicts
        index = draw(st.integers(0, len(records) - 1))
        records[index] = (
            records[index][0],
            draw(st.sampled_from([None, "tokens", b"\x01", 3, 2.5, {1, 2}, [4, 5, 6]])),
        )
    elif what == 8 and records:  # positions that do not start at zero
        place = _first_field(spec, draw, ("positions",))
        if place is not None:
            index, _ = place
            payload = records[index][1]
            plain = _plain(payload["positions"])
            if plain is not None:
                payload["positions"] = [p + 1 for p in plain]
    elif what == 9 and records:  # a field on another device (meta stands in for it)
        place = _first_field(spec, draw)
        if place is not None:
            index, name = place
            payload = records[index][1]
            if hasattr(payload[name], "__len__") and not isinstance(payload[name], str):
                payload[name] = torch.zeros(len(payload[name]), dtype=torch.long, device="meta")
    elif what == 10:  # an argument of a wrong type or value
        name, value = draw(
            st.sampled_from(
                [
                    ("dtype", torch.float32), ("dtype", torch.uint8), ("dtype", 5), ("dtype", "int8"),
                    ("dtype", torch.int8), ("dtype", np.uint16), ("ignore_index", 1.5), ("ignore_index", 2**70),
                    ("ignore_index", 300), ("ignore_index", 5), ("eos_token_id", -1), ("eos_token_id", True),
                    ("eos_token_id", 3), ("eos_token_id", 2**64), ("position_mode", "continuous"),
                    ("return_labels", 1), ("flatten", "yes"), ("return_loss_mask", True),
                    ("return_num_valid_tokens", True), ("eos_mask_loss", True), ("extra_fields", "weights"),
                    ("extra_fields", ["input_ids"]), ("extra_fields", ["padding_length"]),
                    ("extra_fields", ["missing"]), ("extra_fields", ["loss_mask"]), ("extra_fields", [3]),
                    ("exclude_fields", "ids"), ("exclude_fields", None), ("rename_fields", {"labels": "y"}),
                    ("rename_fields", {"input_ids": "texts"}), ("rename_fields", [("a", "b")]),
                    ("rename_fields", {"input_ids": 3}), ("tokens_field", ""), ("tokens_field", "tokenz"),
                    ("tokens_field", None), ("return_cu_seqlens", True), ("return_padding_mask", True),
                ]
            )
        )  # fmt: skip
        options[name] = value
    elif what == 11 and records:  # ragged rows: one row one token longer
        place = _first_field(spec, draw, TOKEN_NAMES)
        if place is not None:
            index, name = place
            payload = records[index][1]
            plain = _plain(payload[name])
            if plain is not None:
                payload[name] = [*plain, 1]
    elif what == 12 and records:  # non-scalar tokens in every row
        for _, payload in records:
            if isinstance(payload, dict):
                for name in TOKEN_NAMES:
                    plain = _plain(payload[name]) if name in payload else None
                    if plain is not None:
                        payload[name] = np.stack([np.array(plain, dtype=np.int64)] * 2, axis=-1)
                mask = _plain(payload["loss_mask"]) if "loss_mask" in payload else None
                if mask is not None and draw(st.booleans()):  # a per-channel supervision mask
                    other = draw(st.lists(st.integers(0, 1), min_size=len(mask), max_size=len(mask)))
                    payload["loss_mask"] = np.stack(
                        [np.array(mask), np.array(other, dtype=np.asarray(mask).dtype)], -1
                    )
    elif what == 13 and records:  # a record with no tokens at all, or only one
        place = _first_field(spec, draw, TOKEN_NAMES)
        if place is not None:
            index, name = place
            records[index][1][name] = draw(st.sampled_from([[], [5], torch.tensor([]), np.array([])]))
    elif what == 14:  # the batch itself is not a list of records
        spec["not_records"] = draw(
            st.sampled_from(["batch", None, {"input_ids": [1]}, [{"input_ids": [1]}], 3])
        )
    else:  # an extra, unlisted field: harmless
        place = _first_field(spec, draw)
        if place is not None:
            records[place[0]][1]["unused"] = draw(st.sampled_from([[1, 2], "text", None, object()]))


@st.composite
def hostile_batches(draw: st.DrawFn, *, max_corruptions: int = 3) -> dict[str, Any]:
    """A :func:`varied_batches` spec with 0 to ``max_corruptions`` random corruptions applied."""
    spec = draw(varied_batches())
    for _ in range(draw(st.integers(0, max_corruptions))):
        _mutate(draw, spec)
    return spec


def build_batch(spec: dict[str, Any]) -> Any:
    """The SampleBatch of a spec (or, after a corruption, the non-batch to pass instead)."""
    from zephon_collate import SampleMeta, SampleRecord

    if "not_records" in spec:
        return spec["not_records"]
    return SampleBatch([SampleRecord(SampleMeta(**meta), payload) for meta, payload in spec["records"]])


def grouped(draw: st.DrawFn, lengths: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Small documents (a quarter of ``lengths``) in random groups whose total fits ``budget``."""
    lengths = [max(1, n // 4) for n in lengths]
    keys = draw(st.lists(st.integers(0, 5), min_size=len(lengths), max_size=len(lengths)))
    groups, sums = [], {}
    for i, (length, key) in enumerate(zip(lengths, keys, strict=True)):
        key = key if sums.get(key, 0) + length <= budget else 100 + i
        sums[key] = sums.get(key, 0) + length
        groups.append(key)
    return lengths, groups
