"""Float fields (log-probs, advantages, rewards): their own dtype, shifted with the labels, everywhere.

Hand-worked layouts for every alignment, a property (a field holding the tokens as floats equals the
labels wherever a label is kept, in every layout), and the field crossing each boundary: the host pass
and the torch chain, a DataLoader worker's transfer, the device copy, pack_flat and the
``transformers`` layout.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FloatField, SampleBatch, pack_flat, to_training, use_host_pass
from zephon_collate.types import SampleMeta, SampleRecord

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(got, want) -> bool:
    return bool(np.allclose(np.asarray(torch.as_tensor(got).float()), np.asarray(want, dtype=np.float32)))


def payloads() -> list[dict]:
    return [
        {"input_ids": [1, 2, 3, 4], "lp": [0.1, 0.2, 0.3, 0.4], "v": [1.0, 2.0, 3.0, 4.0], "adv": 0.5},
        {"input_ids": [5, 6, 7, 8], "lp": [0.5, 0.6, 0.7, 0.8], "v": [5.0, 6.0, 7.0, 8.0], "adv": -1.0},
    ]


SPECS = ["lp", FloatField("v", align="label"), FloatField("adv", align="sequence")]


def test_each_alignment_is_placed_with_the_labels():
    """Token-aligned: cut like the labels; label-aligned: like the inputs; per sequence: one value per row."""
    out = Collator(return_labels=True, dtype=torch.int32, float_fields=SPECS)(payloads())
    assert out["labels"].tolist() == [[2, 3, 4], [6, 7, 8]] and out["labels"].dtype == torch.int32
    assert out["lp"].dtype == torch.float32
    assert np.allclose(out["lp"].tolist(), [[0.2, 0.3, 0.4], [0.6, 0.7, 0.8]])  # lp[t] of token t = labels
    assert out["v"].tolist() == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]  # the prediction made at each input
    assert out["adv"].tolist() == [0.5, -1.0]
    assert list(out) == ["ids", "texts", "input_ids", "labels", "lp", "v", "adv"]
    broadcast = Collator(return_labels=True, float_fields=[FloatField("adv", "sequence", broadcast=True)])
    assert broadcast(payloads())["adv"].tolist() == [[0.5] * 3, [-1.0] * 3]
    unshifted = Collator(float_fields=SPECS)(payloads())  # no labels: nothing is shifted
    assert unshifted["v"].tolist() == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]


def test_dtypes_of_their_own_padding_and_list_output():
    specs = [FloatField("lp", dtype=torch.float64), FloatField("v", dtype=torch.bfloat16)]
    rows = payloads()
    rows[1] = {key: value[:2] if isinstance(value, list) else value for key, value in rows[1].items()}
    out = Collator(return_labels=True, pad_token_id=0, float_fields=specs)(rows)
    assert (out["lp"].dtype, out["v"].dtype) == (torch.float64, torch.bfloat16)
    assert out["labels"].tolist() == [[2, 3, 4], [6, -100, -100]]
    assert close(out["lp"], [[0.2, 0.3, 0.4], [0.6, 0.0, 0.0]])  # 0.0 on padding
    lists = Collator(return_labels=True, dtype=None, float_fields=["lp"])(rows)  # ragged lists
    assert close(lists["lp"][0], [0.2, 0.3, 0.4]) and close(lists["lp"][1], [0.6])
    flat = Collator(return_labels=True, flatten=True, float_fields=SPECS)(payloads())
    assert flat["v"].tolist() == [1.0, 2.0, 3.0, 5.0, 6.0, 7.0] and flat["adv"].tolist() == [0.5, -1.0]
    empty = Collator(return_labels=True, float_fields=SPECS)([])
    assert empty["lp"] == [] and empty["adv"] == []


def test_host_pass_and_torch_chain_agree():
    collate = Collator(return_labels=True, return_loss_mask=True, float_fields=SPECS)
    rows = [dict(p, positions=[0, 1, 0, 1], loss_mask=[0, 1, 1, 1]) for p in payloads()]
    host = collate(rows)
    with use_host_pass(False):
        chain = collate(rows)
    for key in ("input_ids", "labels", "lp", "v", "adv", "loss_mask", "positions"):
        assert torch.equal(torch.as_tensor(host[key]), torch.as_tensor(chain[key])), key
    assert host["labels"].tolist() == [[2, -100, 4], [6, -100, 8]]  # boundary-safe: no label crosses


def test_a_float_field_crosses_the_worker_transfer_and_the_device_copy():
    """A packed float field (pack_flat) through stack, pickling (as a worker sends it) and finish."""
    docs = [
        SampleRecord(
            SampleMeta((0, 0, i), 0, 0, i), {"input_ids": [9, 10 + i, 11], "lp": [0.0, -0.5 * i, -1.25]}
        )
        for i in range(4)
    ]
    rows = pack_flat(docs, 8, pad_token_id=0)
    assert rows[0].payload["lp"].dtype == np.float64  # the packer keeps the payload's float dtype
    collate = Collator(return_labels=True, device="cpu", float_fields=["lp"])
    stacked = collate.stack(rows)
    arrived = pickle.loads(pickle.dumps(stacked))
    assert arrived.td["lp"].dtype == torch.float32
    out = collate.finish(arrived)
    direct = Collator(return_labels=True, float_fields=["lp"])(rows)
    assert torch.equal(out["lp"], direct["lp"]) and out["lp"].dtype == torch.float32
    assert out["lp"][0].tolist() == [-0.0, -1.25, 0.0, -0.5, -1.25, 0.0, 0.0]
    assert out["labels"][0].tolist() == [10, 11, -100, 11, 11, -100, -100]
    halves = Collator(return_labels=True, float_fields=["lp"]).stack(
        [SampleRecord(r.meta, {**r.payload, "lp": np.full(8, 0.5)}) for r in rows]
    )
    assert pickle.loads(pickle.dumps(halves)).widened().td["lp"].dtype == torch.float32  # 0/1-free floats


def test_to_training_keeps_the_reference_pages_extra_fields():
    """to_training's extra fields follow dtype (the page): float values are refused, naming the fix."""
    batch = SampleBatch([SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [1, 2], "lp": [0.5, 0.25]})])
    with pytest.raises(ValueError, match=r"non-integral.*Collator\(float_fields=\['lp'\]\)"):
        to_training(batch, extra_fields=["lp"])
    with pytest.raises(ValueError, match="dtype"):
        to_training(batch, extra_fields=["lp"], dtype=torch.float32)


