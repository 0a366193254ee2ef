"""Each transform alone: its keys, a small literal example, its configuration checks, no writes into its input."""

from __future__ import annotations

import pytest
import torch
from helpers import BOS, EOS, run_checked
from tensordict import TensorDict
from tensordict.nn import TensorDictSequential

from zephon_collate import Chain, Transform
from zephon_collate.transforms import CuSeqlens, EosMask, LossMask, PaddingMask, Positions, TokenShift


def td_of(**fields):
    tensors = {key: torch.as_tensor(value) for key, value in fields.items()}
    return TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])


def test_token_shift_keys_and_example():
    shift = TokenShift(input_keys=["positions"], label_keys=["loss_mask"])
    assert shift.in_keys == ["input_ids", "positions", "loss_mask"]
    assert shift.out_keys == ["input_ids", "labels", "positions", "loss_mask"]
    td = td_of(input_ids=[[5, 6, 7, 8]], positions=[[0, 1, 0, 1]], loss_mask=[[1, 0, 1, 1]])
    out = run_checked(shift, td)
    assert out["input_ids"].tolist() == [[5, 6, 7]]
    assert out["labels"].tolist() == [[6, 7, 8]]
    assert out["positions"].tolist() == [[0, 1, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1]]


def test_token_shift_non_scalar_tokens():
    td = td_of(input_ids=[[[1, 2], [3, 4], [5, 6]]])
    out = TokenShift()(td)
    assert out["input_ids"].tolist() == [[[1, 2], [3, 4]]] and out["labels"].tolist() == [[[3, 4], [5, 6]]]


def test_token_shift_rejects_repeated_keys():
    with pytest.raises(ValueError, match="distinct"):
        TokenShift(input_keys=["labels"])
    with pytest.raises(TypeError, match="input_keys"):
        TokenShift(input_keys="positions")


def test_padding_mask_example():
    pad = PaddingMask()
    assert pad.in_keys == ["padding_length", "input_ids"] and pad.out_keys == ["padding_mask"]
    td = td_of(input_ids=[[1, 2, 0], [1, 2, 3]], padding_length=[2, 0])
    out = run_checked(pad, td)
    assert out["padding_mask"].tolist() == [[False, True, True], [False, False, False]]


def test_eos_mask_example_and_config():
    eos = EosMask(EOS, ignore_index=-1)
    assert eos.in_keys == ["input_ids", "labels"] and eos.out_keys == ["labels"]
    td = td_of(input_ids=[[BOS, 10, EOS, BOS, 11]], labels=[[10, EOS, BOS, 11, EOS]])
    assert run_checked(eos, td)["labels"].tolist() == [[10, EOS, -1, 11, EOS]]
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="eos_token_id"):
            EosMask(bad)


def test_loss_mask_example_drops_consumed_mask():
    mask = LossMask(out_key=None)
    assert mask.in_keys == ["labels", "loss_mask", "padding_length"]
    assert mask.out_keys == ["labels", "num_valid_tokens"] and mask.dropped_keys == ("loss_mask",)
    td = td_of(labels=[[4, 5, 6], [7, 8, 9]], loss_mask=[[1, 0, 1], [1, 1, 1]], padding_length=[0, 2])
    out = run_checked(mask, td)
    assert out["labels"].tolist() == [[4, -100, 6], [7, -100, -100]]
    assert out["num_valid_tokens"].tolist() == [2, 1]
    assert "loss_mask" not in out


def test_loss_mask_emits_float_mask():
    td = td_of(labels=[[4, -100, 6]])
    out = LossMask(supervision_key=None, padding_length_key=None)(td)
    assert out["loss_mask"].dtype == torch.float32 and out["loss_mask"].tolist() == [[1.0, 0.0, 1.0]]
    with pytest.raises(TypeError, match="ignore_index"):
        LossMask(ignore_index="x")


