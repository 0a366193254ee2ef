"""The chain ends with the batch: every output holds what the last step left, so a transform of yours,
run after the built-in chain, sees exactly what the batch will hold (the assembly only names and
converts). Checked on the host, in torch eager and compiled, in every layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from helpers import PAD, record

from zephon_collate import Collator, Transform
from zephon_collate.core import keys
from zephon_collate.layouts.plan import use_host_pass
from zephon_collate.transforms import LossMask, Total

KNOWN = tuple(
    sorted({value for name, value in vars(keys).items() if name.isupper() and isinstance(value, str)})
)


class Seen(Transform):
    """Records what it sees of every known key (a copy), and writes nothing of its own but a marker."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = [], ["seen_marker"]
        self.optional_keys = (*KNOWN, "old_logprobs", "routes")
        self.seen: dict[str, Any] = {}

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.seen = {key: torch.as_tensor(value).clone() for key, value in data.items()}
        return {"seen_marker": torch.zeros(())}


class CountSeen(Transform):
    """Copies ``num_valid_tokens`` under a key of its own: what a transform of yours reads."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["num_valid_tokens"], ["count_seen"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"count_seen": data["num_valid_tokens"].clone()}


def packed(index: int) -> object:
    """Two documents of 3 and 2 tokens, then one pad token."""
    tokens = [3 + index, 4, 5, 6 + index, 7, PAD]
    return record({"input_ids": tokens, "positions": [0, 1, 2, 0, 1, 0]}, index, padding=1)


@pytest.mark.parametrize("mode", ["host", "eager", "compiled"])
def test_a_transform_of_yours_sees_the_batch_count(mode):
    """Before, it saw each row's count ([4, 4]) while the batch held their sum (8)."""
    collate = Collator(
        return_labels=True, return_num_valid_tokens=True, transforms=[CountSeen()], compile=mode == "compiled"
    )
    rows = [packed(0), packed(1)]
    with use_host_pass(mode == "host"):
        out = collate(rows)
    assert out["num_valid_tokens"] == 6  # boundary-safe: 2 + 1 labels per document, twice
    assert out["count_seen"].shape == () and int(out["count_seen"]) == out["num_valid_tokens"]
    single = Collator(return_labels=True, return_num_valid_tokens=True, python_scalars=False)(rows)
    assert single["num_valid_tokens"].shape == () and int(single["num_valid_tokens"]) == 6


def test_a_chain_of_yours_ends_with_what_it_computes():
    """A chain of yours is the whole chain: its LossMask counts per row, and a Total sums them."""
    rows = [packed(0), packed(1)]
    # No boundary masking in this chain, said so: every non-padding label counts (4 of 5 per row).
    per_row = Collator(chain=[_shift(), LossMask(supervision_key=None)], boundary_safe_labels=False)(rows)
    assert per_row["num_valid_tokens"].tolist() == [4, 4]
    summed = Collator(chain=[_shift(), LossMask(supervision_key=None), Total()], boundary_safe_labels=False)(
        rows
    )
    assert summed["num_valid_tokens"] == 8


def _shift() -> Transform:
    from zephon_collate.transforms import TokenShift

    return TokenShift(input_keys=["positions"], label_keys=[])


def _same(output: Any, seen: torch.Tensor, key: str) -> None:
    if isinstance(output, (int, float)):
        assert seen.dim() == 0 and seen.item() == output, key
        return
    got = torch.as_tensor(np.asarray(output)) if not isinstance(output, torch.Tensor) else output
    assert got.shape == seen.shape, (key, got.shape, seen.shape)
    assert torch.equal(got.to(seen.dtype), seen), key


PRESETS = {
    "native": (
        lambda seen: Collator(
            return_labels=True,
            return_num_valid_tokens=True,
            return_loss_mask=True,
            return_cu_seqlens=True,
            return_padding_mask=True,
            transforms=[seen],
        ),
        lambda: [packed(0), packed(1)],
    ),
    "native flattened": (
        lambda seen: Collator(
            return_labels=True,
            return_num_valid_tokens=True,
            return_cu_seqlens=True,
            flatten=True,
            transforms=[seen],
        ),
        lambda: [packed(0), packed(1)],
    ),
    "transformers padded left": (
        lambda seen: Collator.for_transformers(pad_token_id=0, padding_side="left", transforms=[seen]),
        lambda: [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}],
    ),
    "transformers padding-free": (
        lambda seen: Collator.for_transformers(
            padding_free=True,
            return_flash_attn_kwargs=True,
            return_seq_idx=True,
            return_sequence_map=True,
            transforms=[seen],
        ),
        lambda: [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}],
    ),
    "preference shared": (
        lambda seen: Collator.for_preference(padding_free=True, shared_prompt=True, transforms=[seen]),
        lambda: [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}],
    ),
    "rollouts padded": (
        lambda seen: Collator.for_rollouts(pad_token_id=0, float_fields=["old_logprobs"], transforms=[seen]),
        lambda: [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "old_logprobs": [0.0, -1.0, -2.0]},
            {"input_ids": [1, 4], "completion_mask": [0, 1], "old_logprobs": [0.0, -0.5]},
        ],
    ),
    "rewards": (
        lambda seen: Collator.for_rewards(pad_token_id=0, transforms=[seen]),
        lambda: [{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 4], "margin": 0.5}],
    ),
}


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("host", [True, False], ids=["host", "torch"])
def test_every_output_is_what_the_chain_ended_with(name, host):
    build, samples = PRESETS[name]
    seen = Seen()
    with use_host_pass(host):
        out = build(seen)(samples())
    assert seen.seen, name
    for key, value in out.items():
        if key in ("ids", "texts", "seen_marker"):
            continue
        assert key in seen.seen, (name, key)
        _same(value, seen.seen[key], key)
