"""The demo's training run: corpus -> records -> ``pack_flat`` -> DataLoader + ``Collator`` -> model.

``run_demo(DemoConfig())`` is ``python -m demo demo``:

1. documents from the standard library (or ``--corpus``), two mixture
   components, tokenized into records with metadata (:mod:`.corpus`);
2. :func:`~zephon_collate.pack_flat` packs them into rows of ``seq_len + 1``
   tokens (best fit), each document a segment with restarting positions
   (:mod:`.pipeline`);
3. a ``DataLoader`` with worker processes runs :meth:`Collator.stack` (read,
   check, stack on the CPU) and the main process :meth:`Collator.finish`
   (to the device, labels, loss mask, EOS mask, positions, ``cu_seqlens``,
   padding mask; :func:`~.pipeline.make_collator`);
4. :class:`~demo.model.DocumentTransformer` trains with AdamW,
   its attention restricted to each document by the collator's positions.

It shows a progress bar (loss, real tokens per second, padding), prints a
summary, and writes ``loss_curve.png`` to ``out`` (:mod:`.report`).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from demo.corpus import CHAT
from demo.model import DocumentTransformer, ModelConfig
from demo.pipeline import batches as stacked_batches
from demo.pipeline import make_collator, pack_rows
from demo.report import DemoResult, plot_losses, progress, sample, summary
from demo.tokenizer import VOCAB_SIZE
from zephon_collate.core.keys import IGNORE_INDEX
from zephon_collate.functional.attention import segment_ids_from_positions

__all__ = ["DemoConfig", "cpu_threads", "run_demo"]


@dataclass
class DemoConfig:
    """Options of the demo (the CLI flags of ``python -m demo demo``)."""

    corpus: str | None = None
    seq_len: int = 256
    steps: int = 200
    batch_size: int = 12
    device: str | None = None
    compile: bool = False
    out: str = "out"
    lr: float = 3e-3
    warmup: int = 20
    dim: int = 128
    layers: int = 4
    heads: int = 4
    workers: int = 2
    eval_rows: int = 32
    eval_every: int = 25
    seed: int = 0
    progress: bool = True
    sample_bytes: int = 120
    threads: int | None = None


def _loss(model: Callable[..., torch.Tensor], batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the supervised labels, and the logits."""
    segment_ids = segment_ids_from_positions(batch["positions"], batch["padding_mask"])
    logits = model(batch["input_ids"], batch["positions"], segment_ids)
    total = F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / max(int(batch["num_valid_tokens"]), 1), logits


@torch.no_grad()
def _evaluate(model: torch.nn.Module, batches: list[dict[str, Any]], autocast: Any) -> float:
    model.eval()
    total = count = 0.0
    for batch in batches:
        with autocast():
            loss, _ = _loss(model, batch)
        total += float(loss) * int(batch["num_valid_tokens"])
        count += int(batch["num_valid_tokens"])
    model.train()
    return total / max(count, 1)


def _threads_note(device: torch.device) -> str:
    if device.type != "cpu":
        return ""
    count = torch.get_num_threads()
    return f" ({count} thread{'' if count == 1 else 's'})"


def cpu_threads() -> int:
    """The demo's default CPU threads: one core fewer than this process may use (at least 1).

    The spare core serves the DataLoader workers and whatever else runs: a
    torch thread that has to share its core stalls every other thread at each
    operation, which slows a small model down many times over.
    """
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available - 1)


def run_demo(config: DemoConfig, log: Any = print) -> DemoResult:
    """Train the demo model as ``config`` says; print progress and a summary through ``log``.

    On the CPU it runs with ``config.threads`` torch threads (default
    :func:`cpu_threads`), and restores the process's setting when done.
    """
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(config.threads or cpu_threads())
    try:
        return _run(config, device, log)
    finally:
        torch.set_num_threads(threads)


