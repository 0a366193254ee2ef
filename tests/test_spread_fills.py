"""``Spread(experts)`` fills of MoE routes, numbered by the place in the row each batch hands out.

``TensorField(..., fill=Spread(experts), shape=(..., k))`` documents: the place at position ``p`` of
its row gets ``(p * k + j) % experts`` in entry ``j``, so that padding routes cycle through every
expert. The row is the one the batch holds: left padding is numbered once it is at the front, a
padding-free batch by the place in its one row (a label-aligned field's first token of each
sequence too, wherever the sequence starts), a packed row by its place in the packed row, a
context-parallel shard's added tokens by their place in the shard.

Hand-worked values for left padding and a padding-free label-aligned field; a hypothesis property
over the layouts (``for_transformers`` padded right and left, padding-free with and without
``pad_to_multiple_of``, the vision-language dummy image, ``for_rollouts`` padded, padding-free and
with a shared prompt, the native ``Collator`` on records and on ``pack_flat``'s rows, the packers,
context-parallel shards, the worker split), each run on the host and on the torch path; the compiled
chain against both.

Every real token's routes are beyond the experts (``100 + ...``), so a fill can never pass for one.
The native ``Collator``'s token-aligned field cut ``[:, 1:]`` by ``return_labels``, and a
response-aligned field's prompt in a padding-free row, are checked by hand.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from zephon_collate import (
    Collator,
    FlatPacker,
    SampleMeta,
    SampleRecord,
    TensorField,
    pack_flat,
    use_host_pass,
)
from zephon_collate.layouts.vision import MRope
from zephon_collate.packing.columns import pack_columns
from zephon_collate.read.fields import Spread
from zephon_collate.transforms import ContextParallelShard

EXPERTS, K = 7, 2
SPREAD = Spread(EXPERTS)
TOKEN = TensorField("routes", dtype=torch.int64, shape=(K,), fill=SPREAD)
LABEL = TensorField("next_routes", align="label", dtype=torch.int64, shape=(K,), fill=SPREAD)
FIELDS = [TOKEN, LABEL]
DUMMY = 50_000  # the dummy image's token: no example's
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def spread(p: int) -> list[int]:
    """The documented fill of the place at position ``p`` of its row."""
    return [(p * K + j) % EXPERTS for j in range(K)]


def routes_of(token: int) -> list[int]:
    """A real token's own routes: beyond the experts, so never a fill."""
    return [100 + K * token + j for j in range(K)]


# -- examples ---------------------------------------------------------------------------------------


class Examples:
    """Sequences of a prompt and a response; ``shared``: consecutive ones of a group share the prompt.

    Token ids are unique but within a group's prompt. ``before[id]`` is the token before ``id`` in its
    sequence (``None`` at a sequence's first token): a label-aligned value at ``id`` is that token's.
    """

    def __init__(self, groups: list[tuple[int, list[int]]]) -> None:
        ids = itertools.count(1)
        self.rows: list[tuple[list[int], int]] = []  # (ids, prompt length)
        self.before: dict[int, int | None] = {}
        for prompt_length, responses in groups:
            prompt = [next(ids) for _ in range(prompt_length)]
            for response_length in responses:
                sequence = prompt + [next(ids) for _ in range(response_length)]
                self.rows.append((sequence, prompt_length))
                for place, token in enumerate(sequence):
                    self.before[token] = sequence[place - 1] if place else None

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.rows]

    def dicts(self, *, completion: bool = False) -> list[dict[str, Any]]:
        out = []
        for ids, prompt in self.rows:
            row: dict[str, Any] = {
                "input_ids": ids,
                "routes": [routes_of(t) for t in ids],
                "next_routes": [routes_of(t) for t in ids],  # the prediction made at each token's routes
            }
            if completion:
                row["completion_mask"] = [0] * prompt + [1] * (len(ids) - prompt)
            out.append(row)
        return out

    def records(self) -> list[SampleRecord]:
        return [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), row) for i, row in enumerate(self.dicts())]


@st.composite
def examples(draw: st.DrawFn, *, shared: bool = False) -> Examples:
    """1 to 4 groups: a prompt of 1-3 tokens, then 1 response (1 to 3 with ``shared``) of 1-4 tokens."""
    groups = draw(
        st.lists(
            st.tuples(
                st.integers(1, 3),
                st.lists(st.integers(1, 4), min_size=1, max_size=3 if shared else 1),
            ),
            min_size=1,
            max_size=4,
        )
    )
    return Examples(groups)


# -- the check --------------------------------------------------------------------------------------


