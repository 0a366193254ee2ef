"""The NumPy twins of the CPU kernels give exactly what the torch kernels give.

Each case runs a kernel twice on the same random inputs: once as the package
runs it (CPU tensors, eager: the NumPy twin) and once with
``use_cpu_twins(False)`` (the torch code that CUDA and ``torch.compile``
run), then compares values, dtypes and shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import FULL_OPTIONS, as_lists, batch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_to_training
from strategies import packed_batches, training_options

from zephon_collate import functional
from zephon_collate.functional.dispatch import cpu_twins_apply, use_cpu_twins
from zephon_collate.functional.labels import contiguous
from zephon_collate.transforms import LossMask

CASES = settings(max_examples=150, deadline=None)
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@contextmanager
def torch_kernels() -> Iterator[None]:
    with use_cpu_twins(False):
        yield


def both_ways(kernel: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``kernel(*args)`` through the NumPy twin, then through torch; asserts the twin did run."""
    assert cpu_twins_apply(*(a for a in args if isinstance(a, torch.Tensor)))
    fast = kernel(*args)
    with torch_kernels():
        plain = kernel(*args)
    return fast, plain


def assert_same(fast: Any, plain: Any) -> None:
    if isinstance(plain, tuple):
        assert len(fast) == len(plain)
        for a, b in zip(fast, plain, strict=True):
            assert_same(a, b)
        return
    assert fast.dtype == plain.dtype and fast.shape == plain.shape
    assert torch.equal(fast, plain)


@st.composite
def label_batches(draw: st.DrawFn) -> dict[str, Any]:
    """Labels ``[B, S]`` or ``[B, S, C]`` of a random integer dtype, a supervision mask, pad counts."""
    rows, length = draw(st.integers(0, 4)), draw(st.integers(0, 12))
    channels = draw(st.sampled_from([(), (2,)]))
    dtype = draw(st.sampled_from(INT_DTYPES))
    low = 0 if dtype == torch.uint8 else -128
    shape = (rows, length, *channels)
    labels = torch.randint(low, 128, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    labels = labels.to(dtype)
    if draw(st.booleans()) and labels.numel():  # plant the sentinel among the real labels
        labels.view(-1)[0] = 0 if dtype == torch.uint8 else -100
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))
    mask_shape = draw(st.sampled_from([shape, (rows, length)]))
    supervision = torch.randint(0, 2, mask_shape).to(mask_dtype)
    padding = torch.tensor([draw(st.integers(0, length)) for _ in range(rows)], dtype=torch.int64)
    ignore = 0 if dtype == torch.uint8 else draw(st.sampled_from([-100, -1, 7]))
    return {"labels": labels, "supervision": supervision, "padding": padding, "ignore": ignore}


@CASES
@given(label_batches(), st.booleans(), st.booleans())
def test_apply_loss_mask(case: dict[str, Any], with_supervision: bool, with_padding: bool) -> None:
    supervision = case["supervision"] if with_supervision else None
    padding = case["padding"] if with_padding else None
    args = (case["labels"], supervision, padding, case["ignore"])
    assert_same(*both_ways(functional.apply_loss_mask, *args))


@CASES
@given(label_batches(), st.integers(0, 130))
def test_eos_and_mask_labels(case: dict[str, Any], eos: int) -> None:
    inputs = case["labels"]
    fast, plain = both_ways(functional.eos_label_mask, inputs, eos)
    assert_same(fast, plain)
    assert_same(*both_ways(functional.mask_labels, case["labels"], fast, case["ignore"]))


@CASES
@given(label_batches())
def test_trailing_mask(case: dict[str, Any]) -> None:
    length = case["labels"].shape[1]
    assert_same(*both_ways(functional.trailing_mask, case["padding"], length))
    assert_same(*both_ways(functional.trailing_mask, case["padding"].to(torch.uint8), length))


