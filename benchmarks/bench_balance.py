"""Benchmark balanced ranks: per-slot cost imbalance of the planner beside today's packing and other balancers.

A simulation over document lengths (no model runs) with a Llama-3-8B-shaped cost model
(``CostModel.from_model``: hidden 4096, 32 layers, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary
128,256), eight data-parallel ranks, two length distributions:

(a) lognormal, median 700, sigma 0.9 (clipped to 8..4,096), 10% of documents at 4,096 (TRL's packing
    benchmark shape); micro-batches of 16,384 tokens (padding-free) or 4 rows of 4,096, 8 micro-batches
    per step: 1,048,576 tokens a step.
(b) a long-context mix: 60% lognormal (median 1,500, sigma 1.0), 40% lognormal (median 16,384,
    sigma 1.2), clipped to 128..131,072 (1.7% at 131,072); micro-batches of 655,360 tokens (five of the
    longest documents) or 5 rows of 131,072, 2 micro-batches per step: 10,485,760 tokens a step.

Methods, on the same documents:

* ``balanced``: ``plan_balance`` through ``BalanceSchedule`` (windows filled to a step, what does not fit
  waits for the next window); ``seed only`` is the same without the swap refinement (``swap_rounds=0``).
* ``greedy rows`` / ``best-fit rows``: today's packing (``pack_flat``'s greedy and best-fit-decreasing
  over buffers of 1,024 documents, mirrored on lengths and checked equal to the packer's row engine)
  into fixed rows, dealt round-robin to the ranks, ``rows`` consecutive rows per micro-batch.
* ``token KK``: verl / OpenRLHF-style: Karmarkar-Karp (largest differencing) of each window's documents
  over the ranks by token count, then each rank's documents into ``max(ceil(tokens / max_tokens))``
  micro-batches by Karmarkar-Karp again, largest first; the budget is not enforced (violations counted).
  ``cost KK`` is the same over the cost model's ``a * L + b * L**2`` (verl's workload balancing): each
  rank's total is balanced, its micro-batches are not aligned with the other ranks'.
* ``longest-first L^2``: documents by length, descending, each to the rank with the least sum of squared
  lengths (TRL async GRPO style); each rank's documents then fill micro-batches in that order; ranks
  with fewer micro-batches idle in the slots they lack (cost 0).

"micro-batches a step" and "fill" (tokens per micro-batch over the budget) show what a method spends:
``cost KK`` takes as many micro-batches as its fullest rank needs (so they are less full), ``cost KK, the
step's micro-batches`` the step's ``micro_batches``, as the planner does. Imbalance of a slot: the costliest rank's modelled cost over the
mean rank's; lower bound:
``max(max_i c_i, sum c / ranks) / (sum c / ranks)`` over the slot's documents. Planning time: per
global batch (one window), wall clock. Bit-identical: the plans' digests of two independent runs and
of a run resumed from a saved schedule state at window 5.

Then ``hold_back`` (WLB-LLM's outlier delay) where it matters: (b) with micro-batches of 131,072 tokens.
Then a CPU measurement: a tiny document-masked transformer, forward + backward, timed on micro-batches
the planner balanced and on token-count KK ones; how closely the modelled cost predicts the measured
time, with per-document causal SDPA (what a varlen kernel computes) and with SDPA over the whole row
with ``dense_document_mask`` (which computes every score, masked or not).

Prints markdown tables and plots ``docs/images/bench_balance.png``. Example::

    python benchmarks/bench_balance.py            # about 2 minutes on 2 CPU cores
    python benchmarks/bench_balance.py --no-measure
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zephon_collate import BalanceOptions, CostModel, SampleMeta, SampleRecord
from zephon_collate.packing.reader import Document, PackOptions
from zephon_collate.packing.rows import Engine, split_document
from zephon_collate.parallel.placement import pack_rows
from zephon_collate.parallel.schedule import BalanceSchedule

RANKS = 8
LLAMA = CostModel.from_model(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256
)
IMAGE = Path(__file__).resolve().parent.parent / "docs" / "images" / "bench_balance.png"


def lengths_a(count: int, rng: np.random.Generator) -> np.ndarray:
    lengths = np.clip(np.rint(rng.lognormal(np.log(700), 0.9, count)), 8, 4096).astype(np.int64)
    lengths[rng.random(count) < 0.10] = 4096
    return lengths


def lengths_b(count: int, rng: np.random.Generator) -> np.ndarray:
    short = rng.lognormal(np.log(1500), 1.0, count)
    long = rng.lognormal(np.log(16384), 1.2, count)
    return np.clip(np.rint(np.where(rng.random(count) < 0.6, short, long)), 128, 131072).astype(np.int64)


CASES = {
    "a": {"lengths": lengths_a, "max_tokens": 16384, "rows": 4, "seq_len": 4096, "micro_batches": 8},
    "b": {"lengths": lengths_b, "max_tokens": 655360, "rows": 5, "seq_len": 131072, "micro_batches": 2},
}


# --- our planner -----------------------------------------------------------------------------------


def run_balanced(lengths: np.ndarray, options: BalanceOptions, windows: int) -> dict[str, Any]:
    """Plan ``windows`` steps through a BalanceSchedule; per-slot metrics, times, digests."""
    schedule = BalanceSchedule(options, RANKS)
    cursor, plans, seconds = 0, [], []
    ends = np.cumsum(lengths)
    for _ in range(windows):
        taken = int(ends[cursor - 1]) if cursor else 0
        end = int(np.searchsorted(ends, taken + schedule.room(), side="left")) + 1
        keys = list(range(cursor, end))
        start = time.perf_counter()
        plan = schedule.plan(keys, lengths[cursor:end].tolist())
        seconds.append(time.perf_counter() - start)
        plans.append(plan)
        cursor = end
    imbalance = np.concatenate([plan.imbalance() for plan in plans])
    bound = np.concatenate([plan.lower_bound() for plan in plans])
    budget = options.micro_batch_tokens
    computed = sum(int(plan.computed.sum()) for plan in plans)
    padding = (computed - sum(int(plan.tokens.sum()) for plan in plans)) / computed
    return {
        "imbalance": imbalance,
        "bound": bound,
        "padding": padding,
        "tokens": np.concatenate([plan.token_spread() for plan in plans]),
        "seconds": seconds,
        "violations": 0,
        "plans": plans,
        "documents": cursor,
        "per_step": float(np.mean([plan.num_slots for plan in plans])),
        "fill": float(np.mean([plan.tokens.mean() / budget for plan in plans])),
    }


def identical_and_resumable(lengths: np.ndarray, options: BalanceOptions, windows: int) -> bool:
    """Two independent runs, and a run resumed at window 5 from a saved state, give the same plans."""

    def digests(resume_at: int | None) -> list[str]:
        schedule, cursor, out = BalanceSchedule(options, RANKS), 0, []
        ends = np.cumsum(lengths)
        for window in range(windows):
            if window == resume_at:
                state = schedule.state_dict()
                schedule = BalanceSchedule(options, RANKS)
                schedule.load_state_dict(state)
            taken = int(ends[cursor - 1]) if cursor else 0
            end = int(np.searchsorted(ends, taken + schedule.room(), side="left")) + 1
            out.append(schedule.plan(list(range(cursor, end)), lengths[cursor:end].tolist()).digest())
            cursor = end
        return out

    first = digests(None)
    return first == digests(None) == digests(5)


# --- baselines -------------------------------------------------------------------------------------


def cost_of(lengths: np.ndarray) -> np.ndarray:
    return LLAMA.costs(lengths)


def greedy_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Next-fit rows, as the packer's greedy strategy builds them."""
    rows: list[list[int]] = []
    used = seq_len
    for i, size in enumerate(lengths.tolist()):
        if used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += size
    return rows


