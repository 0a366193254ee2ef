"""aggregate_loss and global_loss_count against their peers' own code, over whole optimizer steps.

The same per-token losses and masks, with an all-masked completion (what TRL's
``mask_truncated_completions=True`` leaves of a truncated one, ``grpo_trainer.py`` lines 2487-2495), spread
over 2 ranks x 2 micro-batches, go

- to TRL 1.16's own ``GRPOTrainer._compute_loss``, called once per micro-batch and rank, for every
  ``loss_type`` (its forward, ``_get_per_token_logps_and_entropies``, returns given log-probs; with the old
  log-probs equal to them every ratio is 1 and TRL's ``per_token_loss`` is the given one: ``-advantages``,
  or ``advantages`` for cispo and vespo, whose loss multiplies by the log-probs, -1 here), its step loss the
  mean over ranks (DDP's) of the sum over micro-batches;
- to verl 0.10's ``agg_loss`` (``verl/trainer/ppo/core_algos.py`` lines 1140-1206 at
  verl-project/verl@1dda039b, transcribed below; the released 0.9.1 itself runs in ``test_verl_real.py``), with the global batch
  info verl's trainer passes (``batch_num_tokens`` all-reduced, ``global_batch_size`` the mini-batch's
  rows, ``dp_size``);
- and packed by ``Collator.for_rollouts`` in four layouts, to ``aggregate_loss`` with the call the docs
  give for that peer (``PEER_CALLS``).

Each must give the peer's number: 1e-12 in float64, 1e-6 in float32. A hypothesis property checks every
mode and choice against the formulas over plain lists, for random masks and micro-batch splits; a
torchrun check runs the collectives on 2 ranks (this file is its script).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, aggregate_loss, global_loss_count, unpack
from zephon_collate.losses import MODES

LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padded-shared": {"pad_token_id": 0, "shared_prompt": True},
    "flat": {"padding_free": True},
    "flat-shared-pad16": {
        "padding_free": True,
        "shared_prompt": True,
        "pad_token_id": 0,
        "pad_to_multiple_of": 16,
    },
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
GARBAGE = 50.0  # the per-token loss where nothing is supervised: it would show if read
MAX_COMPLETION_LENGTH = 6
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@dataclass
class Row:
    """A rollout: prompt and completion tokens, the completion's loss mask and per-token loss."""

    prompt: list[int]
    completion: list[int]
    mask: list[int]
    loss: list[float]


Step = list[list[list[Row]]]  # [rank][micro-batch] -> rows


def make_step(seed: int, ranks: int = 2, micro_batches: int = 2, rows: int = 3) -> Step:
    """Rollouts of a step: two prompts, completions of 1 to 6 tokens (uneven token counts in every
    micro-batch), one all-masked completion (truncated at 6 tokens) per rank and one completion with a
    hole in its mask (TRL's ``tool_mask``)."""
    rng = random.Random(seed)
    prompts = [[1, 2, 3], [4, 5]]
    step: Step = []
    for rank in range(ranks):
        micro = []
        for m in range(micro_batches):
            out = []
            for i in range(rows):
                n = rng.randint(1, MAX_COMPLETION_LENGTH)
                mask = [1] * n
                if m == rank and i == 1:  # truncated, then masked out
                    n, mask = MAX_COMPLETION_LENGTH, [0] * MAX_COMPLETION_LENGTH
                elif (rank, m, i) == (1, 0, 2) and n > 2:
                    mask[1] = 0
                completion = [rng.randint(6, 29) for _ in range(n)]
                loss = [round(rng.uniform(-2, 3), 3) if bit else GARBAGE for bit in mask]
                out.append(Row(prompts[rng.randint(0, 1)], completion, mask, loss))
            micro.append(out)
        step.append(micro)
    return step


def collate(rows: list[Row], layout: dict[str, Any]) -> dict[str, Any]:
    examples = [
        {"input_ids": r.prompt + r.completion, "completion_mask": [0] * len(r.prompt) + r.mask} for r in rows
    ]
    return Collator.for_rollouts(**layout)(examples)


