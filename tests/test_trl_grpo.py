"""PackedGRPOTrainer and PackedRLOOTrainer against stock trl.GRPOTrainer and trl.RLOOTrainer: the same log-probs
and entropies of left-padded prompts and right-padded completions, the same loss, gradients and metrics for every
loss type and KL option, and the same training with generation (tiny Llama from a config; float64 weights, where packing's positions from 0 and TRL's
positions shifted by the left padding give the same RoPE scores; TRL's head computes in float32)."""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from zephon_collate.trainers import PackedGRPOTrainer, PackedRLOOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from datasets import Dataset
from trl_dpo import WORDS, llama, tokenizer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GRPOTrainer loads its reference model from a path: a tiny Llama saved once."""
    path = tmp_path_factory.mktemp("llama")
    llama(dtype=torch.float64).save_pretrained(path)
    return str(path)


def prompts() -> Dataset:
    rng = random.Random(0)
    return Dataset.from_list(
        [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))} for _ in range(16)]
    )


def reward(completions: list[str], **_: Any) -> list[float]:
    return [len(text) / 10 for text in completions]


PAIRS = [(GRPOTrainer, PackedGRPOTrainer), (RLOOTrainer, PackedRLOOTrainer)]  # (stock, packed)


def trainer(cls: type, path: str, steps: int = 3, shared_prompt: bool = False, **options: Any) -> Any:
    args = (RLOOConfig if issubclass(cls, RLOOTrainer) else GRPOConfig)(
        output_dir="/tmp/zephon-grpo-test", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, model_init_kwargs={"dtype": torch.float64}, bf16=False, **options,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shared = {} if shared_prompt is False else {"shared_prompt": shared_prompt}
        run = cls(
            model=path,
            reward_funcs=reward,
            args=args,
            train_dataset=prompts(),
            processing_class=tokenizer(),
            **shared,
        )
    run.current_gradient_accumulation_steps = 1  # what a training step sets, for _compute_loss called alone
    return run


def rows(grouped: bool = False) -> dict[str, torch.Tensor]:
    """Four rollouts: prompts of 3, 7, 5 and 2 tokens padded on the left to 7, completions of 6, 2, 4 and 1
    padded on the right to 6. ``grouped``: two groups of two completions, a prompt of 3 and one of 5
    tokens each, as TRL generates ``num_generations`` completions per prompt."""
    generator = torch.Generator().manual_seed(1)
    out = {name: torch.zeros(4, width, dtype=torch.long) for name, width in
           (("prompt_ids", 7), ("prompt_mask", 7), ("completion_ids", 6), ("completion_mask", 6))}  # fmt: skip
    prompts = (3, 3, 5, 5) if grouped else (3, 7, 5, 2)
    for row, (prompt, completion) in enumerate(zip(prompts, (6, 2, 4, 1), strict=True)):
        if grouped and row % 2:
            out["prompt_ids"][row] = out["prompt_ids"][row - 1]
        else:
            out["prompt_ids"][row, 7 - prompt :] = torch.randint(3, 60, (prompt,), generator=generator)
        out["prompt_mask"][row, 7 - prompt :] = 1
        out["completion_ids"][row, :completion] = torch.randint(3, 60, (completion,), generator=generator)
        out["completion_mask"][row, :completion] = 1
    return out


@pytest.mark.parametrize("pair", PAIRS, ids=["grpo", "rloo"])
@pytest.mark.parametrize("layout", ["fit", "one", "shared-fit", "shared-one"])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_log_probs_and_entropies_equal_stock(model_path, layout, batch_size, pair, monkeypatch):
    from zephon_collate.trainers import policy

    views, original = [], policy.pack_view  # the layouts built: the packed trainer's pass really ran packed
    monkeypatch.setattr(policy, "pack_view", lambda *a, **k: views.append(original(*a, **k)) or views[-1])
    shared = layout.startswith("shared")
    stock, packed = (
        trainer(pair[0], model_path),
        trainer(pair[1], model_path, shared_prompt=shared),
    )
    packed.packed_rows = layout.removeprefix("shared-")
    batch = rows(grouped=shared)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    want = stock._get_per_token_logps_and_entropies(
        stock.model, ids, mask, 6, batch_size, compute_entropy=True
    )
    got = packed._get_per_token_logps_and_entropies(
        packed.model, ids, mask, 6, batch_size, compute_entropy=True
    )
    assert got[0].shape == want[0].shape == (4, 6)
    assert len(views) == (2 if batch_size else 1)
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0)
    assert torch.allclose(got[1], want[1], atol=1e-6, rtol=0)


CASES = [{"loss_type": kind} for kind in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")] + [
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
    {"beta": 0.04},
    {"beta": 0.04, "use_bias_correction_kl": False},
    {"beta": 0.04, "importance_sampling_level": "sequence", "loss_type": "grpo"},
    {"epsilon_high": 0.28, "delta": 1.5},
    {"top_entropy_quantile": 0.5},
]


def current_logps(run: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rows' completion log-probs under ``run``'s model, float64, as the old policy's starting point."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        return run._get_per_token_logps_and_entropies(run.model, ids, mask, 6)[0].double()


def assert_step_equal(runs: list[Any], batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Stock's and packed's ``_compute_loss`` on ``batch``: the same loss, gradients and metrics (stock's
    returned)."""
    results = []
    for run in runs:
        run.model.train()
        loss = run._compute_loss(run.model, dict(batch))
        loss.backward()
        metrics = {key: values[-1] for key, values in run._metrics["train"].items()}
        results.append((loss.detach(), [p.grad.clone() for p in run.model.parameters()], metrics))
    (want, want_grads, want_metrics), (got, grads, metrics) = results
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    return want_metrics


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_loss_gradients_and_metrics_equal_stock(model_path, options, shared):
    """Old-policy and reference log-probs off the current ones, so the ratios clip and the KL term counts."""
    runs = [trainer(GRPOTrainer, model_path, **options)]
    runs.append(trainer(PackedGRPOTrainer, model_path, shared_prompt=shared, **options))
    batch = rows(grouped=shared)
    generator = torch.Generator().manual_seed(2)
    noise = torch.randn(2, 4, 6, generator=generator, dtype=torch.float64)
    current = current_logps(runs[0], batch)
    batch.update(
        advantages=torch.tensor([0.5, -1.0, 1.5, -0.2], dtype=torch.float64),
        old_per_token_logps=current + 0.3 * noise[0],
        ref_per_token_logps=current + 0.1 * noise[1],
        num_items_in_batch=batch["completion_mask"].sum(),
    )
    assert_step_equal(runs, batch)


