"""``Collator``: a layout as a DataLoader ``collate_fn``, split in two for workers (``stack``, ``finish``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import get_worker_info

from zephon_collate.collate.transfer import StackedBatch, WireOutputs
from zephon_collate.core.checks import Keywords, keywords
from zephon_collate.core.keys import IDS, INPUT_IDS, TEXTS
from zephon_collate.layouts.base import Layout, Settings, Stacked
from zephon_collate.layouts.native import CollatorOptions, Native
from zephon_collate.layouts.plan import Plan
from zephon_collate.layouts.presets import PreferenceOptions, RewardOptions, RolloutOptions, TrajectoryOptions
from zephon_collate.layouts.transformers import Transformers, TransformersOptions
from zephon_collate.layouts.trees import Trees

__all__ = ["Collator"]


@dataclass(frozen=True, kw_only=True, eq=False)
class _Native(Settings, CollatorOptions):
    """``Collator(...)``'s keywords: the page's, the Collator's own, then the settings."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Transformers(Settings, TransformersOptions):
    """``Collator.for_transformers(...)``'s keywords."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Preference(Settings, PreferenceOptions):
    """``Collator.for_preference(...)``'s keywords."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Rewards(Settings, RewardOptions):
    """``Collator.for_rewards(...)``'s keywords."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Rollouts(Settings, RolloutOptions):
    """``Collator.for_rollouts(...)``'s keywords."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Trajectories(Settings, TrajectoryOptions):
    """``Collator.for_trees(...)``'s keywords."""


def _split(options: type[Keywords], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Settings]:
    """The layout's options and the settings from one call's arguments (positional: the options')."""
    settings = {f.name for f in fields(Settings) if f.init}
    given = {name: value for name, value in kwargs.items() if name not in settings}
    return options(*args, **given), Settings(**{k: v for k, v in kwargs.items() if k in settings})


