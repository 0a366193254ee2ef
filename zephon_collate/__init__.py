"""zephon_collate: a PyTorch-native collator for LLM training data.

:class:`Collator` is the ``collate_fn``, :func:`to_training` one call; the map: ``docs/architecture.md``."""

from zephon_collate.collate.collator import Collator
from zephon_collate.collate.columnar import ColumnarDataset
from zephon_collate.collate.sample_batch import to_training
from zephon_collate.layouts.plan import use_host_pass
from zephon_collate.losses import aggregate_loss, global_loss_count, sequence_logprobs, token_logprobs, unpack
from zephon_collate.packing.columns import pack_columns
from zephon_collate.packing.pack_flat import pack_flat
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.packing.stream import PackedStream
from zephon_collate.parallel.balance import BalanceOptions
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.distributed import global_num_valid_tokens, normalize_loss
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.read.fields import FloatField, TensorField
from zephon_collate.transforms import Chain, Transform
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

from zephon_collate import functional, transforms  # isort: skip (the modules, after their names)

__version__ = "0.1.0"

__all__ = [
    "BalanceOptions",
    "BalancedBatchSampler",
    "Chain",
    "ChunkId",
    "ChunkOffset",
    "Collator",
    "ColumnarDataset",
    "ComponentId",
    "ContributorRef",
    "CostModel",
    "DatasetId",
    "FlatPacker",
    "FloatField",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "PackedStream",
    "SampleBatch",
    "SampleCursor",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "ShardId",
    "TensorField",
    "Transform",
    "__version__",
    "aggregate_loss",
    "functional",
    "global_loss_count",
    "global_num_valid_tokens",
    "normalize_loss",
    "pack_columns",
    "pack_flat",
    "sequence_logprobs",
    "to_training",
    "token_logprobs",
    "transforms",
    "unpack",
    "use_host_pass",
]
