"""zephon_collate: a PyTorch-native collator for LLM training data.

Records (:class:`SampleRecord`) are stacked once and turned into training
tensors by a chain of transforms (:mod:`zephon_collate.transforms`);
:meth:`SampleBatch.to_training` is the one-call entry point, :class:`Collator`
the ``collate_fn`` for a DataLoader, :meth:`Collator.for_transformers` the one
for Hugging Face ``transformers`` models and ``Trainer``.

The tree, bottom to top: ``records``, ``keys`` and ``text`` (the data model,
field names and limits, how errors quote values), ``checks``, ``read`` and
``columns`` (argument checks, the one payload reader, columnar batches read as
its fields),
``functional/`` (pure kernels), ``transforms/``, ``collate/`` (options, plan,
stacking, output, ``to_training``, the Collator and its ``transformers``
layout, the worker transfer),
``packing/``, ``parallel/`` and ``inspection/``.
"""

from zephon_collate.collate import (
    Collator,
    CollatorOptions,
    ColumnarDataset,
    PreferenceCollator,
    RolloutCollator,
    StackedBatch,
    TrainingOptions,
    TransformersCollator,
    TransformersOptions,
    stack_batch,
    to_training,
    use_host_pass,
)
from zephon_collate.fields import FloatField
from zephon_collate.functional import attention
from zephon_collate.inspection.leakage import check_no_leakage
from zephon_collate.inspection.render import render_batch, render_batch_png
from zephon_collate.inspection.rows import batch_warnings
from zephon_collate.losses import (
    MODES,
    aggregate_loss,
    global_loss_count,
    sequence_logprobs,
    token_logprobs,
    unpack,
)
from zephon_collate.packing.columns import PackedColumns, pack_columns
from zephon_collate.packing.pack_flat import pack_flat
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.packing.stream import PackedStream
from zephon_collate.parallel.balance import BalanceOptions, BalancePlan, plan_balance
from zephon_collate.parallel.context_parallel import gather_context_parallel
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.distributed import global_num_valid_tokens, normalize_loss
from zephon_collate.parallel.even import EvenBatches
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.parallel.schedule import BalanceSchedule
from zephon_collate.transforms import (
    AttentionMask,
    BoundaryMask,
    Chain,
    ContextParallelShard,
    CuSeqlens,
    EosMask,
    LeftPadding,
    LossMask,
    PaddingMask,
    Positions,
    SegmentIds,
    TokenShift,
    Transform,
    UnshiftedLabels,
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

from zephon_collate import functional  # isort: skip (the module, after its names)

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "AttentionMask",
    "BalanceOptions",
    "BalancePlan",
    "BalanceSchedule",
    "BalancedBatchSampler",
    "BoundaryMask",
    "Chain",
    "ChunkId",
    "ChunkOffset",
    "Collator",
    "CollatorOptions",
    "ColumnarDataset",
    "ComponentId",
    "ContextParallelShard",
    "ContributorRef",
    "CostModel",
    "CuSeqlens",
    "DatasetId",
    "EosMask",
    "EvenBatches",
    "FlatPacker",
    "FloatField",
    "LaneId",
    "LeftPadding",
    "LineageIndex",
    "LocalSampleId",
    "LossMask",
    "PackedColumns",
    "PackedStream",
    "PaddingMask",
    "Positions",
    "PreferenceCollator",
    "RolloutCollator",
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
    "TransformersCollator",
    "TransformersOptions",
    "UnshiftedLabels",
    "__version__",
    "aggregate_loss",
    "attention",
    "batch_warnings",
    "check_no_leakage",
    "functional",
    "gather_context_parallel",
    "global_loss_count",
    "global_num_valid_tokens",
    "normalize_loss",
    "pack_columns",
    "pack_flat",
    "plan_balance",
    "render_batch",
    "render_batch_png",
    "sequence_logprobs",
    "stack_batch",
    "to_training",
    "token_logprobs",
    "unpack",
    "use_host_pass",
]
