"""Packed layouts inside the trainers people use (needs the ``trl`` extra).

:class:`~zephon_collate.trainers.dpo.PackedDPOTrainer` and
:class:`~zephon_collate.trainers.grpo.PackedGRPOTrainer` are ``trl.DPOTrainer``
and ``trl.GRPOTrainer`` with their forward passes on packed rows.
"""

from zephon_collate.trainers.dpo import PackedDPOTrainer, PackedPreference
from zephon_collate.trainers.grpo import PackedGRPOTrainer

__all__ = ["PackedDPOTrainer", "PackedGRPOTrainer", "PackedPreference"]
