"""zephon.types: the canonical data model shared across the data-loading pipeline.

Every name of the reference page lives here, spelled as there. The records sit
at the bottom of the package (:mod:`zephon_collate.core.records`); :class:`SampleBatch`
sits above the collate path its ``to_training`` runs
(:mod:`zephon_collate.collate.sample_batch`). Metadata objects are immutable
values: ``with_*`` and ``child`` return new objects and never change the
receiver (its ``tags`` dict included). All of them pickle, so DataLoader
workers can send them between processes.
"""

from zephon_collate.collate.sample_batch import SampleBatch
from zephon_collate.core.records import *  # noqa: F403 (the page's names, listed once in records.__all__)
from zephon_collate.core.records import __all__ as _record_names

__all__ = [*_record_names]
__all__ += ["SampleBatch"]
