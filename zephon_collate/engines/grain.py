"""Grain stages: packing and the balanced plan as ``grain.IterDataset`` stages, checkpointed by Grain.

Needs the ``grain`` extra; pipelines, JSON state and worker processes: docs/engines.md.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
import torch

from zephon_collate.core.records import SampleRecord
from zephon_collate.engines.state import from_json, to_json
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.read.arrow import is_columnar

__all__ = ["BalancedIterDataset", "PackIterDataset", "as_torch"]


class PackIterDataset(grain.IterDataset):  # type: ignore[misc]  # grain ships no type hints
    """Rows of ``seq_len`` tokens packed from the parent's documents by a :class:`~zephon_collate.FlatPacker`.

    Parameters:
        parent: a Grain dataset of documents (dict payloads, token arrays or ``SampleRecord``);
            a ``MapDataset`` is read in order, without read-ahead threads.
        *args, **options: the :class:`~zephon_collate.FlatPacker` options (``seq_len``,
            ``pad_token_id``, ``strategy``, ``group_key``, ...), checked here.

    Example:
        >>> from zephon_collate import Collator
        >>> docs = grain.MapDataset.source([{"input_ids": [i + 1] * n} for i, n in enumerate([3, 2, 4])])
        >>> rows = PackIterDataset(docs, seq_len=5, pad_token_id=0)
        >>> [row.payload["input_ids"].tolist() for row in rows]
        [[1, 1, 1, 2, 2], [3, 3, 3, 3, 0]]
        >>> Collator()(list(rows))["positions"].tolist()
        [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    """

    def __init__(self, parent: Any, *args: Any, **options: Any) -> None:
        self._indexed = isinstance(parent, grain.MapDataset)
        if self._indexed:  # read in order, without Grain's read-ahead threads, each with its index
            parent = parent.map_with_index(_with_index)  # which worker slices keep: errors and ids name it
            parent = parent.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        super().__init__(parent)
        self._seq_len = FlatPacker(*args, **options).options.seq_len  # checked now, not in a worker
        self._args, self._options = args, options

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's worker slice, handed to the parent; refused with ``group_key`` (it would split groups)."""
        if self._options.get("group_key") is not None and (sl.step or 1) > 1:
            raise ValueError(
                "PackIterDataset: group_key keeps consecutive records together, and Grain's worker slices "
                "(mp_prefetch) take every n-th record, which would split each group across workers; pack "
                "grouped documents with 0 workers, or give each group as one element and no group_key"
            )
        parent = self._parent
        if hasattr(parent, "set_slice"):
            parent.set_slice(sl, sequential_slice)
        else:  # Grain's own walk up the pipeline, as mp_prefetch does for a stage without set_slice
            from grain._src.python.dataset.transformations.prefetch import _set_slice_iter_dataset

            _set_slice_iter_dataset(parent, sl, sequential_slice)

    def __iter__(self) -> _PackIterator:
        packer = FlatPacker(*self._args, **self._options)
        return _PackIterator(self._parent.__iter__(), packer, self._indexed)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self._seq_len})"


class _PackIterator(grain.DatasetIterator):  # type: ignore[misc]
    """The packer over the parent iterator; its state is the parent's and the packer's."""

    def __init__(self, parent: Any, packer: FlatPacker, indexed: bool) -> None:
        super().__init__(parent)
        self._packer = packer
        self._rows: Iterator[SampleRecord] | None = None
        self._indexed = indexed
        self._latest = (-1, -1)  # (the packer's count, the source index) of the latest document read

    def __next__(self) -> SampleRecord:
        if self._rows is None:  # the packer pulls documents from the parent as rows need them
            documents = self._parent
            if self._indexed:  # the packer names each document by its index in the source
                documents = self._numbered(documents)
                self._packer._number_by(self._index_of)
            self._rows = self._packer.pack(_documents(documents))
        return next(self._rows)

    def _numbered(self, elements: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        count = self._packer.records_consumed
        for index, document in elements:
            self._latest = (count, index)
            count += 1
            yield document

    def _index_of(self, count: int) -> int:
        """The source index of the packer's ``count``-th document: the one it has just read."""
        latest, index = self._latest
        assert count == latest, "the packer names the document it has just read"
        return index

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "packer": to_json(self._packer.state_dict())}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._packer.load_state_dict(from_json(state["packer"]))
        self._rows = None


def _with_index(index: int, document: Any) -> tuple[int, Any]:
    return index, document


def _documents(parent: Iterator[Any]) -> Iterator[Any]:
    """The parent's elements, one document each: a batch of columns is refused (its resume point would be
    the whole batch, not the documents the rows have read)."""
    for element in parent:
        if is_columnar(element):
            raise ValueError(
                "PackIterDataset: the parent yields a batch of columns (an Arrow table or record batch); "
                "Grain resumes a stage from its parent's state, which is past the whole batch, and rows "
                "read from part of it would lose the rest: give one document per element (a dict payload "
                "or a token array), or pack batches of columns with FlatPacker outside Grain"
            )
        yield element


