"""The data model's names, spelled as on the reference page: the records and :class:`SampleBatch`."""

from zephon_collate.collate.sample_batch import SampleBatch
from zephon_collate.core.records import *  # noqa: F403 (the page's names, listed once in records.__all__)
from zephon_collate.core.records import __all__ as _record_names

__all__ = [*_record_names]
__all__ += ["SampleBatch"]
