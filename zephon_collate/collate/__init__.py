"""The Collator, ``to_training``, the worker transfer and the columnar dataset: the entry points over the
layouts (:mod:`zephon_collate.layouts`).

- :mod:`~zephon_collate.collate.collator`: ``Collator`` and its presets (``for_transformers``,
  ``for_preference``, ``for_rollouts``), one class over every layout.
- :mod:`~zephon_collate.collate.sample_batch`: ``SampleBatch``, ``to_training``, ``stack_batch``.
- :mod:`~zephon_collate.collate.transfer`: what a worker sends, as one narrow buffer.
- :mod:`~zephon_collate.collate.columnar`: ``ColumnarDataset``, a ``datasets.Dataset`` handing over
  whole batches of columns.
"""
