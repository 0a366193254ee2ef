"""Tensor-valued fields (a teacher's top-k, MoE routes): any value shape, int or float, their own fill.

Hand-worked layouts; a property in every layout (a field whose entries hold the tokens equals the
labels wherever a label is kept, the fill everywhere nothing is given); the packers (greedy and
best-fit), context-parallel shards, the worker transfer; and every refusal.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from zephon_collate import Collator, FloatField, SampleMeta, SampleRecord, TensorField, pack_flat
from zephon_collate.parallel.context_parallel import gather_context_parallel
from zephon_collate.read.fields import Spread
from zephon_collate.transforms import ContextParallelShard

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEG = float("-inf")
IDS = TensorField("top_ids", align="label", dtype=torch.int64, shape=(2,))
LOGPROBS = TensorField("top_logprobs", align="label", fill=NEG, shape=(2,))
ROUTES = TensorField("routes", dtype=torch.int16, shape=(2, 1), fill=7)


def examples() -> list[dict]:
    """Two examples; the teacher's top-2 of the prediction at each token, its routes per token."""
    return [
        {
            "input_ids": [1, 2, 3],
            "top_ids": [[2, 9], [3, 8], [4, 4]],
            "top_logprobs": [[-0.125, -2.0], [-0.25, NEG], [-0.375, -1.0]],
            "routes": [[[0], [1]], [[2], [3]], [[4], [5]]],
        },
        {
            "input_ids": [5, 6],
            "top_ids": [[6, 1], [0, 0]],
            "top_logprobs": [[-0.5, -0.875], [NEG, NEG]],
            "routes": [[[6], [6]], [[1], [2]]],
        },
    ]


SPECS = [IDS, LOGPROBS, ROUTES]


def test_shifted_layout_by_hand():
    out = Collator(return_labels=True, pad_token_id=0, float_fields=SPECS)(examples())
    assert out["labels"].tolist() == [[2, 3], [6, -100]]
    # label-aligned: the prediction at each input, [:, :-1]; the padding holds the fill
    assert out["top_ids"].tolist() == [[[2, 9], [3, 8]], [[6, 1], [0, 0]]]
    assert out["top_logprobs"].tolist() == [[[-0.125, -2.0], [-0.25, NEG]], [[-0.5, -0.875], [NEG, NEG]]]
    # token-aligned: with the labels, [:, 1:]; routes keep int16 and pad with 7
    assert out["routes"].dtype == torch.int16
    assert out["routes"].tolist() == [[[[2], [3]], [[4], [5]]], [[[1], [2]], [[7], [7]]]]
    assert out["top_logprobs"].dtype == torch.float32 and out["top_ids"].shape == (2, 2, 2)


def test_unshifted_layouts_by_hand():
    flat = Collator.for_transformers(padding_free=True, float_fields=SPECS)(examples())
    assert flat["labels"].tolist() == [[-100, 2, 3, -100, 6]]
    # label-aligned, unshifted: moved to the token each prediction is scored against; a sequence's first
    # token (no prediction) holds the fill
    assert flat["top_ids"].tolist() == [[[0, 0], [2, 9], [3, 8], [0, 0], [6, 1]]]
    assert flat["top_logprobs"][0, :, 0].tolist() == [NEG, -0.125, -0.25, NEG, -0.5]
    assert flat["routes"].shape == (1, 5, 2, 1)
    left = Collator.for_transformers(pad_token_id=0, padding_side="left", float_fields=SPECS)(examples())
    assert left["top_ids"].tolist() == [[[0, 0], [2, 9], [3, 8]], [[0, 0], [0, 0], [6, 1]]]
    assert left["routes"][1, 0].tolist() == [[7], [7]]  # the padding, moved left with its fill
    multiple = Collator.for_transformers(
        padding_free=True, pad_to_multiple_of=4, pad_token_id=0, float_fields=SPECS
    )(examples())
    assert multiple["top_logprobs"][0, 5:].tolist() == [[NEG, NEG]] * 3
    assert multiple["routes"][0, 5:].flatten().tolist() == [7] * 6


