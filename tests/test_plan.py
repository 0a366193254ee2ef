"""zephon_collate.collate._plan: the chain a layout builds, the names derived from it, compile stages."""

from __future__ import annotations

import pickle
from collections.abc import Mapping

import pytest
import torch

from zephon_collate import Collator, CuSeqlens, TrainingOptions, Transform
from zephon_collate.collate._native import Native
from zephon_collate.collate._plan import Plan, Plans

KEYS = ("input_ids", "positions", "loss_mask", "padding_length")


class Doubled(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["input_ids"], ["doubled"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"doubled": data["input_ids"] * 2}


def data() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[1, 10, 2, 1, 11]]),
        "positions": torch.tensor([[0, 1, 2, 0, 1]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1]]),
        "padding_length": torch.tensor([0]),
    }


def test_the_chain_follows_the_options_and_the_names_follow_the_chain():
    options = TrainingOptions(return_labels=True, return_loss_mask=True, return_cu_seqlens=True)
    plan = Plan(Native(options), KEYS)
    assert [type(t).__name__ for t in plan.chain.steps] == ["TokenShift", "LossMask", "CuSeqlens"]
    assert [name for _, name in plan.pairs] == [
        "ids", "texts", "input_ids", "labels", "positions", "loss_mask", "cu_seqlens", "max_seqlen",
    ]  # fmt: skip
    safe = Plan(Native(options, boundary_safe=True), KEYS)
    assert type(safe.chain.steps[0]).__name__ == "BoundaryMask"
    assert safe.run(data())["labels"].tolist() == [[10, 2, -100, 11]]


def test_your_transforms_follow_and_add_outputs_after_the_pages():
    options = TrainingOptions(return_labels=True)
    plan = Plan(Native(options), KEYS, transforms=[Doubled()])
    assert [name for _, name in plan.pairs][-1] == "doubled"
    out = plan.run(data())  # the host pass computes the built-in part, then Doubled runs on tensors
    assert out["doubled"].tolist() == [[2, 20, 4, 2]] and torch.is_tensor(out["doubled"])


def test_a_plan_names_the_missing_key_of_a_transform_of_yours():
    with pytest.raises(ValueError, match="Doubled reads 'input_ids'"):
        Plan(Native(TrainingOptions()), ("tokens",), chain=[Doubled()])


def test_compiled_plans_run_data_dependent_steps_eagerly_between_graphs():
    options = TrainingOptions(return_labels=True, return_cu_seqlens=True, position_mode="sequence")
    dynamic = Plan(Native(options), KEYS)
    assert dynamic.eager_steps == ["CuSeqlens"]
    static = Plan(Native(options, num_boundaries=4), KEYS)
    assert static.eager_steps == [] and not CuSeqlens(num_boundaries=4).data_dependent_shape


def test_layouts_cache_their_plans_and_never_pickle_them():
    layout = Native(TrainingOptions(return_labels=True))
    assert layout.plan(KEYS) is layout.plan(KEYS)
    copy = pickle.loads(pickle.dumps(layout))
    assert isinstance(copy._plans, Plans) and not copy._plans and copy == layout


def test_collators_share_the_plans_of_their_options():
    first, second = Collator(return_labels=True), Collator(return_labels=True)
    assert first.plan_for(KEYS) is not None
    own = Collator(return_labels=True, transforms=[Doubled()])
    assert own.plan_for(KEYS) is own.plan_for(KEYS) and own.plan_for(KEYS) is not first.plan_for(KEYS)
    assert "TokenShift" in repr(second.plan_for(KEYS))
