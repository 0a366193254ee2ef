"""The demo: a real training run of the whole package, on text every Python install has.

``python -m demo demo`` (:func:`run_demo`) packs the standard
library's source and docstring -> body chat examples (:mod:`.corpus`,
byte-level :mod:`.tokenizer`) with ``pack_flat``, collates them in DataLoader
workers with :class:`~zephon_collate.Collator`, and trains a small causal
transformer whose attention stays inside each document (:mod:`.model`,
:mod:`.pipeline`, :mod:`.train`, :mod:`.report`). See ``docs/demo.md``.
"""

from demo.corpus import CHAT, COMPONENTS, SOURCE, Document, load_documents, to_records
from demo.model import DocumentTransformer, ModelConfig
from demo.pipeline import demo_batch, make_collator, pack_rows
from demo.report import DemoResult
from demo.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, ByteTokenizer
from demo.train import DemoConfig, run_demo

__all__ = [
    "BOS",
    "CHAT",
    "COMPONENTS",
    "EOS",
    "PAD",
    "SOURCE",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DemoConfig",
    "DemoResult",
    "Document",
    "DocumentTransformer",
    "ModelConfig",
    "demo_batch",
    "load_documents",
    "make_collator",
    "pack_rows",
    "run_demo",
    "to_records",
]
