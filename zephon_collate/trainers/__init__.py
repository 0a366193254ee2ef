"""Packed layouts inside the trainers people use (needs the ``trl`` extra).

:class:`~zephon_collate.trainers.dpo.PackedDPOTrainer` is ``trl.DPOTrainer``
with its forward passes on packed padding-free rows.
"""

from zephon_collate.trainers.dpo import PackedDPOTrainer, PackedPreference

__all__ = ["PackedDPOTrainer", "PackedPreference"]
