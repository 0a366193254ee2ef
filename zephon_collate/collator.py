"""Collator: to_training as a DataLoader ``collate_fn``, with the device work in the main process.

The split fast pipelines use:

- **Workers** call :meth:`Collator.stack`: read, check and stack the records
  into a CPU TensorDict (:class:`~zephon_collate.transfer.StackedBatch`). No CUDA call happens there.
- ``DataLoader(pin_memory=True)`` pins the stacked tensors in the main
  process's pinning thread (:meth:`~zephon_collate.transfer.StackedBatch.pin_memory`).
- **The main process** calls :meth:`Collator.finish`: copy to the device with
  ``non_blocking=True`` and run the transform chain there, compiled with
  ``torch.compile`` when asked.

``Collator(...)(samples)`` does both in one call, for ``num_workers=0`` or CPU
training.
"""

from __future__ import annotations

import difflib
import inspect
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch.utils.data import get_worker_info

from zephon_collate.options import TrainingOptions
from zephon_collate.output import assemble_outputs, empty_outputs, ids_and_texts, output_keys
from zephon_collate.payloads import describe, is_array_payload
from zephon_collate.training import _stackable, read_batch, stack, training_outputs
from zephon_collate.transfer import StackedBatch, WireOutputs
from zephon_collate.transforms import Chain, CuSeqlens
from zephon_collate.types import SampleMeta, SampleRecord
from zephon_collate.validation import check_bool

__all__ = ["Collator", "as_records"]

OPTION_NAMES = tuple(inspect.signature(TrainingOptions.create).parameters)

# Inductor's vectorised CPU code stores bool results slowly in torch 2.13 (an int64
# ``== 0`` into a [8, 8193] bool tensor: 625 us compiled, 40 us eager); with scalar
# loops the compiled chain runs at 194 us against 286 us eager (benchmarks/bench_collator.py).
CPU_INDUCTOR_OPTIONS = {"cpp.simdlen": 0}


def _check_option_names(options: Mapping[str, Any]) -> None:
    """``TypeError`` naming an unknown to_training option, with the closest known name."""
    for name in options:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known options: {', '.join(OPTION_NAMES)}"
            raise TypeError(f"Collator: unknown option {name!r}{hint}")


