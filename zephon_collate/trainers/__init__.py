"""Packed layouts inside the trainers people use (needs the ``trl`` extra).

:class:`~zephon_collate.trainers.dpo.PackedDPOTrainer`,
:class:`~zephon_collate.trainers.grpo.PackedGRPOTrainer` and
:class:`~zephon_collate.trainers.rewards.PackedRewardTrainer` are ``trl.DPOTrainer``,
``trl.GRPOTrainer`` and ``trl.RewardTrainer`` with their forward passes on packed rows.
"""

from zephon_collate.trainers.dpo import PackedDPOTrainer, PackedPreference
from zephon_collate.trainers.grpo import PackedGRPOTrainer
from zephon_collate.trainers.rewards import PackedRewardTrainer

__all__ = ["PackedDPOTrainer", "PackedGRPOTrainer", "PackedPreference", "PackedRewardTrainer"]
