"""Collator: to_training as a DataLoader ``collate_fn``, your transforms included, the device work in the
main process.

The split fast pipelines use:

- **Workers** call :meth:`Collator.stack`: read, check and stack the records
  into a CPU TensorDict (:class:`~zephon_collate.StackedBatch`). No CUDA call happens there.
- ``DataLoader(pin_memory=True)`` pins the stacked tensors in the main
  process's pinning thread (:meth:`~zephon_collate.StackedBatch.pin_memory`).
- **The main process** calls :meth:`Collator.finish`: copy to the device with
  ``non_blocking=True`` and run the transform chain there, compiled with
  ``torch.compile`` when asked, transforms of yours (``transforms=[...]``) at
  its end.

``Collator(...)(samples)`` does both in one call, for ``num_workers=0`` or CPU
training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import torch
from tensordict import TensorDict
from torch.utils.data import get_worker_info

from zephon_collate._checks import Keywords, check_bool, check_device, check_num_boundaries, suggest_options
from zephon_collate._text import shown
from zephon_collate.collate._native import Native
from zephon_collate.collate._output import ids_and_texts
from zephon_collate.collate._plan import CollateLayout, Plan, Plans
from zephon_collate.collate._stack import RowPadding
from zephon_collate.collate.options import TrainingOptions, options_for
from zephon_collate.collate.transfer import StackedBatch, WireOutputs
from zephon_collate.fields import FloatField, check_float_fields
from zephon_collate.keys import (
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
)
from zephon_collate.transforms import Chain, Transform

if TYPE_CHECKING:
    from zephon_collate.collate.hf import TransformersCollator
    from zephon_collate.collate.preference import PreferenceCollator
    from zephon_collate.collate.rollouts import RolloutCollator

__all__ = ["COLLATOR_OPTION_NAMES", "Collator", "CollatorOptions"]


def _check_transforms(name: str, value: object) -> tuple[Transform, ...]:
    if isinstance(value, torch.nn.Module) or not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"Collator: {name} must be a list of transforms, got {shown(value)}")
    for index, transform in enumerate(value):
        if not isinstance(transform, torch.nn.Module) or not hasattr(transform, "in_keys"):
            raise TypeError(
                f"Collator: {name}[{index}] ({shown(transform)}) is not a transform with in_keys and "
                "out_keys; subclass zephon_collate.Transform"
            )
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class CollatorOptions(Keywords):
    """The :class:`Collator`'s own keyword arguments (besides ``to_training``'s), checked once.

    See :class:`Collator` for each one's meaning.

    Raises:
        TypeError, ValueError: for a value of the wrong type or out of range.

    Example:
        >>> CollatorOptions(pad_token_id=0, pad_to_multiple_of=8).pad_to_multiple_of
        8
        >>> CollatorOptions(num_boundaries=0)
        Traceback (most recent call last):
        ...
        ValueError: Collator: num_boundaries must be an int >= 1 or None, got 0
    """

    device: str | torch.device | None = None
    compile: bool = False
    num_boundaries: int | None = None
    python_scalars: bool = True
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    boundary_safe_labels: bool = True
    float_fields: Sequence[str | FloatField] = ()
    transforms: Sequence[Transform] = ()
    chain: Sequence[Transform] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "device", check_device("Collator", self.device))
        for name in ("compile", "python_scalars", "boundary_safe_labels"):
            put(self, name, check_bool(name, getattr(self, name), owner="Collator"))
        put(self, "num_boundaries", check_num_boundaries("Collator", self.num_boundaries))
        put(self, "float_fields", check_float_fields("Collator", self.float_fields))
        put(self, "transforms", _check_transforms("transforms", self.transforms))
        if self.chain is not None:
            put(self, "chain", _check_transforms("chain", self.chain))


COLLATOR_OPTION_NAMES = CollatorOptions.names()
"""The :class:`Collator`'s own keyword arguments, after ``to_training``'s, in its signature's order."""

_WRITTEN = (INPUT_IDS, LABELS, POSITIONS, POSITION_IDS, LOSS_MASK, PADDING_LENGTH, PADDING_MASK)
"""Names a float field may not take: fields the collate path reads or writes itself."""