def expected(ids: Any, before: dict[int, int | None], moved: bool) -> list[list[int]]:
    """Row ``ids``' expected values: a real token's routes (``moved``: a label-aligned field of an
    unshifted layout, the routes of the token before it, the fill at a sequence's first token), the
    fill at its position everywhere else (padding, a packed row's tail, the dummy image)."""
    want = []
    for place, token in enumerate(np.asarray(ids).tolist()):
        if token not in before:
            want.append(spread(place))
        elif not moved:
            want.append(routes_of(token))
        else:
            previous = before[token]
            want.append(spread(place) if previous is None else routes_of(previous))
    return want


def check_rows(ids: Any, values: Any, before: dict[int, int | None], moved: bool, what: str) -> None:
    """Every row of ``values`` (``[B, S, k]`` or ``[S, k]``) as :func:`expected` says, from its ``ids``."""
    ids, values = np.asarray(ids), np.asarray(values)
    assert values.shape == (*ids.shape, K), what
    rows = ids.reshape(-1, ids.shape[-1])
    for row, row_ids in enumerate(rows):
        got = values.reshape(len(rows), -1, K)[row].tolist()
        assert got == expected(row_ids, before, moved), f"{what}, row {row}: ids {row_ids.tolist()}"


def same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert list(a) == list(b), what
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{what}: {key}"
        else:
            assert a[key] == b[key], f"{what}: {key}"


def both_paths(collate: Callable[[Any], dict[str, Any]], batch: Any, what: str) -> dict[str, Any]:
    """The batch on the host path, checked equal to the torch path's (a GPU's, eager)."""
    host = collate(batch)
    with use_host_pass(False):
        same(host, collate(batch), f"{what}: host vs torch")
    return host


# -- hand-worked: the two found cases ----------------------------------------------------------------


def test_left_padding_numbers_the_padding_at_the_front():
    routes = TensorField("routes", dtype=torch.int64, fill=Spread(5), shape=(2,))
    label = TensorField("next_routes", align="label", dtype=torch.int64, fill=Spread(5), shape=(2,))
    rows = [
        {"input_ids": [1, 2, 3], "routes": [[9, 9]] * 3, "next_routes": [[8, 8]] * 3},
        {"input_ids": [4, 5, 6, 7, 8], "routes": [[9, 9]] * 5, "next_routes": [[8, 8]] * 5},
    ]
    collate = Collator.for_transformers(pad_token_id=0, padding_side="left", float_fields=[routes, label])
    out = both_paths(collate, rows, "left")
    assert out["input_ids"][0].tolist() == [0, 0, 1, 2, 3]
    # places 0 and 1: entries (2p, 2p + 1) % 5
    assert out["routes"][0].tolist() == [[0, 1], [2, 3], [9, 9], [9, 9], [9, 9]]
    # the first token, at place 2, predicted by nothing: (4, 5) % 5
    assert out["next_routes"][0].tolist() == [[0, 1], [2, 3], [4, 0], [8, 8], [8, 8]]
    assert out["next_routes"][1].tolist() == [[0, 1], [8, 8], [8, 8], [8, 8], [8, 8]]


def test_padding_free_numbers_each_first_token_by_its_place_in_the_row():
    label = TensorField("next_routes", align="label", dtype=torch.int64, fill=Spread(5), shape=(2,))
    rows = [
        {"input_ids": [1, 2, 3], "next_routes": [[8, 8]] * 3},
        {"input_ids": [4, 5], "next_routes": [[8, 8]] * 2},
        {"input_ids": [6], "next_routes": [[8, 8]]},
    ]
    out = both_paths(Collator.for_transformers(padding_free=True, float_fields=[label]), rows, "free")
    # first tokens at places 0, 3 and 5: (0, 1), (6, 7) % 5 and (10, 11) % 5
    assert out["next_routes"].tolist() == [[[0, 1], [8, 8], [8, 8], [1, 2], [8, 8], [0, 1]]]
    rollouts = Collator.for_rollouts(padding_free=True, float_fields=[label])
    given = [{**row, "completion_mask": [0] + [1] * (len(row["input_ids"]) - 1)} for row in rows[:2]]
    assert both_paths(rollouts, given, "rollouts")["next_routes"].tolist() == [
        [[0, 1], [8, 8], [8, 8], [1, 2], [8, 8]]
    ]


