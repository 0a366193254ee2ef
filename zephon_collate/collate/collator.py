"""Collator: to_training as a DataLoader ``collate_fn``, with the device work in the main process.

The split fast pipelines use:

- **Workers** call :meth:`Collator.stack`: read, check and stack the records
  into a CPU TensorDict (:class:`~zephon_collate.collate.transfer.StackedBatch`). No CUDA call happens there.
- ``DataLoader(pin_memory=True)`` pins the stacked tensors in the main
  process's pinning thread (:meth:`~zephon_collate.collate.transfer.StackedBatch.pin_memory`).
- **The main process** calls :meth:`Collator.finish`: copy to the device with
  ``non_blocking=True`` and run the transform chain there, compiled with
  ``torch.compile`` when asked.

``Collator(...)(samples)`` does both in one call, for ``num_workers=0`` or CPU
training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import get_worker_info

from zephon_collate.checks import check_bool, check_option_names
from zephon_collate.collate.hf import TransformersCollator
from zephon_collate.collate.options import OPTION_NAMES, TrainingOptions
from zephon_collate.collate.output import assemble_outputs, empty_outputs, ids_and_texts
from zephon_collate.collate.padding import RowPadding
from zephon_collate.collate.plan import Plan, plan_for
from zephon_collate.collate.prepare import read_batch, segment_counts, stack
from zephon_collate.collate.training import stackable, training_outputs
from zephon_collate.collate.transfer import StackedBatch, WireOutputs
from zephon_collate.keys import POSITIONS
from zephon_collate.read import describe, is_array_payload
from zephon_collate.records import SampleMeta, SampleRecord
from zephon_collate.text import shown
from zephon_collate.transforms import CuSeqlens

__all__ = ["Collator", "as_records"]


def _check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` this process can use, or ``None``."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"Collator: device must be None, a str such as 'cuda' or a torch.device, got {shown(device)}"
        )
    try:
        checked = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"Collator: device {shown(device)} is not a device name such as 'cpu' or 'cuda:0'"
        ) from None
    if checked.type == "meta":
        raise ValueError("Collator: device 'meta' holds no data; pass 'cpu', an accelerator or None")
    if checked.type != "cpu":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != checked.type:
            raise ValueError(
                f"Collator: device {shown(str(checked))} is not available here (accelerator: {accelerator})"
            )
        if checked.index is not None and checked.index >= torch.accelerator.device_count():
            raise ValueError(
                f"Collator: device {shown(str(checked))} does not exist: this machine has "
                f"{torch.accelerator.device_count()} {checked.type} device(s)"
            )
    return checked


def _check_boundary_count(
    data: Mapping[str, torch.Tensor], records: Sequence[SampleRecord], options: TrainingOptions, limit: int
) -> None:
    """``ValueError`` naming the first record whose segments do not fit a static ``num_boundaries``.

    Runs on the worker's CPU tensors, so the device-side assertion of :class:`CuSeqlens` never fires.
    """
    positions = data[POSITIONS]
    if options.return_labels:
        positions = positions[:, :-1]
    if not positions.numel():
        return
    needed = segment_counts(positions)
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
        pad_token_id: pad ragged rows (unpacked SFT examples) on the right to the
            longest with this id; the padding counts as each record's trailing
            padding, so labels, ``padding_mask``, ``cu_seqlens`` and
            ``num_valid_tokens`` treat it as the page's (``None``: rows must be
            of equal length, or ``dtype=None`` gives ragged lists).
        pad_to_multiple_of: round the padded length up to a multiple of this.
        boundary_safe_labels: with labels and payload positions, ignore every label
            whose target starts a new segment (:class:`~zephon_collate.BoundaryMask`):
            no label crosses a document boundary, EOS or not. On by default here;
            ``to_training`` keeps the reference page's labels.
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
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        boundary_safe_labels: bool = True,
        **options: Any,
    ) -> None:
        check_option_names("Collator", options, OPTION_NAMES)
        self.options = TrainingOptions(**options)
        self.padding = RowPadding.create(pad_token_id, pad_to_multiple_of)
        self.boundary_safe_labels = check_bool("boundary_safe_labels", boundary_safe_labels, owner="Collator")
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

    @classmethod
    def for_transformers(cls, **options: Any) -> TransformersCollator:
        """A ``collate_fn`` for Hugging Face ``transformers`` models and ``Trainer(data_collator=...)``.

        It takes Hugging Face examples (``input_ids``; optional ``labels`` with
        -100, a right-padding ``attention_mask``, ``loss_mask``, ``assistant_masks``)
        and returns the batch a causal LM's ``forward`` takes, unshifted labels
        included: padded like ``DataCollatorForSeq2Seq``, or with
        ``padding_free=True`` in one row like ``DataCollatorWithFlattening``.
        The options and outputs are :class:`~zephon_collate.TransformersCollator`'s.

        Example:
            >>> collate = Collator.for_transformers(pad_token_id=0, pad_to_multiple_of=4)
            >>> batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
            >>> batch["labels"].tolist(), batch["attention_mask"].tolist()
            ([[-100, 6, 7, -100]], [[1, 1, 1, 0]])
        """
        return TransformersCollator(**options)

    for_transformers.__func__.__signature__ = inspect.signature(TransformersCollator).replace(  # type: ignore[attr-defined]
        parameters=[
            inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *inspect.signature(TransformersCollator).parameters.values(),
        ],
        return_annotation=TransformersCollator,
    )

    def __repr__(self) -> str:
        return (
            f"Collator(device={self.device}, compile={self.compile}, "
            f"num_boundaries={self.num_boundaries}, padding={self.padding}, options={self.options})"
        )

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        """Collate in one step: :meth:`stack` then :meth:`finish`.

        In a DataLoader worker the dict returned pickles its CPU tensors as one
        compact buffer (:class:`~zephon_collate.collate.transfer.WireOutputs`); the main
        process receives a plain dict.
        """
        if self.device is None and not self.compile and self.num_boundaries is None and self.python_scalars:
            records = as_records(samples)
            out = training_outputs(records, self.options, self.padding, self.boundary_safe_labels, "raise")
        else:
            out = self.finish(self.stack(samples))
        return WireOutputs(out) if get_worker_info() is not None else out

    def stack(self, samples: Sequence[Any]) -> StackedBatch:
        """Worker side: read, check and stack the samples into a CPU TensorDict.

        Every data error is raised here, naming the record and the field (with
        ``num_boundaries``, also a row with more segments than that allows).
        Rows must have equal lengths, whatever ``dtype`` is, unless the collator
        pads them (``pad_token_id``): ragged rows with ``dtype=None`` and no
        padding work through ``Collator(...)(samples)`` only.
        """
        records = tuple(as_records(samples))
        if not records:
            return StackedBatch(None, ids_and_texts(records))
        columns = read_batch(records, self.options, self.padding, self.boundary_safe_labels, unused="raise")
        if self.options.output.kind == "list" and not stackable(columns):
            raise ValueError(
                "Collator.stack: rows of unequal length cannot be stacked into one TensorDict, even for "
                "dtype=None (lists); call the collator itself (Collator(...)(samples)), which returns "
                "ragged lists, or pad the rows (Collator(pad_token_id=...)) or pack them (pack_flat)"
            )
        data = stack(columns, self.options)
        if self.num_boundaries is not None and self.options.return_cu_seqlens:
            _check_boundary_count(data, records, self.options, self.num_boundaries)
        device = next(iter(data.values())).device
        td = TensorDict(data, batch_size=[len(records)], device=device)
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
            td = td.to(self.device, non_blocking=True)  # narrow fields move narrow, then widen there
        data = dict(td.items())
        for key, dtype in stacked.dtypes.items():
            data[key] = data[key].to(dtype)
        plan = self.plan_for(tuple(data))
        result = self.runner(plan, td.device)(data) if self.compile else plan.outputs(data)
        return assemble_outputs(
            stacked.per_record, self.options, result, plan.pairs, python_scalars=self.python_scalars
        )

    def plan_for(self, keys: tuple[str, ...]) -> Plan:
        """The cached plan of this collator's options on a stacked batch holding ``keys``."""
        return plan_for(self.options, keys, self.num_boundaries, self.boundary_safe_labels)

    def runner(
        self, plan: Plan, device: str | torch.device | None = None
    ) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """How ``plan`` runs here: eager, or compiled for ``device`` (default: the collator's, else the CPU).

        The returned callable takes a mapping of stacked tensors (a dict or a
        TensorDict) and returns the chain's output as a dict.
        """
        if not self.compile:
            return plan.run
        return plan.compiled(torch.device(device or self.device or "cpu").type)