def test_rollouts_and_shared_prompts_carry_them():
    rollouts = [
        {**example, "completion_mask": [0] + [1] * (len(example["input_ids"]) - 1)} for example in examples()
    ]
    out = Collator.for_rollouts(padding_free=True, float_fields=SPECS)(rollouts)
    flat = Collator.for_transformers(padding_free=True, float_fields=SPECS)(rollouts)
    for name in ("top_ids", "top_logprobs", "routes"):
        assert torch.equal(out[name], flat[name]), name
    same_prompt = [{**rollouts[0]}, {**rollouts[0], "top_ids": [[2, 9], [1, 1], [1, 1]]}]
    shared = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=SPECS)(same_prompt)
    assert shared["input_ids"].tolist() == [[1, 2, 3, 2, 3]]  # the prompt [1] once
    assert shared["top_ids"].tolist() == [[[0, 0], [2, 9], [3, 8], [2, 9], [1, 1]]]
    # the prompt's label-aligned values moved right hold the fill: its routes differ, so it is not shared
    differ = [{**rollouts[0]}, {**rollouts[0], "routes": [[[1], [1]], [[2], [3]], [[4], [5]]]}]
    unshared = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=SPECS)(differ)
    assert unshared["input_ids"].shape == (1, 6)


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    k = draw(st.integers(1, 3))
    rows = []
    for i, n in enumerate(lengths):
        tokens = [10 * i + t + 1 for t in range(n)]
        following = [*tokens[1:], 0]
        rows.append(
            {
                "input_ids": tokens,
                # entry j of token t: (j + 1) * token t (token-aligned), (j + 1) * token t + 1 (label-aligned)
                "tok": [[(j + 1) * token for j in range(k)] for token in tokens],
                "lab": [[float((j + 1) * token) for j in range(k)] for token in following],
                "inp": [[(j + 1) * token for j in range(k)] for token in tokens],  # read at token t
            }
        )
    return rows, k


LAYOUTS = ["native", "native-padded", "native-flatten", "hf-padded", "hf-left", "hf-flat", "hf-flat-64"]


@FAST
@given(data=batches(), layout=st.sampled_from(LAYOUTS))
def test_every_entry_goes_with_its_label_and_the_rest_holds_the_fill(data, layout):
    rows, k = data
    specs = [
        TensorField("tok", dtype=torch.int32, shape=(None,), fill=-1),
        TensorField("lab", align="label", dtype=torch.float64, shape=(k,), fill=NEG),
        TensorField("inp", align="input", dtype=torch.int64, shape=(k,), fill=-2),
    ]
    if layout.startswith("native"):
        if layout == "native":
            shortest = min(len(row["input_ids"]) for row in rows)
            rows = [{key: value[:shortest] for key, value in row.items()} for row in rows]
        pad = {"pad_token_id": 0} if layout != "native" else {}
        out = Collator(return_labels=True, flatten=layout == "native-flatten", float_fields=specs, **pad)(
            rows
        )
        labels = out["labels"]
        scored = labels != -100
    else:
        kwargs = {"hf-padded": {"pad_token_id": 0}, "hf-left": {"pad_token_id": 0, "padding_side": "left"},
                  "hf-flat": {"padding_free": True},
                  "hf-flat-64": {"padding_free": True, "pad_to_multiple_of": 64, "pad_token_id": 0}}[layout]  # fmt: skip
        out = Collator.for_transformers(float_fields=specs, **kwargs)(rows)
        labels = out["labels"]
        scored = labels != -100
    weights = torch.arange(1, k + 1)
    assert out["tok"].dtype == torch.int32 and out["lab"].dtype == torch.float64
    assert out["tok"].shape == (*labels.shape, k) == out["lab"].shape
    assert torch.equal(out["tok"][scored], (labels[scored, None] * weights).to(torch.int32))
    if "attention_mask" in out:  # unshifted labels: the first of each row is never scored (no prediction)
        predicted = torch.zeros_like(scored)
        predicted[:, 1:] = out["attention_mask"][:, :-1] == 1
        scored &= predicted
    assert torch.equal(out["lab"][scored], (labels[scored, None] * weights).double())
    padding = out["input_ids"] == 0  # tokens are >= 1: the padding of the inputs
    # token-aligned values go with the labels (shifted: the padding of the labels), label-aligned ones with
    # the inputs; wherever nothing was given, the fill
    with_labels = labels == -100 if layout.startswith("native") else padding
    assert bool((out["tok"][with_labels] == -1).all())
    assert bool((out["lab"][padding] == NEG).all())
    # input-aligned values go with the inputs in every layout, shifted or not
    real = ~padding
    assert torch.equal(out["inp"][real], out["input_ids"][real, None] * weights)
    assert bool((out["inp"][padding] == -2).all())


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_packed_rows_keep_each_documents_values_and_fill_the_rest(strategy):
    records = [
        SampleRecord(SampleMeta((0, 0, i), 0, 0, i), example) for i, example in enumerate(examples() * 3)
    ]
    rows = pack_flat(records, 8, pad_token_id=0, float_fields=SPECS, strategy=strategy)
    for row in rows:
        payload = row.payload
        tokens = np.asarray(payload["input_ids"])
        used = int((tokens != 0).sum())
        assert payload["top_ids"].shape == (8, 2) and payload["routes"].shape == (8, 2, 1)
        assert payload["routes"].dtype == np.int16
        assert (payload["top_logprobs"][used:] == NEG).all() and (payload["routes"][used:] == 7).all()
    collated = Collator(return_labels=True, return_cu_seqlens=True, float_fields=SPECS)(rows)
    direct = Collator(return_labels=True, pad_token_id=0, float_fields=SPECS)(examples())
    # each document's label-aligned values sit at its labels, wherever it was packed
    got = {tuple(v.tolist()) for v in collated["top_ids"][collated["labels"] != -100]}
    want = {tuple(v.tolist()) for v in direct["top_ids"][direct["labels"] != -100]}
    assert got == want


