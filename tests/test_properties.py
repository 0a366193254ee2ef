"""to_training on random valid batches equals the per-row pure-Python reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import torch
from helpers import as_lists
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_to_training
from strategies import packed_batches, training_options

DTYPES = ["auto", torch.int32, np.int64, None]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_matches_reference_for_equal_rows(data):
    batch = data.draw(packed_batches())
    options = data.draw(training_options(batch))
    dtype = data.draw(st.sampled_from(DTYPES))
    out = batch.to_training(dtype=dtype, **options)
    assert as_lists(out) == reference_to_training(batch.records, **options)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_reference_for_ragged_lists(data):
    batch = data.draw(packed_batches(ragged=True))
    options = data.draw(training_options(batch))
    out = batch.to_training(dtype=None, **options)
    assert out == reference_to_training(batch.records, **options)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_invariants(data):
    """Labels equal the next token wherever not ignored; masks, counts and boundaries agree."""
    batch = data.draw(packed_batches(min_length=2))
    options = data.draw(training_options(batch))
    options.update(return_labels=True, return_loss_mask=True, return_num_valid_tokens=True, flatten=False)
    out = batch.to_training(**options)
    ignore = options["ignore_index"]
    tokens = torch.stack([torch.as_tensor(r.payload["input_ids"] if isinstance(r.payload, dict) else r.payload)
                          for r in batch.records])  # fmt: skip
    kept = out["labels"] != ignore
    assert torch.equal(out["labels"][kept], tokens[:, 1:][kept])
    assert torch.equal(out["loss_mask"], kept.float())
    assert out["num_valid_tokens"] == int(kept.sum())
    assert out["input_ids"].shape == out["labels"].shape == out["loss_mask"].shape
    if "cu_seqlens" in out:
        cu = out["cu_seqlens"]
        assert bool((cu[:, 1:] >= cu[:, :-1]).all()) and bool((cu[:, -1] == tokens.shape[1] - 1).all())
