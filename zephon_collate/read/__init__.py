"""The door: every input read once into one columnar type, and checked there.

- :mod:`.columns`: :class:`~.columns.Ragged` (values and offsets) and :class:`~.columns.Batch`, the
  columnar type every layout reads; how a value becomes a row.
- :mod:`.rows`: records, payload dicts, Hugging Face examples and token rows.
- :mod:`.arrow`: Arrow tables, ``datasets`` batches and ``(values, offsets)`` pairs.
- :mod:`.rules`: the checks, each written once.
- :mod:`.fields`: float fields (``FloatField``), declared once and read the same everywhere.
"""
