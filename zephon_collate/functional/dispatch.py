"""Kernel dispatch: a torch kernel, its input check, and an optional CPU twin registered beside it.

On the CPU, torch's elementwise comparisons over integer tensors run several
times slower than NumPy's (an ``int64 == scalar`` over 65,536 tokens: ~39 us
against ~9 us on a 2-core AMD EPYC, one thread), and every torch call costs
1-3 us before it touches data (a slice: 1.6 us; in NumPy 0.2 us). So a kernel
may register a NumPy twin in its own module, taking and returning arrays: same
values, dtypes and shapes. It runs when every tensor argument is a plain CPU
tensor of a NumPy dtype, outside ``torch.compile``, without autograd (the
tensors are viewed as arrays and the results wrapped back, no copy), and
whenever the kernel is given arrays: the collate plan runs its chain on the
CPU over arrays (:mod:`zephon_collate.collate.plan`). The torch kernel is the
specification; tests compare the two.

A decorated kernel ``k`` is called checked (``k(...)``: the check, then the
dispatch), or ``k.unchecked(...)`` by a caller that has checked its inputs
already (the transforms do, naming their keys); ``k.torch`` is the torch
kernel alone and ``k.cpu`` its twin (or ``None``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["check_tensor", "cpu_twins_apply", "kernel", "use_cpu_twins"]

F = TypeVar("F", bound=Callable[..., Any])

_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)
_twins_enabled = [True]


@contextlib.contextmanager
def use_cpu_twins(enabled: bool) -> Iterator[None]:
    """Within the block, run the NumPy twins (``True``, the default) or the torch kernels everywhere.

    Example:
        >>> from zephon_collate.functional import eos_label_mask
        >>> with use_cpu_twins(False):
        ...     eos_label_mask(torch.tensor([[1, 2]]), 2).tolist()
        [[False, True]]
    """
    previous = _twins_enabled[0]
    _twins_enabled[0] = bool(enabled)
    try:
        yield
    finally:
        _twins_enabled[0] = previous


def cpu_twins_apply(*args: object) -> bool:
    """True when a NumPy twin may stand in for a kernel called on ``args`` (its tensors are checked)."""
    if not _twins_enabled[0] or torch.compiler.is_compiling():
        return False
    for t in args:  # a plain loop: this runs a dozen times per call
        if type(t) is torch.Tensor:
            if not t.is_cpu or t.dtype not in _NUMPY_DTYPES or t.requires_grad:
                return False  # another device or dtype, autograd
        elif isinstance(t, torch.Tensor):
            return False  # a subclass (Parameter, FakeTensor, ...)
    return True


def check_tensor(kernel: str, name: str, value: object, min_dim: int = 0, max_dim: int = 64) -> torch.Tensor:
    """``value`` if a tensor (else ``TypeError``) of ``min_dim`` to ``max_dim`` dims (else ``ValueError``)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not min_dim <= value.dim() <= max_dim:
        raise ValueError(
            f"{kernel}: {name} has shape {tuple(value.shape)}; it needs {min_dim} to {max_dim} dims"
        )
    return value


def kernel(
    *,
    check: Callable[..., None] | None = None,
    cpu: Callable[..., Any] | None = None,
    cpu_when: Callable[..., bool] | None = None,
) -> Callable[[F], F]:
    """Decorate a torch kernel with its input ``check`` and an optional CPU twin ``cpu``.

    The twin runs when its tensor arguments allow it (:func:`cpu_twins_apply`)
    and ``cpu_when(...)`` holds, if given. ``check``, ``cpu`` and ``cpu_when``
    take the kernel's arguments.
    """

    def decorate(torch_fn: F) -> F:
        def unchecked(*args: Any, **kwargs: Any) -> Any:
            twin = checked.cpu  # type: ignore[attr-defined]
            if any(type(a) is np.ndarray for a in args):  # arrays in, arrays out (the CPU plan)
                if twin is not None and (cpu_when is None or cpu_when(*args, **kwargs)):
                    return twin(*args, **kwargs)
                tensors = [torch.from_numpy(a) if type(a) is np.ndarray else a for a in args]
                return _to_arrays(checked.torch(*tensors, **kwargs))  # type: ignore[attr-defined]
            if (
                twin is not None
                and cpu_twins_apply(*args, *kwargs.values())
                and (cpu_when is None or cpu_when(*args, **kwargs))
            ):
                arrays = [a.numpy() if type(a) is torch.Tensor else a for a in args]
                return _to_tensors(twin(*arrays, **kwargs))
            return checked.torch(*args, **kwargs)  # type: ignore[attr-defined]

        @functools.wraps(torch_fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if check is not None:
                check(*args, **kwargs)
            return unchecked(*args, **kwargs)

        checked.unchecked = unchecked  # type: ignore[attr-defined]
        checked.torch = torch_fn  # type: ignore[attr-defined]
        checked.cpu = cpu  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


def _to_tensors(value: Any) -> Any:
    """A twin's result with its arrays as tensors (no copy)."""
    if type(value) is np.ndarray:
        return torch.from_numpy(value)
    if type(value) is tuple:
        return tuple(_to_tensors(item) for item in value)
    return value


def _to_arrays(value: Any) -> Any:
    """A torch kernel's result with its CPU tensors as arrays (no copy)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if type(value) is tuple:
        return tuple(_to_arrays(item) for item in value)
    return value