@pytest.mark.parametrize("pair", PAIRS, ids=["grpo", "rloo"])
@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_training_with_generation_equals_stock(model_path, shared, pair):
    """Three steps of sampling, rewards and updates: the same logged losses and rewards, the same weights
    (shared: each prompt's 4 completions after one copy of it). RLOO's KL term enters its rewards."""
    runs = []
    for cls, more in ((pair[0], {}), (pair[1], {"shared_prompt": shared})):
        runs.append(trainer(cls, model_path, steps=3, beta=0.04, **more))
        runs[-1].train()  # each built, then trained: Trainer seeds the sampling at build
    stock, packed = ([entry for entry in run.state.log_history if "loss" in entry] for run in runs)
    assert len(stock) == len(packed) == 3
    for want, got in zip(stock, packed, strict=True):
        for key in ("loss", "reward", "kl", "entropy"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert any(entry["kl"] != 0 for entry in stock)  # the reference model ran, packed too
    weights = zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in weights) < 1e-6


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("options", [{}, {"epsilon_high": 0.28}], ids=["clip", "clip-higher"])
def test_rloo_loss_gradients_and_metrics_equal_stock(model_path, options, shared):
    """RLOO's sequence-level ratio against old log-probs off the current ones, so some ratios clip."""
    runs = [trainer(RLOOTrainer, model_path, **options)]
    runs.append(trainer(PackedRLOOTrainer, model_path, shared_prompt=shared, **options))
    batch = rows(grouped=shared)
    current = current_logps(runs[0], batch)
    sums = (current * batch["completion_mask"]).sum(1)
    batch.update(
        advantages=torch.tensor([0.5, -1.0, 1.5, -0.2], dtype=torch.float64),
        old_logps=sums + torch.tensor([0.3, -0.4, -0.1, 0.5], dtype=torch.float64),
    )
    assert assert_step_equal(runs, batch)["clip_ratio/region_mean"] > 0  # the case clips


