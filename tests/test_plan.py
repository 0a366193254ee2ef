"""zephon_collate.layouts.plan: the chain a layout builds, the outputs named by it, compile stages."""

from __future__ import annotations

import pickle
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from zephon_collate import Collator, Transform
from zephon_collate.layouts.base import Settings
from zephon_collate.layouts.native import CollatorOptions, Native
from zephon_collate.layouts.plan import Plan, Plans
from zephon_collate.layouts.training import TrainingOptions
from zephon_collate.transforms import CuSeqlens

KEYS = ("input_ids", "positions", "loss_mask", "padding_length")


class Doubled(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["input_ids"], ["doubled"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"doubled": data["input_ids"] * 2}


def data() -> dict[str, np.ndarray]:
    return {
        "input_ids": np.array([[1, 10, 2, 1, 11]]),
        "positions": np.array([[0, 1, 2, 0, 1]]),
        "loss_mask": np.array([[1, 1, 1, 1, 1]]),
        "padding_length": np.array([0]),
    }


def test_the_chain_follows_the_options_and_the_names_follow_the_chain():
    options = TrainingOptions(return_labels=True, return_loss_mask=True, return_cu_seqlens=True)
    layout = Native(options)
    plan = layout.plan(KEYS)
    assert [type(t).__name__ for t in plan.chain.steps] == ["TokenShift", "LossMask", "CuSeqlens"]
    assert [name for _, name in layout.output_names(plan.output_keys)] == [
        "ids", "texts", "input_ids", "labels", "positions", "loss_mask", "cu_seqlens", "max_seqlen",
    ]  # fmt: skip
    safe = Native(CollatorOptions(return_labels=True)).plan(KEYS)
    assert type(safe.chain.steps[0]).__name__ == "BoundaryMask"
    assert safe.run(data())["labels"].tolist() == [[10, 2, -100, 11]]


def test_your_transforms_follow_and_add_outputs_after_the_pages():
    layout = Native(TrainingOptions(return_labels=True), Settings(transforms=[Doubled()]))
    plan = layout.plan(KEYS)
    assert [name for _, name in layout.output_names(plan.output_keys)][-1] == "doubled"
    out = plan.run(data())  # the built-in steps on the host, then Doubled on tensor views
    assert out["doubled"].tolist() == [[2, 20, 4, 2]] and torch.is_tensor(out["doubled"])


def test_a_plan_names_the_missing_key_of_a_transform_of_yours():
    with pytest.raises(ValueError, match="Doubled reads 'input_ids'"):
        Plan([Doubled()], ("tokens",))


def test_compiled_plans_run_data_dependent_steps_eagerly_between_graphs():
    options = TrainingOptions(return_labels=True, return_cu_seqlens=True, position_mode="sequence")
    assert Native(options).plan(KEYS).eager_steps == ["CuSeqlens"]
    static = Native(options, Settings(num_boundaries=4)).plan(KEYS)
    assert static.eager_steps == [] and not CuSeqlens(num_boundaries=4).data_dependent_shape


def test_layouts_cache_their_plans_and_never_pickle_them():
    layout = Native(TrainingOptions(return_labels=True))
    assert layout.plan(KEYS) is layout.plan(KEYS)
    copy = pickle.loads(pickle.dumps(layout))
    assert isinstance(copy._plans, Plans) and not copy._plans and copy.options == layout.options


def test_each_collator_has_its_plans():
    first = Collator(return_labels=True)
    assert first.plan(KEYS) is first.plan(KEYS)
    own = Collator(return_labels=True, transforms=[Doubled()])
    assert own.plan(KEYS) is not first.plan(KEYS) and "Doubled" in repr(own.plan(KEYS))
    assert "TokenShift" in repr(first.plan(KEYS))
