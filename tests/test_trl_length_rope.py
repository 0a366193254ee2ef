"""Length-dependent RoPE (transformers' ``dynamic`` and ``longrope``) in the packed TRL trainers, against stock.

Such a rotary embedding picks its frequencies from the call's largest position. Stock TRL runs the padded batch
with positions 0 to width - 1, so every sequence of it gets the frequencies of the padded width; packed, each
sequence's positions restart at 0. Here the width passes the original context (16) while every sequence stays
under it (GRPO: a long prompt beside a long completion; DPO and rewards: ``pad_to_multiple_of=32``), the case
where the two would pick different frequencies. The q/k projections are scaled so that positions matter, as in
a trained model: a wrong pick changes the log-probs by up to 0.4.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset, disable_progress_bars
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)
from transformers.utils import logging
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer

from zephon_collate.trainers import PackedDPOTrainer, PackedGRPOTrainer, PackedRewardTrainer
from zephon_collate.trainers.view import padded_rope

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl_dpo import pairs, tokenizer

ORIGINAL = 16
ROPES = {
    "longrope": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
        "short_factor": [1.0] * 4, "long_factor": [4.0, 8.0, 16.0, 32.0], "factor": 4.0,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
}  # fmt: skip


def config(rope: str, **more: Any) -> LlamaConfig:
    """A 2-layer Llama config whose context was ``ORIGINAL`` tokens (``dynamic`` reads max_position_embeddings)."""
    out = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=ORIGINAL if rope == "dynamic" else 64, pad_token_id=0,
        eos_token_id=1, bos_token_id=1, rope_parameters=dict(ROPES[rope]), **more,
    )  # fmt: skip
    out._attn_implementation = "sdpa"
    return out


def sharpened(model: Any) -> Any:
    """``model`` in float64 with attention sharp enough that positions change its outputs."""
    torch.manual_seed(0)
    model = model.to(torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def quiet() -> None:
    disable_progress_bars()
    logging.set_verbosity_error()
    warnings.simplefilter("ignore")


@pytest.fixture(scope="module", params=sorted(ROPES))
def rope(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def causal_lm(family: str, rope: str) -> Any:
    """A Llama, or a Gemma 3 whose full-attention layers have the ``rope`` RoPE and its sliding ones the
    default (one rotary embedding with a table per layer kind)."""
    torch.manual_seed(0)
    if family == "llama":
        return sharpened(LlamaForCausalLM(config(rope)))
    settings = config(rope).to_dict()
    settings |= {
        "head_dim": 8, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": dict(ROPES[rope]),
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }  # fmt: skip
    gemma = Gemma3TextConfig(**{key: value for key, value in settings.items() if key != "model_type"})
    gemma._attn_implementation = "sdpa"
    return sharpened(Gemma3ForCausalLM(gemma))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_grpo_scores_a_wide_batch_of_short_rollouts_as_stock(rope, family, shared, tmp_path):
    """Two rollouts of 14 tokens, padded to 24 (a 12-token prompt with 2 completion tokens, a 2-token prompt
    with 12), then a batch of 10 tokens: each call's log-probs as stock's (``dynamic`` keeps a cache of the
    widest call, so the order of calls counts too)."""
    quiet()
    causal_lm(family, rope).save_pretrained(tmp_path)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=12, max_steps=1, report_to=[], use_cpu=True, seed=0, bf16=False,
        model_init_kwargs={"dtype": torch.float64},
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": "w1 w2"}] * 4)
    runs = [
        GRPOTrainer(model=str(tmp_path), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=args, train_dataset=data, processing_class=tokenizer()),
        PackedGRPOTrainer(model=str(tmp_path), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=data, processing_class=tokenizer(), shared_prompt=shared),
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    batches = []
    for prompt_width, spans in ((12, [(12, 2), (2, 12)]), (5, [(5, 5), (3, 2)])):
        width = prompt_width + max(completion for _, completion in spans)
        ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
        for row, (prompt, completion) in enumerate(spans):
            start = prompt_width - prompt
            ids[row, start : prompt_width + completion] = torch.randint(3, 60, (prompt + completion,),
                                                                        generator=generator)  # fmt: skip
            mask[row, start : prompt_width + completion] = 1
        batches.append((ids, mask, width - prompt_width))
    for ids, mask, completion_width in batches:
        with torch.no_grad():
            want, got = (run._get_per_token_logps_and_entropies(run.model, ids, mask, completion_width)[0]
                         for run in runs)  # fmt: skip
        scored = mask[:, -completion_width:].bool()
        assert torch.allclose(got[scored], want[scored], atol=1e-6, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_dpo_trains_padded_to_a_multiple_as_stock(rope, shared):
    """Pairs of at most 10 tokens padded to 32: three steps log the same history and reach the same weights."""
    quiet()
    runs = []
    for cls, more in ((DPOTrainer, {}), (PackedDPOTrainer, {"shared_prompt": shared})):
        torch.manual_seed(0)
        model = sharpened(LlamaForCausalLM(config(rope)))
        args = DPOConfig(
            output_dir="/tmp/zephon-dpo-rope", per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False,
            pad_to_multiple_of=32,
        )  # fmt: skip
        run = cls(model=model, ref_model=copy.deepcopy(model), args=args,
                  train_dataset=pairs(12, prompt=(2, 5), response=(1, 4)), processing_class=tokenizer(), **more)  # fmt: skip
        run.train()
        runs.append(run)
    histories = [[entry for entry in run.state.log_history if "loss" in entry] for run in runs]
    assert len(histories[0]) == len(histories[1]) == 3
    for want, got in zip(*histories, strict=True):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    # TRL's head computes in float32; Adam turns its rounding on near-zero gradients into up to ~1e-6 (a
    # wrong pick of frequencies: ~1e-2).
    weights = zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in weights) < 5e-6


def test_reward_model_trains_padded_to_a_multiple_as_stock(rope):
    """Reward pairs of at most 11 tokens padded to 32: the same history and weights after three steps."""
    quiet()
    generator = torch.Generator().manual_seed(0)

    def sequence() -> list[int]:
        length = int(torch.randint(2, 11, (1,), generator=generator))
        return [*torch.randint(3, 63, (length,), generator=generator).tolist(), 1]

    data = Dataset.from_list([{"chosen_ids": sequence(), "rejected_ids": sequence()} for _ in range(12)])
    runs = []
    for cls in (RewardTrainer, PackedRewardTrainer):
        torch.manual_seed(0)
        model = sharpened(LlamaForSequenceClassification(config(rope, num_labels=1)))
        args = RewardConfig(
            output_dir="/tmp/zephon-reward-rope", per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False,
            pad_to_multiple_of=32,
        )  # fmt: skip
        run = cls(model=model, args=args, train_dataset=data, processing_class=tokenizer())
        run.train()
        runs.append(run)
    histories = [[entry for entry in run.state.log_history if "loss" in entry] for run in runs]
    assert len(histories[0]) == len(histories[1]) == 3
    for want, got in zip(*histories, strict=True):
        for key in ("loss", "grad_norm", "mean_reward", "margin"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    weights = zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in weights) < 1e-10


def test_the_rotary_forward_is_restored_and_others_are_left_alone():
    """Within the context only length-dependent rotary embeddings are rerouted; after it, nothing is."""
    model = LlamaForCausalLM(config("longrope"))
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    rotary = model.model.rotary_emb
    with padded_rope(model, 24), padded_rope(plain, 24):
        assert "forward" in vars(rotary)
        assert "forward" not in vars(plain.model.rotary_emb)
        x, short = torch.zeros(1, 3, 8), torch.arange(3)[None]
        cos, _ = rotary(x, short)
        assert cos.shape == (1, 3, 8)
        assert torch.equal(rotary.inv_freq, rotary.long_inv_freq)  # chosen for a width of 24 > 16
    assert "forward" not in vars(rotary)
    rotary(torch.zeros(1, 3, 8), torch.arange(3)[None])
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)  # 3 positions alone: the short factors
    with padded_rope(model, None):
        assert "forward" not in vars(rotary)


def test_a_phimoe_reward_model_scores_as_stock():
    """PhiMoE's rotary embedding picks its scale (``short_mscale`` 1.0, ``long_mscale`` 1.2 here) from the
    call's largest position in its own forward: pairs padded to 32 past its original 16 get the long one,
    stock and packed. In eval mode (its training router samples): the same rewards, loss and gradients."""
    from transformers import PhimoeConfig, PhimoeForSequenceClassification

    quiet()
    rope = {**ROPES["longrope"], "short_mscale": 1.0, "long_mscale": 1.2}
    settings = config("longrope").to_dict() | {"rope_parameters": rope, "num_labels": 1}
    settings |= {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "original_max_position_embeddings": ORIGINAL,
    }
    generator = torch.Generator().manual_seed(0)

    def sequence() -> list[int]:
        length = int(torch.randint(2, 11, (1,), generator=generator))
        return [*torch.randint(3, 63, (length,), generator=generator).tolist(), 1]

    data = Dataset.from_list([{"chosen_ids": sequence(), "rejected_ids": sequence()} for _ in range(4)])
    args = RewardConfig(
        output_dir="/tmp/zephon-reward-rope", per_device_train_batch_size=4, max_steps=1, report_to=[],
        use_cpu=True, seed=0, bf16=False, pad_to_multiple_of=32,
    )  # fmt: skip
    results = []
    for cls in (RewardTrainer, PackedRewardTrainer):
        torch.manual_seed(0)
        phimoe = PhimoeConfig(**{key: value for key, value in settings.items() if key != "model_type"})
        phimoe._attn_implementation = "sdpa"
        phimoe._experts_implementation = "eager"  # the grouped matmul takes no float64
        run = cls(model=sharpened(PhimoeForSequenceClassification(phimoe)), args=args, train_dataset=data,
                  processing_class=tokenizer())  # fmt: skip
        batch = next(iter(run.get_train_dataloader()))
        run.model.eval()
        loss, out = run.compute_loss(run.model, dict(batch), return_outputs=True)
        loss.backward()
        results.append((loss.detach(), out.logits.detach(), [p.grad for p in run.model.parameters()]))
    (want_loss, want, want_grads), (got_loss, got, grads) = results
    assert float((got - want).abs().max()) < 1e-12, (got.flatten().tolist(), want.flatten().tolist())
    assert abs(float(got_loss - want_loss)) < 1e-12
    for a, b in zip(grads, want_grads, strict=True):
        assert (a is None and b is None) or float((a - b).abs().max()) < 1e-10