def test_shared_prompt_lays_each_group_out_once():
    """Two groups of two completions: each prompt once (but its last token, which opens every branch)."""
    from zephon_collate.trainers.view import pack_view

    batch = rows(grouped=True)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    trained = torch.cat([torch.zeros_like(batch["prompt_mask"]), batch["completion_mask"]], dim=1)
    shared = pack_view(ids, mask, trained, "one", "test", shared_prompt=True)
    unshared = pack_view(ids, mask, trained, "one", "test")
    assert unshared["input_ids"].shape == (1, 3 + 6 + 3 + 2 + 5 + 4 + 5 + 1)
    assert shared["input_ids"].shape == (1, (3 - 1) + (1 + 6) + (1 + 2) + (5 - 1) + (1 + 4) + (1 + 1))
    assert shared["attention_mask"].shape == (1, 1, 23, 23)
    assert torch.equal(shared["target"].sort().values, unshared["target"].sort().values)


def test_shared_prompt_under_flash_attention_is_refused(model_path):
    run = trainer(PackedGRPOTrainer, model_path)
    run.model.config._attn_implementation = "flash_attention_2"
    from zephon_collate.trainers.view import packed_rows

    with pytest.raises(ValueError, match=r"FlashAttention's varlen kernels cannot keep apart"):
        packed_rows(run.model, shared_prompt=True)
    for cls in (PackedGRPOTrainer, PackedRLOOTrainer):
        with pytest.raises(TypeError, match=rf"{cls.__name__}: shared_prompt must be a bool"):
            trainer(cls, model_path, shared_prompt=1)


def test_shuffled_groups_still_share_and_score_as_stock(model_path):
    """TRL shuffles a generation batch's rows before the training pass: a group's completions are found
    wherever they sit, laid out after one copy of their prompt, and scored as stock scores them."""
    from zephon_collate.trainers.view import pack_view

    batch = rows(grouped=True)
    shuffle = torch.tensor([2, 0, 3, 1])  # no two of a group side by side
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)[shuffle]
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)[shuffle]
    trained = mask.clone()
    trained[:, :-6] = 0
    shared = pack_view(ids, mask, trained, "one", "test", shared_prompt=True)  # prefixes found anywhere
    assert shared["input_ids"].shape == (1, 23)  # as the grouped rows: each prompt once
    stock, packed = (
        trainer(GRPOTrainer, model_path),
        trainer(PackedGRPOTrainer, model_path, shared_prompt=True),
    )
    want = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, 6, compute_entropy=True)
    got = packed._get_per_token_logps_and_entropies(packed.model, ids, mask, 6, compute_entropy=True)
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0)
    assert torch.allclose(got[1], want[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_qwen_vl_model_scores_text_rollouts_packed_as_stock(family, tmp_path):
    """Multimodal RoPE: packed positions in 4 rows, the text row first (from which the text model masks
    the packed sequences); Qwen2-VL and Qwen2.5-VL were refused as attending across sequences."""
    from vlm_models import tiny_model

    model = tiny_model(family, torch.float64)
    model.config.pad_token_id = 0
    model.save_pretrained(tmp_path)
    stock, packed = trainer(GRPOTrainer, str(tmp_path)), trainer(PackedGRPOTrainer, str(tmp_path))
    batch = rows()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    want = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, 6, compute_entropy=True)
    got = packed._get_per_token_logps_and_entropies(packed.model, ids, mask, 6, compute_entropy=True)
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0)
    assert torch.allclose(got[1], want[1], atol=1e-6, rtol=0)
