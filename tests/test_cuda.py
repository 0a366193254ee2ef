"""CUDA: every output on the requested device and equal to the CPU's. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from helpers import FULL_OPTIONS, PackedRecords, as_lists

from zephon_collate import Collator, SampleBatch, SampleRecord

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPTIONS = FULL_OPTIONS


def cpu_records(rows=4, length=32):
    data = PackedRecords(rows, length)
    return [data[i] for i in range(rows)]


def on_cuda(record):
    payload = {key: value.cuda() for key, value in record.payload.items()}
    return SampleRecord(record.meta, payload)


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("position_mode", ["preserve", "sequence"])
def test_to_training_on_cuda_payloads(flatten, position_mode):
    records = cpu_records()
    expected = SampleBatch(records).to_training(flatten=flatten, position_mode=position_mode, **OPTIONS)
    got = SampleBatch([on_cuda(r) for r in records]).to_training(
        flatten=flatten, position_mode=position_mode, **OPTIONS
    )
    for key, value in got.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cuda", key
            assert value.dtype == expected[key].dtype, key
    assert as_lists(got) == as_lists(expected)


@pytest.mark.parametrize("compile", [False, True])
def test_collator_finishes_on_cuda(compile):
    records = cpu_records()
    collator = Collator(device="cuda", compile=compile, **OPTIONS, boundary_safe_labels=False)
    stacked = collator.stack(records).pin_memory()
    assert stacked.td["input_ids"].is_pinned()
    got = collator.finish(stacked)
    assert all(v.device.type == "cuda" for v in got.values() if isinstance(v, torch.Tensor))
    assert as_lists(got) == as_lists(SampleBatch(records).to_training(**OPTIONS))


def test_static_shape_chain_in_cuda_graph():
    records = cpu_records()
    collator = Collator(
        device="cuda", num_boundaries=8, python_scalars=False, **OPTIONS, boundary_safe_labels=False
    )
    td = collator.stack(records).td.cuda()
    chain = collator.runner(collator.plan_for(tuple(td.keys())))
    static_in = td.clone()
    chain(static_in)  # warm-up on the side stream is not needed for these ops
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_in)
    graph.replay()
    eager = chain(td)
    for key, value in eager.items():
        assert torch.equal(static_out[key], value), key


@pytest.mark.parametrize("compile", [False, True])
def test_static_shape_chain_makes_no_host_sync(compile):
    """With num_boundaries the whole chain stays on the device: no host sync, checked by torch's sync
    debug mode (an error on any synchronising call), eager and compiled; the outputs equal the CPU's."""
    records = cpu_records()
    collator = Collator(
        device="cuda",
        compile=compile,
        num_boundaries=8,
        python_scalars=False,
        **OPTIONS,
        boundary_safe_labels=False,
    )
    stacked = collator.stack(records)
    td = stacked.widened().td.cuda()
    run = collator.runner(collator.plan_for(tuple(td.keys())))
    run(td)  # warm-up (compiles once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(td)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = Collator(num_boundaries=8, **OPTIONS).finish(stacked)  # BoundaryMask on, as above
    for key in ("input_ids", "labels", "loss_mask", "cu_seqlens", "padding_mask"):
        assert out[key].device.type == "cuda", key
        assert out[key].cpu().tolist() == as_lists(want[key]), key
