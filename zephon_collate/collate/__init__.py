"""The collate path: options, reading, the plan, the host pass, output; the Collator, its presets, the
worker transfer.

- :mod:`~zephon_collate.collate.options`: ``TrainingOptions``, ``to_training``'s arguments and their chain.
- :mod:`~zephon_collate.collate._native`: the reference page's layout (records in, the page's outputs out).
- :mod:`~zephon_collate.collate._stack`: ragged fields to ``[B, S]`` tensors, right padding.
- :mod:`~zephon_collate.collate._plan`: the chain and output names per layout and key set, compiled on demand.
- :mod:`~zephon_collate.collate._host`: the fused host pass that stands in for the built-in chain on the CPU.
- :mod:`~zephon_collate.collate._output`: renaming, exclusion, flattening, containers.
- :mod:`~zephon_collate.collate.sample_batch`: ``SampleBatch``, ``to_training``, ``stack_batch``.
- :mod:`~zephon_collate.collate.collator`: the DataLoader ``collate_fn``, transforms of yours included.
- :mod:`~zephon_collate.collate.hf`: ``Collator.for_transformers``, Hugging Face examples to a
  ``transformers`` batch, over the same machinery.
- :mod:`~zephon_collate.collate.preference` and :mod:`~zephon_collate.collate.rollouts`:
  ``Collator.for_preference`` and ``Collator.for_rollouts``, post-training batches over the
  ``transformers`` layout (:mod:`~zephon_collate.collate._sequences`: sequences, shared prompts).
- :mod:`~zephon_collate.collate.transfer`: what a worker sends, as one narrow buffer.
- :mod:`~zephon_collate.collate.columnar`: ``ColumnarDataset``, a ``datasets.Dataset`` handing over
  whole batches of columns (read by :mod:`zephon_collate._columns`).
"""

from zephon_collate.collate._host import use_host_pass
from zephon_collate.collate.collator import Collator, CollatorOptions
from zephon_collate.collate.columnar import ColumnarDataset
from zephon_collate.collate.hf import TransformersCollator, TransformersOptions
from zephon_collate.collate.options import TrainingOptions
from zephon_collate.collate.preference import PreferenceCollator, PreferenceOptions
from zephon_collate.collate.rollouts import RolloutCollator, RolloutOptions
from zephon_collate.collate.sample_batch import SampleBatch, stack_batch, to_training
from zephon_collate.collate.transfer import StackedBatch

__all__ = [
    "Collator",
    "CollatorOptions",
    "ColumnarDataset",
    "PreferenceCollator",
    "PreferenceOptions",
    "RolloutCollator",
    "RolloutOptions",
    "SampleBatch",
    "StackedBatch",
    "TrainingOptions",
    "TransformersCollator",
    "TransformersOptions",
    "stack_batch",
    "to_training",
    "use_host_pass",
]
