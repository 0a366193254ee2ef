"""Layout: the collate flow (read, lay out, chain, plan, assemble), owned by one base class."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from zephon_collate.core.checks import Keywords, check_bool, check_device, check_num_boundaries, renamed
from zephon_collate.core.keys import (
    IDS,
    INPUT_IDS,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    POSITIONS,
    TEXT,
    TEXTS,
)
from zephon_collate.core.records import SampleMeta
from zephon_collate.core.text import shown
from zephon_collate.layouts.plan import Plan, Plans
from zephon_collate.read.arrow import columns_of
from zephon_collate.read.columns import Batch
from zephon_collate.read.fields import TensorField
from zephon_collate.read.rows import as_record, examples_of, records_of
from zephon_collate.transforms import Transform
from zephon_collate.transforms.base import declared_keys, flat_steps, is_step

__all__ = ["Layout", "Settings", "Stacked", "convert", "per_row_outputs"]

_Kind = Literal["torch", "numpy", "list"]


def _check_transforms(name: str, value: object) -> tuple[Transform, ...]:
    if isinstance(value, torch.nn.Module) or not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"Collator: {name} must be a list of transforms, got {shown(value)}")
    for index, transform in enumerate(value):
        if not isinstance(transform, torch.nn.Module) or not hasattr(transform, "in_keys"):
            raise TypeError(
                f"Collator: {name}[{index}] ({shown(transform)}) is not a transform with in_keys and "
                "out_keys; subclass zephon_collate.Transform"
            )
        kind = type(transform)
        if (
            issubclass(kind, Transform)
            and kind.forward is Transform.forward
            and kind.compute is Transform.compute
        ):
            raise TypeError(
                f"Collator: {name}[{index}] ({kind.__name__}) defines no compute: the torch core "
                "runs on the device and compiled (host is the optional NumPy variant of it); write compute"
            )
    return tuple(value)


@dataclass(frozen=True, kw_only=True, eq=False)
class Settings(Keywords):
    """Where and how a collator runs its chain: every collator's own keyword arguments.

    Parameters:
        device: where ``finish`` runs the chain (``None``: where the data is).
        compile: run the chain through ``torch.compile`` (dynamic shapes, full graphs).
        num_boundaries: give ``cu_seqlens`` this many boundaries (a static shape), padded with the row length.
        python_scalars: counts and flattened maxima as Python numbers (``False``: 0-d tensors, no sync).
        transforms: transforms of yours, run after the built-in chain wherever it runs; each key is an output.
        chain: transforms of yours that replace the built-in chain (its options must keep their defaults).
    """

    device: str | torch.device | None = None
    compile: bool = False
    num_boundaries: int | None = None
    python_scalars: bool = True
    transforms: Sequence[Transform] = ()
    chain: Sequence[Transform] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "device", check_device("Collator", self.device))
        for name in ("compile", "python_scalars"):
            put(self, name, check_bool(name, getattr(self, name), owner="Collator"))
        put(self, "num_boundaries", check_num_boundaries("Collator", self.num_boundaries))
        put(self, "transforms", _check_transforms("transforms", self.transforms))
        if self.chain is not None:
            put(self, "chain", _check_transforms("chain", self.chain))

    @property
    def target(self) -> torch.device | None:
        """``device``, checked to a ``torch.device``."""
        return self.device if isinstance(self.device, torch.device) else None


@dataclass
class Stacked:
    """A batch laid out: the chain's input, and what the outputs need besides.

    Parameters:
        data: each key's ``[B, ...]`` array (host data) or tensor (data on a device).
        per_row: the per-row outputs (``ids``, ``texts``).
        metas: each record's metadata.
    """

    data: dict[str, Any]
    per_row: dict[str, list[Any]] = field(default_factory=dict)
    metas: tuple[SampleMeta, ...] = ()


def per_row_outputs(batch: Batch) -> dict[str, list[Any]]:
    """``{"ids": ..., "texts": ...}``: each row's sample id and ``"text"`` (copied unless a str)."""
    texts = batch.objects(TEXT) if TEXT in batch else [None] * batch.rows
    texts = [t if t is None or isinstance(t, (str, bytes)) else copy.deepcopy(t) for t in texts]
    return {IDS: list(batch.ids), TEXTS: texts}


