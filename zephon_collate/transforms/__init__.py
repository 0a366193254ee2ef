"""Composable TensorDict transforms that turn a stacked batch into training tensors (docs/transforms.md)."""

from zephon_collate.transforms.attention_mask import AttentionMask
from zephon_collate.transforms.base import Chain, Transform
from zephon_collate.transforms.boundary_mask import BoundaryMask
from zephon_collate.transforms.context_parallel import ContextParallelShard
from zephon_collate.transforms.copy_keys import CopyKeys
from zephon_collate.transforms.cu_seqlens import CuSeqlens
from zephon_collate.transforms.eos_mask import EosMask
from zephon_collate.transforms.flatten import Flatten
from zephon_collate.transforms.last_token_index import LastTokenIndex
from zephon_collate.transforms.left_padding import LeftPadding
from zephon_collate.transforms.loss_mask import LossMask
from zephon_collate.transforms.mrope_positions import MRopePositions
from zephon_collate.transforms.padding_mask import PaddingMask
from zephon_collate.transforms.positions import Positions
from zephon_collate.transforms.positions_offset import PositionOffset
from zephon_collate.transforms.predicted_labels import PredictedLabels
from zephon_collate.transforms.segment_ids import SegmentIds
from zephon_collate.transforms.separator_labels import SeparatorLabels
from zephon_collate.transforms.sequence_map import SequenceMap
from zephon_collate.transforms.sequence_roles import SequenceRoles
from zephon_collate.transforms.token_shift import TokenShift
from zephon_collate.transforms.total import Total
from zephon_collate.transforms.unshifted_labels import UnshiftedLabels

__all__ = [
    "AttentionMask",
    "BoundaryMask",
    "Chain",
    "ContextParallelShard",
    "CopyKeys",
    "CuSeqlens",
    "EosMask",
    "Flatten",
    "LastTokenIndex",
    "LeftPadding",
    "LossMask",
    "MRopePositions",
    "PaddingMask",
    "PositionOffset",
    "Positions",
    "PredictedLabels",
    "SegmentIds",
    "SeparatorLabels",
    "SequenceMap",
    "SequenceRoles",
    "TokenShift",
    "Total",
    "Transform",
    "UnshiftedLabels",
]
