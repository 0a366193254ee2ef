"""Entry points over the layouts: ``Collator``, ``to_training``, the worker transfer, ``ColumnarDataset``."""
