"""The collate path: options, plan, read-stack-check, chain, output; the Collator and the worker transfer.

- :mod:`~zephon_collate.collate.options`: ``TrainingOptions``, the one home of ``to_training``'s signature.
- :mod:`~zephon_collate.collate.prepare`: read, stack and check a batch's fields.
- :mod:`~zephon_collate.collate.plan`: the chain and output names per option and key set, cached.
- :mod:`~zephon_collate.collate.output`: renaming, exclusion, flattening, containers.
- :mod:`~zephon_collate.collate.sample_batch`: ``SampleBatch`` and ``to_training``.
- :mod:`~zephon_collate.collate.collator`: the DataLoader ``collate_fn``.
- :mod:`~zephon_collate.collate.hf`: ``Collator.for_transformers``, Hugging Face examples to a
  ``transformers`` batch.
- :mod:`~zephon_collate.collate.transfer`: what a worker sends, as one narrow buffer.
"""