def test_context_parallel_shards_gather_back_with_the_fill_on_added_tokens():
    out = Collator(return_labels=True, return_cu_seqlens=True, float_fields=SPECS, flatten=True)(
        pack_flat(
            [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), e) for i, e in enumerate(examples())],
            8,
            pad_token_id=0,
            float_fields=SPECS,
        )
    )
    fills = {spec.name: spec.fill for spec in SPECS}
    tensors = {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}
    shards = [ContextParallelShard(2, rank, fill_values=fills)(TensorDict(tensors, [])) for rank in range(2)]
    for shard in shards:
        added = shard["cp_padding_mask"]
        assert bool((shard["top_logprobs"][added] == NEG).all()) and bool((shard["routes"][added] == 7).all())
    back = gather_context_parallel(shards)
    for name in ("top_ids", "top_logprobs", "routes"):
        assert torch.equal(back[name], out[name][: back[name].shape[0]]), name


def test_a_worker_transfer_keeps_values_shapes_and_dtypes():
    collate = Collator(return_labels=True, pad_token_id=0, float_fields=SPECS)
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), e) for i, e in enumerate(examples())]
    direct, finished = collate(records), collate.finish(collate.stack(records))
    for name in ("top_ids", "top_logprobs", "routes"):
        assert finished[name].dtype == direct[name].dtype and torch.equal(finished[name], direct[name])


def test_inputs_are_never_changed():
    given = examples()
    arrays = [{key: np.array(value) for key, value in example.items()} for example in given]
    before = [{key: value.copy() for key, value in example.items()} for example in arrays]
    Collator.for_transformers(padding_free=True, float_fields=SPECS)(arrays)
    for example, kept in zip(arrays, before, strict=True):
        for key, value in example.items():
            assert np.array_equal(value, kept[key], equal_nan=False) or key == "top_logprobs"
            assert np.array_equal(np.nan_to_num(value), np.nan_to_num(kept[key]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"top_ids": [[2, 9], [3, 8]]}, r"example 0: float field 'top_ids' holds shape \(2, 2\), but the token row"),
        ({"top_ids": [[2], [3], [4]]}, r"example 0: float field 'top_ids' holds shape \(3, 1\), but it is declared one value of shape \(2,\)"),
        ({"top_ids": [2, 3, 4]}, r"holds shape \(3,\), but it is declared one value of shape \(2,\) per token"),
        ({"top_ids": [[2.5, 9], [3, 8], [4, 4]]}, r"example 0: float field 'top_ids' holds 2.5 at top_ids\[0, 0\], but it is declared torch.int64; give whole numbers"),
        ({"routes": [[[0], [1]], [[2], [40000]], [[4], [5]]]}, r"holds 40000 at routes\[1, 1, 0\], beyond torch.int16"),
        ({"top_logprobs": [[-0.125, math.nan], [-0.25, NEG], [-0.375, -1.0]]}, r"holds nan at top_logprobs\[0, 1\]; give finite values"),
        ({"top_logprobs": [[-0.125, math.inf], [-0.25, NEG], [-0.375, -1.0]]}, r"holds inf at top_logprobs\[0, 1\]"),
    ],
)  # fmt: skip
def test_bad_values_name_the_example_the_field_and_the_place(change, match):
    rows = examples()
    rows[0] = {**rows[0], **change}
    with pytest.raises(ValueError, match=match):
        Collator.for_transformers(padding_free=True, float_fields=SPECS)(rows)