def _check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` this process can use, or ``None``."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"Collator: device must be None, a str such as 'cuda' or a torch.device, got {device!r}"
        )
    try:
        checked = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"Collator: device {device!r} is not a device name such as 'cpu' or 'cuda:0'"
        ) from None
    if checked.type == "meta":
        raise ValueError("Collator: device 'meta' holds no data; pass 'cpu', an accelerator or None")
    if checked.type != "cpu":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != checked.type:
            raise ValueError(
                f"Collator: device {str(checked)!r} is not available here (accelerator: {accelerator})"
            )
        if checked.index is not None and checked.index >= torch.accelerator.device_count():
            raise ValueError(
                f"Collator: device {str(checked)!r} does not exist: this machine has "
                f"{torch.accelerator.device_count()} {checked.type} device(s)"
            )
    return checked


def _check_boundary_count(
    stacked: TensorDictBase, records: Sequence[SampleRecord], options: Any, limit: int
) -> None:
    """``ValueError`` naming the first record whose segments do not fit a static ``num_boundaries``.

    Runs on the worker's CPU tensors, so the device-side assertion of :class:`CuSeqlens` never fires.
    """
    positions = stacked.get("positions")
    if options.return_labels:
        positions = positions[:, :-1]
    if not positions.numel():
        return
    needed = (positions == 0).sum(dim=1) + 1  # boundaries per row: the starts, then the end
    if options.flatten:
        total = int(needed.sum()) - len(needed) + 1
        if total > limit:
            raise ValueError(
                f"Collator: the batch has {total - 1} segments, more than num_boundaries - 1 = {limit - 1}; "
                "raise num_boundaries, or send fewer segments per batch"
            )
    elif bool((needed > limit).any()):
        index = int((needed > limit).nonzero()[0, 0])
        raise ValueError(
            f"{describe(records, index)}: has {int(needed[index]) - 1} segments, more than "
            f"num_boundaries - 1 = {limit - 1}; raise num_boundaries, or pack fewer documents per row"
        )


def as_records(samples: Sequence[Any]) -> list[SampleRecord]:
    """Records as given, or plain payloads (dicts or token arrays) wrapped in records.

    A plain payload gets ``SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0,
    chunk_offset=i)``, ``i`` being its place in the batch, and no tags (so no
    padding): what Hugging Face datasets and ``transformers.Trainer`` hand over.

    Raises:
        TypeError: if ``samples`` is not a sequence, or an item is neither a record,
            a dict nor a token array.
    """
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise TypeError(f"Collator: expected a list of samples, got {type(samples).__name__}")
    records = []
    for index, sample in enumerate(samples):
        if isinstance(sample, SampleRecord):
            records.append(sample)
        elif isinstance(sample, Mapping) or is_array_payload(sample):
            records.append(SampleRecord(SampleMeta((0, 0, index), 0, 0, index), sample))
        else:
            raise TypeError(
                f"Collator: sample {index} must be a SampleRecord, a payload dict or a token array, "
                f"got {type(sample).__name__}"
            )
    return records


class Collator:
    """A ``collate_fn`` that runs :meth:`SampleBatch.to_training` on what a DataLoader hands it.

    Parameters:
        device: where :meth:`finish` runs the chain (``None``: where the data is).
        compile: run the chain through ``torch.compile`` (dynamic shapes, full
            graph), so varying batch sizes and lengths do not recompile.
        num_boundaries: give ``cu_seqlens`` a static shape: each row's boundaries
            (or the flattened sequence) padded to exactly this many, with the row
            (or total) length as filler. The whole chain is then one graph (CUDA
            graph friendly); more segments than that fail a device-side assertion.
        python_scalars: return ``num_valid_tokens`` (and a flattened
            ``max_seqlen``) as Python ints, as the reference page does; ``False``
            keeps them as 0-d tensors on the device, which avoids a device sync.
        **options: :meth:`SampleBatch.to_training`'s keyword arguments, checked now.

    Raises:
        TypeError, ValueError: for bad ``options``, as ``to_training`` raises them, or an
            unknown option name (``TypeError``, with the closest known name);
            ``TypeError`` for a non-bool ``compile``/``python_scalars``; ``ValueError``
            for a ``device`` this process cannot use, or if ``device`` or ``compile``
            is combined with non-torch output.

    Example:
        >>> collate = Collator(return_labels=True, return_num_valid_tokens=True)
        >>> out = collate([{"input_ids": [1, 10, 2]}, {"input_ids": [1, 11, 2]}])
        >>> out["labels"].tolist(), out["num_valid_tokens"]
        ([[10, 2], [11, 2]], 4)
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        compile: bool = False,
        num_boundaries: int | None = None,
        python_scalars: bool = True,
        **options: Any,
    ) -> None:
        _check_option_names(options)
        self.options = TrainingOptions.create(**options)
        self.device = _check_device(device)
        self.compile = check_bool("compile", compile, owner="Collator")
        self.python_scalars = check_bool("python_scalars", python_scalars, owner="Collator")
        if num_boundaries is not None:
            num_boundaries = CuSeqlens(num_boundaries=num_boundaries).num_boundaries  # validates the count
        self.num_boundaries = num_boundaries
        if (self.device is not None or self.compile) and self.options.output.kind != "torch":
            raise ValueError(
                "Collator: device and compile need torch output; pass dtype='auto' or a torch dtype"
            )
        self._chains: dict[tuple[tuple[str, ...], str], Any] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chains"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"Collator(device={self.device}, compile={self.compile}, "
            f"num_boundaries={self.num_boundaries}, options={self.options})"
        )

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        """Collate in one step: :meth:`stack` then :meth:`finish`.

        In a DataLoader worker the dict returned pickles its CPU tensors as one
        compact buffer (:class:`~zephon_collate.transfer.WireOutputs`); the main
        process receives a plain dict.
        """
        if self.device is None and not self.compile and self.num_boundaries is None and self.python_scalars:
            out = training_outputs(as_records(samples), self.options)
        else:
            out = self.finish(self.stack(samples))
        return WireOutputs(out) if get_worker_info() is not None else out

    def stack(self, samples: Sequence[Any]) -> StackedBatch:
        """Worker side: read, check and stack the samples into a CPU TensorDict.

        Every data error is raised here, naming the record and the field (with
        ``num_boundaries``, also a row with more segments than that allows).
        Rows must have equal lengths, whatever ``dtype`` is: ragged rows with
        ``dtype=None`` work through ``Collator(...)(samples)`` only.
        """
        records = tuple(as_records(samples))
        if not records:
            return StackedBatch(None, ids_and_texts(records))
        columns = read_batch(records, self.options)
        if self.options.output.kind == "list" and not _stackable(columns):
            raise ValueError(
                "Collator.stack: rows of unequal length cannot be stacked into one TensorDict, even for "
                "dtype=None (lists); call the collator itself (Collator(...)(samples)), which returns "
                "ragged lists, or pad or pack the rows (pack_flat)"
            )
        td = stack(columns, self.options)
        if self.num_boundaries is not None and self.options.return_cu_seqlens:
            _check_boundary_count(td, records, self.options, self.num_boundaries)
        return StackedBatch(td, ids_and_texts(records), tuple(r.meta for r in records))

    def finish(self, stacked: StackedBatch) -> dict[str, Any]:
        """Main-process side: move to ``device`` (``non_blocking``), run the chain, build the outputs."""
        if not isinstance(stacked, StackedBatch):
            raise TypeError(
                f"Collator.finish: expected the StackedBatch that Collator.stack returns, got "
                f"{type(stacked).__name__}"
            )
        if stacked.td is None:
            return empty_outputs(self.options)
        td = stacked.td
        if self.device is not None and td.device != self.device:
            td = td.to(self.device, non_blocking=True)
        keys = output_keys(self.options, list(td.keys()))
        result = self.chain_for(tuple(td.keys()), td.device)(td)
        return assemble_outputs(
            stacked.per_record, self.options, result, keys, python_scalars=self.python_scalars
        )

    def chain_for(self, keys: tuple[str, ...], device: str | torch.device | None = None) -> Any:
        """The (compiled, when asked) chain for a stacked batch with ``keys`` on ``device``; cached.

        ``device`` (default: the collator's, else the CPU) only matters when
        compiling: a CPU chain is compiled to scalar loops (see :data:`CPU_INDUCTOR_OPTIONS`).
        """
        device_type = torch.device(device or self.device or "cpu").type
        chain = self._chains.get((keys, device_type))
        if chain is None:
            with self._lock:
                chain = self._chains.get((keys, device_type)) or self._build(keys, device_type)
                self._chains[keys, device_type] = chain
        return chain

    def _build(self, keys: tuple[str, ...], device_type: str) -> Any:
        chain = self.options.build_chain(keys, num_boundaries=self.num_boundaries)
        if not self.compile:
            return chain
        # A cu_seqlens step whose size depends on the data stays eager: compile what precedes it.
        split = next(
            (
                i
                for i, t in enumerate(chain.transforms)
                if isinstance(t, CuSeqlens) and t.num_boundaries is None
            ),
            len(chain.transforms),
        )
        head = Chain(*chain.transforms[:split])
        options = CPU_INDUCTOR_OPTIONS if device_type == "cpu" else None
        compiled = torch.compile(head, dynamic=True, fullgraph=True, options=options)
        tail = list(chain.transforms[split:])
        return _CompiledChain(compiled, tail) if tail else compiled


class _CompiledChain:
    """A compiled head followed by the eager, data-dependent tail of a chain."""

    def __init__(self, head: Any, tail: list[Any]) -> None:
        self.head = head
        self.tail = tail

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td = self.head(td)
        for transform in self.tail:
            td = transform(td)
        return td