def best_fit_rows(lengths: np.ndarray, seq_len: int, buffer: int = 1024) -> list[list[int]]:
    """Best-fit-decreasing over consecutive buffers, as the packer's best_fit strategy builds them."""
    rows: list[list[int]] = []
    for start in range(0, lengths.size, buffer):
        chunk = pack_rows(lengths[start : start + buffer], seq_len)
        rows += [[start + i for i in row] for row in chunk]
    return rows


def check_row_mirrors(lengths: np.ndarray, seq_len: int) -> None:
    """The mirrors above place documents exactly as the packer's row Engine does."""
    options = PackOptions.create("bench", seq_len=seq_len, pad_token_id=0, buffer_size=1024)
    tokens = np.zeros(int(lengths.max()), np.int64)  # documents are views of one array: no copies
    for best_fit, mirror in ((False, greedy_rows), (True, best_fit_rows)):
        engine = Engine(seq_len, best_fit, 1024)
        for i, size in enumerate(lengths.tolist()):
            record = SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": tokens[:size]})
            engine.push(split_document(record, i, Document(tokens[:size], {}, None, None), options))
        engine.flush()
        rows = [[piece.base.sample_id[2] for piece in row] for row in engine.ready]
        assert [sorted(r) for r in rows] == [sorted(r) for r in mirror(lengths, seq_len)], mirror.__name__