def packed_loss(rows: list[Row], batch: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The rows' per-token losses where the batch lays out their completions; GARBAGE everywhere else."""
    shape = batch["input_ids"].shape
    out = torch.full(shape, GARBAGE, dtype=dtype)
    places = unpack(torch.arange(out.numel()).reshape(shape), batch)
    for row, where in zip(rows, places, strict=True):
        out.view(-1)[where[len(where) - len(row.completion) :]] = torch.tensor(row.loss, dtype=dtype)
    return out


def padded(rows: list[Row], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's and verl's view: completions right-padded to the step's width, ``[B, T]`` losses and mask."""
    loss = torch.zeros(len(rows), MAX_COMPLETION_LENGTH, dtype=dtype)
    mask = torch.zeros(len(rows), MAX_COMPLETION_LENGTH, dtype=torch.long)
    for i, row in enumerate(rows):
        loss[i, : len(row.loss)] = torch.tensor(row.loss, dtype=dtype)
        mask[i, : len(row.mask)] = torch.tensor(row.mask)
    return loss, mask


def every(step: Step) -> list[list[Row]]:
    return [micro for rank in step for micro in rank]


# --- the calls the docs give for each peer (docs/post_training.md, "Loss aggregation: TRL and verl") ------


def ours(
    step: Step,
    layout: dict[str, Any],
    dtype: torch.dtype,
    *,
    mode: str,
    empty: str = "skip",
    per_micro_batch: bool = False,
    global_count: torch.Tensor | None = None,
    normalizer: float | None = None,
    scale: float = 1.0,
) -> float:
    """The step's loss with ``aggregate_loss`` on each rank's micro-batches: the sum over a rank's
    micro-batches, then the mean over ranks (DDP's and FSDP's gradient averaging)."""
    ranks, micro_batches = len(step), len(step[0])
    batches = [[collate(rows, layout) for rows in rank] for rank in step]
    if not per_micro_batch and global_count is None and mode != "token-sum":
        # One process stands for every rank: the count over all their micro-batches is the all-reduced one.
        global_count = global_loss_count([b for rank in batches for b in rank], mode=mode, empty=empty)
    total = 0.0
    for rank_rows, rank_batches in zip(step, batches, strict=True):
        for rows, batch in zip(rank_rows, rank_batches, strict=True):
            loss = packed_loss(rows, batch, dtype)
            if per_micro_batch:
                value = aggregate_loss(
                    loss,
                    batch,
                    mode=mode,
                    empty=empty,
                    accumulation_steps=micro_batches,
                    normalizer=normalizer,
                )
            else:
                value = aggregate_loss(
                    loss,
                    batch,
                    mode=mode,
                    empty=empty,
                    global_count=global_count,
                    normalizer=normalizer,
                    world_size=ranks,
                )
            assert value.dtype == dtype
            total += float(value) * scale
    return total / ranks


def trl_call(
    loss_type: str, num_items_in_batch: torch.Tensor, steps_per_generation: int, accumulation: int
) -> dict:
    """The documented ``aggregate_loss`` arguments that give TRL 1.16's ``loss_type``."""
    if loss_type in ("grpo", "sapo"):
        return {"mode": "seq-mean-token-mean", "empty": "count", "per_micro_batch": True}
    if loss_type == "bnpo":
        return {"mode": "token-mean", "per_micro_batch": True}
    if loss_type == "dr_grpo":
        return {
            "mode": "seq-mean-token-sum-norm",
            "empty": "count",
            "per_micro_batch": True,
            "normalizer": MAX_COMPLETION_LENGTH,
        }
    if loss_type == "luspo":
        return {"mode": "seq-mean-token-sum", "empty": "count", "per_micro_batch": True}
    assert loss_type in ("dapo", "cispo", "vespo")
    return {
        "mode": "token-mean",
        "global_count": num_items_in_batch,
        "scale": steps_per_generation / accumulation,
    }


# --- TRL 1.16: GRPOTrainer._compute_loss itself -----------------------------------------------------------


def trl_micro_batch_loss(
    loss_type: str,
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    accumulation: int,
    processes: int,
    steps_per_generation: int,
    num_items_in_batch: torch.Tensor,
) -> torch.Tensor:
    """``GRPOTrainer._compute_loss`` of TRL 1.16 on one micro-batch of one rank, in training mode.

    The trainer is TRL's class with the attributes ``__init__`` would set from a ``GRPOConfig`` (no model,
    no beta, no entropy bonus, no vLLM); the rank count and the collectives (``gather``, ``reduce``, which
    feed its metrics only) come from a stand-in accelerator, so that one process plays every rank."""
    from trl import GRPOConfig, GRPOTrainer

    with warnings.catch_warnings():  # transformers' deprecations of TrainingArguments fields
        warnings.simplefilter("ignore", FutureWarning)
        args = GRPOConfig(
            output_dir="/tmp/zephon-loss-modes",
            report_to=[],
            use_cpu=True,
            bf16=False,
            loss_type=loss_type,
            beta=0.0,
            gradient_accumulation_steps=accumulation,
            steps_per_generation=steps_per_generation,
            max_completion_length=MAX_COMPLETION_LENGTH,
            importance_sampling_level="sequence" if loss_type == "luspo" else "token",
            # At ratio 1, SAPO's gate 4 sigmoid(0) / temperature and CISPO's clamp(ratio, max=epsilon_high)
            # are 1: TRL's per-token loss is the advantage's (times -logps for CISPO and VESPO).
            sapo_temperature_pos=2.0,
            sapo_temperature_neg=2.0,
            epsilon_high=5.0 if loss_type == "cispo" else None,
        )
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    logps = torch.full(mask.shape, -1.0, dtype=per_token_loss.dtype)
    vars(trainer).update(
        args=args,
        loss_type=args.loss_type,
        beta=args.beta,
        importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=None,
        aux_loss_enabled=False,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False,
        max_completion_length=args.max_completion_length,
        current_gradient_accumulation_steps=accumulation,
        model=types.SimpleNamespace(training=True),
        _metrics={"train": collections.defaultdict(list)},
        accelerator=types.SimpleNamespace(
            num_processes=processes, gather=lambda x: x, reduce=lambda x, reduction: x
        ),
        _get_per_token_logps_and_entropies=lambda *_, **__: (logps.clone(), torch.zeros_like(logps), None),
    )
    rows, width = mask.shape
    sign = 1.0 if loss_type in ("cispo", "vespo") else -1.0  # their loss: -weight * A * logps, logps = -1
    inputs = {
        "prompt_ids": torch.ones(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.ones(rows, width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": sign * per_token_loss,  # [B, T]: TRL takes per-token advantages as they are
        "old_per_token_logps": logps.clone(),
        "num_items_in_batch": num_items_in_batch,
    }
    return trainer._compute_loss(None, inputs)


def trl_step_loss(
    step: Step, loss_type: str, dtype: torch.dtype, steps_per_generation: int | None = None
) -> float:
    """TRL's loss of the step: each rank's micro-batch losses summed (they are divided by the accumulation
    steps already), then averaged over ranks as DDP averages gradients."""
    ranks, accumulation = len(step), len(step[0])
    num_items = trl_num_items(step)
    total = 0.0
    for rank in step:
        for rows in rank:
            loss, mask = padded(rows, dtype)
            value = trl_micro_batch_loss(
                loss_type,
                loss,
                mask,
                accumulation=accumulation,
                processes=ranks,
                steps_per_generation=steps_per_generation or accumulation,
                num_items_in_batch=num_items,
            )
            assert value.dtype == dtype
            total += float(value)
    return total / ranks


def trl_num_items(step: Step) -> torch.Tensor:
    """TRL's ``num_items_in_batch``: the loss mask summed over the generation batch, gathered over ranks."""
    return sum(padded(rows, torch.float64)[1].sum() for rows in every(step))  # type: ignore[return-value]


# --- verl 0.10: agg_loss, transcribed -------------------------------------------------------------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``verl.utils.torch_functional.masked_sum``."""
    return (values * mask).sum()


def verl_agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> torch.Tensor:
    """verl 0.10's ``agg_loss``, line for line (``verl/trainer/ppo/core_algos.py`` lines 1140-1206,
    verl-project/verl@1dda039b, ``verl/version/version`` 0.10.0.dev)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                horizon = loss_mask.shape[-1]
                loss_scale_factor = horizon
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def verl_step_loss(step: Step, mode: str, dtype: torch.dtype, *, global_batch_size: int) -> float:
    """verl's step: each rank's micro-batches with the mini-batch's global info (``batch_num_tokens`` the
    mask's sum over every rank, all-reduced as verl's engines do; ``global_batch_size`` given, as the
    trainer gives ``ppo_mini_batch_size * rollout.n``), summed, then averaged over ranks."""
    ranks = len(step)
    batch_num_tokens = int(sum(padded(rows, dtype)[1].sum() for rows in every(step)))
    total = 0.0
    for rank in step:
        for rows in rank:
            loss, mask = padded(rows, dtype)
            value = verl_agg_loss(
                loss,
                mask.to(dtype),
                mode,
                dp_size=ranks,
                batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size,
                loss_scale_factor=MAX_COMPLETION_LENGTH,
            )
            total += float(value)
    return total / ranks


# --- 1. hand-worked: the two numbers that differed --------------------------------------------------------


def test_an_all_masked_completion_counts_in_trl_and_is_skipped_in_verls_agg_loss():
    """Completions with token means 2 and 1 and one all-masked (``mask_truncated_completions``): TRL's grpo
    is (2 + 0 + 1) / 3, verl's ``agg_loss`` (global_batch_size not given) (2 + 1) / 2."""
    rows = [
        Row([1, 2], [6, 7], [1, 1], [1.0, 3.0]),
        Row([1, 2], [8, 9, 10], [0, 0, 0], [GARBAGE] * 3),
        Row([3], [11], [1], [1.0]),
    ]
    batch = collate(rows, {"padding_free": True})
    loss = packed_loss(rows, batch, torch.float64)
    assert float(aggregate_loss(loss, batch, mode="seq-mean-token-mean")) == pytest.approx(1.5)
    assert float(aggregate_loss(loss, batch, mode="seq-mean-token-mean", empty="count")) == pytest.approx(1.0)
    assert int(global_loss_count(batch, mode="seq-mean-token-mean")) == 2
    assert int(global_loss_count(batch, mode="seq-mean-token-mean", empty="count")) == 3
    tokens = global_loss_count(batch, mode="token-mean", empty="count")  # tokens: empty changes nothing
    assert int(tokens) == 3
    step = [[rows]]
    assert trl_step_loss(step, "grpo", torch.float64) == pytest.approx(1.0, rel=1e-12)
    trl_loss, mask = padded(rows, torch.float64)
    assert float(verl_agg_loss(trl_loss, mask.double(), "seq-mean-token-mean")) == pytest.approx(
        1.5, rel=1e-7
    )


def test_bnpo_over_two_micro_batches_is_the_mean_of_their_token_means():
    """One token of loss 5, then three of loss 1: TRL's bnpo is (5 + 1) / 2 = 3, the step's token mean 8 / 4."""
    step = [[[Row([1], [6], [1], [5.0])], [Row([1], [6, 7, 8], [1, 1, 1], [1.0, 1.0, 1.0])]]]
    assert trl_step_loss(step, "bnpo", torch.float64) == pytest.approx(3.0, rel=1e-12)
    layout = {"padding_free": True}
    assert ours(step, layout, torch.float64, mode="token-mean", per_micro_batch=True) == pytest.approx(3.0)
    assert ours(step, layout, torch.float64, mode="token-mean") == pytest.approx(2.0)  # verl's token-mean


# --- 2. every TRL loss_type, 2 ranks x 2 micro-batches ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_every_trl_loss_type_over_ranks_and_micro_batches(loss_type, layout, dtype):
    pytest.importorskip("trl")
    step = make_step(seed=3)
    want = trl_step_loss(step, loss_type, dtype)
    call = trl_call(loss_type, trl_num_items(step), steps_per_generation=2, accumulation=2)
    got = ours(step, layout, dtype, **call)
    assert got == pytest.approx(want, rel=TOLERANCE[dtype], abs=TOLERANCE[dtype])


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_trl_token_normalised_types_when_a_generation_spans_two_steps(loss_type):
    """``steps_per_generation`` = 2 x the accumulation steps: TRL's normaliser is the generation batch's
    tokens over 2; ``num_items_in_batch`` is that batch's ``global_loss_count``."""
    pytest.importorskip("trl")
    generation = make_step(seed=5, micro_batches=4)
    step = [rank[:2] for rank in generation]  # the first optimizer step of the generation batch
    num_items = trl_num_items(generation)
    layout = LAYOUTS["flat"]
    batches = [collate(rows, layout) for rows in every(generation)]
    assert int(global_loss_count(batches)) == int(num_items)
    want = 0.0
    for rank in step:
        for rows in rank:
            loss, mask = padded(rows, torch.float64)
            want += float(
                trl_micro_batch_loss(
                    loss_type,
                    loss,
                    mask,
                    accumulation=2,
                    processes=2,
                    steps_per_generation=4,
                    num_items_in_batch=num_items,
                )
            )
    call = trl_call(loss_type, num_items, steps_per_generation=4, accumulation=2)
    assert ours(step, layout, torch.float64, **call) == pytest.approx(want / 2, rel=1e-12, abs=1e-12)


# --- 3. every verl mode, 2 ranks x 2 micro-batches ----------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_every_verl_mode_over_ranks_and_micro_batches(mode, layout):
    """verl's trainer passes ``global_batch_size`` = every row of the mini-batch (``empty="count"``); the
    skipping count (the default) is ``agg_loss``'s own formula with the non-empty rows as that size."""
    step = make_step(seed=7)
    rows = every(step)
    # verl's seq-mean-token-mean divides by n_i + 1e-8: its value is 1e-8 (relative) off the exact mean.
    tolerance = 2e-8 if mode == "seq-mean-token-mean" else 1e-12
    everything = sum(len(r) for r in rows)
    non_empty = sum(1 for r in rows for row in r if any(row.mask))
    assert non_empty < everything
    for empty, size in (("count", everything), ("skip", non_empty)):
        want = verl_step_loss(step, mode, torch.float64, global_batch_size=size)
        got = ours(step, layout, torch.float64, mode=mode, empty=empty, normalizer=MAX_COMPLETION_LENGTH)
        assert got == pytest.approx(want, rel=tolerance, abs=1e-12), empty


@pytest.mark.parametrize("mode", MODES)
def test_verl_agg_loss_called_alone_skips_empty_rows(mode):
    """``agg_loss`` without global info (one rank, one micro-batch) counts the rows with a supervised
    token: ``aggregate_loss``'s default."""
    rows = make_step(seed=11, ranks=1, micro_batches=1, rows=5)[0][0]
    loss, mask = padded(rows, torch.float64)
    want = float(verl_agg_loss(loss, mask.double(), mode, loss_scale_factor=MAX_COMPLETION_LENGTH))
    for layout in LAYOUTS.values():
        batch = collate(rows, layout)
        got = aggregate_loss(
            packed_loss(rows, batch, torch.float64), batch, mode=mode, normalizer=MAX_COMPLETION_LENGTH
        )
        assert float(got) == pytest.approx(want, rel=2e-8, abs=1e-12)


# --- 4. the property: every mode and choice against the formulas over plain lists --------------------------


def reference(sequences: list[list[tuple[float, bool]]], mode: str, empty: str, normalizer: float) -> float:
    """One micro-batch's (or a whole step's) value: the formulas over per-sequence ``(loss, supervised)``."""
    sums = [sum(v for v, m in s if m) for s in sequences]
    counts = [sum(1 for _, m in s if m) for s in sequences]
    units = len(sequences) if empty == "count" else sum(1 for n in counts if n)
    if mode == "token-sum":
        return sum(sums)
    if mode == "token-mean":
        return sum(sums) / max(sum(counts), 1)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(sums, counts, strict=True) if n) / max(units, 1)
    value = sum(sums) / max(units, 1)
    return value / normalizer if mode == "seq-mean-token-sum-norm" else value


ROWS = st.lists(
    st.tuples(
        st.integers(1, 3),  # prompt length
        st.lists(st.tuples(st.floats(-4, 4, allow_nan=False), st.booleans()), min_size=0, max_size=5),
        st.booleans(),  # all masked
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=ROWS,
    cuts=st.lists(st.integers(0, 9), max_size=3),
    layout=st.sampled_from(list(LAYOUTS.values())),
    empty=st.sampled_from(["skip", "count"]),
)
def test_every_mode_and_choice_equals_the_formulas(spec, cuts, layout, empty):
    """Random per-token losses and masks (some rows all masked, some without completion tokens), split into
    random micro-batches: the step-global call equals the formula over the whole step, the per-micro-batch
    call the mean of the formula over each micro-batch."""
    rows = [
        Row(
            [1 + k for k in range(p)],
            [6 + (3 * i + k) % 20 for k in range(len(tokens))],
            [0 if masked else int(bit) for _, bit in tokens],
            [v for v, _ in tokens],
        )
        for i, (p, tokens, masked) in enumerate(spec)
    ]
    bounds = sorted({0, len(rows), *(c for c in cuts if c < len(rows))})
    micro = [rows[a:b] for a, b in itertools.pairwise(bounds)]
    step = [micro]

    def sequences(group: list[Row]) -> list[list[tuple[float, bool]]]:
        return [list(zip(r.loss, (bool(b) for b in r.mask), strict=True)) for r in group]

    for mode in MODES:
        whole = reference(sequences(rows), mode, empty, 7.0)
        got = ours(step, layout, torch.float64, mode=mode, empty=empty, normalizer=7.0)
        assert got == pytest.approx(whole, rel=1e-12, abs=1e-12), (mode, "step")
        mean = sum(reference(sequences(g), mode, empty, 7.0) for g in micro) / len(micro)
        got = ours(step, layout, torch.float64, mode=mode, empty=empty, normalizer=7.0, per_micro_batch=True)
        assert got == pytest.approx(mean, rel=1e-12, abs=1e-12), (mode, "micro-batch")


# --- 5. refusals ----------------------------------------------------------------------------------------


def test_bad_choices_are_refused_by_name():
    rows = make_step(seed=1, ranks=1, micro_batches=1)[0][0]
    batch = collate(rows, LAYOUTS["flat"])
    loss = packed_loss(rows, batch, torch.float64)
    with pytest.raises(ValueError, match=r"aggregate_loss: empty must be 'skip' or 'count' .*got 'all'"):
        aggregate_loss(loss, batch, mode="seq-mean-token-mean", empty="all")
    with pytest.raises(ValueError, match=r"global_loss_count: empty must be 'skip' or 'count' .*got None"):
        global_loss_count(batch, mode="seq-mean-token-mean", empty=None)
    with pytest.raises(TypeError, match=r"aggregate_loss: accumulation_steps must be an int >= 1"):
        aggregate_loss(loss, batch, accumulation_steps=2.0)
    with pytest.raises(ValueError, match=r"aggregate_loss: accumulation_steps must be an int >= 1, got 0"):
        aggregate_loss(loss, batch, accumulation_steps=0)
    with pytest.raises(ValueError, match=r"global_count= and accumulation_steps="):
        aggregate_loss(loss, batch, global_count=4, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"world_size= and accumulation_steps="):
        aggregate_loss(loss, batch, world_size=2, accumulation_steps=2)


def test_counting_empty_sequences_refuses_padding_it_cannot_tell_from_sequences():
    """A padding-free ``for_transformers`` batch without a sequence map, padded to a multiple: its padding
    reads as one-token sequences, which ``empty="count"`` would count. The skipping count is exact."""
    examples = [
        {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        {"input_ids": [4, 5], "completion_mask": [0, 0]},
    ]
    batch = Collator.for_transformers(padding_free=True, pad_token_id=0, pad_to_multiple_of=8)(examples)
    loss = torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.0, 9.0, 9.0, 9.0]])
    assert float(aggregate_loss(loss, batch, mode="seq-mean-token-sum")) == 4.0
    for call in (
        lambda: aggregate_loss(loss, batch, mode="seq-mean-token-sum", empty="count"),
        lambda: aggregate_loss(loss, batch, mode="seq-mean-token-sum", empty="count", accumulation_steps=1),
        lambda: global_loss_count(batch, mode="seq-mean-token-sum", empty="count"),
    ):
        with pytest.raises(
            ValueError, match=r"cannot tell padding from one-token sequences.*return_sequence_map"
        ):
            call()
    mapped = Collator.for_transformers(
        padding_free=True, pad_token_id=0, pad_to_multiple_of=8, return_sequence_map=True
    )(examples)
    assert float(aggregate_loss(loss, mapped, mode="seq-mean-token-sum", empty="count")) == 2.0
    tokens = aggregate_loss(loss, batch, mode="token-mean", empty="count")  # tokens: read as before
    assert float(tokens) == 2.0


# --- 6. two real ranks (gloo): the collectives of each choice ----------------------------------------------

# Each empty choice with the three scales: the step's count from global_loss_count (all-reduced), each
# micro-batch's own count all-reduced (global_count=None), and TRL's per-micro-batch one (no collective).
COMBINATIONS = [(empty, scale) for empty in ("skip", "count") for scale in ("step", "own", "micro-batch")]


def test_choices_on_two_ranks(tmp_path):
    """torchrun, 2 ranks: the DDP-averaged sum of each rank's micro-batch losses equals the one-process
    simulation, for every mode and choice."""
    from test_distributed import torchrun

    report = tmp_path / "report.json"
    result = torchrun(Path(__file__), "--report", str(report))
    assert "rank 0: OK" in result.stdout and "rank 1: OK" in result.stdout, result.stdout + result.stderr
    assert json.loads(report.read_text())["checked"] == len(MODES) * len(COMBINATIONS)


def _ranks_check(report: str) -> None:
    import os

    import torch.distributed as dist

    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    step = make_step(seed=13, ranks=ranks)
    layout = LAYOUTS["flat-shared-pad16"]
    options = {"layout": layout, "dtype": torch.float64, "normalizer": 5.0}
    wants = {}  # simulated in one process, before any collective: global_loss_count would all-reduce
    for mode in MODES:
        for empty, scale in COMBINATIONS:
            if scale == "own" and mode != "token-sum":  # each micro-batch's count over the ranks
                micro = [[[rank_rows[m]] for rank_rows in step] for m in range(len(step[0]))]
                want = sum(ours(one, mode=mode, empty=empty, **options) for one in micro)
            else:
                want = ours(step, mode=mode, empty=empty, per_micro_batch=scale == "micro-batch", **options)
            wants[mode, empty, scale] = want
    dist.init_process_group("gloo")
    checked = 0
    for (mode, empty, scale), want in wants.items():
        batches = [collate(rows, layout) for rows in step[rank]]
        extra: dict[str, Any] = {}
        if scale == "micro-batch":
            extra["accumulation_steps"] = len(batches)
        elif scale == "step" and mode != "token-sum":
            extra["global_count"] = global_loss_count(batches, mode=mode, empty=empty)
        local = 0.0
        for rows, batch in zip(step[rank], batches, strict=True):
            loss = packed_loss(rows, batch, torch.float64)
            local += float(aggregate_loss(loss, batch, mode=mode, empty=empty, normalizer=5.0, **extra))
        total = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(total)
        mean = float(total) / ranks  # what DDP's gradient averaging makes of the ranks' losses
        assert abs(mean - want) <= 1e-12 * max(1.0, abs(want)), (mode, empty, scale, mean, want)
        checked += 1
    if rank == 0:
        Path(report).write_text(json.dumps({"checked": checked}))
    print(f"rank {rank}: OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    _ranks_check(parser.parse_args().report)
