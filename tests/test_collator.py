"""Collator as a DataLoader collate_fn: records and plain dicts, workers (fork and spawn), pinning, pickling, threads."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from helpers import FULL_OPTIONS, PackedRecords, as_lists, batch
from torch.utils.data import DataLoader

from zephon_collate import Collator, SampleBatch
from zephon_collate.collate.transfer import StackedBatch

OPTIONS = FULL_OPTIONS


def expected(records):
    return as_lists(SampleBatch(records).to_training(**OPTIONS))


def test_collator_on_records_equals_to_training():
    data = PackedRecords(6)
    records = [data[i] for i in range(6)]
    assert as_lists(Collator(**OPTIONS, boundary_safe_labels=False)(records)) == expected(records)


def test_collator_split_path_equals_to_training():
    """stack (worker side) then finish (main process) gives to_training's output."""
    records = [PackedRecords(4)[i] for i in range(4)]
    collator = Collator(device="cpu", **OPTIONS, boundary_safe_labels=False)
    stacked = collator.stack(records)
    assert isinstance(stacked, StackedBatch) and stacked.td.device == torch.device("cpu")
    assert as_lists(collator.finish(stacked)) == expected(records)


def test_plain_dict_payloads_get_documented_metadata():
    """Plain payloads (as HF datasets hand over) get sample_id (0, 0, i) and no padding."""
    out = Collator(return_labels=True)([{"input_ids": [1, 2, 3], "text": "a"}, [4, 5, 6]])
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)] and out["texts"] == ["a", None]
    assert out["labels"].tolist() == [[2, 3], [5, 6]]


def test_bad_samples_and_options():
    with pytest.raises(TypeError, match="item 1 must be a SampleRecord"):
        Collator()([{"input_ids": [1]}, "text"])
    with pytest.raises(ValueError, match="eos_mask_loss"):
        Collator(eos_mask_loss=True)
    with pytest.raises(ValueError, match="torch output"):
        Collator(device="cpu", dtype=None)
    with pytest.raises(ValueError, match="num_boundaries"):
        Collator(num_boundaries=0)


def test_data_errors_raised_in_stack_naming_the_record():
    bad = batch({"input_ids": [1, 2, 3]}, {"input_ids": [1, -5, 3]}).records
    with pytest.raises(ValueError, match=r"record 1 .*>= 0"):
        Collator(device="cpu").stack(bad)


def test_empty_batch():
    assert Collator(**OPTIONS, boundary_safe_labels=False)([]) == SampleBatch([]).to_training(**OPTIONS)
    collator = Collator(device="cpu", **OPTIONS, boundary_safe_labels=False)
    assert collator.finish(collator.stack([])) == SampleBatch([]).to_training(**OPTIONS)


def test_python_scalars_off_keeps_tensors():
    out = Collator(device="cpu", python_scalars=False, flatten=True, **OPTIONS, boundary_safe_labels=False)(
        [PackedRecords(2)[i] for i in range(2)]
    )
    assert isinstance(out["num_valid_tokens"], torch.Tensor) and isinstance(out["max_seqlen"], torch.Tensor)


def test_static_cu_seqlens_shape():
    records = [PackedRecords(3)[i] for i in range(3)]
    out = Collator(device="cpu", num_boundaries=5, **OPTIONS, boundary_safe_labels=False)(records)
    reference = expected(records)
    assert out["cu_seqlens"].shape == (3, 5)
    for row, ref in zip(out["cu_seqlens"].tolist(), reference["cu_seqlens"], strict=True):
        assert row == ref + [ref[-1]] * (5 - len(ref))
    flat = Collator(device="cpu", num_boundaries=12, flatten=True, **OPTIONS, boundary_safe_labels=False)(
        records
    )
    ref_flat = as_lists(SampleBatch(records).to_training(flatten=True, **OPTIONS))["cu_seqlens"]
    assert flat["cu_seqlens"].tolist() == ref_flat + [ref_flat[-1]] * (12 - len(ref_flat))


def test_collator_pickles_after_use():
    collator = Collator(device="cpu", **OPTIONS, boundary_safe_labels=False)
    records = [PackedRecords(2)[i] for i in range(2)]
    first = as_lists(collator(records))
    clone = pickle.loads(pickle.dumps(collator))
    assert as_lists(clone(records)) == first


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(context):
    data = PackedRecords(12)
    collator = Collator(**OPTIONS, boundary_safe_labels=False)
    loader = DataLoader(
        data, batch_size=4, num_workers=2, collate_fn=collator, multiprocessing_context=context
    )
    outs = list(loader)
    assert [as_lists(out) for out in outs] == [
        expected([data[i] for i in range(s, s + 4)]) for s in (0, 4, 8)
    ]
    # The workers send one compact buffer (transfer.WireOutputs); what arrives is a plain dict of the page's dtypes.
    direct = collator([data[i] for i in range(4)])
    assert type(outs[0]) is dict and list(outs[0]) == list(direct)
    assert {k: v.dtype for k, v in outs[0].items() if isinstance(v, torch.Tensor)} == {
        k: v.dtype for k, v in direct.items() if isinstance(v, torch.Tensor)
    }


def test_dataloader_split_recipe_with_pin_memory():
    """Workers stack, the main process finishes; pin_memory=True pins StackedBatch (a no-op without an accelerator)."""
    data = PackedRecords(8)
    collator = Collator(
        device="cuda" if torch.cuda.is_available() else "cpu", **OPTIONS, boundary_safe_labels=False
    )
    loader = DataLoader(data, batch_size=4, num_workers=2, collate_fn=collator.stack, pin_memory=True)
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else _nothing():
        outputs = [as_lists(collator.finish(stacked)) for stacked in loader]
    assert outputs == [expected([data[i] for i in range(start, start + 4)]) for start in (0, 4)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_collator_is_thread_safe():
    collator = Collator(device="cpu", **OPTIONS, boundary_safe_labels=False)
    data = PackedRecords(16)
    chunks = [[data[i] for i in range(start, start + 4)] for start in range(0, 16, 4)]
    results: dict[int, object] = {}

    def work(index):
        for _ in range(5):
            results[index] = as_lists(collator(chunks[index]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(4)] == [expected(chunk) for chunk in chunks]