def dealt_round_robin(
    lengths: np.ndarray, rows: list[list[int]], per_cell: int, seq_len: int
) -> dict[str, Any]:
    """Rows dealt round-robin to the ranks, ``per_cell`` consecutive rows a micro-batch; full slots only."""
    costs = cost_of(lengths)
    fills = np.array([int(lengths[row].sum()) for row in rows])
    pads = seq_len - fills
    row_cost = np.array([int(costs[row].sum()) for row in rows]) + LLAMA.costs(pads)
    row_max = np.array([int(costs[row].max()) for row in rows])
    slots = len(rows) // (RANKS * per_cell)
    used = slots * RANKS * per_cell
    # row j goes to rank j % RANKS; that rank's k-th micro-batch holds its rows k*per_cell .. +per_cell
    index = np.arange(used).reshape(slots, per_cell, RANKS)  # [slot, row in cell, rank]
    cell_cost = row_cost[index].sum(axis=1)
    cell_tokens = fills[index].sum(axis=1)
    padding = 1 - fills[:used].sum() / (used * seq_len)
    metrics = slot_metrics(cell_cost, row_max[index].max(axis=(1, 2)), cell_tokens, padding)
    metrics["fill"] = 1 - padding
    return metrics


def slot_metrics(
    cell_cost: np.ndarray, largest: np.ndarray, cell_tokens: np.ndarray, padding: float
) -> dict[str, Any]:
    mean = cell_cost.mean(axis=1)
    return {
        "imbalance": cell_cost.max(axis=1) / mean,
        "bound": np.maximum(largest, mean) / mean,
        "padding": padding,
        "tokens": cell_tokens.max(axis=1) / np.maximum(cell_tokens.mean(axis=1), 1),
        "seconds": [],
        "violations": 0,
        "per_step": None,
        "fill": 0.0,
    }


def karmarkar_karp(values: list[int], parts: int) -> list[list[int]]:
    """Largest differencing: partitions of ``range(len(values))`` into ``parts``, sums balanced."""
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, value in enumerate(values):
        state = [(value, [i])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-value, i, state))
    counter = len(values)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second), strict=True)]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [items for _, items in heap[0][2]] if heap else [[] for _ in range(parts)]


def windows_of(lengths: np.ndarray, capacity: int, windows: int) -> list[np.ndarray]:
    """Consecutive windows of documents, each reaching ``capacity`` tokens (no carry)."""
    ends = np.cumsum(lengths)
    cuts = np.minimum(
        np.searchsorted(ends, capacity * np.arange(1, windows + 1), side="left") + 1, lengths.size
    )
    spans = zip([0, *cuts[:-1].tolist()], cuts.tolist(), strict=True)
    return [np.arange(start, end) for start, end in spans if end > start]