def test_minus_infinity_needs_the_fill_that_says_so():
    with pytest.raises(ValueError, match=r"holds -inf at lp\[1, 1\].*declare fill=float\('-inf'\)"):
        Collator.for_transformers(padding_free=True, float_fields=[TensorField("lp", shape=(2,))])(
            [{"input_ids": [1, 2], "lp": [[0.0, -1.0], [-2.0, NEG]]}]
        )


def test_a_jagged_top_k_is_padded_with_the_fill_and_a_fixed_one_is_refused():
    jagged = TensorField("top", shape=(None,), fill=NEG)
    rows = [
        {"input_ids": [1, 2], "top": [[-0.5], [-0.25, -2.0, -3.0]]},  # tokens of 1 and 3 entries
        {"input_ids": [3], "top": [[-1.0, -1.5]]},
    ]
    want = [[[NEG, NEG, NEG], [-0.5, NEG, NEG]]]  # label-aligned: moved one token right
    out = Collator.for_transformers(padding_free=True, float_fields=[jagged])(rows)["top"]
    assert out.tolist() == [[[-0.5, NEG, NEG], [-0.25, -2.0, -3.0], [-1.0, -1.5, NEG]]]
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)  # list<list<double>>: the offsets of each token's entries
    assert torch.equal(Collator.for_transformers(padding_free=True, float_fields=[jagged])(table)["top"], out)
    moved = TensorField("top", align="label", shape=(None,), fill=NEG)
    assert (
        Collator.for_transformers(padding_free=True, float_fields=[moved])(rows[:1])["top"].tolist() == want
    )
    across = [{"input_ids": [1], "top": [[0.0, 1.0]]}, {"input_ids": [2], "top": [[0.0, 1.0, 2.0]]}]
    assert Collator.for_transformers(padding_free=True, float_fields=[jagged])(across)["top"].shape == (
        1,
        2,
        3,
    )
    fixed = TensorField("top", shape=(2,))
    with pytest.raises(ValueError, match=r"example 1: float field 'top' holds shape \(1, 3\).*shape=\(2,\)"):
        Collator.for_transformers(padding_free=True, float_fields=[fixed])(across)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": torch.bool}, ValueError, "dtype must be a torch float dtype .* or integer dtype"),
        ({"fill": math.nan}, ValueError, "fill must be a number within torch.float32"),
        ({"fill": math.inf}, ValueError, "fill must be a number within torch.float32"),
        ({"dtype": torch.int8, "fill": 300}, ValueError, "fill must be an integer from -128 to 127"),
        ({"dtype": torch.int64, "fill": NEG}, ValueError, "fill must be an integer"),
        ({"dtype": torch.int64, "fill": 0.5}, ValueError, "fill must be an integer"),
        ({"fill": True}, TypeError, "fill must be an int, a float or a Spread"),
        ({"shape": [2]}, TypeError, "shape must be a tuple of sizes"),
        ({"shape": (0,)}, TypeError, "shape must be a tuple of sizes"),
        ({"align": "sequence", "shape": (2,)}, ValueError, "a value per sequence is one number"),
    ],
)
def test_bad_declarations(kwargs, error, match):
    with pytest.raises(error, match=match):
        TensorField("x", **kwargs)


