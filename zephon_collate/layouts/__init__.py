"""Layouts: how a batch read at the door is laid out, and the chain that turns it into training tensors.

One base class (:class:`~zephon_collate.layouts.base.Layout`) owns the flow:
read, lay out, run the chain, assemble the outputs once. Each layout writes
how it lays a batch out and its chain:

- :mod:`~zephon_collate.layouts.native`: the reference page's (``to_training``, ``Collator``),
  with its options (:mod:`~zephon_collate.layouts.training`);
- :mod:`~zephon_collate.layouts.transformers`: Hugging Face's (``Collator.for_transformers``);
- :mod:`~zephon_collate.layouts.trees`: post-training data as a forest of token spans, every
  shared prefix once (``for_preference``, ``for_rewards``, ``for_rollouts`` and ``for_trees``,
  their options and read adapters in :mod:`~zephon_collate.layouts.presets`;
  :mod:`~zephon_collate.layouts.forest` shares the prefixes and lays the trees out).

:mod:`~zephon_collate.layouts.plan` runs a chain (on the host, eagerly or compiled) and
:mod:`~zephon_collate.layouts.stack` lays ragged fields out in rows.
"""