class BalancedIterDataset(grain.IterDataset):  # type: ignore[misc]
    """This rank's balanced micro-batches, each a list of the parent's documents, planned by a
    :class:`~zephon_collate.BalancedBatchSampler` (docs/engines.md); collate each with ``.map(collator)``.

    Parameters:
        parent: the documents, with random access (a ``grain.MapDataset`` or a sequence).
        sampler: the plan, over ``len(parent)`` lengths, for this rank.
        num_epochs: epochs to run (``None``: forever), from the sampler's epoch on.

    Example:
        >>> from zephon_collate import BalanceOptions, CostModel
        >>> docs = [[i + 1] * n for i, n in enumerate([8, 1, 6, 2, 5, 3, 4, 4, 7, 1])]
        >>> options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=8, micro_batches=2)
        >>> sampler = BalancedBatchSampler([len(d) for d in docs], options, num_replicas=2, rank=1,
        ...                                shuffle=False)
        >>> [[doc[0] for doc in batch] for batch in BalancedIterDataset(docs, sampler)]
        [[3, 4], [7, 8], [2, 10]]
    """

    def __init__(self, parent: Any, sampler: BalancedBatchSampler, num_epochs: int | None = 1) -> None:
        if not isinstance(sampler, BalancedBatchSampler):
            raise TypeError(
                f"BalancedIterDataset: sampler must be a BalancedBatchSampler, got {type(sampler).__name__}"
            )
        if len(parent) != sampler.lengths.size:
            raise ValueError(
                f"BalancedIterDataset: the parent holds {len(parent)} documents, the sampler plans "
                f"{sampler.lengths.size} lengths; give the sampler one length per document"
            )
        if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
            raise ValueError(
                f"BalancedIterDataset: num_epochs must be an int >= 1 or None, got {num_epochs!r}"
            )
        super().__init__([parent] if isinstance(parent, grain.MapDataset) else [])
        self._documents: Sequence[Any] = parent
        self._sampler, self._num_epochs = sampler, num_epochs
        self._slice = slice(0, None, 1)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Keep micro-batches ``sl.start, sl.start + sl.step, ...`` (Grain's worker slice)."""
        if sequential_slice:
            raise ValueError(
                "BalancedIterDataset: a sequential slice needs the epoch's length, which the plan gives only "
                "as it goes; use Grain's default (interleaved) worker slices"
            )
        self._slice = slice(sl.start or 0, None, sl.step or 1)

    def __iter__(self) -> _BalancedIterator:
        return _BalancedIterator(self._documents, self._sampler, self._num_epochs, self._slice)

    def __str__(self) -> str:
        return f"BalancedIterDataset(rank={self._sampler.rank}, num_replicas={self._sampler.num_replicas})"


class _BalancedIterator(grain.DatasetIterator):  # type: ignore[misc]
    """The sampler's micro-batches of this worker's slice; its state is the sampler's position."""

    def __init__(
        self, documents: Sequence[Any], sampler: BalancedBatchSampler, epochs: int | None, part: slice
    ) -> None:
        super().__init__()
        self._documents, self._part = documents, part
        self._sampler = copy.copy(sampler)  # the position is this iterator's, not the dataset's
        self._sampler.load_state_dict(sampler.state_dict())
        self._last = None if epochs is None else sampler.epoch + epochs - 1  # counted from the sampler's
        self._drawn = 0  # micro-batches drawn from the plan, every worker's, across epochs
        self._batches: Iterator[list[int]] | None = None

    def __next__(self) -> list[Any]:
        sampler, part = self._sampler, self._part
        while True:
            if self._batches is None:
                self._batches = iter(sampler)
            indices = next(self._batches, None)
            if indices is None:  # the epoch is over: the next one, if any
                if self._last is not None and sampler.epoch >= self._last:
                    raise StopIteration
                sampler.set_epoch(sampler.epoch + 1)
                self._batches = None
                continue
            place, self._drawn = self._drawn, self._drawn + 1
            if place >= part.start and (place - part.start) % part.step == 0:
                return [self._documents[index] for index in indices]

    def get_state(self) -> dict[str, Any]:
        return {"sampler": self._sampler.state_dict(), "drawn": self._drawn, "last_epoch": self._last}

    def set_state(self, state: dict[str, Any]) -> None:
        # The state alone says where to stand: no later epoch this iterator reached may win over it.
        self._sampler.epoch = 0
        self._sampler.load_state_dict(state["sampler"])
        self._drawn = int(state["drawn"])
        self._last = state.get("last_epoch", self._last)
        self._batches = None


def as_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch of NumPy arrays as torch tensors on the same memory; other values as is.

    A tensor keeps its array, so Grain's shared memory behind it stays mapped while the tensor lives
    (a read-only array is copied: torch tensors are writable).

    Map it after ``mp_prefetch`` when the workers collate to NumPy (docs/engines.md, "Worker processes").

    Example:
        >>> batch = as_torch({"input_ids": np.array([[1, 2]]), "ids": [(0, 0, 0)]})
        >>> batch["input_ids"].dtype, batch["ids"]
        (torch.int64, [(0, 0, 0)])
    """
    return {k: _tensor(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())
