"""TRL's trainers with their forward passes on packed rows (needs the ``trl`` extra)."""

from zephon_collate.trainers.dpo import PackedDPOTrainer, PackedPreference
from zephon_collate.trainers.policy import PackedGRPOTrainer, PackedRLOOTrainer
from zephon_collate.trainers.rewards import PackedRewardTrainer

__all__ = [
    "PackedDPOTrainer",
    "PackedGRPOTrainer",
    "PackedPreference",
    "PackedRLOOTrainer",
    "PackedRewardTrainer",
]