def test_transformers_layouts_carry_float_fields():
    examples = [
        {"input_ids": [1, 2, 3, 4], "lp": [0.1, 0.2, 0.3, 0.4], "v": [1.0, 2.0, 3.0, 4.0], "adv": 0.5,
         "attention_mask": [1, 1, 1, 0]},
        {"input_ids": [5, 6], "lp": [0.5, 0.6], "v": [5.0, 6.0], "adv": -1.0},
    ]  # fmt: skip
    padded = Collator.for_transformers(pad_token_id=0, float_fields=SPECS)(examples)
    assert padded["labels"].tolist() == [[1, 2, 3], [5, 6, -100]]
    assert close(padded["lp"], [[0.1, 0.2, 0.3], [0.5, 0.6, 0.0]])  # unshifted, as labels
    assert padded["v"].tolist() == [[0.0, 1.0, 2.0], [0.0, 5.0, 0.0]]  # moved to the token it scores
    assert padded["adv"].tolist() == [0.5, -1.0]
    left = Collator.for_transformers(pad_token_id=0, padding_side="left", float_fields=SPECS)(examples)
    assert close(left["lp"].tolist()[1], [0.0, 0.5, 0.6]) and left["v"].tolist()[1] == [0.0, 0.0, 5.0]
    flat = Collator.for_transformers(padding_free=True, float_fields=SPECS)(examples)
    assert flat["v"].tolist() == [[0.0, 1.0, 2.0, 0.0, 5.0]] and flat["adv"].tolist() == [0.5, -1.0]
    packed = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2], "v": [1.0, 2.0, 3.0, 4.0, 5.0]}]
    out = Collator.for_transformers(padding_free=True, float_fields=[FloatField("v", "label")])(packed)
    assert out["v"].tolist() == [[0.0, 1.0, 2.0, 0.0, 4.0]]  # restarts with each packed document
    batched = {key: [e[key] for e in examples] for key in ("input_ids", "lp", "v", "adv")}
    assert Collator.for_transformers(pad_token_id=0, float_fields=SPECS)(batched)["adv"].tolist() == [
        0.5,
        -1.0,
    ]
    collate = Collator.for_transformers(padding_free=True, float_fields=SPECS)
    arrived = collate.finish(pickle.loads(pickle.dumps(collate.stack(examples))))
    assert torch.equal(arrived["v"], flat["v"]) and torch.equal(arrived["adv"], flat["adv"])
    cut = Collator.for_transformers(
        pad_token_id=0, max_length=2, truncation_mode="keep_end", float_fields=SPECS
    )
    assert cut(examples)["v"].tolist() == [[0.0, 2.0], [0.0, 5.0]]


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("lp", [0.1, float("nan"), 0.3, 0.4], ValueError, r"record 1.*'lp' holds nan at lp\[1\]"),
        ("lp", [0.1, 0.2, float("inf"), 0.4], ValueError, "finite"),
        ("lp", [0.1, 0.2], ValueError, "token row has 4 tokens"),
        ("lp", 0.5, ValueError, "align='sequence'"),
        ("adv", [0.5, 0.5, 0.5, 0.5], ValueError, "one value per sequence"),
        ("lp", "abc", TypeError, "'lp'"),
    ],
)
def test_bad_float_values_name_the_record_and_field(field, value, error, match):
    rows = payloads()
    rows[1] = {**rows[1], field: value}
    with pytest.raises(error, match=match):
        Collator(return_labels=True, float_fields=SPECS)(rows)