def test_the_dummy_image_is_numbered_where_it_ends_the_row():
    routes = TensorField("routes", dtype=torch.int64, fill=Spread(5), shape=(2,))
    rows = [
        {"input_ids": [0, 1, 2], "attention_mask": [0, 1, 1], "routes": [[9, 9]] * 3},  # one token dropped
        {"input_ids": [3], "routes": [[9, 9]]},
    ]
    collate = Collator.for_transformers(
        padding_free=True, mrope=MRope(dummy_image=(DUMMY, 12)), float_fields=[routes]
    )
    out = both_paths(collate, rows, "dummy image")
    assert out["input_ids"].tolist() == [[1, 2, 3, DUMMY]]
    assert out["routes"][0].tolist() == [[9, 9], [9, 9], [9, 9], [1, 2]]  # place 3: (6, 7) % 5


# -- the property over the layouts --------------------------------------------------------------------

TRANSFORMERS = {
    "padded right": Collator.for_transformers(pad_token_id=0, float_fields=FIELDS),
    "padded right, multiple": Collator.for_transformers(
        pad_token_id=0, pad_to_multiple_of=4, float_fields=FIELDS
    ),
    "padded left": Collator.for_transformers(pad_token_id=0, padding_side="left", float_fields=FIELDS),
    "padded left, multiple": Collator.for_transformers(
        pad_token_id=0, padding_side="left", pad_to_multiple_of=4, float_fields=FIELDS
    ),
    "padding-free": Collator.for_transformers(padding_free=True, float_fields=FIELDS),
    "padding-free, multiple": Collator.for_transformers(
        padding_free=True, pad_token_id=0, pad_to_multiple_of=4, float_fields=FIELDS
    ),
    "dummy image": Collator.for_transformers(
        padding_free=True, mrope=MRope(dummy_image=(DUMMY, 12)), float_fields=FIELDS
    ),
}
ROLLOUTS = {
    "rollouts padded": Collator.for_rollouts(pad_token_id=0, float_fields=FIELDS),
    "rollouts padding-free": Collator.for_rollouts(padding_free=True, float_fields=FIELDS),
    "rollouts padding-free, multiple": Collator.for_rollouts(
        padding_free=True, pad_token_id=0, pad_to_multiple_of=4, float_fields=FIELDS
    ),
    "rollouts shared prompt": Collator.for_rollouts(
        padding_free=True, shared_prompt=True, float_fields=FIELDS
    ),
    "rollouts shared prompt, padded": Collator.for_rollouts(
        pad_token_id=0, shared_prompt=True, float_fields=FIELDS
    ),
}
# The native layout moves no field at collation: a label-aligned field is cut like the inputs
# ([:, :-1]) with return_labels, so its column j is the token at j.
NATIVE = {
    "native": Collator(pad_token_id=0, float_fields=FIELDS),
    "native, multiple": Collator(pad_token_id=0, pad_to_multiple_of=4, float_fields=FIELDS),
    "native, shifted": Collator(pad_token_id=0, return_labels=True, float_fields=[LABEL]),
}
PACKED = {
    "native on packed rows": Collator(float_fields=FIELDS),
    "native on packed rows, shifted": Collator(return_labels=True, float_fields=[LABEL]),
}


@FAST
@given(examples(shared=True), st.integers(0, 3))
def test_every_fill_is_numbered_by_its_place_in_the_final_row(given_examples: Examples, extra: int):
    before = given_examples.before
    dicts = given_examples.dicts()
    for name, collate in TRANSFORMERS.items():
        out = both_paths(collate, dicts, name)
        check_rows(out["input_ids"], out["routes"], before, False, f"{name}: routes")
        check_rows(out["input_ids"], out["next_routes"], before, True, f"{name}: next_routes")
    with_masks = given_examples.dicts(completion=True)
    for name, collate in ROLLOUTS.items():
        out = both_paths(collate, with_masks, name)
        check_rows(out["input_ids"], out["routes"], before, False, f"{name}: routes")
        check_rows(out["input_ids"], out["next_routes"], before, True, f"{name}: next_routes")
    records = given_examples.records()
    for name, collate in NATIVE.items():
        out = both_paths(collate, records, name)
        for field in FIELDS:
            if field.name in out:
                check_rows(out["input_ids"], out[field.name], before, False, f"{name}: {field.name}")
    seq_len = max(given_examples.lengths) + extra
    rows = pack_flat(records, seq_len, pad_token_id=0, float_fields=FIELDS)
    streamed = list(FlatPacker(seq_len, pad_token_id=0, float_fields=FIELDS).pack(records))
    columns = pack_columns(pa.Table.from_pylist(dicts), seq_len, pad_token_id=0, float_fields=FIELDS)
    for field in FIELDS:
        for packer, packed in (("pack_flat", rows), ("FlatPacker", streamed)):
            for row in packed:
                check_rows(row.payload["input_ids"], row.payload[field.name], before, False, packer)
        check_rows(columns.fields["input_ids"], columns.fields[field.name], before, False, "pack_columns")
    for name, collate in PACKED.items():
        out = both_paths(collate, rows, name)
        for field in FIELDS:
            if field.name in out:
                check_rows(out["input_ids"], out[field.name], before, False, f"{name}: {field.name}")