def test_a_float_field_is_a_tensor_field_of_a_float_dtype():
    assert isinstance(FloatField("lp"), TensorField)
    with pytest.raises(ValueError, match=r"declare TensorField\('ids', dtype=torch.int64\) for integer"):
        FloatField("ids", dtype=torch.int64)
    assert FloatField("lp", fill=NEG, shape=(4,)).shape == (4,)


def test_a_fill_beyond_the_float_dtype_is_refused():
    with pytest.raises(ValueError, match=r"fill must be a number within torch.float16 \(largest 65504\)"):
        FloatField("w", dtype=torch.float16, fill=1e5)
    assert FloatField("w", dtype=torch.float16, fill=-65504.0).fill == -65504.0


def test_a_shared_prompt_whose_sequences_disagree_holds_the_fill():
    spec = TensorField("adv", align="sequence", broadcast=True, fill=-9.0)
    rollouts = [
        {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "adv": 1.0},
        {"input_ids": [1, 2, 4], "completion_mask": [0, 1, 1], "adv": 2.0},
    ]
    out = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=[spec])(rollouts)
    assert out["input_ids"].tolist() == [[1, 2, 3, 2, 4]]
    assert out["adv"].tolist() == [[-9.0, 1.0, 1.0, 2.0, 2.0]]


def test_a_packer_state_with_tensor_fields_round_trips():
    from zephon_collate import FlatPacker

    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), e) for i, e in enumerate(examples() * 4)]
    whole = [row.payload for row in FlatPacker(8, pad_token_id=0, float_fields=SPECS).pack(records)]
    packer = FlatPacker(8, pad_token_id=0, float_fields=SPECS)
    first = [next(iter(packer.pack(records))).payload]  # stopped after one row, pieces pending
    restored = FlatPacker(8, pad_token_id=0, float_fields=SPECS)
    restored.load_state_dict(packer.state_dict())
    rest = [row.payload for row in restored.pack(records[packer.records_consumed :])]
    assert len(first + rest) == len(whole)
    for got, want in zip(first + rest, whole, strict=True):
        for name in ("input_ids", "top_ids", "top_logprobs", "routes"):
            assert np.array_equal(got[name], want[name]), name
    other = FlatPacker(8, pad_token_id=0, float_fields=[IDS, LOGPROBS, TensorField("routes", shape=(3,))])
    with pytest.raises(ValueError, match="the state was saved with other options"):
        other.load_state_dict(packer.state_dict())


def test_arrow_nulls_and_chunks_of_other_value_shapes_are_named():
    import pyarrow as pa

    spec = [TensorField("top", shape=(None,), fill=NEG)]
    nulls = pa.Table.from_pylist([{"input_ids": [1, 2], "top": [[-0.5, None], [-1.0, -2.0]]}])
    with pytest.raises(ValueError, match=r"example 0: (float )?field 'top' holds a null at top\[0"):
        Collator.for_transformers(padding_free=True, float_fields=spec)(nulls)
    chunks = pa.concat_tables(
        [pa.Table.from_pylist([{"input_ids": [1], "top": [[0.0, -1.0]]}]),
         pa.Table.from_pylist([{"input_ids": [2], "top": [[0.0, -1.0, -2.0]]}])]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"field 'top' holds values of shapes \[\(2,\), \(3,\)\] per token"):
        Collator.for_transformers(padding_free=True, float_fields=[TensorField("top", shape=(2,))])(chunks)
    padded = Collator.for_transformers(padding_free=True, float_fields=spec)(chunks)["top"]  # shape=(None,)
    assert padded.tolist() == [[[0.0, -1.0, NEG], [0.0, -1.0, -2.0]]]


