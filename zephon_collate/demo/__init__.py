"""The demo: a real training run of the whole package, on text every Python install has.

``python -m zephon_collate demo`` (:func:`run_demo`) packs the standard
library's source and docstring -> body chat examples (:mod:`.corpus`,
byte-level :mod:`.tokenizer`) with ``pack_flat``, collates them in DataLoader
workers with :class:`~zephon_collate.Collator`, and trains a small causal
transformer whose attention stays inside each document (:mod:`.model`,
:mod:`.pipeline`, :mod:`.train`, :mod:`.report`). See ``docs/demo.md``.
"""

from zephon_collate.demo.corpus import CHAT, COMPONENTS, SOURCE, Document, load_documents, to_records
from zephon_collate.demo.model import DocumentTransformer, ModelConfig
from zephon_collate.demo.pipeline import demo_batch, make_collator, pack_rows
from zephon_collate.demo.report import DemoResult
from zephon_collate.demo.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, ByteTokenizer
from zephon_collate.demo.train import DemoConfig, run_demo

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
