"""The plan: what one option set does to a stacked batch with one key set, built once and cached.

A :class:`Plan` knows the transform chain the options build, the output names
(after renaming and exclusion) and, when asked, the chain compiled with
``torch.compile``. :func:`~zephon_collate.to_training`, ``Collator.__call__``
and ``Collator.finish`` all run a plan: the transforms' cores over one mapping
of tensors, no TensorDict per step, no per-step check (the reader and the
stacker have checked the data).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from zephon_collate.collate.options import TrainingOptions
from zephon_collate.collate.output import output_keys
from zephon_collate.functional.dispatch import cpu_twins_apply
from zephon_collate.keys import (
    INPUT_IDS,
    LOSS_MASK,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITIONS,
)
from zephon_collate.transforms import (
    BoundaryMask,
    Chain,
    CuSeqlens,
    EosMask,
    LossMask,
    PaddingMask,
    Positions,
    TokenShift,
)

__all__ = ["CPU_INDUCTOR_OPTIONS", "Plan", "build_chain", "plan_for"]

# Inductor's vectorised CPU code stores bool results slowly in torch 2.13 (an int64
# ``== 0`` into a [8, 8193] bool tensor: 625 us compiled, 40 us eager); with scalar
# loops the compiled chain runs at 194 us against 286 us eager (benchmarks/bench_collator.py).
CPU_INDUCTOR_OPTIONS = {"cpp.simdlen": 0}


def build_chain(
    options: TrainingOptions,
    keys: tuple[str, ...],
    num_boundaries: int | None = None,
    boundary_safe: bool = False,
) -> Chain:
    """The transform chain ``options`` build for a stacked batch holding ``keys``.

    ``PaddingMask -> BoundaryMask -> TokenShift -> EosMask -> LossMask -> CuSeqlens
    -> Positions``, each only when asked for. ``num_boundaries`` gives ``CuSeqlens``
    a static shape. ``boundary_safe`` (the Collator's ``boundary_safe_labels``)
    adds ``BoundaryMask`` when there are labels and positions.
    ``Positions("sequence")`` comes after ``CuSeqlens`` because it overwrites the
    payload positions that ``CuSeqlens`` reads.

    Example:
        >>> options = TrainingOptions(return_labels=True, return_padding_mask=True)
        >>> [type(t).__name__ for t in build_chain(options, ("input_ids", "padding_length"))]
        ['PaddingMask', 'TokenShift', 'LossMask']
    """
    transforms: list[Any] = []
    if options.return_padding_mask:
        transforms.append(PaddingMask())
    if boundary_safe and options.return_labels and POSITIONS in keys:
        transforms.append(BoundaryMask())
    has_loss_mask = LOSS_MASK in keys or any(isinstance(t, BoundaryMask) for t in transforms)
    if options.return_labels:
        aligned = [k for k in keys if k not in (INPUT_IDS, LOSS_MASK, PADDING_LENGTH)]
        aligned += [PADDING_MASK] if options.return_padding_mask else []
        transforms.append(TokenShift(input_keys=aligned, label_keys=[LOSS_MASK] if has_loss_mask else []))
        if options.eos_mask_loss:
            transforms.append(EosMask(options.eos_token_id, options.ignore_index))  # type: ignore[arg-type]
        transforms.append(
            LossMask(
                options.ignore_index,
                supervision_key=LOSS_MASK if has_loss_mask else None,
                out_key=LOSS_MASK if options.return_loss_mask else None,
                count_key=NUM_VALID_TOKENS if options.return_num_valid_tokens else None,
            )
        )
    if options.return_cu_seqlens:
        transforms.append(CuSeqlens(flatten=options.flatten, num_boundaries=num_boundaries))
    if options.position_mode == "sequence":
        transforms.append(Positions("sequence"))
    return Chain(*transforms, input_keys=keys)


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


class Plan:
    """The chain and the output names of one option set on one key set.

    Parameters:
        options: the checked arguments.
        keys: the keys of the stacked batch the plan runs on.
        num_boundaries: a static ``cu_seqlens`` width, or ``None``.

    Example:
        >>> plan = plan_for(TrainingOptions(return_labels=True), ("input_ids", "padding_length"))
        >>> out = plan.run({"input_ids": torch.tensor([[1, 2, 3]]), "padding_length": torch.tensor([0])})
        >>> out["input_ids"].tolist(), out["labels"].tolist(), [name for _, name in plan.pairs]
        ([[1, 2]], [[2, 3]], ['ids', 'texts', 'input_ids', 'labels'])
    """

    def __init__(
        self,
        options: TrainingOptions,
        keys: tuple[str, ...],
        num_boundaries: int | None = None,
        boundary_safe: bool = False,
    ):
        self.options = options
        self.keys = keys
        self.chain = build_chain(options, keys, num_boundaries, boundary_safe)
        self.pairs = output_keys(options, keys)
        self._compiled: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def run(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The chain's cores over ``data`` (a mapping of stacked tensors), eager: a dict of tensors."""
        return {k: torch.from_numpy(v) if type(v) is np.ndarray else v for k, v in self.outputs(data).items()}

    def outputs(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | np.ndarray]:
        """:meth:`run` as the collate path uses it: on plain CPU tensors in eager mode, over arrays.

        There the chain runs over NumPy views of the tensors (no copy): every
        kernel takes its NumPy twin directly and a slice costs 0.2 us instead of
        torch's 1.6 us. The outputs are then arrays, which
        :func:`~zephon_collate.collate.output.assemble_outputs` turns into the
        containers asked for.
        """
        if cpu_twins_apply(*data.values()):
            return self.chain.run({key: value.numpy() for key, value in data.items()})
        return self.chain.run(data)

    def compiled(self, device_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        """:meth:`run` through ``torch.compile`` (dynamic shapes, full graph) for ``device_type``; cached.

        The last :attr:`eager_tail` steps run eager after the compiled head. On
        the CPU the head is compiled to scalar loops (see :data:`CPU_INDUCTOR_OPTIONS`).
        """
        function = self._compiled.get(device_type)
        if function is None:
            with self._lock:
                function = self._compiled.get(device_type) or self._compile(device_type)
                self._compiled[device_type] = function
        return function

    @property
    def eager_tail(self) -> int:
        """How many steps at the end of the chain stay eager when compiled.

        A ``CuSeqlens`` step whose output size depends on the data (no
        ``num_boundaries``) and every step after it: 0 when the whole chain is one graph.
        """
        steps = list(self.chain.transforms)
        dynamic = [i for i, t in enumerate(steps) if isinstance(t, CuSeqlens) and t.num_boundaries is None]
        return len(steps) - dynamic[0] if dynamic else 0

    def _compile(self, device_type: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        steps = list(self.chain.transforms)
        split = len(steps) - self.eager_tail
        head, tail = Chain(*steps[:split]), Chain(*steps[split:])
        options = CPU_INDUCTOR_OPTIONS if device_type == "cpu" else None
        compiled = torch.compile(_runner(head), dynamic=True, fullgraph=True, options=options)

        def run(data: Mapping[str, Any]) -> dict[str, Any]:
            out = compiled(dict(data))
            return tail.run(out) if len(tail) else out

        return run


@functools.lru_cache(maxsize=512)
def plan_for(
    options: TrainingOptions,
    keys: tuple[str, ...],
    num_boundaries: int | None = None,
    boundary_safe: bool = False,
) -> Plan:
    """The cached :class:`Plan` of ``options`` on a stacked batch holding ``keys``."""
    return Plan(options, keys, num_boundaries, boundary_safe)
