"""The plan: the chain one layout runs on a stacked batch with one key set, built once and cached.

A :class:`Plan` holds the chain (the layout's built-in transforms, then the
user's own, or the user's chain in their place), the output names derived
from that chain, and, when asked, the chain compiled with ``torch.compile``.
``to_training``, ``Collator.__call__`` and ``Collator.finish`` all run a plan:
the transforms' cores over one mapping of tensors, no TensorDict per step, no
per-step check (the reader has checked the data). On plain CPU tensors in eager
mode, the fused host pass (:mod:`._host`) stands in for the built-in part.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from zephon_collate.collate import _host
from zephon_collate.transforms import Chain, Transform

__all__ = ["CPU_INDUCTOR_OPTIONS", "CollateLayout", "Layout", "Plan", "Plans", "Result"]

Result = dict[str, "torch.Tensor | np.ndarray"]
"""What a plan returns: its chain's output mapping, arrays where the host pass ran."""

# Inductor's vectorised CPU code stores bool results slowly in torch 2.13 (an int64
# ``== 0`` into a bool tensor takes many times the eager time), so the CPU graphs are
# compiled to scalar loops; even so, the compiled chain is slower than the eager one on
# the CPU (benchmarks/bench_collator.py): compiling is for GPUs.
CPU_INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"cpp.simdlen": 0}


class Layout(Protocol):
    """What a plan needs from a layout (the page's, ``for_transformers``'): see :class:`Plan`."""

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The built-in transforms for a stacked batch holding ``keys``."""
        ...

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The built-in chain's output mapping, computed by the fused host pass."""
        ...

    def names(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """``(key, output name)`` pairs of the outputs, from the chain's final ``keys``."""
        ...


class CollateLayout(Layout, Protocol):
    """What a :class:`~zephon_collate.Collator` needs from its layout: a plan per key set, reading,
    stacking, the outputs (the page's layout and ``for_transformers``' both are one)."""

    def plan(self, keys: tuple[str, ...]) -> Plan:
        """The layout's plan on a stacked batch holding ``keys``, built once."""
        ...

    def stack(self, samples: Any) -> Any:
        """Read, check and stack ``samples``: a :class:`~zephon_collate.collate._native.Stacked`, or
        ``None`` for an empty batch."""
        ...

    def collate(
        self, samples: Any, plan: Callable[[tuple[str, ...]], Plan], *, python_scalars: bool = True
    ) -> dict[str, Any]:
        """The one-step path: read, stack, run ``plan(keys)``, assemble."""
        ...

    def assemble(
        self,
        per_record: Mapping[str, list[Any]],
        result: Mapping[str, Any],
        pairs: Sequence[tuple[str, str]],
        python_scalars: bool,
    ) -> dict[str, Any]:
        """The output dict from a plan's result."""
        ...

    def empty(self, chain: Callable[[list[str]], Chain] | None = None) -> dict[str, Any]:
        """The outputs of an empty batch, named by ``chain(keys)`` (default: the layout's own chain),
        or the error a layout raises for one."""
        ...


def _stage_input(stage: Chain, data: Mapping[str, Any]) -> dict[str, Any]:
    """What a compiled stage is fed: the keys it needs, and the optional keys it reads that are present."""
    given = {key: data[key] for key in stage.in_keys}
    given.update((key, data[key]) for key in stage.optional_keys if key in data)
    return given


def _dynamic(transform: Any) -> bool:
    """True for a step whose output size depends on the data (it cannot sit inside a compiled graph)."""
    return bool(getattr(transform, "data_dependent_shape", False))


def _runner(chain: Chain) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``chain.run`` as a function with a code object of its own.

    Dynamo caches compiled graphs per code object, with a limit on how many it
    keeps (``torch._dynamo.config.recompile_limit``, 8); plans that compiled one
    shared function would share that limit, and the ninth plan would fail.
    """

    def run_chain(data: dict[str, Any]) -> dict[str, Any]:
        return chain.run(data)

    code = run_chain.__code__.replace()  # a new code object: a cache of its own
    return types.FunctionType(code, run_chain.__globals__, "run_chain", None, run_chain.__closure__)


class Plans(dict[tuple[str, ...], "Plan"]):
    """A layout's plans by key set, built once per process: pickled empty (compiled code and locks
    do not travel; a DataLoader worker builds its own)."""

    def __reduce__(self) -> tuple[type[Plans], tuple[()]]:
        return Plans, ()


class Plan:
    """The chain and the output names of one layout on one key set.

    Parameters:
        layout: what builds the chain and names the outputs (``to_training``'s options, or a preset's).
        keys: the keys of the stacked batch the plan runs on.
        transforms: transforms of yours, run after the built-in chain.
        chain: transforms of yours that replace the built-in chain (``transforms`` then follow them).

    Raises:
        ValueError: if a transform reads a key that neither the batch nor an earlier step provides.

    Example:
        >>> from zephon_collate.collate._native import Native
        >>> from zephon_collate.collate.options import TrainingOptions
        >>> plan = Plan(Native(TrainingOptions(return_labels=True)), ("input_ids", "padding_length"))
        >>> out = plan.run({"input_ids": torch.tensor([[1, 2, 3]]), "padding_length": torch.tensor([0])})
        >>> out["input_ids"].tolist(), out["labels"].tolist(), [name for _, name in plan.pairs]
        ([[1, 2]], [[2, 3]], ['ids', 'texts', 'input_ids', 'labels'])
    """

    def __init__(
        self,
        layout: Layout,
        keys: tuple[str, ...],
        transforms: Sequence[Transform] = (),
        chain: Sequence[Transform] | None = None,
    ) -> None:
        self.layout = layout
        self.keys = keys
        builtin = layout.chain(keys) if chain is None else list(chain)
        self.chain = Chain(*builtin, *transforms, input_keys=keys)
        self.hosted = chain is None  # the host pass computes the built-in part
        self.after = Chain(*transforms) if transforms else None
        self.pairs = layout.names(self.chain.output_keys(keys))
        self._compiled: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def run(self, data: Mapping[str, torch.Tensor]) -> Result:
        """The chain over ``data`` (a mapping of stacked tensors), eager.

        On plain CPU tensors the fused host pass computes the built-in part over
        NumPy views (no copy); its outputs are then arrays, unless transforms of
        yours follow, which get tensors (views of those arrays).
        """
        if self.hosted and _host.applies(data):
            out: Result = dict(self.layout.host({key: value.numpy() for key, value in data.items()}))
            if self.after is None:
                return out
            tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
            return self.after.run(tensors)
        return self.chain.run(data)

    def compiled(self, device_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        """The chain through ``torch.compile`` (dynamic shapes, full graphs) for ``device_type``; cached.

        Steps whose output size depends on the data (``CuSeqlens`` without
        ``num_boundaries``, or a transform of yours with ``data_dependent_shape =
        True``) run eager between the compiled runs of steps around them; on the
        CPU the graphs are compiled to scalar loops (:data:`CPU_INDUCTOR_OPTIONS`).
        """
        function = self._compiled.get(device_type)
        if function is None:
            with self._lock:
                function = self._compiled.get(device_type) or self._compile(device_type)
                self._compiled[device_type] = function
        return function

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
                out.update(function(_stage_input(stage, out)))
                for key in stage.dropped_keys:
                    out.pop(key, None)
            return out

        return run_stages

    def __repr__(self) -> str:
        steps = ", ".join(type(t).__name__ for t in self.chain.steps)
        return f"Plan({steps}; outputs {[name for _, name in self.pairs]})"