_CHAIN_OPTIONS = (
    "return_labels",
    "return_num_valid_tokens",
    "return_loss_mask",
    "return_cu_seqlens",
    "return_padding_mask",
    "eos_mask_loss",
    "position_mode",
)


class Collator:
    """A ``collate_fn`` that runs :meth:`SampleBatch.to_training` on what a DataLoader hands it.

    The keyword arguments are ``to_training``'s (checked now, with its names,
    order and defaults), then the collator's own:

    Parameters:
        device: where :meth:`finish` runs the chain (``None``: where the data is).
        compile: run the chain through ``torch.compile`` (dynamic shapes, full
            graphs), so varying batch sizes and lengths do not recompile.
        num_boundaries: give ``cu_seqlens`` a static shape: each row's boundaries
            (or the flattened sequence) padded to exactly this many, with the row
            (or total) length as filler. The whole chain is then one graph (CUDA
            graph friendly); more segments than that are refused by :meth:`stack`.
        python_scalars: return ``num_valid_tokens`` (and a flattened
            ``max_seqlen``) as Python ints, as the reference page does; ``False``
            keeps them as 0-d tensors on the device, which avoids a device sync.
        pad_token_id: pad ragged rows (unpacked SFT examples) on the right to the
            longest with this id; the padding counts as each record's trailing
            padding, so labels, ``padding_mask``, ``cu_seqlens`` and
            ``num_valid_tokens`` treat it as the page's (``None``: rows must be
            of equal length, or ``dtype=None`` gives ragged lists).
        pad_to_multiple_of: round the padded length up to a multiple of this
            (at most 2**20).
        boundary_safe_labels: with labels and payload positions, ignore every label
            whose target starts a new segment (:class:`~zephon_collate.BoundaryMask`):
            no label crosses a document boundary, EOS or not. On by default here;
            ``to_training`` keeps the reference page's labels.
        transforms: transforms of yours (:class:`~zephon_collate.Transform`), run
            after the built-in chain wherever it runs: in :meth:`__call__`, in
            :meth:`finish` after the device copy, compiled with ``compile=True``.
            Each key one of them writes is an output (renamed and excluded like
            the others, flattened with ``flatten`` when per-token).
        chain: transforms of yours that replace the built-in chain (the options
            that build it, ``return_labels`` to ``position_mode``, must then keep
            their defaults); they run on the stacked batch (``input_ids``,
            ``positions``, ``loss_mask`` and extra fields when read,
            ``padding_length``).
        float_fields: float payload fields (log-probs, advantages, rewards): names, or
            :class:`~zephon_collate.fields.FloatField` specs. Each keeps its own float
            dtype (float32 by default, whatever ``dtype`` is), is 0.0 on padding, and is
            shifted with the labels as its alignment says: a token-aligned field (value
            ``t`` belongs to token ``t``, the default) is cut ``[:, 1:]`` with
            ``return_labels``, so ``out[name][:, j]`` belongs to ``labels[:, j]``
            (:mod:`zephon_collate.fields`). ``to_training`` has no such option: its
            extra fields follow ``dtype``, as the reference page says. Float fields are
            read example by example: a columnar batch with ``float_fields`` is refused.

    Raises:
        TypeError, ValueError: for bad options, as ``to_training`` raises them;
            ``TypeError`` for a non-bool ``compile``/``python_scalars`` or a
            transform that is not one; ``ValueError`` for a ``device`` this process
            cannot use, ``device`` or ``compile`` with non-torch output, or ``chain``
            with options that build the chain.

    Example:
        >>> collate = Collator(return_labels=True, return_num_valid_tokens=True)
        >>> out = collate([{"input_ids": [1, 10, 2]}, {"input_ids": [1, 11, 2]}])
        >>> out["labels"].tolist(), out["num_valid_tokens"]
        ([[10, 2], [11, 2]], 4)
    """

    @suggest_options("Collator")
    def __init__(
        self,
        *,
        tokens_field: str = "auto",
        return_labels: bool = False,
        dtype: Any = "auto",
        extra_fields: Sequence[str] = (),
        ignore_index: int = IGNORE_INDEX,
        rename_fields: Mapping[str, str] | None = None,
        flatten: bool = False,
        exclude_fields: Sequence[str] = (),
        return_num_valid_tokens: bool = False,
        return_loss_mask: bool = False,
        return_cu_seqlens: bool = False,
        return_padding_mask: bool = False,
        eos_mask_loss: bool = False,
        eos_token_id: int | None = None,
        position_mode: Literal["preserve", "sequence"] = "preserve",
        device: str | torch.device | None = None,
        compile: bool = False,
        num_boundaries: int | None = None,
        python_scalars: bool = True,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        boundary_safe_labels: bool = True,
        float_fields: Sequence[str | FloatField] = (),
        transforms: Sequence[Transform] = (),
        chain: Sequence[Transform] | None = None,
    ) -> None:
        scope = locals()
        self.options = options_for(TrainingOptions.arguments(scope))
        self.settings = CollatorOptions(**CollatorOptions.arguments(scope))
        settings = self.settings
        specs = cast(tuple[FloatField, ...], settings.float_fields)  # normalised by CollatorOptions
        reserved = (*self.options.generated_keys(), *self.options.extra_fields, *_WRITTEN)
        check_float_fields("Collator", specs, reserved)
        if chain is not None:
            defaults = TrainingOptions()
            given = [
                name for name in _CHAIN_OPTIONS if getattr(self.options, name) != getattr(defaults, name)
            ]
            if given:
                raise ValueError(
                    f"Collator: chain= replaces the chain that {', '.join(given)} would build; leave "
                    "those at their defaults, or pass transforms=[...] to add yours after the built-in chain"
                )
        if (settings.device is not None or settings.compile) and self.options.output.kind != "torch":
            raise ValueError(
                "Collator: device and compile need torch output; pass dtype='auto' or a torch dtype"
            )
        padding = RowPadding.create(pad_token_id, pad_to_multiple_of)
        if padding is not None and self.options.output.kind != "list":
            info = torch.iinfo(self.options.output.torch_dtype)
            if padding.pad_token_id > info.max:
                raise ValueError(
                    f"Collator: pad_token_id {padding.pad_token_id} does not fit dtype "
                    f"{self.options.output.torch_dtype}; pick a wider dtype"
                )
        self.layout: CollateLayout = Native(
            self.options,
            padding=padding,
            boundary_safe=settings.boundary_safe_labels,
            refuse_unused=True,
            num_boundaries=settings.num_boundaries,
            check_padding=chain is not None,  # a chain of yours may read padding_length
            float_fields=specs,
        )
        self._plans = Plans()

    # The settings, as attributes.
    @property
    def device(self) -> torch.device | None:
        return self.settings.device  # type: ignore[return-value]  # checked to a torch.device

    @property
    def compile(self) -> bool:
        return self.settings.compile

    @property
    def num_boundaries(self) -> int | None:
        return self.settings.num_boundaries

    @property
    def python_scalars(self) -> bool:
        return self.settings.python_scalars

    @property
    def padding(self) -> RowPadding | None:
        return getattr(self.layout, "padding", None)

    @property
    def boundary_safe_labels(self) -> bool:
        return self.settings.boundary_safe_labels

    for_transformers: ClassVar[type[TransformersCollator]]
    """``Collator.for_transformers(...)`` is :class:`~zephon_collate.TransformersCollator`: the
    ``collate_fn`` for Hugging Face ``transformers`` models and ``Trainer(data_collator=...)``,
    over the same reader, chain, stack/finish, device and compile (set by :mod:`.hf`)."""

    for_preference: ClassVar[type[PreferenceCollator]]
    """``Collator.for_preference(...)`` is :class:`~zephon_collate.collate.preference.PreferenceCollator`:
    preference pairs to one exact batch of chosen and rejected sequences (set by :mod:`.preference`)."""

    for_rollouts: ClassVar[type[RolloutCollator]]
    """``Collator.for_rollouts(...)`` is :class:`~zephon_collate.collate.rollouts.RolloutCollator`: RL
    rollouts (prompt + completion, float fields) to one exact batch (set by :mod:`.rollouts`)."""

    def __repr__(self) -> str:
        return f"Collator(options={self.options}, settings={self.settings}, padding={self.padding})"

    def _empty(self) -> dict[str, Any]:
        """The outputs of an empty batch, named by this collator's chain (your transforms included)."""
        settings = self.settings
        if not settings.transforms and settings.chain is None:
            return self.layout.empty()

        def chain(keys: list[str]) -> Chain:
            steps = self.layout.chain(keys) if settings.chain is None else settings.chain
            return Chain(*steps, *settings.transforms)

        return self.layout.empty(chain)

    def plan_for(self, keys: tuple[str, ...]) -> Plan:
        """The plan of this collator on a stacked batch holding ``keys``: its chain and output names."""
        settings = self.settings
        if not settings.transforms and settings.chain is None:
            return self.layout.plan(keys)
        plan = self._plans.get(keys)
        if plan is None:
            plan = self._plans[keys] = Plan(self.layout, keys, settings.transforms, settings.chain)
        return plan

    def runner(
        self, plan: Plan, device: str | torch.device | None = None
    ) -> Callable[[Mapping[str, torch.Tensor]], Mapping[str, Any]]:
        """How ``plan`` runs here: eager, or compiled for ``device`` (default: the collator's, else the CPU).

        The returned callable takes a mapping of stacked tensors (a dict or a
        TensorDict) and returns the chain's output mapping.
        """
        if not self.compile:
            return plan.run
        return plan.compiled(torch.device(device or self.device or "cpu").type)

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        """Collate in one step: :meth:`stack` then :meth:`finish`.

        ``samples``: records, plain payloads, or a columnar batch (an Arrow table,
        ``(values, offsets)`` pairs: see :mod:`zephon_collate._columns`).

        In a DataLoader worker the dict returned pickles its CPU tensors as one
        compact buffer (:class:`~zephon_collate.collate.transfer.WireOutputs`); the main
        process receives a plain dict.
        """
        if isinstance(samples, Sequence) and not isinstance(samples, (str, bytes)) and not len(samples):
            return self._empty()
        if self.device is None and not self.compile:
            out = self.layout.collate(samples, self.plan_for, python_scalars=self.python_scalars)
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

        Returns:
            a :class:`~zephon_collate.StackedBatch` (``td``: the stacked CPU TensorDict, ``None``
            for an empty batch; the per-record outputs; each row's ``SampleMeta`` in ``metas``).

        Raises:
            TypeError, ValueError: for every data error, naming the record, the field and the fix.

        Example:
            >>> collate = Collator(return_labels=True)
            >>> stacked = collate.stack([{"input_ids": [5, 6, 7]}])
            >>> sorted(stacked.td.keys()), stacked.metas[0].sample_id
            (['input_ids', 'padding_length'], (0, 0, 0))
            >>> collate.finish(stacked)["labels"].tolist()
            [[6, 7]]
        """
        batch = self.layout.stack(samples)
        if batch is None:
            return StackedBatch(None, ids_and_texts(()))
        rows = {value.shape[0] if value.dim() else -1 for value in batch.data.values()}
        size = list(rows) if len(rows) == 1 and -1 not in rows else []  # [] when some hold one entry per row
        td = TensorDict(batch.data, batch_size=size, device=batch.data["input_ids"].device)
        return StackedBatch(td, batch.per_record, batch.metas)

    def finish(self, stacked: StackedBatch) -> dict[str, Any]:
        """Main-process side: move to ``device`` (``non_blocking``), run the chain, build the outputs.

        Returns:
            the outputs of ``collator(samples)`` for the samples ``stacked`` was made from.

        Raises:
            TypeError: for anything but the :class:`~zephon_collate.StackedBatch` that
                :meth:`stack` returns.
            ValueError: from a transform of yours whose inputs the batch lacks.
        """
        if not isinstance(stacked, StackedBatch):
            raise TypeError(
                f"Collator.finish: expected the StackedBatch that Collator.stack returns, got "
                f"{type(stacked).__name__}"
            )
        if stacked.td is None:
            return self._empty()
        td = stacked.td
        if self.device is not None and td.device != self.device:
            td = td.to(self.device, non_blocking=True)  # narrow fields move narrow, then widen there
        data: dict[str, torch.Tensor] = {
            key: value for key, value in td.items() if isinstance(value, torch.Tensor)
        }
        for key, dtype in stacked.dtypes.items():
            data[key] = data[key].to(dtype)
        plan = self.plan_for(tuple(data))
        result = self.runner(plan, td.device)(data)
        return self.layout.assemble(stacked.per_record, result, plan.pairs, self.python_scalars)
