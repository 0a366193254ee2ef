"""What a demo run measured, and how it is shown: progress bar, greedy sample, loss curve, summary.

:class:`DemoResult` holds a run's losses (per step, and on held-out rows),
its token counts (input, real, supervised, per mixture component) and its
time. While the run trains, a tqdm bar shows the loss, the real tokens per
second and the padding (without tqdm, one line per tenth of the run); at the
end the model continues a held-out docstring prompt, ``loss_curve.png`` is
drawn (with matplotlib) and :func:`summary` gives the closing lines.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from demo.corpus import COMPONENTS, fields
from demo.model import DocumentTransformer
from demo.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer
from zephon_collate.core.records import SampleRecord
from zephon_collate.functional import segment_starts

__all__ = ["DemoResult", "plot_losses", "progress", "sample", "summary"]


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


def progress(total: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type stubs
    except ImportError:
        return _PlainProgress(total, enabled)
    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)


def plot_losses(result: DemoResult, path: Path, title: str) -> Path | None:
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


def sample(
    model: DocumentTransformer, rows: list[SampleRecord], length: int, device: torch.device
) -> tuple[str, str] | None:
    """A greedy continuation of a held-out chat example's prompt: ``(prompt, continuation)``."""
    if length <= 0:
        return None
    tokenizer = ByteTokenizer()
    for row in rows:
        mask, ids, positions = (fields(row)[k] for k in ("loss_mask", "input_ids", "positions"))
        starts = [int(i) for i in segment_starts(torch.as_tensor(positions)).nonzero().reshape(-1)] + [
            len(ids)
        ]
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
    epochs = result.tokens / max(1, len(train_rows) * (len(fields(train_rows[0])["input_ids"]) - 1))
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