def test_spread_routes_padding_over_every_expert_in_every_layout():
    from zephon_collate.read.fields import Spread

    spec = TensorField("routes", dtype=torch.int16, shape=(2, 2), fill=Spread(8))
    rows = [
        {"input_ids": [1, 2, 3], "routes": np.zeros((3, 2, 2), np.int64)},
        {"input_ids": [4], "routes": np.zeros((1, 2, 2), np.int64)},
    ]
    padded = Collator.for_transformers(pad_token_id=0, float_fields=[spec])(rows)["routes"]
    # padding at row place p gets experts (2p, 2p + 1) % 8 in every layer
    assert padded[1].tolist() == [[[0, 0], [0, 0]], [[2, 3], [2, 3]], [[4, 5], [4, 5]]]
    assert padded.dtype == torch.int16
    tail = Collator.for_transformers(
        padding_free=True, pad_to_multiple_of=8, pad_token_id=0, float_fields=[spec]
    )
    assert tail(rows)["routes"][0, 4:, 0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), row) for i, row in enumerate(rows)]
    packed = pack_flat(records, 6, pad_token_id=0, float_fields=[spec])[0].payload["routes"]
    assert packed[4:, 1].tolist() == [[0, 1], [2, 3]]
    experts = torch.as_tensor(padded[1, 1:]).flatten().tolist() + packed[4:].flatten().tolist()
    assert len(set(experts)) == 6  # over many experts, not one


def test_bad_spread_declarations():
    from zephon_collate.read.fields import Spread

    with pytest.raises(
        ValueError, match=r"spreads integer ids .* declare an integer dtype and shape=\(\.\.\., k\)"
    ):
        TensorField("r", fill=Spread(8), shape=(2,))
    with pytest.raises(ValueError, match=r"spreads integer ids"):
        TensorField("r", dtype=torch.int64, fill=Spread(8))
    with pytest.raises(ValueError, match=r"Spread\(count\) needs an int count >= the 4 entries"):
        TensorField("r", dtype=torch.int64, shape=(4,), fill=Spread(2))
    with pytest.raises(ValueError, match=r"Spread\(300\) holds ids beyond torch.int8"):
        TensorField("r", dtype=torch.int8, shape=(2,), fill=Spread(300))


def test_spread_in_label_moves_and_context_parallel_shards():
    from zephon_collate.read.fields import Spread

    spread = Spread(4)
    label = TensorField("next_routes", align="label", dtype=torch.int64, shape=(2,), fill=spread)
    rows = [
        {"input_ids": [1, 2], "next_routes": [[3, 3], [3, 3]]},
        {"input_ids": [4], "next_routes": [[3, 3]]},
    ]
    out = Collator.for_transformers(pad_token_id=0, float_fields=[label])(rows)["next_routes"]
    # each example's first token (no prediction) and the padding: numbered by their place in the row
    assert out.tolist() == [[[0, 1], [3, 3]], [[0, 1], [2, 3]]]
    routes = TensorField("routes", dtype=torch.int64, shape=(2,), fill=spread)
    flat = Collator(return_labels=True, return_cu_seqlens=True, flatten=True, float_fields=[routes])(
        [
            SampleRecord(
                SampleMeta((0, 0, 0), 0, 0, 0),
                {"input_ids": [1, 2, 3, 4], "positions": [0, 1, 2, 0], "routes": [[3, 3]] * 4},
            )
        ]
    )
    tensors = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
    added = []
    for rank in range(2):
        shard = ContextParallelShard(2, rank, fill_values={"routes": spread})(TensorDict(tensors, []))
        added += shard["routes"][shard["cp_padding_mask"]].tolist()
    assert added and all(route != [3, 3] and route[1] == (route[0] + 1) % 4 for route in added)


def test_jagged_fields_in_the_record_packers_and_their_bad_rows():
    jagged = TensorField("lp", shape=(None,), fill=NEG)
    rows = [
        {"input_ids": [1, 2], "lp": [[-0.5], [-0.25, -2.0]]},
        {"input_ids": [3], "lp": [[-1.0, -1.5, -3.0]]},
        {"input_ids": [], "lp": []},  # an empty example takes any K
    ]
    out = Collator.for_transformers(padding_free=True, float_fields=[jagged])(rows)["lp"]
    assert out.tolist() == [[[-0.5, NEG, NEG], [-0.25, -2.0, NEG], [-1.0, -1.5, -3.0]]]
    packed = pack_flat(rows[:2], 4, pad_token_id=0, float_fields=[jagged])[0].payload["lp"]
    assert packed.tolist() == [[-0.5, NEG, NEG], [-0.25, -2.0, NEG], [-1.0, -1.5, -3.0], [NEG, NEG, NEG]]
    for bad, match in (
        ([{"input_ids": [1, 2], "lp": [[1.0], None]}], r"gives token 1 None, not a list of numbers"),
        ([{"input_ids": [1, 2], "lp": [[1.0], 2.0]}], r"gives token 1 2.0, not a list of numbers"),
    ):
        with pytest.raises(ValueError, match=match):
            Collator.for_transformers(padding_free=True, float_fields=[jagged])(bad)


