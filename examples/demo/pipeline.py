"""The demo's data pipeline: corpus -> packed rows -> DataLoader workers + ``Collator``.

:func:`pack_rows` tokenizes the corpus (:mod:`.corpus`, :mod:`.tokenizer`)
and packs it with :func:`~zephon_collate.pack_flat` into rows of
``seq_len + 1`` tokens, each document a segment with restarting positions.
:func:`make_collator` is the collator the demo trains with (labels, loss mask
with EOS masking, positions, ``cu_seqlens``, padding mask). The training run
(:mod:`.train`) draws its batches from a ``DataLoader`` whose worker processes
run :meth:`Collator.stack`, and calls :meth:`Collator.finish` itself.
:func:`demo_batch` is one collated batch of the same pipeline, for
``python -m demo show --demo-batch``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from demo.corpus import fields, load_documents, to_records
from demo.tokenizer import EOS, PAD, ByteTokenizer
from zephon_collate.collate.collator import Collator
from zephon_collate.collate.transfer import StackedBatch
from zephon_collate.core.records import SampleRecord
from zephon_collate.packing.pack_flat import pack_flat

if TYPE_CHECKING:
    from demo.train import DemoConfig

__all__ = ["Rows", "batches", "demo_batch", "make_collator", "pack_rows"]


class Rows(torch.utils.data.Dataset[SampleRecord]):
    """Packed rows as a map-style dataset (picklable, for worker processes)."""

    def __init__(self, rows: list[SampleRecord]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> SampleRecord:
        return self.rows[index]


def pack_rows(
    corpus: str | None, seq_len: int, rows_wanted: int, seed: int = 0
) -> tuple[list[SampleRecord], list[Any], int]:
    """About ``rows_wanted`` packed rows of ``seq_len + 1`` tokens from ``corpus``, their documents, and
    the number of chat examples left out.

    Rows hold ``seq_len + 1`` tokens so that, after the label shift, the model
    sees ``seq_len`` inputs. A chat example longer than a row (from a JSONL
    corpus; the standard library's are cut to fit) is left out and counted: cut,
    its response would be trained without its prompt.
    """
    budget = int(rows_wanted * (seq_len + 1) * 1.05)
    documents = load_documents(corpus, max_chars=seq_len - 1, budget_chars=budget, seed=seed)
    records = to_records(documents, ByteTokenizer())
    fits = [len(fields(r)["input_ids"]) <= seq_len + 1 or bool(fields(r)["loss_mask"].all()) for r in records]
    records = [record for record, keep in zip(records, fits, strict=True) if keep]
    kept = [document for document, keep in zip(documents, fits, strict=True) if keep]
    rows = pack_flat(records, seq_len + 1, pad_token_id=PAD, strategy="best_fit", buffer_size=512)
    return rows, kept, len(documents) - len(kept)


def make_collator(device: str | torch.device | None = None, compile: bool = False) -> Collator:
    """The demo's collator: labels, loss mask with EOS masking, positions, cu_seqlens, padding mask."""
    return Collator(
        device=device,
        compile=compile,
        return_labels=True,
        return_loss_mask=True,
        return_num_valid_tokens=True,
        return_cu_seqlens=True,
        return_padding_mask=True,
        eos_mask_loss=True,
        eos_token_id=EOS,
    )


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # workers only stack; leave the cores to the model


def batches(
    rows: list[SampleRecord], config: DemoConfig, collator: Collator, pin: bool
) -> Generator[StackedBatch, None, None]:
    """Stacked batches from worker processes, epoch after epoch (reshuffled each time)."""
    loader = torch.utils.data.DataLoader(
        Rows(rows),
        batch_size=config.batch_size,
        shuffle=True,
        drop_last=len(rows) >= config.batch_size,
        generator=torch.Generator().manual_seed(config.seed),
        collate_fn=collator.stack,
        num_workers=config.workers,
        persistent_workers=config.workers > 0,
        pin_memory=pin,
        worker_init_fn=_worker_init if config.workers else None,
    )
    while True:
        yield from loader


def _documents_in(row: SampleRecord) -> int:
    """How many documents (or pieces of one) a packed row holds, its padding not counted."""
    return len(row.meta.contributors)


def _shows_everything(row: SampleRecord) -> bool:
    """True for a row with a prompt (unsupervised real tokens), two or more documents, and padding."""
    padding = row.meta.padding_length or 0
    mask = fields(row).get("loss_mask")
    real = len(fields(row)["input_ids"]) - padding
    has_prompt = mask is not None and bool((np.asarray(mask[:real]) == 0).any())
    return padding > 1 and has_prompt and _documents_in(row) >= 2  # one pad token is cut by the shift


def demo_batch(
    corpus: str | None = None,
    *,
    seq_len: int = 128,
    batch_size: int = 4,
    min_documents: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """A collated batch of the demo's pipeline: rows drawn at random, as the trainer draws them.

    The first row is one that shows everything a packed batch can hold, where the
    corpus has one: a prompt (unsupervised tokens), several documents, and
    trailing padding. ``min_documents`` draws only among rows that pack at least
    that many documents (or pieces of documents), to see the packing at work.
    """
    rows, _, _ = pack_rows(corpus, seq_len, max(512, 8 * batch_size), seed)
    rows = [row for row in rows if _documents_in(row) >= min_documents] or rows
    order = [int(i) for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
    first = next((i for i in order if _shows_everything(rows[i])), order[0])
    chosen = [first, *(i for i in order if i != first)][:batch_size]
    return make_collator()([rows[i] for i in chosen])
