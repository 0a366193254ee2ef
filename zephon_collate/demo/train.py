"""The demo's training run: corpus -> records -> ``pack_flat`` -> DataLoader + ``Collator`` -> model.

``run_demo(DemoConfig())`` is ``python -m zephon_collate demo``:

1. documents from the standard library (or ``--corpus``), two mixture
   components, tokenized into records with metadata (:mod:`.corpus`);
2. :func:`~zephon_collate.pack_flat` packs them into rows of ``seq_len + 1``
   tokens (best fit), each document a segment with restarting positions;
3. a ``DataLoader`` with worker processes runs :meth:`Collator.stack` (read,
   check, stack on the CPU) and the main process :meth:`Collator.finish`
   (to the device, labels, loss mask, EOS mask, positions, ``cu_seqlens``,
   padding mask);
4. :class:`~zephon_collate.demo.model.DocumentTransformer` trains with AdamW,
   its attention restricted to each document by the collator's positions.

It shows a progress bar (loss, real tokens per second, padding), prints a
summary, and writes ``loss_curve.png`` to ``out``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from zephon_collate.attention import segment_ids_from_positions
from zephon_collate.collator import Collator, StackedBatch
from zephon_collate.demo.corpus import CHAT, COMPONENTS, load_documents, to_records
from zephon_collate.demo.model import DocumentTransformer, ModelConfig
from zephon_collate.demo.tokenizer import EOS, PAD, VOCAB_SIZE, ByteTokenizer
from zephon_collate.packing import pack_flat
from zephon_collate.types import SampleRecord

__all__ = ["DemoConfig", "DemoResult", "cpu_threads", "demo_batch", "make_collator", "pack_rows", "run_demo"]

IGNORE_INDEX = -100


@dataclass
class DemoConfig:
    """Options of the demo (the CLI flags of ``python -m zephon_collate demo``)."""

    corpus: str | None = None
    seq_len: int = 256
    steps: int = 300
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


@dataclass
class DemoResult:
    """What a demo run did and measured."""

    steps: int
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    tokens: int
    real_tokens: int
    supervised_tokens: int
    component_tokens: dict[int, int]
    seconds: float
    device: str
    model: Any = None
    eval_batch: dict[str, Any] | None = None
    sample: tuple[str, str] | None = None
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last 20 steps."""
        tail = self.losses[-20:]
        return sum(tail) / len(tail)