def test_bad_float_field_declarations():
    rows = payloads()
    del rows[1]["lp"]
    with pytest.raises(ValueError, match=r"record 1.*lacks field 'lp'"):
        Collator(float_fields=["lp"])(rows)
    for bad, error, match in [
        ("lp", TypeError, "list of field names"),
        ([3], TypeError, "FloatField"),
        (["lp", "lp"], ValueError, "twice"),
        (["labels"], ValueError, "collides"),
        (["positions"], ValueError, "collides"),
    ]:
        with pytest.raises(error, match=match):
            Collator(return_labels=True, float_fields=bad)
    with pytest.raises(ValueError, match="collides"):
        Collator(extra_fields=["m"], float_fields=["m"])
    with pytest.raises(ValueError, match="collides"):
        Collator.for_transformers(padding_free=True, float_fields=["attention_mask"])
    for kwargs, error in [
        ({"name": ""}, TypeError),
        ({"name": "x", "align": "tokens"}, ValueError),
        ({"name": "x", "dtype": torch.int64}, ValueError),
        ({"name": "x", "broadcast": True}, ValueError),
        ({"name": "x", "align": "sequence", "broadcast": 1}, TypeError),
    ]:
        with pytest.raises(error):
            FloatField(**kwargs)


@FAST
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    layout=st.sampled_from(["native", "native-padded", "hf-padded", "hf-flat", "hf-left"]),
)
def test_a_field_holding_the_tokens_equals_the_labels_wherever_one_is_kept(lengths, layout):
    """Token-aligned value t = token t, label-aligned value t = token t + 1: each equals its label
    (every label kept, or, unshifted, every label some position predicts)."""
    rows = []
    for i, n in enumerate(lengths):
        tokens = [10 * i + k + 1 for k in range(n)]
        rows.append(
            {
                "input_ids": tokens,
                "tok": [float(t) for t in tokens],
                "lab": [float(t) for t in tokens[1:]] + [0.0],
            }
        )
    specs = ["tok", FloatField("lab", "label")]
    if layout.startswith("native"):
        if layout == "native":
            rows = [{key: value[: min(lengths)] for key, value in row.items()} for row in rows]
        out = Collator(
            return_labels=True, pad_token_id=0 if layout == "native-padded" else None, float_fields=specs
        )(rows)
    else:
        kwargs = {"hf-padded": {"pad_token_id": 0}, "hf-flat": {"padding_free": True},
                  "hf-left": {"pad_token_id": 0, "padding_side": "left"}}[layout]  # fmt: skip
        out = Collator.for_transformers(float_fields=specs, **kwargs)(rows)
    labels = out["labels"]
    kept = labels != -100
    assert torch.equal(out["tok"][kept], labels[kept].float())
    if "attention_mask" in out:  # unshifted labels: the first of each row is never scored (no prediction)
        predicted = torch.zeros_like(kept)
        predicted[:, 1:] = out["attention_mask"][:, :-1] == 1
        kept &= predicted
    assert torch.equal(out["lab"][kept], labels[kept].float())
    assert out["tok"].shape == labels.shape == out["lab"].shape