def test_a_jagged_row_that_is_no_list_is_refused():
    jagged = TensorField("lp", shape=(None,), fill=NEG)
    with pytest.raises(TypeError, match=r"example 1: field 'lp' must be a list, .* got NoneType"):
        Collator.for_transformers(padding_free=True, float_fields=[jagged])(
            [{"input_ids": [1], "lp": [[1.0]]}, {"input_ids": [2], "lp": None}]
        )


def test_preference_and_reward_pairs_refuse_media():
    pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4]}
    media = {"pixel_values": np.zeros((4, 8)), "image_grid_thw": [[1, 2, 2]]}
    with pytest.raises(
        ValueError, match=r"example 0: carries 'pixel_values'.*Collator.for_preference does not read"
    ):
        Collator.for_preference(pad_token_id=0)([{**pair, **media}])
    with pytest.raises(ValueError, match=r"carries 'mm_token_type_ids'.*Collator.for_rewards does not read"):
        Collator.for_rewards(pad_token_id=0)(
            [{"chosen_ids": [1, 2], "rejected_ids": [3], "mm_token_type_ids": [0, 0]}]
        )
    with pytest.raises(
        ValueError, match=r"carries 'pixel_values'.*Collator.for_rollouts does not read.*mrope"
    ):
        Collator.for_rollouts(padding_free=True)([{"input_ids": [1, 2], "completion_mask": [0, 1], **media}])


def test_spread_needs_a_fixed_k_and_a_shard_a_count():
    from zephon_collate.read.fields import Spread

    with pytest.raises(ValueError, match=r"with k fixed \(a jagged token's missing routes are not padding\)"):
        TensorField("r", dtype=torch.int64, shape=(None,), fill=Spread(4))
    with pytest.raises(ValueError, match=r"fill_values\['r'\] = Spread\(count=0\) needs a count >= 1"):
        ContextParallelShard(2, 0, fill_values={"r": Spread(0)})


def test_input_aligned_routes_go_with_the_inputs_in_every_collator():
    """Routes are what the model computed reading each token: beside ``input_ids``, shifted or not."""
    spec = TensorField("routes", align="input", dtype=torch.int64, shape=(1,), fill=Spread(200))
    rows = [{"input_ids": [10, 11, 12, 13]}, {"input_ids": [20, 21]}]
    rows = [{**row, "routes": [[t] for t in row["input_ids"]]} for row in rows]  # a token's routes: itself
    trained = [{**row, "completion_mask": [0] + [1] * (len(row["input_ids"]) - 1)} for row in rows]
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), row) for i, row in enumerate(rows)]
    # the padding is spread over the experts by its place, as in every other alignment
    shifted = Collator(return_labels=True, pad_token_id=0, float_fields=[spec])(rows)
    assert shifted["input_ids"].tolist() == [[10, 11, 12], [20, 21, 0]]
    assert shifted["routes"][..., 0].tolist() == [[10, 11, 12], [20, 21, 2]]
    packed = Collator(return_labels=True, float_fields=[spec])(
        pack_flat(records, seq_len=8, pad_token_id=0, float_fields=[spec])
    )
    assert packed["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 0]]
    assert packed["routes"][..., 0].tolist() == [[10, 11, 12, 13, 20, 21, 6]]
    for out in (
        Collator(pad_token_id=0, float_fields=[spec])(rows),
        Collator.for_transformers(pad_token_id=0, float_fields=[spec])(rows),
        Collator.for_transformers(padding_free=True, float_fields=[spec])(rows),
        Collator.for_rollouts(padding_free=True, float_fields=[spec])(trained),
        Collator.for_trees(float_fields=[spec])(trained),
    ):
        real = out["input_ids"] != 0
        assert torch.equal(out["routes"][..., 0][real], out["input_ids"][real])
