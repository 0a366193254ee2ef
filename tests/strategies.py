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
    labels = draw(st.booleans())
    options: dict[str, Any] = {
        "return_labels": labels,
        "flatten": draw(st.booleans()),
        "return_padding_mask": draw(st.booleans()),
        "position_mode": draw(st.sampled_from(["preserve", "sequence"])),
        "ignore_index": draw(st.sampled_from([-100, -1, 0])),
        "return_cu_seqlens": has("positions") and draw(st.booleans()),
    }
    if has("weights"):
        options["extra_fields"] = ["weights"]
    if labels:
        options["return_loss_mask"] = draw(st.booleans())
        options["return_num_valid_tokens"] = draw(st.booleans())
        if draw(st.booleans()):
            options.update(eos_mask_loss=True, eos_token_id=draw(st.integers(0, VOCAB)))
    return options