@FAST
@given(examples(), st.integers(1, 3))
def test_context_parallel_shards_number_the_tokens_they_add_by_their_place_in_the_shard(
    given_examples: Examples, cp_size: int
):
    """Each rank's added tokens: the fill at their place in the shard; every other token keeps the
    collated batch's value (a first token's fill numbered in the collated row)."""
    collate = Collator.for_transformers(padding_free=True, float_fields=FIELDS)
    batch = collate(given_examples.dicts())
    tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
    total = batch["input_ids"].shape[1]
    tensors["where"] = torch.arange(total).unsqueeze(0)  # each token's place in the collated row
    fills: dict[str, Any] = {"routes": SPREAD, "next_routes": SPREAD, "where": -1}
    for rank in range(cp_size):
        shard = ContextParallelShard(cp_size, rank, positions_key="position_ids", fill_values=fills)(
            TensorDict(tensors, batch_size=[])
        )
        added = shard["cp_padding_mask"]
        for name in ("routes", "next_routes"):
            got = shard[name]
            for place in range(got.shape[0]):
                if added[place]:
                    assert got[place].tolist() == spread(place), (name, rank, place)
                else:
                    source = int(shard["where"][place])
                    assert got[place].tolist() == batch[name][0, source].tolist(), (name, rank, place)
        assert (shard["where"][added] == -1).all()


def test_the_worker_split_and_the_compiled_chain_give_the_same_fills():
    """``stack`` then ``finish``, the compiled chain (LeftPadding, TokenShift) and the host path agree."""
    cases = {
        "padded left": dict(pad_token_id=0, padding_side="left", float_fields=FIELDS),
        "padding-free": dict(padding_free=True, pad_token_id=0, pad_to_multiple_of=4, float_fields=FIELDS),
    }
    batches = [Examples([(1, [2]), (2, [3]), (3, [1])]), Examples([(2, [4]), (1, [1])])]
    for name, options in cases.items():
        host = Collator.for_transformers(**options)
        compiled = Collator.for_transformers(**options, compile=True)
        for given_examples in batches:
            dicts = given_examples.dicts()
            out = host(dicts)
            same(out, host.finish(host.stack(dicts)), f"{name}: stack + finish")
            same(out, compiled(dicts), f"{name}: compiled")
            check_rows(out["input_ids"], out["routes"], given_examples.before, False, name)
            check_rows(out["input_ids"], out["next_routes"], given_examples.before, True, name)
    native = {"pad_token_id": 0, "return_labels": True, "float_fields": [LABEL]}
    host, compiled = Collator(**native), Collator(**native, compile=True)
    for given_examples in batches:
        records = given_examples.records()
        out = host(records)
        same(out, host.finish(host.stack(records)), "native: stack + finish")
        same(out, compiled(records), "native: compiled")
        check_rows(out["input_ids"], out["next_routes"], given_examples.before, False, "native")


# -- shifted and response-aligned ---------------------------------------------------------------------------------------


def test_native_shifted_token_aligned_fill_is_numbered_by_its_column():
    given_examples = Examples([(1, [2]), (2, [4])])
    out = Collator(pad_token_id=0, return_labels=True, float_fields=[TOKEN])(given_examples.records())
    # column j holds the routes of labels[:, j], the token at j + 1; padding at column j: spread(j)
    for row, (ids, _) in enumerate(given_examples.rows):
        for column in range(out["routes"].shape[1]):
            want = routes_of(ids[column + 1]) if column + 1 < len(ids) else spread(column)
            assert out["routes"][row, column].tolist() == want


def test_padding_free_response_aligned_prompt_fill_is_numbered_in_the_row():
    response = TensorField("routes", align="response", dtype=torch.int64, shape=(2,), fill=Spread(5))
    rows = [
        {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "routes": [[9, 9]] * 2},
        {"input_ids": [4, 5, 6], "completion_mask": [0, 1, 1], "routes": [[9, 9]] * 2},
    ]
    out = Collator.for_rollouts(padding_free=True, float_fields=[response])(rows)
    assert out["routes"][0, 3].tolist() == [1, 2]  # the second prompt's token, at place 3
