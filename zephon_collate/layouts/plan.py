"""The plan: the chain one layout runs on one key set (host, eager or compiled), built once and cached."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate.transforms import Chain, Transform

__all__ = ["CPU_INDUCTOR_OPTIONS", "Plan", "Plans", "host_applies", "use_host_pass"]

# Inductor's vectorised CPU code stores bool results slowly in torch 2.13 (an int64 ``== 0`` into a bool
# tensor takes many times the eager time), so CPU graphs are compiled to scalar loops; even so, a compiled
# chain is slower than the eager one on the CPU (benchmarks/bench_collator.py): compiling is for GPUs.
CPU_INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"cpp.simdlen": 0}

_HOST_DTYPES = frozenset(
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
_state = threading.local()


@contextlib.contextmanager
def use_host_pass(enabled: bool) -> Iterator[None]:
    """Within the block, in this thread, run the host variants on CPU data (``True``) or torch everywhere.

    Example:
        >>> from zephon_collate import Collator
        >>> with use_host_pass(False):  # the torch transforms, as on a GPU
        ...     Collator(return_labels=True)([{"input_ids": [5, 6, 7]}])["labels"].tolist()
        [[6, 7]]
    """
    previous = getattr(_state, "enabled", True)
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def host_applies(data: Mapping[str, object]) -> bool:
    """True when a plan may run on the host: NumPy arrays or plain CPU tensors, eager, host pass on."""
    if not getattr(_state, "enabled", True) or torch.compiler.is_compiling():
        return False
    for value in data.values():
        if isinstance(value, np.ndarray):
            continue
        if type(value) is not torch.Tensor or not value.is_cpu or value.requires_grad:
            return False  # another device, autograd, or a subclass (FakeTensor, ...)
        if value.dtype not in _HOST_DTYPES:
            return False
    return True


def _dynamic(transform: Any) -> bool:
    """True for a step whose output size depends on the data."""
    return bool(getattr(transform, "data_dependent_shape", False))


def _runner(chain: Chain) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``chain.run`` as a function with a code object of its own. Dynamo caches compiled graphs per code
    object, with a limit on how many it keeps; plans sharing one function would share that limit."""

    def run_chain(data: dict[str, Any]) -> dict[str, Any]:
        return chain.run(data)

    code = run_chain.__code__.replace()  # a new code object: a cache of its own
    return types.FunctionType(code, run_chain.__globals__, "run_chain", None, run_chain.__closure__)


class Plans(dict[tuple[str, ...], "Plan"]):
    """A layout's plans by key set: pickled empty (a DataLoader worker builds its own)."""

    def __reduce__(self) -> tuple[type[Plans], tuple[()]]:
        return Plans, ()


class Plan:
    """A chain on one key set (its wiring checked): run eagerly (on the host where it applies) or compiled.

    Parameters:
        steps: the transforms, in order (a layout's built-in ones, then yours).
        keys: the keys of the stacked batch the plan runs on.

    Example:
        >>> from zephon_collate.transforms import LossMask, TokenShift
        >>> plan = Plan([TokenShift(), LossMask(supervision_key=None)], ("input_ids", "padding_length"))
        >>> out = plan.run({"input_ids": np.array([[1, 2, 3]]), "padding_length": np.array([0])})
        >>> out["input_ids"].tolist(), out["labels"].tolist(), plan.output_keys
        ([[1, 2]], [[2, 3]], ['input_ids', 'padding_length', 'labels', 'loss_mask', 'num_valid_tokens'])
    """

    def __init__(self, steps: Sequence[Transform], keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.chain = Chain(*steps, input_keys=keys)
        self.output_keys = self.chain.output_keys(keys)
        # A step that replaces the batch (ContextParallelShard) writes what the data holds: its declared keys
        # are the most it writes, so the outputs are those it wrote.
        self.keys_by_data = any(getattr(step, "replaces_batch", False) for step in self.chain.steps)
        self._compiled: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def run(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The chain over ``data`` (stacked arrays or tensors), eager: on the host where it applies."""
        if host_applies(data):
            arrays = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
            return self.chain.run(arrays, host=True)
        return self.chain.run(
            {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in data.items()}
        )

    def compiled(self, device_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        """The chain through ``torch.compile`` (dynamic shapes, full graphs) for ``device_type``; cached."""
        function = self._compiled.get(device_type)
        if function is None:
            with self._lock:
                function = self._compiled.get(device_type) or self._compile(device_type)
                self._compiled[device_type] = function
        return function

    def join(self, key: str, rows: list[Any]) -> Any:
        """Output ``key`` of a batch run row by row, from each row's as Python values (:meth:`Chain.join`)."""
        return self.chain.join(key, rows)

    @property
    def eager_steps(self) -> list[str]:
        """The steps a compiled plan runs eagerly (data-dependent output sizes); ``[]``: one graph."""
        return [type(step).__name__ for step in self.chain.steps if _dynamic(step)]

    def _compile(self, device_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        options = CPU_INDUCTOR_OPTIONS if device_type == "cpu" else None
        stages: list[tuple[Chain, Callable[[dict[str, Any]], dict[str, Any]]]] = []
        run: list[Any] = []
        for step in [*self.chain.steps, None]:
            if step is not None and not _dynamic(step):
                run.append(step)
                continue
            if run:
                head = Chain(*run)
                stages.append(
                    (head, torch.compile(_runner(head), dynamic=True, fullgraph=True, options=options))
                )
                run = []
            if step is not None:
                tail = Chain(step)
                stages.append((tail, tail.run))

        def run_stages(data: Mapping[str, Any]) -> dict[str, Any]:
            out = dict(data)
            for stage, function in stages:
                # A graph gets the keys its steps declare only (a key it passes through would add shape
                # guards, and recompiles, for nothing): the keys each step sees eagerly too.
                if stage.reads_every_key:  # it reshapes the whole batch: its output is the batch
                    out = function(dict(out))
                    continue
                given = {key: out[key] for key in stage.in_keys}  # the keys it needs, the optional ones given
                given.update((key, out[key]) for key in stage.optional_keys if key in out)
                try:
                    out.update(function(given))
                except Exception:
                    if function == stage.run:
                        raise
                    stage.run(given)  # eager, it names what failed (an undeclared key, a bad return)
                    raise  # eager runs: the compiler's own failure
                for key in stage.dropped_keys:
                    out.pop(key, None)
            return out

        return run_stages

    def __repr__(self) -> str:
        steps = ", ".join(type(t).__name__ for t in self.chain.steps)
        return f"Plan({steps}; outputs {self.output_keys})"