class Rows(torch.utils.data.Dataset):
    """Packed rows as a map-style dataset (picklable, for worker processes)."""

    def __init__(self, rows: list[SampleRecord]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> SampleRecord:
        return self.rows[index]


def pack_rows(
    corpus: str | None, seq_len: int, rows_wanted: int, seed: int = 0
) -> tuple[list[SampleRecord], list[Any]]:
    """About ``rows_wanted`` packed rows of ``seq_len + 1`` tokens from ``corpus``, and their documents.

    Rows hold ``seq_len + 1`` tokens so that, after the label shift, the model
    sees ``seq_len`` inputs. Chat examples are at most one row long.
    """
    budget = int(rows_wanted * (seq_len + 1) * 1.05)
    documents = load_documents(corpus, max_chars=seq_len - 1, budget_chars=budget, seed=seed)
    records = to_records(documents, ByteTokenizer())
    rows = pack_flat(records, seq_len + 1, pad_token_id=PAD, strategy="best_fit", buffer_size=512)
    return rows, documents


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


def _batches(
    rows: list[SampleRecord], config: DemoConfig, collator: Collator, pin: bool
) -> Iterator[StackedBatch]:
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


def demo_batch(
    corpus: str | None = None,
    *,
    seq_len: int = 128,
    batch_size: int = 4,
    min_documents: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """A collated batch of the demo's pipeline: rows drawn at random, as the trainer draws them.

    ``min_documents`` draws only among rows that pack at least that many
    documents (or pieces of documents), to see the packing at work.
    """
    rows, _ = pack_rows(corpus, seq_len, max(512, 8 * batch_size), seed)
    rows = [row for row in rows if _documents_in(row) >= min_documents] or rows
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return make_collator()([rows[int(i)] for i in order[:batch_size]])


def _loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
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


class _PlainProgress:
    """A stand-in for tqdm when it is not installed: one line per tenth of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.postfix = total, enabled, 0, ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self) -> None:
        self.done += 1
        if self.enabled and (self.done % max(1, self.total // 10) == 0 or self.done == self.total):
            print(f"step {self.done}/{self.total}: {self.postfix}", flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, enabled)
    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)


def _plot(result: DemoResult, path: Path, title: str) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        result.notes.append("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return None
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = range(1, len(result.losses) + 1)
    axes.plot(steps, result.losses, color="#90caf9", lw=0.8, label="train (per step)")
    window = 20
    smooth = [
        sum(result.losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(result.losses))
    ]
    axes.plot(steps, smooth, color="#1565c0", lw=1.8, label=f"train ({window}-step mean)")
    if result.eval_losses:
        x, y = zip(*result.eval_losses, strict=True)
        axes.plot(x, y, "o-", color="#e65100", lw=1.2, ms=4, label="held-out rows")
    axes.axhline(math.log(VOCAB_SIZE), color="#9e9e9e", ls=":", lw=1, label="uniform guess (ln 259)")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("cross-entropy per supervised byte (nats)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


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
    rows, documents = pack_rows(config.corpus, config.seq_len, rows_wanted, config.seed)
    eval_count = min(config.eval_rows, len(rows) // 5)
    train_rows, eval_rows = rows[: len(rows) - eval_count], rows[len(rows) - eval_count :]
    chat = sum(1 for d in documents if d.component == CHAT)
    source = "the Python standard library" if config.corpus is None else config.corpus
    log(
        f"corpus: {len(documents):,} documents from {source} ({len(documents) - chat:,} source blocks, "
        f"{chat:,} docstring->body examples) packed into {len(train_rows):,} training rows and "
        f"{len(eval_rows)} held-out rows of {config.seq_len + 1} tokens"
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
    batches = _batches(train_rows, config, collator, pin=device.type == "cuda")
    bar = _progress(config.steps, config.progress)
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
        loss.backward()
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
    result.sample = _sample(model, eval_rows, config.sample_bytes, device)
    result.seconds = time.perf_counter() - started
    result.plot = _plot(
        result,
        Path(config.out) / "loss_curve.png",
        f"zephon_collate demo: {parameters / 1e6:.2f}M-parameter byte-level LM, "
        f"{config.batch_size} x {config.seq_len} tokens per step, {device}",
    )
    for line in summary(result, train_rows):
        log(line)
    return result


def _sample(
    model: DocumentTransformer, rows: list[SampleRecord], length: int, device: torch.device
) -> tuple[str, str] | None:
    """A greedy continuation of a held-out chat example's prompt: ``(prompt, continuation)``."""
    if length <= 0:
        return None
    tokenizer = ByteTokenizer()
    for row in rows:
        mask, ids, positions = (row.payload[k] for k in ("loss_mask", "input_ids", "positions"))
        starts = [int(i) for i in (positions == 0).nonzero()[0]] + [len(ids)]
        for start, end in itertools.pairwise(starts):
            segment = mask[start:end]
            if ids[start] == 1 and segment.any() and not segment[0]:  # a whole chat example
                prompt = ids[start : start + int(segment.argmax())]
                model.eval()
                new = model.generate(torch.as_tensor(prompt, device=device), length, stop_token=EOS)
                model.train()
                return tokenizer.decode(prompt[1:]), tokenizer.decode(new)
    return None


def summary(result: DemoResult, train_rows: list[SampleRecord]) -> list[str]:
    """The closing lines of the demo."""
    minutes, seconds = divmod(result.seconds, 60)
    epochs = result.tokens / max(1, len(train_rows) * (len(train_rows[0].payload["input_ids"]) - 1))
    lines = [
        "",
        f"done in {int(minutes)}m{seconds:04.1f}s on {result.device}: {result.steps} steps, "
        f"{result.tokens:,} input tokens seen ({epochs:.2f} epochs), {result.real_tokens:,} real "
        f"({1 - result.real_tokens / max(1, result.tokens):.1%} padding), "
        f"{result.supervised_tokens:,} supervised labels",
        "tokens per mixture component (the rows' component_token_counts):",
    ]
    total = sum(result.component_tokens.values())
    for component, count in sorted(result.component_tokens.items()):
        name = COMPONENTS.get(component, str(component))
        lines.append(f"  {component} {name:<16} {count:>12,} ({count / max(1, total):.0%})")
    first_eval = result.eval_losses[0][1] if result.eval_losses else float("nan")
    last_eval = result.eval_losses[-1][1] if result.eval_losses else float("nan")
    lines.append(
        f"loss: {result.losses[0]:.3f} -> {result.final_loss:.3f} (train, mean of the last 20 steps); "
        f"held-out {first_eval:.3f} -> {last_eval:.3f} (uniform guess {math.log(VOCAB_SIZE):.3f})"
    )
    if result.sample is not None:
        prompt, continuation = result.sample
        tail = "\n".join(prompt.rstrip("\n").splitlines()[-3:])
        lines += ["sample: a held-out docstring prompt (last lines) and the model's greedy body:", tail]
        lines += [f"  | {line}".rstrip() for line in continuation.replace("<eos>", "").splitlines()[:6]]
    if result.plot is not None:
        lines.append(f"loss curve: {result.plot}")
    lines += result.notes
    return lines
