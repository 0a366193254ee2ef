"""zephon_collate: a PyTorch-native collator for LLM training data.

Records (:class:`SampleRecord`) are stacked into a TensorDict and turned into
training tensors by a chain of transforms (:mod:`zephon_collate.transforms`);
:meth:`SampleBatch.to_training` is the one-call entry point.
"""

from zephon_collate import functional
from zephon_collate.batch import stack_batch
from zephon_collate.collator import Collator, StackedBatch
from zephon_collate.options import TrainingOptions
from zephon_collate.packing import pack_flat
from zephon_collate.packing_stream import FlatPacker
from zephon_collate.training import to_training
from zephon_collate.transforms import (
    Chain,
    CuSeqlens,
    EosMask,
    LossMask,
    PaddingMask,
    Positions,
    TokenShift,
    Transform,
)
from zephon_collate.types import (
    ChunkId,
    ChunkOffset,
    ComponentId,
    ContributorRef,
    DatasetId,
    LaneId,
    LineageIndex,
    LocalSampleId,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SamplePayload,
    SamplePayloadArray,
    SampleRecord,
    ShardId,
)

__version__ = "0.1.0"

__all__ = [
    "Chain",
    "ChunkId",
    "ChunkOffset",
    "Collator",
    "ComponentId",
    "ContributorRef",
    "CuSeqlens",
    "DatasetId",
    "EosMask",
    "FlatPacker",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "LossMask",
    "PaddingMask",
    "Positions",
    "SampleBatch",
    "SampleCursor",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "ShardId",
    "StackedBatch",
    "TokenShift",
    "TrainingOptions",
    "Transform",
    "__version__",
    "functional",
    "pack_flat",
    "stack_batch",
    "to_training",
]