class Collator:
    """A ``collate_fn`` that lays out what a DataLoader hands it, as :meth:`SampleBatch.to_training` does.

    Parameters:
        **options: ``to_training``'s keywords, then ``CollatorOptions``' and ``Settings``' fields.

    Example:
        >>> collate = Collator(return_labels=True, return_num_valid_tokens=True)
        >>> out = collate([{"input_ids": [1, 10, 2]}, {"input_ids": [1, 11, 2]}])
        >>> out["labels"].tolist(), out["num_valid_tokens"]
        ([[10, 2], [11, 2]], 4)
    """

    layout: Layout

    @keywords(_Native, "Collator")
    def __init__(self, **options: Any) -> None:
        layout_options, settings = _split(CollatorOptions, (), options)
        self._use(Native(layout_options, settings))

    @classmethod
    def of(cls, layout: Layout) -> Collator:
        """The collator of ``layout``: how every preset is built (through the one setup)."""
        collator = cls.__new__(cls)
        collator._use(layout)
        return collator

    def _use(self, layout: Layout) -> None:
        settings = layout.settings
        if (settings.device is not None or settings.compile) and layout.kind != "torch":
            raise ValueError(
                f"{layout.OWNER}: device and compile need torch output; pass {layout.TORCH_OUTPUT}"
            )
        layout.check_chain()
        self.layout = layout

    @classmethod
    @keywords(_Transformers, "Collator.for_transformers")
    def for_transformers(cls, *args: Any, **options: Any) -> Collator:
        """The ``transformers`` causal-LM ``collate_fn``; takes ``TransformersOptions``, then the settings.

        Example:
            >>> flatten = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
            >>> flat = flatten([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
            >>> flat["labels"].tolist(), flat["position_ids"].tolist(), flat["cu_seq_lens_q"].tolist()
            ([[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5])
        """
        layout_options, settings = _split(TransformersOptions, args, options)
        return cls.of(Transformers(layout_options, settings))

    @classmethod
    @keywords(_Preference, "Collator.for_preference")
    def for_preference(cls, *args: Any, **options: Any) -> Collator:
        """Preference pairs (or KTO examples) to one batch; takes ``PreferenceOptions``, then the settings.

        Example:
            >>> pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}]
            >>> batch = Collator.for_preference(pad_token_id=0)(pairs)
            >>> batch["input_ids"].tolist(), batch["chosen_index"].tolist(), batch["rejected_index"].tolist()
            ([[1, 2, 3, 0], [1, 2, 4, 5]], [0], [1])
        """
        layout_options, settings = _split(PreferenceOptions, args, options)
        return cls.of(Trees(layout_options, settings))

    @classmethod
    @keywords(_Rewards, "Collator.for_rewards")
    def for_rewards(cls, *args: Any, **options: Any) -> Collator:
        """Reward-model pairs to TRL's reward batch; takes ``RewardOptions``, then the settings.

        Example:
            >>> flat = Collator.for_rewards(padding_free=True)([{"chosen_ids": [1, 2], "rejected_ids": [3]}])
            >>> flat["input_ids"].tolist(), flat["position_ids"].tolist(), flat["last_token_index"].tolist()
            ([[1, 2, 3]], [[0, 1, 0]], [1, 2])
        """
        layout_options, settings = _split(RewardOptions, args, options)
        return cls.of(Trees(layout_options, settings))

    @classmethod
    @keywords(_Rollouts, "Collator.for_rollouts")
    def for_rollouts(cls, *args: Any, **options: Any) -> Collator:
        """RL rollouts (with float fields) to one batch; takes ``RolloutOptions``, then the settings.

        Example:
            >>> from zephon_collate import FloatField
            >>> collate = Collator.for_rollouts(
            ...     padding_free=True, shared_prompt=True, float_fields=[FloatField("adv", "sequence")]
            ... )
            >>> batch = collate([{"input_ids": [1, 2, 3], "completion_mask": [0, 0, 1], "adv": 1.0},
            ...                  {"input_ids": [1, 2, 4], "completion_mask": [0, 0, 1], "adv": -1.0}])
            >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["adv"].tolist()
            ([[1, 2, 3, 4]], [[0, 1, 2, 2]], [1.0, -1.0])
        """
        layout_options, settings = _split(RolloutOptions, args, options)
        return cls.of(Trees(layout_options, settings))

    @classmethod
    @keywords(_Trajectories, "Collator.for_trees")
    def for_trees(cls, *args: Any, **options: Any) -> Collator:
        """Trajectories or trees to one prefix-sharing batch; takes ``TrajectoryOptions``, then the settings.

        Example:
            >>> batch = Collator.for_trees()([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            ...                               {"input_ids": [1, 2, 4], "completion_mask": [0, 1, 1]}])
            >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["subtree_end"].tolist()
            ([[1, 2, 3, 4]], [[0, 1, 2, 2]], [[4, 4, 3, 4]])
        """
        layout_options, settings = _split(TrajectoryOptions, args, options)
        return cls.of(Trees(layout_options, settings))

    @property
    def options(self) -> Any:
        """The layout's options (checked)."""
        return self.layout.options

    @property
    def settings(self) -> Settings:
        return self.layout.settings

    @property
    def device(self) -> torch.device | None:
        return self.settings.target

    @property
    def compile(self) -> bool:
        return self.settings.compile

    def __repr__(self) -> str:
        return f"{self.layout.OWNER}({self.options}, {self.settings})"

    def plan(self, keys: tuple[str, ...]) -> Plan:
        """The plan of this collator on a stacked batch holding ``keys``: its chain and output keys."""
        return self.layout.plan(keys)

    def __call__(self, samples: Any) -> dict[str, Any]:
        """Collate in one step (:meth:`stack` then :meth:`finish` when a device or compiling is asked)."""
        out = self.layout.collate(samples)
        return WireOutputs(out) if get_worker_info() is not None or _in_grain_worker() else out

    def stack(self, samples: Any) -> StackedBatch:
        """Worker side: read, check and stack the samples into a CPU ``StackedBatch`` (no CUDA call).

        Example:
            >>> collate = Collator(return_labels=True)
            >>> stacked = collate.stack([{"input_ids": [5, 6, 7]}])
            >>> sorted(stacked.td.keys()), stacked.metas[0].sample_id
            (['input_ids', 'padding_length'], (0, 0, 0))
            >>> collate.finish(stacked)["labels"].tolist()
            [[6, 7]]
        """
        stacked = self.layout.stack(samples)
        if not stacked:
            return StackedBatch(None, {IDS: [], TEXTS: []})
        if len(stacked) > 1:
            raise ValueError(
                "Collator.stack: rows of unequal length cannot be stacked into one TensorDict, even for "
                "dtype=None (lists); call the collator itself (Collator(...)(samples)), which returns "
                "ragged lists, or pad the rows (Collator(pad_token_id=...)) or pack them (pack_flat)"
            )
        part = stacked[0]
        data = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in part.data.items()}
        rows = {value.shape[0] if value.dim() else -1 for value in data.values()}
        size = list(rows) if len(rows) == 1 and -1 not in rows else []  # [] when some hold one entry per row
        td = TensorDict(data, batch_size=size, device=data[INPUT_IDS].device)
        return StackedBatch(td, part.per_row or {IDS: [], TEXTS: []}, part.metas)

    def finish(self, stacked: StackedBatch) -> dict[str, Any]:
        """Main-process side: move :meth:`stack`'s batch to ``device`` (``non_blocking``), run the chain."""
        if not isinstance(stacked, StackedBatch):
            raise TypeError(
                f"Collator.finish: expected the StackedBatch that Collator.stack returns, got "
                f"{type(stacked).__name__}"
            )
        if stacked.td is None:
            return self.layout.empty()
        td = stacked.td
        device = self.settings.target
        if device is not None and td.device != device:
            td = td.to(device, non_blocking=True)  # narrow fields move narrow, then widen there
        data: dict[str, Any] = {key: value for key, value in td.items() if isinstance(value, torch.Tensor)}
        for key, dtype in stacked.dtypes.items():
            data[key] = data[key].to(dtype)
        return self.layout.finish([Stacked(data, stacked.per_record, stacked.metas)])


_GRAIN_WORKER = "grain._src.python.dataset.transformations.process_prefetch"


def _in_grain_worker() -> bool:
    """True in a Grain ``mp_prefetch`` worker process: its batches leave through a pipe, as a DataLoader
    worker's do, so they travel as one narrow buffer too (``WireOutputs``), not a shared-memory block per
    tensor. Grain is never imported here: a process that has not loaded it is no Grain worker."""
    module = sys.modules.get(_GRAIN_WORKER)
    check = getattr(module, "is_in_worker_process", None)
    return bool(check()) if check is not None else False