def per_rank_baseline(
    lengths: np.ndarray,
    windows: list[np.ndarray],
    max_tokens: int,
    split: Callable[[np.ndarray], list[list[int]]],
) -> dict[str, Any]:
    """Slots from a method that gives each rank its documents, then cuts them into micro-batches."""
    costs = cost_of(lengths)
    cells_cost, cells_tokens, largest, seconds, violations, cells = [], [], [], [], 0, 0
    for window in windows:
        start = time.perf_counter()
        ranks = split(window)  # per rank: a list of micro-batches (lists of document indices)
        seconds.append(time.perf_counter() - start)
        slots = max(len(rank) for rank in ranks)
        for slot in range(slots):
            cell = [rank[slot] if slot < len(rank) else [] for rank in ranks]
            cells_cost.append([int(costs[c].sum()) if c else 0 for c in cell])
            cells_tokens.append([int(lengths[c].sum()) if c else 0 for c in cell])
            largest.append(max(int(costs[c].max()) for c in cell if c))
            violations += sum(tokens > max_tokens for tokens in cells_tokens[-1])
            cells += RANKS
    metrics = slot_metrics(np.array(cells_cost), np.array(largest), np.array(cells_tokens), 0.0)
    metrics["seconds"], metrics["violations"] = seconds, violations / cells
    metrics["per_step"] = len(cells_cost) / len(windows)
    metrics["fill"] = float(np.mean(cells_tokens)) / max_tokens
    return metrics