def _run(config: DemoConfig, device: torch.device, log: Any) -> DemoResult:
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    rows_wanted = config.steps * config.batch_size + config.eval_rows
    rows, documents, left_out = pack_rows(config.corpus, config.seq_len, rows_wanted, config.seed)
    eval_count = min(config.eval_rows, len(rows) // 5)
    train_rows, eval_rows = rows[: len(rows) - eval_count], rows[len(rows) - eval_count :]
    chat = sum(1 for d in documents if d.component == CHAT)
    source = "the Python standard library" if config.corpus is None else config.corpus
    log(
        f"corpus: {len(documents):,} documents from {source} ({len(documents) - chat:,} source blocks, "
        f"{chat:,} docstring->body examples) packed into {len(train_rows):,} training rows and "
        f"{len(eval_rows)} held-out rows of {config.seq_len + 1} tokens"
        + (f"; {left_out:,} chat examples longer than a row left out" if left_out else "")
    )
    collator = make_collator(device, config.compile)
    model = DocumentTransformer(
        ModelConfig(vocab_size=VOCAB_SIZE, dim=config.dim, layers=config.layers, heads=config.heads)
    ).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    log(
        f"model: {parameters / 1e6:.2f}M parameters ({config.layers} layers, dim {config.dim}) on {device}"
        f"{_threads_note(device)}; {config.steps} steps "
        f"of {config.batch_size} x {config.seq_len} tokens, {config.workers} DataLoader workers"
    )
    step_model = torch.compile(model) if config.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.1, betas=(0.9, 0.95))

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    cuda = device.type == "cuda"
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if cuda else nullcontext

    eval_batches = [
        collator(eval_rows[i : i + config.batch_size]) for i in range(0, len(eval_rows), config.batch_size)
    ]
    result = DemoResult(config.steps, [], [], 0, 0, 0, {}, 0.0, str(device), model, None)
    if eval_batches:
        result.eval_batch = eval_batches[0]
        result.eval_losses.append((0, _evaluate(model, eval_batches, autocast)))
    batches = stacked_batches(train_rows, config, collator, pin=device.type == "cuda")
    bar = progress(config.steps, config.progress)
    train_start = time.perf_counter()
    for step in range(1, config.steps + 1):
        stacked = next(batches)
        for meta in stacked.metas:
            for component, count in (meta.component_token_counts or {}).items():
                result.component_tokens[component] = result.component_tokens.get(component, 0) + count
        batch = collator.finish(stacked)
        with autocast():
            loss, _ = _loss(step_model, batch)
        optimizer.zero_grad(set_to_none=True)
        cast(Any, loss).backward()  # torch types Tensor.backward loosely
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        result.losses.append(loss.detach().item())
        padding = int(batch["padding_mask"].sum())
        result.tokens += batch["input_ids"].numel()
        result.real_tokens += batch["input_ids"].numel() - padding
        result.supervised_tokens += int(batch["num_valid_tokens"])
        if eval_batches and (step % config.eval_every == 0 or step == config.steps):
            result.eval_losses.append((step, _evaluate(model, eval_batches, autocast)))
        elapsed = time.perf_counter() - train_start
        bar.set_postfix_str(
            f"loss {result.losses[-1]:.3f}, {result.real_tokens / elapsed:,.0f} tok/s, "
            f"padding {1 - result.real_tokens / result.tokens:.1%}",
            refresh=False,
        )
        bar.update()
    bar.close()
    batches.close()  # shuts the workers down
    result.sample = sample(model, eval_rows, config.sample_bytes, device)
    result.seconds = time.perf_counter() - started
    result.plot = plot_losses(
        result,
        Path(config.out) / "loss_curve.png",
        f"zephon_collate demo: {parameters / 1e6:.2f}M-parameter byte-level LM, "
        f"{config.batch_size} x {config.seq_len} tokens per step, {device}",
    )
    for line in summary(result, train_rows):
        log(line)
    return result