def convert(value: Any, kind: _Kind, taken: list[tuple[int, int]] | None = None) -> Any:
    """A chain output in the container ``kind`` asks for, never sharing memory with the batch's inputs.

    ``taken`` holds the byte ranges of the outputs converted before this one: a value that overlaps one
    of them (the views ``TokenShift`` cuts from one row, a step of yours returning its input) is copied.
    """
    if kind == "list":
        return value.tolist()
    if isinstance(value, np.ndarray):
        value = value if value.flags.c_contiguous else value.copy()  # 0-d stays 0-d
        value = torch.from_numpy(value) if kind == "torch" else value
    else:  # contiguous first: a view of the stacked batch would keep all of it alive
        value = value.detach().cpu().contiguous() if kind == "numpy" else value.contiguous()
    size = value.nbytes
    if taken is not None and size:
        tensor = isinstance(value, torch.Tensor)
        low = value.data_ptr() if tensor else value.__array_interface__["data"][0]
        for start, end in taken:
            if start < low + size and low < end:
                value = value.clone() if tensor else value.copy()
                low = value.data_ptr() if tensor else value.__array_interface__["data"][0]
                break
        taken.append((low, low + size))
    return value.numpy() if isinstance(value, torch.Tensor) and kind == "numpy" else value


class Layout:
    """The collate flow; a subclass lays a batch out and names its chain.

    Parameters:
        options: the layout's options dataclass (checked).
        settings: the collator's :class:`Settings`.
    """

    OWNER: str = "Collator"
    """How errors name the entry point."""
    READS: ClassVar[Literal["records", "examples"]] = "examples"
    """Row-wise input read as records (``record i (sample_id ...)``) or examples (``example i``)."""
    KEY: tuple[str, ...] = (INPUT_IDS,)
    """The field every row of a batched dict of lists has (the first found of these)."""
    ITEM: str = "example"
    TORCH_OUTPUT: ClassVar[str] = "return_tensors='pt'"
    """The option that asks for torch output, for the messages that need it."""
    ORDER: tuple[str | None, ...] = ()
    """The outputs' order (``None``: the extra fields); keys not named follow, in the chain's order."""
    INTERNAL: frozenset[str] = frozenset({PADDING_LENGTH})
    """Keys of the stacked batch that no output carries."""
    ROW_OUTPUTS: ClassVar[tuple[str, ...]] = ()
    """Outputs made per row, beside the chain (the records' ``ids`` and ``texts``)."""
    CHAIN_OPTIONS: ClassVar[Mapping[str, tuple[object, ...]]] = {}
    """The options only the built-in chain reads, each with the values that build nothing: ``chain=``
    replaces that chain, so any other value would be ignored."""
    SCALARS: frozenset[str] = frozenset({NUM_VALID_TOKENS})
    """0-d outputs returned as Python numbers (with ``python_scalars``)."""

    def __init__(self, options: Any, settings: Settings | None = None) -> None:
        self.options = options
        self.settings = settings if settings is not None else Settings()
        self._plans = Plans()
        self._names: dict[tuple[str, ...], list[tuple[str, str]]] = {}  # output names by key set
        for spec in self.floats:
            if spec.dtype == torch.bfloat16 and self.kind != "torch":  # NumPy has no bfloat16
                raise ValueError(
                    f"{self.OWNER}: float field {shown(spec.name)} has dtype torch.bfloat16, which "
                    f"{self.kind} output cannot hold; pass {self.TORCH_OUTPUT}, or give the field "
                    "dtype=torch.float32"
                )

    # -- what a layout writes --------------------------------------------------------------------

    @property
    def floats(self) -> tuple[TensorField, ...]:
        """The float fields read (each output's dtype is checked against :attr:`kind`)."""
        return ()

    @property
    def extra_fields(self) -> tuple[str, ...]:
        """Fields stacked as given: their outputs go at :attr:`ORDER`'s ``None``."""
        return ()

    @property
    def renames(self) -> Mapping[str, str]:
        """Output renames (``rename_fields``)."""
        return {}

    @property
    def excluded(self) -> tuple[str, ...]:
        """Outputs left out, by final name (``exclude_fields``)."""
        return ()

    @property
    def tokens_field(self) -> str:
        """The records' token field (``"auto"``: found at the door)."""
        return INPUT_IDS

    @property
    def boundary_safe(self) -> bool:
        """Whether labels must stop at each document's end (the built-in chain's ``BoundaryMask``)."""
        return False

    def internal(self, key: str) -> bool:
        """Whether the stacked batch's ``key`` stays inside: no output carries it."""
        return key in self.INTERNAL

    @property
    def positions_key(self) -> str:
        """The stacked batch's positions, where documents start (``BoundaryMask`` reads them)."""
        return POSITIONS

    def check_chain(self) -> None:
        """Refuse a ``chain=`` beside the options it would ignore."""
        if self.settings.chain is None:
            return
        given = [name for name, idle in self.CHAIN_OPTIONS.items() if getattr(self.options, name) not in idle]
        given += ["num_boundaries"] if self.settings.num_boundaries is not None else []
        if given:
            raise ValueError(
                f"{self.OWNER}: chain= replaces the chain that {', '.join(given)} would build; leave "
                "those at their defaults, or pass transforms=[...] to add yours after the built-in chain"
            )

    @staticmethod
    def labels_unbounded(steps: Sequence[Any]) -> str | None:
        """The step of ``steps`` that makes labels no ``BoundaryMask`` keeps inside documents (none whose
        mask a ``LossMask`` reads), or ``None``."""
        steps = flat_steps(steps)
        maker = next((s for s in steps if is_step(s, "TokenShift") or is_step(s, "UnshiftedLabels")), None)
        masks = {step.mask_key for step in steps if is_step(step, "BoundaryMask")}
        if maker is None or any(is_step(s, "LossMask") and s.supervision_key in masks for s in steps):
            return None
        return type(maker).__name__

    def _check_boundaries(self, steps: Sequence[Any], keys: Sequence[str]) -> None:
        """Refuse steps of yours whose labels would cross the documents the batch's positions mark, where
        this layout promises they never do."""
        maker = self.labels_unbounded(steps)
        if self.boundary_safe and maker is not None and self.positions_key in keys:
            optional = any(option.name == "boundary_safe_labels" for option in fields(self.options))
            raise ValueError(
                f"{self.OWNER}: your steps make labels ({maker}) that no BoundaryMask keeps inside their "
                f"documents: a label would run from each document into the next; add "
                f"BoundaryMask({self.positions_key!r}) before {maker} and a LossMask reading its mask"
                + (", or pass boundary_safe_labels=False" if optional else "")
            )

    def lay_out(self, batch: Batch) -> list[Stacked]:  # pragma: no cover
        """The chain's input for a non-empty batch: one :class:`Stacked`, or one per row (ragged lists)."""
        raise NotImplementedError

    def chain(self, keys: Sequence[str]) -> list[Transform]:  # pragma: no cover
        """The built-in transforms for a stacked batch holding ``keys``, in order."""
        raise NotImplementedError

    def empty(self) -> dict[str, Any]:
        """The outputs of an empty batch (refused by default)."""
        raise ValueError(f"{self.OWNER}: the batch holds no {self.ITEM}s")

    # -- the flow ----------------------------------------------------------------------------------

    def read(self, samples: object) -> Batch:
        """The door: ``samples`` as a :class:`~zephon_collate.read.columns.Batch`."""
        columns = columns_of(samples, self.OWNER)
        if columns is not None:
            return columns
        if self.READS == "examples":
            key = self.KEY[0]  # a list, the common case, is no batched dict: no ABC check, no search
            if type(samples) is not list and isinstance(samples, Mapping):
                key = next((k for k in self.KEY if k in samples), key)
            return examples_of(samples, self.OWNER, key=key)
        if isinstance(samples, Mapping):
            pairs = [name for name, value in samples.items() if type(value) is tuple and len(value) == 2]
            hint = (
                f"; field {shown(pairs[0])} looks like a (values, offsets) pair: give both as NumPy "
                "arrays or tensors"
                if pairs
                else "; a batch of columns is a dict of Arrow columns or (values, offsets) pairs"
            )
            raise TypeError(f"{self.OWNER}: expected a list of samples, got a {type(samples).__name__}{hint}")
        if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
            raise TypeError(f"{self.OWNER}: expected a list of samples, got {type(samples).__name__}")
        records = [as_record(sample, index, self.OWNER) for index, sample in enumerate(samples)]
        return records_of(records, self.tokens_field, self.OWNER)

    def stack(self, samples: object) -> list[Stacked]:
        """Read and lay out ``samples``: the chain's input (``[]`` for an empty batch)."""
        batch = self.read(samples)
        return self.lay_out(batch) if batch.rows else []

    def plan(self, keys: tuple[str, ...]) -> Plan:
        """The plan on a stacked batch holding ``keys`` (the chain, then your transforms); built once."""
        found = self._plans.get(keys)
        if found is None:
            settings = self.settings
            builtin = self.chain(keys) if settings.chain is None else list(settings.chain)
            self._check_boundaries([*builtin, *settings.transforms], keys)
            self._check_written([*(settings.chain or ()), *settings.transforms])
            found = self._plans[keys] = Plan([*builtin, *settings.transforms], keys)
        return found

    def _check_written(self, steps: Sequence[Transform]) -> None:
        """Refuse a step of yours writing a key this layout keeps to itself, which no later step reads:
        it would reach no output (each key your steps write is one)."""
        steps = flat_steps(steps)  # a Chain of yours: its steps one by one
        for step in steps:
            for key in (key for key in getattr(step, "out_keys", ()) if key in self.ROW_OUTPUTS):
                raise ValueError(
                    f"{self.OWNER}: transform {type(step).__name__} writes {key!r}, an output this layout "
                    f"makes itself, row by row ({list(self.ROW_OUTPUTS)}); write it under a name of your own"
                )
        for index, step in enumerate(steps):
            for key in (key for key in getattr(step, "out_keys", ()) if self.internal(key)):
                later = steps[index + 1 :]
                if not any(key in declared_keys(s) or getattr(s, "reads_every_key", False) for s in later):
                    raise ValueError(
                        f"{self.OWNER}: transform {type(step).__name__} writes {key!r}, which this layout "
                        f"keeps to itself (no output carries it: {sorted(self.INTERNAL)}); write it under a "
                        "name of your own"
                    )

    def run(self, plan: Plan, data: Mapping[str, Any], device: torch.device | None = None) -> dict[str, Any]:
        """``plan`` over ``data``: compiled for ``device`` with ``compile``, else eager."""
        if not self.settings.compile:
            return plan.run(data)
        tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in data.items()}
        device_type = (device or self.settings.target or torch.device("cpu")).type
        return plan.compiled(device_type)(tensors)

    def collate(self, samples: object) -> dict[str, Any]:
        """Read, lay out, run the chain, assemble: the one-step path."""
        return self.finish(self.stack(samples))

    def finish(self, stacked: Sequence[Stacked]) -> dict[str, Any]:
        """Move stacked batches to the device (``non_blocking``), run the chain, assemble."""
        if not stacked:
            return self.empty()
        device = self.settings.target
        results = []
        plan = self.plan(tuple(stacked[0].data))
        for part in stacked:
            data = part.data
            if device is not None:
                data = {
                    k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v).to(device, non_blocking=True)
                    for k, v in data.items()
                }
            results.append(self.run(plan, data, device))
        return self.assemble(stacked, results, plan)

    # -- the one assembly --------------------------------------------------------------------------

    def output_names(self, keys: Sequence[str], *, empty: bool = False) -> list[tuple[str, str]]:
        """``(key, name)`` of each output of the final ``keys``: ordered, renamed, exclusions dropped."""
        extras = self.extra_fields
        slot = self.ORDER.index(None) if None in self.ORDER else len(self.ORDER)
        ranks = {key: rank for rank, key in enumerate(self.ORDER) if key is not None}
        found = [key for key in dict.fromkeys((*self.ROW_OUTPUTS, *keys)) if not self.internal(key)]

        def rank(item: tuple[int, str]) -> tuple[int, int]:
            index, key = item
            if key in ranks:
                return ranks[key], 0
            if key in extras:
                return slot, extras.index(key)
            return len(self.ORDER) + 1, index

        emitted = [key for _, key in sorted(enumerate(found), key=rank)]
        renames = self.renames
        if not empty:
            for source in renames:
                if source not in emitted:
                    raise ValueError(
                        f"to_training: rename_fields names {shown(source)}, which this call does not emit "
                        f"(it emits {emitted})"
                    )
        named = renamed(emitted, renames)
        excluded = set(self.excluded)
        return [(key, name) for name, key in named.items() if name not in excluded]

    @property
    def kind(self) -> _Kind:
        """The container of the outputs: torch tensors, NumPy arrays or Python lists."""
        return "torch"

    def assemble(
        self, stacked: Sequence[Stacked], results: Sequence[Mapping[str, Any]], plan: Plan
    ) -> dict[str, Any]:
        """The output dict: each output named, in its container; several ``results``: ragged rows, joined."""
        kind = self.kind
        out: dict[str, Any] = {}
        keys = tuple(plan.output_keys)
        names = self._names.get(keys)
        if names is None:
            names = self._names[keys] = self.output_names(keys)
        one = results[0] if len(results) == 1 else None  # the common case: no list per output to join
        taken: list[tuple[int, int]] = []  # the outputs' bytes so far (device pointers are unique too)
        if plan.keys_by_data and results:
            names = [(key, name) for key, name in names if key in self.ROW_OUTPUTS or key in results[0]]
        for key, name in names:
            if key in self.ROW_OUTPUTS:
                out[name] = [value for part in stacked for value in part.per_row.get(key, [])]
            elif one is None:
                out[name] = plan.join(key, [convert(result[key], "list") for result in results])
            elif key in self.SCALARS and one[key].ndim == 0 and self.settings.python_scalars:
                out[name] = one[key].item()  # an int, or a float where a step of yours wrote one (never cut)
            else:
                out[name] = convert(one[key], kind, taken)
        return out
