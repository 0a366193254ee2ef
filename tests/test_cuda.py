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
    plan = collator.plan(tuple(td.keys()))

    def chain(td):
        return collator.layout.run(plan, dict(td.items()), torch.device("cuda"))

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
    plan = collator.plan(tuple(td.keys()))

    def run(td):
        return collator.layout.run(plan, dict(td.items()), torch.device("cuda"))

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


def test_float_fields_and_the_loss_helpers_on_cuda():
    """Float fields keep their dtype through the pinned copy to the device; the loss helpers run there and
    give the CPU's numbers."""
    from zephon_collate import FloatField, aggregate_loss, sequence_logprobs, token_logprobs, unpack

    rollouts = [
        {
            "input_ids": [1, 2, 3, 4],
            "completion_mask": [0, 0, 1, 1],
            "old": [0.0, 0.0, -0.5, -1.0],
            "adv": 1.0,
        },
        {"input_ids": [1, 2, 5], "completion_mask": [0, 0, 1], "old": [0.0, 0.0, -2.0], "adv": -1.0},
    ]
    specs = ["old", FloatField("adv", "sequence", broadcast=True)]
    on_gpu = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=specs, device="cuda")
    batch = on_gpu.finish(on_gpu.stack(rollouts).pin_memory())
    assert batch["old"].device.type == "cuda" and batch["old"].dtype == torch.float32
    cpu = Collator.for_rollouts(padding_free=True, shared_prompt=True, float_fields=specs)(rollouts)
    logits = torch.randn(1, batch["input_ids"].shape[1], 8, generator=torch.Generator().manual_seed(0))
    for key in ("old", "adv", "logits_index", "sequence_index"):
        assert torch.equal(batch[key].cpu(), cpu[key]), key
    cuda_lp = token_logprobs(logits.cuda(), batch)
    assert torch.allclose(cuda_lp.cpu(), token_logprobs(logits, cpu), atol=1e-6)
    sums = sequence_logprobs(logits.cuda(), batch).sums
    assert torch.allclose(sums.cpu(), sequence_logprobs(logits, cpu).sums, atol=1e-6)
    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [r["input_ids"] for r in rollouts]
    loss = aggregate_loss(-cuda_lp, batch, mode="seq-mean-token-mean")
    assert loss.device.type == "cuda"
    assert float(loss) == pytest.approx(
        float(aggregate_loss(-token_logprobs(logits, cpu), cpu, mode="seq-mean-token-mean"))
    )
    native = Collator(return_labels=True, device="cuda", float_fields=["lp"])
    records = [
        SampleRecord(r.meta, {**r.payload, "lp": torch.linspace(-1, 0, r.payload["input_ids"].numel())})
        for r in cpu_records()
    ]
    out = native.finish(native.stack(records).pin_memory())
    assert out["lp"].device.type == "cuda" and out["lp"].dtype == torch.float32
    assert torch.equal(out["lp"].cpu(), Collator(return_labels=True, float_fields=["lp"])(records)["lp"])