def token_kk(
    lengths: np.ndarray, max_tokens: int, weights: np.ndarray | None = None, micro_batches: int | None = None
) -> Callable[[np.ndarray], list[list[list[int]]]]:
    """KK over ranks, then over each rank's micro-batches, by ``weights`` (default: token counts); as many
    micro-batches as the fullest rank needs, or ``micro_batches``."""
    values = lengths if weights is None else weights

    def split(window: np.ndarray) -> list[list[list[int]]]:
        sizes, weight = lengths[window].tolist(), values[window].tolist()
        ranks = karmarkar_karp(weight, RANKS)
        count = micro_batches or max(-(-sum(sizes[i] for i in rank) // max_tokens) for rank in ranks)
        out = []
        for rank in ranks:
            parts = karmarkar_karp([weight[i] for i in rank], count)
            parts.sort(key=lambda part: -sum(weight[rank[i]] for i in part))
            out.append([[int(window[rank[i]]) for i in part] for part in parts])
        return out

    return split


def longest_first_squares(
    lengths: np.ndarray, max_tokens: int
) -> Callable[[np.ndarray], list[list[list[int]]]]:
    def split(window: np.ndarray) -> list[list[list[int]]]:
        order = window[np.argsort(-lengths[window], kind="stable")]
        heap = [(0, rank) for rank in range(RANKS)]
        ranks: list[list[int]] = [[] for _ in range(RANKS)]
        for doc in order.tolist():
            load, rank = heapq.heappop(heap)
            ranks[rank].append(doc)
            heapq.heappush(heap, (load + int(lengths[doc]) ** 2, rank))
        out = []
        for docs in ranks:
            micro: list[list[int]] = [[]]
            used = 0
            for doc in docs:
                if used + int(lengths[doc]) > max_tokens:
                    micro.append([])
                    used = 0
                micro[-1].append(doc)
                used += int(lengths[doc])
            out.append(micro)
        return out

    return split


# --- the table -------------------------------------------------------------------------------------


def row(name: str, mode: str, metrics: dict[str, Any]) -> str:
    imbalance, bound = metrics["imbalance"], metrics["bound"]
    times = metrics["seconds"]
    timing = f"{statistics.median(times) * 1e3:.1f} ({max(times) * 1e3:.1f})" if times else "-"
    padding = f"{metrics['padding']:.2%}" if mode == "fixed rows" else "-"
    violations = f"{metrics['violations']:.1%}" if metrics["violations"] else "0"
    return (
        f"| {name} | {mode} | {imbalance.mean():.4f} | {np.percentile(imbalance, 99):.4f} | "
        f"{imbalance.max():.3f} | {bound.mean():.4f} | {imbalance.mean() / bound.mean():.4f} | {padding} | "
        f"{metrics['per_step']:.2f} | {metrics['fill']:.1%} | {metrics['tokens'].mean():.3f} | {violations} | "
        f"{timing} |"
    )


def simulate(case: str, windows: int, seed: int) -> dict[str, dict[str, Any]]:
    spec = CASES[case]
    rng = np.random.default_rng(seed)
    lengths = spec["lengths"](windows * 1000 + 2000, rng)  # about 800 documents fill a step in both
    free = BalanceOptions(cost=LLAMA, micro_batches=spec["micro_batches"], max_tokens=spec["max_tokens"])
    rows = BalanceOptions(
        cost=LLAMA, micro_batches=spec["micro_batches"], rows=spec["rows"], seq_len=spec["seq_len"]
    )
    seed_only = BalanceOptions(
        cost=LLAMA, micro_batches=spec["micro_batches"], max_tokens=spec["max_tokens"], swap_rounds=0
    )
    seed_only_rows = BalanceOptions(
        cost=LLAMA,
        micro_batches=spec["micro_batches"],
        rows=spec["rows"],
        seq_len=spec["seq_len"],
        swap_rounds=0,
    )
    results: dict[str, dict[str, Any]] = {}
    results["balanced|padding-free"] = run_balanced(lengths, free, windows)
    results["balanced, seed only|padding-free"] = run_balanced(lengths, seed_only, windows)
    results["balanced|fixed rows"] = run_balanced(lengths, rows, windows)
    results["balanced, seed only|fixed rows"] = run_balanced(lengths, seed_only_rows, windows)
    used = max(results["balanced|padding-free"]["documents"], results["balanced|fixed rows"]["documents"])
    docs = lengths[:used]
    check_row_mirrors(lengths[:3000], spec["seq_len"])
    results["greedy rows, round-robin|fixed rows"] = dealt_round_robin(
        docs, greedy_rows(docs, spec["seq_len"]), spec["rows"], spec["seq_len"]
    )
    results["best-fit rows, round-robin|fixed rows"] = dealt_round_robin(
        docs, best_fit_rows(docs, spec["seq_len"]), spec["rows"], spec["seq_len"]
    )
    for key in ("greedy rows, round-robin|fixed rows", "best-fit rows, round-robin|fixed rows"):
        results[key]["per_step"] = spec["micro_batches"]  # each step takes ranks x micro_batches x rows rows
    capacity = free.step_tokens(RANKS)
    window_list = windows_of(docs, capacity, windows)
    results["token KK (verl-style)|padding-free"] = per_rank_baseline(
        docs, window_list, spec["max_tokens"], token_kk(docs, spec["max_tokens"])
    )
    results["cost KK (verl workload-style)|padding-free"] = per_rank_baseline(
        docs, window_list, spec["max_tokens"], token_kk(docs, spec["max_tokens"], cost_of(docs))
    )
    fixed_count = token_kk(docs, spec["max_tokens"], cost_of(docs), spec["micro_batches"])
    results["cost KK, the step's micro-batches|padding-free"] = per_rank_baseline(
        docs, window_list, spec["max_tokens"], fixed_count
    )
    results["longest-first L^2 (TRL-style)|padding-free"] = per_rank_baseline(
        docs, window_list, spec["max_tokens"], longest_first_squares(docs, spec["max_tokens"])
    )
    results["identical"] = {
        "padding-free": identical_and_resumable(lengths, free, min(windows, 12)),
        "fixed rows": identical_and_resumable(lengths, rows, min(windows, 12)),
    }
    results["lengths"] = {"all": lengths}
    return results


def print_case(case: str, results: dict[str, dict[str, Any]]) -> None:
    spec = CASES[case]
    lengths = results["lengths"]["all"]
    print(
        f"\n### ({case}) median {int(np.median(lengths))}, mean {lengths.mean():.0f}, "
        f"{(lengths == lengths.max()).mean():.1%} at {int(lengths.max()):,} tokens; "
        f"{RANKS} ranks x {spec['micro_batches']} micro-batches of {spec['max_tokens']:,} tokens "
        f"(or {spec['rows']} x {spec['seq_len']:,})\n"
    )
    print(
        "| method | mode | mean max/mean | p99 | worst | lower bound | / bound | padding | "
        "micro-batches a step | fill | tokens max/mean | over budget | plan ms p50 (max) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, metrics in results.items():
        if "|" in key:
            name, mode = key.split("|")
            print(row(name, mode, metrics))
    identical = results["identical"]
    print(
        f"\nPlans bit-identical across two runs and across a resume at window 5: padding-free "
        f"{'yes' if identical['padding-free'] else 'NO'}, fixed rows {'yes' if identical['fixed rows'] else 'NO'}"
    )


def goals(all_results: dict[str, dict[str, dict[str, Any]]]) -> None:
    print("\n### Goals\n")
    print("| goal | target | (a) | (b) | met |")
    print("|---|---|---:|---:|---|")

    def both(key: str, fn: Callable[[dict[str, Any]], float]) -> tuple[float, float]:
        return fn(all_results["a"][key]), fn(all_results["b"][key])

    lines = []
    for mode in ("padding-free", "fixed rows"):
        key = f"balanced|{mode}"
        mean = both(key, lambda m: m["imbalance"].mean())
        lines.append((f"mean max/mean, {mode}", "<= 1.02", mean, all(v <= 1.02 for v in mean)))
        ratio = both(key, lambda m: m["imbalance"].mean() / m["bound"].mean())
        lines.append((f"mean / lower bound, {mode}", "<= 1.01", ratio, all(v <= 1.01 for v in ratio)))
        p99 = both(key, lambda m: float(np.percentile(m["imbalance"], 99)))
        lines.append((f"p99 max/mean, {mode}", "<= 1.05", p99, all(v <= 1.05 for v in p99)))
        ms = both(key, lambda m: statistics.median(m["seconds"]) * 1e3)
        lines.append((f"plan ms per global batch (p50), {mode}", "<= 10", ms, all(v <= 10 for v in ms)))
    padding = both("balanced|fixed rows", lambda m: m["padding"] * 100)
    lines.append(("padding %, fixed rows", "<= 1", padding, all(v <= 1 for v in padding)))
    for name, target, (a, b), met in lines:
        print(f"| {name} | {target} | {a:.4f} | {b:.4f} | {'yes' if met else 'no'} |")
    identical = all(all(r["identical"].values()) for r in all_results.values())
    print(
        f"| plans bit-identical across ranks and a resume | yes | yes | yes | {'yes' if identical else 'no'} |"
    )


def plot(all_results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for axis, case in zip(axes, ("a", "b"), strict=True):
        for key, metrics in all_results[case].items():
            if "|" not in key or "seed only" in key:
                continue
            values = metrics["imbalance"][:60]
            style = "-" if key.startswith("balanced") else "--"
            excess = np.maximum(values - 1, 1e-5)  # a perfect slot sits on the floor
            axis.plot(np.arange(values.size), excess, style, label=key.replace("|", ", "), linewidth=1.2)
        axis.set_yscale("log")
        axis.set_title(
            f"({case}) " + ("lognormal, 10% at 4,096" if case == "a" else "long-context mix to 131,072")
        )
        axis.set_xlabel("lockstep slot")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("max / mean rank cost - 1 (log; 1e-5: perfect)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    figure.suptitle("Per-slot modelled cost imbalance across 8 ranks (Llama-3-8B-shaped cost model)")
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"\nPlot: {path.relative_to(path.parent.parent.parent)}")


def hold_back_table(windows: int, seed: int) -> None:
    """(b) with micro-batches of one longest document: outliers wait up to ``hold_back`` windows."""
    lengths = lengths_b(windows * 1000 + 2000, np.random.default_rng(seed))
    print(
        "\n### Holding outliers back: (b) with micro-batches of 131,072 tokens (one longest document), "
        "8 per step\n"
    )
    print("| hold_back | mean max/mean | p99 | lower bound | documents waiting a window | plan ms p50 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for hold_back in (0, 1, 2):
        options = BalanceOptions(cost=LLAMA, micro_batches=8, max_tokens=131072, hold_back=hold_back)
        metrics = run_balanced(lengths, options, windows)
        waiting = np.mean([len(plan.held) for plan in metrics["plans"]])
        print(
            f"| {hold_back} | {metrics['imbalance'].mean():.4f} | {np.percentile(metrics['imbalance'], 99):.4f} | "
            f"{metrics['bound'].mean():.4f} | {waiting:.1f} | {statistics.median(metrics['seconds']) * 1e3:.1f} |"
        )


# --- measured on a CPU -----------------------------------------------------------------------------


def measure(seed: int) -> None:
    """Forward + backward of a tiny document-masked transformer on balanced and on token-KK micro-batches."""
    import torch.nn.functional as F
    from torch import nn

    from zephon_collate.functional.attention import dense_document_mask

    torch.set_num_threads(1)
    width, heads, layers, ffn, vocab, ranks, max_tokens, slots = 64, 4, 2, 256, 512, 4, 4096, 2
    cost = CostModel.from_model(
        hidden_size=width,
        num_layers=layers,
        num_heads=heads,
        ffn_hidden_size=ffn,
        gated=False,
        vocab_size=vocab,
    )

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width))

        def forward(self, x: torch.Tensor, documents: list[int], dense: bool) -> torch.Tensor:
            s = x.shape[1]
            q, k, v = self.qkv(x).view(1, s, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            if dense:  # the whole row's scores, masked to each document
                ids = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
                attended = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(ids[None]))
            else:  # each document's own causal attention, as a varlen kernel computes it
                parts = [
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                    for qq, kk, vv in zip(
                        q.split(documents, 2), k.split(documents, 2), v.split(documents, 2), strict=True
                    )
                ]
                attended = torch.cat(parts, dim=2)
            x = x + self.out(attended.transpose(1, 2).reshape(1, s, width))
            return x + self.mlp(x)

    torch.manual_seed(seed)
    embed, blocks, head = (
        nn.Embedding(vocab, width),
        nn.ModuleList(Block() for _ in range(layers)),
        nn.Linear(width, vocab),
    )

    def step_time(documents: list[int], dense: bool) -> float:
        tokens = torch.randint(0, vocab, (1, sum(documents)))
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            x = embed(tokens)
            for block in blocks:
                x = block(x, documents, dense)
            head(x).float().logsumexp(-1).sum().backward()
            best = min(best, time.perf_counter() - start)
        return best

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(400), 1.1, 4000)), 32, 2048).astype(np.int64)
    options = BalanceOptions(cost=cost, micro_batches=slots, max_tokens=max_tokens)
    schedule, cursor, balanced = BalanceSchedule(options, ranks), 0, []
    ends = np.cumsum(lengths)
    for _ in range(2):
        taken = int(ends[cursor - 1]) if cursor else 0
        end = int(np.searchsorted(ends, taken + schedule.room(), side="left")) + 1
        plan = schedule.plan(list(range(cursor, end)), lengths[cursor:end].tolist())
        balanced += [[list(cell) for cell in slot] for slot in plan.cells]
        cursor = end
    used = lengths[:cursor]
    kk: list[list[list[int]]] = []
    for window in windows_of(used, options.step_tokens(ranks), 2):
        per_rank = token_kk(used, max_tokens)(window)
        kk += [
            [rank[s] if s < len(rank) else [] for rank in per_rank] for s in range(max(map(len, per_rank)))
        ]
    print(
        "\n### Measured: forward + backward on a CPU (tiny transformer: width 64, 4 heads, 2 layers, "
        f"MLP 256, vocabulary 512; {ranks} ranks x {slots} micro-batches of {max_tokens:,} tokens, "
        "documents 32..2,048)\n"
    )
    print(
        "| micro-batches | modelled max/mean | measured max/mean, per-document SDPA | measured max/mean, dense-mask SDPA |"
    )
    print("|---|---:|---:|---:|")
    samples: dict[str, list[tuple[int, int, int, float, float]]] = {}
    for name, slot_cells in (("balanced", balanced), ("token KK (verl-style)", kk)):
        modelled, varlen, dense, rows = [], [], [], []
        for cells in slot_cells:
            docs = [[int(used[i]) for i in cell] for cell in cells if cell]
            costs = [int(cost.costs(np.array(d)).sum()) for d in docs]
            times = [step_time(d, dense=False) for d in docs]
            dense_times = [step_time(d, dense=True) for d in docs]
            modelled.append(max(costs) / np.mean(costs))
            varlen.append(max(times) / np.mean(times))
            dense.append(max(dense_times) / np.mean(dense_times))
            rows += [
                (sum(d), sum(n * n for n in d), c, t, u)
                for d, c, t, u in zip(docs, costs, times, dense_times, strict=True)
            ]
        samples[name] = rows
        print(f"| {name} | {np.mean(modelled):.3f} | {np.mean(varlen):.3f} | {np.mean(dense):.3f} |")
    every = [sample for rows in samples.values() for sample in rows]
    tokens, squared, modelled_cost, varlen_time, dense_time = (
        np.array(column, float) for column in zip(*every, strict=True)
    )
    fitted = CostModel.fit(tokens.astype(int).tolist(), squared.astype(int).tolist(), varlen_time.tolist())
    r_varlen = np.corrcoef(modelled_cost, varlen_time)[0, 1]
    r_dense = np.corrcoef(modelled_cost, dense_time)[0, 1]
    r_dense_tokens = np.corrcoef(tokens**2, dense_time)[0, 1]
    predicted = np.polyval(np.polyfit(modelled_cost, varlen_time, 1), modelled_cost)
    error = np.abs(predicted - varlen_time) / varlen_time
    print(
        f"\nModelled cost against measured time over {len(every)} micro-batches: per-document SDPA r = {r_varlen:.3f} "
        f"(a linear map of the cost predicts each time within {np.median(error):.1%} median, "
        f"{error.max():.1%} worst); dense-mask SDPA r = {r_dense:.3f} with the cost, {r_dense_tokens:.3f} with "
        "tokens squared (it computes the whole row's scores, so only the token count matters)."
    )
    print(
        f"Fitted from the per-document times: CostModel(linear={fitted.linear}, quadratic={fitted.quadratic}): "
        f"{fitted.linear / fitted.quadratic:.0f} tokens of linear work per squared token, against "
        f"{cost.linear / cost.quadratic:.0f} in the FLOP model (CPU kernels are not FLOP-bound alike)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=40, help="global batches (steps) per distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU timing of a tiny model")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    print(
        f"Cost model: {LLAMA} (FLOPs per unit); {RANKS} ranks; {args.windows} global batches per distribution"
    )
    all_results = {case: simulate(case, args.windows, args.seed) for case in CASES}
    for case, results in all_results.items():
        print_case(case, results)
    goals(all_results)
    hold_back_table(args.windows, args.seed)
    if not args.no_plot:
        plot(all_results, IMAGE)
    if not args.no_measure:
        measure(args.seed)


if __name__ == "__main__":
    main()