def test_positions_modes():
    td = td_of(input_ids=torch.zeros(2, 4, dtype=torch.int32), positions=[[0, 1, 0, 1], [0, 1, 2, 3]])
    assert run_checked(Positions("preserve"), td)["positions"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]
    seq = run_checked(Positions("sequence"), td)["positions"]
    assert seq.tolist() == [[0, 1, 2, 3]] * 2 and seq.dtype == torch.int32
    assert Positions("sequence").in_keys == ["input_ids"]
    with pytest.raises(ValueError, match="position_mode"):
        Positions("continuous")


def test_cu_seqlens_rows_flat_and_static():
    td = td_of(positions=[[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    rows = run_checked(CuSeqlens(), td)
    assert rows["cu_seqlens"].tolist() == [[0, 3, 5], [0, 5, 5]] and rows["max_seqlen"].tolist() == [3, 5]
    assert rows["cu_seqlens"].dtype == rows["max_seqlen"].dtype == torch.int32
    flat = run_checked(CuSeqlens(flatten=True), td)
    assert flat.batch_size == torch.Size([])
    assert flat["cu_seqlens"].tolist() == [0, 3, 5, 10] and int(flat["max_seqlen"]) == 5
    static = CuSeqlens(num_boundaries=4)(td)
    assert static["cu_seqlens"].tolist() == [[0, 3, 5, 5], [0, 5, 5, 5]]
    static_flat = CuSeqlens(flatten=True, num_boundaries=6)(td)
    assert static_flat["cu_seqlens"].tolist() == [0, 3, 5, 10, 10, 10] and int(static_flat["max_seqlen"]) == 5


def test_cu_seqlens_static_overflow_fails():
    td = td_of(positions=[[0, 0, 0, 0]])
    with pytest.raises(RuntimeError, match="num_boundaries"):
        CuSeqlens(num_boundaries=3)(td)
    with pytest.raises(ValueError, match="num_boundaries"):
        CuSeqlens(num_boundaries=0)


def test_chain_checks_wiring_when_built():
    with pytest.raises(ValueError, match="EosMask reads 'labels'"):
        Chain(EosMask(EOS), TokenShift(), input_keys=["input_ids"])
    chain = Chain(TokenShift(), EosMask(EOS), input_keys=["input_ids"])
    assert chain.in_keys == [] and "labels" in chain.out_keys
    with pytest.raises(ValueError, match="LossMask reads 'loss_mask'"):
        Chain(TokenShift(), LossMask(padding_length_key=None), input_keys=["input_ids"])


def test_chain_without_input_keys_reports_what_it_needs():
    chain = Chain(PaddingMask(), TokenShift(input_keys=["padding_mask"]))
    assert chain.in_keys == ["padding_length", "input_ids"]
    with pytest.raises(ValueError, match="needs 'padding_length'"):
        chain(td_of(input_ids=[[1, 2]]))


def test_chain_runs_user_transform_and_leaves_input_alone():
    class Double(Transform):
        def __init__(self):
            super().__init__()
            self.in_keys, self.out_keys = ["labels"], ["labels2"]

        def forward(self, td):
            return td.replace({"labels2": td["labels"] * 2})

    chain = Chain(TokenShift(), Double(), EosMask(EOS), input_keys=["input_ids"])
    td = td_of(input_ids=[[BOS, 10, EOS, BOS]])
    out = run_checked(chain, td)
    assert out["labels2"].tolist() == [[20, 2 * EOS, 2 * BOS]]
    assert out["labels"].tolist() == [[10, EOS, -100]]
    assert len(chain) == 3 and isinstance(chain[1], Double)


def test_chain_rejects_non_transforms():
    with pytest.raises(TypeError, match="item 1"):
        Chain(TokenShift(), lambda td: td)


def test_transforms_fit_tensordict_sequential():
    seq = TensorDictSequential(TokenShift(), EosMask(EOS))
    out = seq(td_of(input_ids=[[BOS, 10, EOS, BOS]]))
    assert out["labels"].tolist() == [[10, EOS, -100]]
