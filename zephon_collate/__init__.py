"""zephon_collate: a PyTorch-native collator for LLM training data.

Records (:class:`SampleRecord`) are stacked into a TensorDict and turned into
training tensors by a chain of transforms (:mod:`zephon_collate.transforms`);
:meth:`SampleBatch.to_training` is the one-call entry point.
"""

from zephon_collate import attention, functional, numpy_kernels
from zephon_collate.batch import stack_batch
from zephon_collate.collator import Collator
from zephon_collate.context_parallel import ContextParallelShard
from zephon_collate.context_parallel_layout import gather_context_parallel
from zephon_collate.distributed import global_num_valid_tokens, normalize_loss
from zephon_collate.inspect_batch import batch_warnings
from zephon_collate.leakage import check_no_leakage
from zephon_collate.options import TrainingOptions
from zephon_collate.packing import pack_flat
from zephon_collate.packing_stream import FlatPacker
from zephon_collate.render import render_batch, render_batch_png
from zephon_collate.resumable import PackedStream
from zephon_collate.training import to_training
from zephon_collate.transfer import StackedBatch
from zephon_collate.transforms import (
    Chain,
    CuSeqlens,
    EosMask,
    LossMask,
    PaddingMask,
    Positions,
    SegmentIds,
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
    "ContextParallelShard",
    "ContributorRef",
    "CuSeqlens",
    "DatasetId",
    "EosMask",
    "FlatPacker",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "LossMask",
    "PackedStream",
    "PaddingMask",
    "Positions",
    "SampleBatch",
    "SampleCursor",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "SegmentIds",
    "ShardId",
    "StackedBatch",
    "TokenShift",
    "TrainingOptions",
    "Transform",
    "__version__",
    "attention",
    "batch_warnings",
    "check_no_leakage",
    "functional",
    "gather_context_parallel",
    "global_num_valid_tokens",
    "normalize_loss",
    "numpy_kernels",
    "pack_flat",
    "render_batch",
    "render_batch_png",
    "stack_batch",
    "to_training",
]