@CASES
@given(st.integers(0, 4), st.integers(0, 12), st.integers(0, 99), st.sampled_from(INT_DTYPES))
def test_cu_seqlens(rows: int, length: int, seed: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 3, (rows, length), generator=generator).to(dtype)
    assert_same(*both_ways(functional.cu_seqlens_rows, positions))
    assert_same(*both_ways(functional.cu_seqlens_flat, positions))
    padding = torch.randint(0, 2, (rows, length), generator=generator).bool()
    assert_same(*both_ways(functional.segment_ids_from_positions, positions))
    assert_same(*both_ways(functional.segment_ids_from_positions, positions, padding))
    flat = positions.reshape(-1)
    assert_same(*both_ways(functional.segment_ids_from_positions, flat, padding.reshape(-1)))


def test_inputs_are_only_read() -> None:
    labels = torch.tensor([[5, 6, 7, 8]])[:, 1:]  # a strided view, as TokenShift hands it over
    supervision = torch.tensor([[1, 0, 1]])
    versions = (labels._version, supervision._version)
    out, loss_mask, counts = functional.apply_loss_mask(labels, supervision, torch.tensor([1]), -100)
    assert (labels._version, supervision._version) == versions
    assert labels.tolist() == [[6, 7, 8]]
    assert out.tolist() == [[6, -100, -100]] and loss_mask.tolist() == [[1.0, 0.0, 0.0]]
    assert counts.tolist() == [1]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(2, 3, dtype=torch.bfloat16),
        torch.zeros(2, 3, requires_grad=True),
        torch.nn.Parameter(torch.zeros(2, 3)),
        torch.zeros(2, 3, device="meta"),
    ],
    ids=["bfloat16", "requires_grad", "parameter", "meta"],
)
def test_twin_steps_aside(tensor: torch.Tensor) -> None:
    """Dtypes NumPy lacks, autograd, subclasses and other devices stay with torch."""
    assert not cpu_twins_apply(tensor)


def test_switch_off() -> None:
    with torch_kernels():
        assert not cpu_twins_apply(torch.zeros(2))
    assert cpu_twins_apply(torch.zeros(2))


def test_transform_same_either_way() -> None:
    """LossMask on a TensorDict: the example of its docstring, both ways."""
    from tensordict import TensorDict

    td = TensorDict(
        labels=torch.tensor([[11, 12, 13, 0]]),
        loss_mask=torch.tensor([[0, 1, 1, 1]]),
        padding_length=torch.tensor([1]),
        batch_size=[1],
    )
    fast = LossMask()(td)
    with torch_kernels():
        plain = LossMask()(td)
    for key in ("labels", "loss_mask", "num_valid_tokens"):
        assert_same(fast[key], plain[key])
    assert fast["labels"].tolist() == [[-100, 12, 13, -100]]


def test_contiguous_copies_strided_rows() -> None:
    tokens = torch.arange(12).reshape(3, 4)
    view = tokens[:, :-1]
    out = contiguous(view)
    assert out.is_contiguous() and torch.equal(out, view.contiguous())
    assert out.data_ptr() != tokens.data_ptr()
    assert contiguous(tokens) is tokens  # already contiguous: no copy, as in torch


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_to_training_same_either_way(data: st.DataObject) -> None:
    """to_training through the torch kernels (what CUDA runs) equals the reference and the NumPy path."""
    batch = data.draw(packed_batches())
    options = data.draw(training_options(batch))
    fast = batch.to_training(**options)
    with torch_kernels():
        plain = batch.to_training(**options)
    assert as_lists(plain) == reference_to_training(batch.records, **options)
    assert as_lists(fast) == as_lists(plain)
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert fast[key].dtype == value.dtype, key


def test_to_training_runs_the_twins_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("apply_loss_mask", "eos_label_mask", "mask_labels", "trailing_mask", "cu_seqlens_rows"):
        kernel = getattr(functional, name)

        def counted(*args: Any, _name: str = name, _original: Any = kernel.cpu) -> Any:
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(kernel, "cpu", counted)
    payload = {"input_ids": [1, 10, 2, 1, 11, 2], "positions": [0, 1, 2, 0, 1, 2], "loss_mask": [1] * 6}
    out = batch(payload).to_training(**FULL_OPTIONS)
    assert out["labels"].tolist() == [[10, 2, -100, 11, 2]]
    assert sorted(set(calls)) == [
        "apply_loss_mask",
        "cu_seqlens_rows",
        "eos_label_mask",
        "mask_labels",
        "trailing_mask",
    ]
