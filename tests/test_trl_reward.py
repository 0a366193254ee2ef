"""Collator.for_rewards against TRL's reward collator, and PackedRewardTrainer against stock trl.RewardTrainer:
the same batch key for key, the same scores read at ``last_token_index``, the same loss, gradients and metrics
(margin and ``center_rewards_coefficient`` included), and the same model after several optimizer steps (tiny
Llama sequence classifier from a config, float64 weights)."""

from __future__ import annotations

import random
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import sys
from pathlib import Path

from datasets import Dataset, disable_progress_bars
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForSequenceClassification
from transformers.utils import logging
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference

from zephon_collate import Collator, use_host_pass
from zephon_collate.trainers import PackedRewardTrainer
from zephon_collate.trainers.rewards import PackedRewards
from zephon_collate.transforms import AttentionMask

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl_dpo import tokenizer

PAD, EOS = 0, 1


def classifier(pad_token_id: int = PAD) -> LlamaForSequenceClassification:
    """A 2-layer Llama reward model from a config, seeded, float64, SDPA."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=pad_token_id, eos_token_id=EOS,
        bos_token_id=EOS, num_labels=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForSequenceClassification(config).to(torch.float64)


def pairs(count: int, *, margin: bool = False, seed: int = 0, low: int = 2, high: int = 20) -> list[dict]:
    """Tokenized reward pairs (whole sequences ending in EOS), of mixed lengths."""
    rng = random.Random(seed)

    def sequence() -> list[int]:
        return [rng.randint(3, 63) for _ in range(rng.randint(low, high))] + [EOS]

    out = []
    for _ in range(count):
        pair: dict[str, Any] = {"chosen_ids": sequence(), "rejected_ids": sequence()}
        if margin:
            pair["margin"] = rng.choice([0.0, 0.5, 1.25, -0.75])
        out.append(pair)
    return out


def trainer(
    cls: type,
    data: list[dict],
    steps: int = 3,
    pad_token_id: int = PAD,
    peft_config: Any = None,
    **options: Any,
) -> Any:
    disable_progress_bars()
    logging.set_verbosity_error()
    args = RewardConfig(
        output_dir="/tmp/zephon-reward", per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False, **options,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            model=classifier(pad_token_id),
            args=args,
            train_dataset=Dataset.from_list(data),
            processing_class=tokenizer(),
            peft_config=peft_config,
        )


# -- the collator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("multiple", [None, 8])
def test_padded_batch_equals_trls_reward_collator(margin, multiple):
    """TRL's keys and values, in TRL's order, then last_token_index; the legacy spelling reads alike."""
    data = pairs(5, margin=margin)
    want = DataCollatorForPreference(pad_token_id=PAD, pad_to_multiple_of=multiple)(data)
    collate = Collator.for_rewards(pad_token_id=PAD, pad_to_multiple_of=multiple)
    legacy = [
        {"chosen_input_ids": p["chosen_ids"], "rejected_input_ids": p["rejected_ids"]}
        | ({"margin": p["margin"]} if margin else {})
        for p in data
    ]
    for samples in (data, legacy):
        got = collate(samples)
        assert list(got) == [*want, "last_token_index"]
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        lengths = want["attention_mask"].sum(dim=1)
        width = want["input_ids"].shape[1]
        assert got["last_token_index"].tolist() == [r * width + int(n) - 1 for r, n in enumerate(lengths)]


def test_tokenizer_gives_the_padding_and_the_prompt_goes_first():
    """A tokenizer's pad token pads; prompt_ids go before both sides, as RewardTrainer joins an explicit
    prompt to each side before it tokenizes; per-side attention masks drop their padding."""
    given = [
        {
            "prompt_ids": [9, 9],
            "chosen_ids": [5, 6, 0],
            "chosen_attention_mask": [1, 1, 0],
            "rejected_ids": [7],
        }
    ]
    batch = Collator.for_rewards(tokenizer())(given)
    assert batch["input_ids"].tolist() == [[9, 9, 5, 6], [9, 9, 7, 0]]
    assert batch["last_token_index"].tolist() == [3, 6]
    assert "labels" not in batch and "position_ids" not in batch


def test_openrlhf_pairs_read_extra_as_the_margin():
    given = [
        {"chosen_ids": [5, 6], "reject_ids": [7], "extra": 0.5},
        {"chosen_ids": [8], "reject_ids": [9], "extra": 1},
    ]
    batch = Collator.for_rewards(pad_token_id=PAD)(given)
    assert batch["input_ids"].tolist() == [[5, 6], [8, 0], [7, 0], [9, 0]]
    assert batch["margin"].tolist() == [0.5, 1.0] and batch["margin"].dtype == torch.float32


def reference_last_tokens(data: list[dict], padded_width: int | None, skip: int | None) -> list[int]:
    """Each sequence's last token (not ``skip``; its first where every one is) in TRL's order, counted
    token by token in the flattened batch."""
    sequences = [p["chosen_ids"] for p in data] + [p["rejected_ids"] for p in data]
    out, start = [], 0
    for row, tokens in enumerate(sequences):
        base = row * padded_width if padded_width is not None else start
        kept = [t for t, token in enumerate(tokens) if token != skip]
        out.append(base + (kept[-1] if kept else 0))
        start += len(tokens)
    return out


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    skip=st.sampled_from([None, EOS]),
    padding_free=st.booleans(),
)
def test_last_token_index_against_a_reference(lengths, seed, skip, padding_free):
    """Padded and padding-free, host and torch alike: each sequence's last token (not ``skip``)."""
    rng = random.Random(seed)
    data = [
        {
            "chosen_ids": [rng.choice([EOS, 5, 6]) for _ in range(a)],
            "rejected_ids": [rng.choice([EOS, 7]) for _ in range(b)],
        }
        for a, b in lengths
    ]
    collate = Collator.for_rewards(pad_token_id=PAD, padding_free=padding_free, last_token_skip_id=skip)
    for host in (True, False):
        with use_host_pass(host):
            batch = collate(data)
        width = None if padding_free else batch["input_ids"].shape[1]
        assert batch["last_token_index"].tolist() == reference_last_tokens(data, width, skip)
        flat = batch["input_ids"].flatten()
        if skip is None:
            ends = [p["chosen_ids"][-1] for p in data] + [p["rejected_ids"][-1] for p in data]
            assert flat[batch["last_token_index"]].tolist() == ends


# -- scores ---------------------------------------------------------------------------------------


def test_scores_at_last_token_index_equal_the_models_padded_logits():
    model = classifier().eval()
    data = pairs(6)
    with torch.no_grad():
        want = model(**DataCollatorForPreference(pad_token_id=PAD)(data), use_cache=False).logits
        padded = Collator.for_rewards(pad_token_id=PAD)(data)
        hidden = model.model(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]
        ).last_hidden_state
        from_padded = model.score(hidden.flatten(0, 1)[padded["last_token_index"]])
        flat = Collator.for_rewards(padding_free=True)(data)
        hidden = model.model(
            input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False
        ).last_hidden_state
        from_flat = model.score(hidden.flatten(0, 1)[flat["last_token_index"]])
    assert want.shape == from_flat.shape == (12, 1)
    assert float((from_padded - want).abs().max()) <= 1e-6
    assert float((from_flat - want).abs().max()) <= 1e-6


# -- the trainer ----------------------------------------------------------------------------------


def one_batch(stock: Any, packed: Any) -> dict[str, Any]:
    """Loss, gradients and metrics of one batch through both trainers."""
    examples = [stock.train_dataset[i] for i in range(4)]
    out = {}
    for name, run in (("stock", stock), ("packed", packed)):
        loss = run.compute_loss(run.model, run.data_collator(examples))
        loss.backward()
        grads = [p.grad.clone() for p in run.model.parameters()]
        metrics = {key: values[-1] for key, values in run._metrics["train"].items()}
        out[name] = (loss.detach(), grads, metrics)
    return out


CASES = [
    {},
    {"margin": True},
    {"margin": True, "center_rewards_coefficient": 0.01},
    {"pad_to_multiple_of": 8, "center_rewards_coefficient": 0.1},
]


@pytest.mark.parametrize("rows", ["fit", "one"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_one_batch_equals_stock(case, rows):
    """Loss, gradients and every metric (num_tokens included) to 1e-6, in SDPA's best-fit rows and in
    FlashAttention's one row."""
    options = {key: value for key, value in case.items() if key != "margin"}
    data = pairs(8, margin=bool(case.get("margin")))
    packed = trainer(PackedRewardTrainer, data, **options)
    view = DataCollatorForPreference(pad_token_id=PAD, pad_to_multiple_of=options.get("pad_to_multiple_of"))
    packed.packing = PackedRewards(view, packed.model.config.pad_token_id, rows)
    assert (packed.packing(data[:4])["input_ids"].shape[0] == 1) == (rows == "one")
    out = one_batch(trainer(RewardTrainer, data, **options), packed)
    (stock_loss, stock_grads, stock_metrics), (loss, grads, metrics) = out["stock"], out["packed"]
    assert abs(float(loss) - float(stock_loss)) <= 1e-6
    for a, b in zip(grads, stock_grads, strict=True):
        assert float((a - b).abs().max()) <= 1e-6
    assert metrics.keys() == stock_metrics.keys() and "num_tokens" in metrics
    for key, value in stock_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_training_steps_equal_stock():
    """Four optimizer steps with a margin and gradient accumulation: the same logged history (every
    metric) and the same weights."""
    runs = []
    data = pairs(32, margin=True)
    for cls in (RewardTrainer, PackedRewardTrainer):  # each built, then trained: Trainer seeds at build
        runs.append(
            trainer(cls, data, steps=4, gradient_accumulation_steps=2, center_rewards_coefficient=0.01)
        )
        runs[-1].train()
    stock, packed = (run.state.log_history for run in runs)
    assert len([entry for entry in stock if "loss" in entry]) == 4
    for a, b in zip(stock, packed, strict=True):
        for key in (
            "loss",
            "grad_norm",
            "accuracy",
            "margin",
            "mean_reward",
            "min_reward",
            "max_reward",
            "num_tokens",
        ):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
    weights = zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True)
    assert max(float((a - b).abs().max()) for a, b in weights) < 1e-6


def test_a_lora_adapter_trains_as_stock():
    """A LoRA adapter on the classifier (PEFT's sequence-classification wrapper passes ``return_dict``):
    the same logged history and the same adapter and score weights after three steps. Prompt learning,
    which feeds ``inputs_embeds`` the packed forward does not lay out, is refused when the trainer is built."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS", init_lora_weights=False
    )
    data, runs = pairs(16, margin=True), []
    for cls in (RewardTrainer, PackedRewardTrainer):
        runs.append(trainer(cls, data, steps=3, peft_config=lora))
        runs[-1].train()
    stock, packed = (run.state.log_history for run in runs)
    assert len([entry for entry in stock if "loss" in entry]) == 3
    for a, b in zip(stock, packed, strict=True):
        for key in ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "num_tokens"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-9), key
    trained = [dict(run.model.named_parameters()) for run in runs]
    assert any("lora_" in name for name in trained[0]) and trained[0].keys() == trained[1].keys()
    assert max(float((trained[0][k] - trained[1][k]).abs().max()) for k in trained[0]) < 1e-9
    prompt = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2)
    with pytest.raises(ValueError, match=r"PackedRewardTrainer: .*prompt.*inputs_embeds.*RewardTrainer"):
        trainer(PackedRewardTrainer, data, peft_config=prompt)


def test_pad_equal_to_eos_scores_the_token_the_model_pools():
    """pad_token = eos_token (TRL's fallback): the model pools the last token that is not the pad id,
    and so does the packed trainer."""
    data = pairs(8, margin=True)
    # RewardTrainer sets the model's pad id from its own pad token: give that the EOS, or the run pads
    # with 0 and never tests pad = EOS.
    runs = [
        trainer(cls, data, pad_token_id=EOS, pad_token="<eos>")
        for cls in (RewardTrainer, PackedRewardTrainer)
    ]
    assert [run.model.config.pad_token_id for run in runs] == [EOS, EOS]
    out = one_batch(*runs)
    assert abs(float(out["packed"][0]) - float(out["stock"][0])) <= 1e-6
    for a, b in zip(out["packed"][1], out["stock"][1], strict=True):
        assert float((a - b).abs().max()) <= 1e-6


def test_the_transformer_sees_only_real_tokens_and_other_calls_run_stock():
    run = trainer(PackedRewardTrainer, pairs(8))
    examples = [run.train_dataset[i] for i in range(4)]
    batch = run.packing(examples)  # SDPA: best-fit rows as wide as the longest sequence
    padded = DataCollatorForPreference(pad_token_id=PAD)(examples)
    real = int(padded["attention_mask"].sum())
    assert batch["input_ids"].shape[1] == int(padded["attention_mask"].sum(dim=1).max())
    assert (
        int(batch["attention_mask"].sum()) == real <= batch["input_ids"].numel() < padded["input_ids"].numel()
    )
    # FlashAttention's layout: one row of every real token (the collator the trainer builds for it)
    one = PackedRewards(DataCollatorForPreference(pad_token_id=PAD), run.model.config.pad_token_id)(examples)
    assert one["input_ids"].shape == (1, real)
    assert torch.equal(one["attention_mask"], torch.ones_like(one["input_ids"]))
    scored = batch["input_ids"].flatten()[batch["last_token_index"]]
    assert torch.equal(scored, one["input_ids"].flatten()[one["last_token_index"]])
    assert "labels" not in batch
    stock = classifier()
    with torch.no_grad():  # a call without last_token_index: the model's own forward
        assert torch.equal(run.model(**padded).logits, stock(**padded).logits)


def test_packed_collator_keeps_a_for_rewards_collators_options():
    view = Collator.for_rewards(pad_token_id=PAD, pad_to_multiple_of=4)
    batch = PackedRewards(view, skip_id=None)([{"chosen_ids": [5, 6], "rejected_ids": [7]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert batch["last_token_index"].tolist() == [1, 2]


def test_trainer_refusals():
    """Another collate function (its batch cannot be packed); a packed call with inputs the packed forward
    does not lay out."""
    with pytest.raises(TypeError, match=r"PackedRewardTrainer: packs the pairs itself.*got function"):
        PackedRewards(lambda examples: {}, skip_id=None)
    with pytest.raises(ValueError, match=r"padding_free=True\); give the padded collator"):
        PackedRewards(Collator.for_rewards(pad_token_id=PAD, padding_free=True), skip_id=None)
    with pytest.raises(ValueError, match=r"runs transforms of yours, on the padded batch"):
        PackedRewards(Collator.for_rewards(pad_token_id=PAD, transforms=[AttentionMask()]), skip_id=None)
    run = trainer(PackedRewardTrainer, pairs(4))
    batch = run.packing([run.train_dataset[i] for i in range(2)])
    embeds = torch.zeros(1, batch["input_ids"].shape[1], 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"packed call.*'inputs_embeds'"):
        run.model(**batch, inputs_embeds=embeds)
    as_tuple = run.model(**batch, return_dict=False)  # as transformers' models answer it
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], run.model(**batch).logits)


@pytest.mark.parametrize("field", ["prompt_ids", "prompt_input_ids", "chosen_attention_mask"])
def test_the_trainer_reads_what_trls_collator_reads(field):
    """RewardTrainer's collator reads chosen_ids, rejected_ids and margin only (each side the whole
    sequence); kept by ``remove_unused_columns=False``, a prompt or a mask Collator.for_rewards would read
    changes nothing: the packed trainer packs the batch TRL's collator made, and trains as stock."""
    data = [
        {**pair, field: [9, 10] if "ids" in field else [1] * len(pair["chosen_ids"])} for pair in pairs(8)
    ]
    runs = [
        trainer(cls, data, steps=2, remove_unused_columns=False)
        for cls in (RewardTrainer, PackedRewardTrainer)
    ]
    for run in runs:
        run.train()
    stock, packed = ([entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in runs)
    assert len(stock) == 2 and packed == pytest.approx(stock, abs=1e-9)


def test_dispatched_batches_score_as_stock():
    """accelerate dispatches an iterable dataset's batches (and any with ``dispatch_batches=True``),
    slicing every tensor by rows: the trainer packs each batch after that, so its evaluation of an
    iterable dataset and its dispatched training steps log stock's numbers (a batch packed by the collator
    lost all but its first rows' worth of ``last_token_index``)."""
    data = pairs(8, margin=True)
    dataset = Dataset.from_list(data)
    logged = []
    for cls in (RewardTrainer, PackedRewardTrainer):
        run = trainer(cls, data, steps=2, accelerator_config={"dispatch_batches": True})
        run.train()
        train = [entry for entry in run.state.log_history if "loss" in entry]
        evaluated = [
            run.evaluate(eval_dataset=dataset),
            run.evaluate(eval_dataset=dataset.to_iterable_dataset()),
        ]
        logged.append((train, evaluated))
    (stock_train, stock_eval), (train, evaluated) = logged
    for a, b in zip(stock_train, train, strict=True):
        for key in ("loss", "accuracy", "margin", "mean_reward"):
            assert b[key] == pytest.approx(a[key], abs=1e-9), key
    for got in evaluated:
        for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward"):
            assert got[key] == pytest.approx(stock_eval[0][key], abs=1e-9), key


# -- refusals -------------------------------------------------------------------------------------


REFUSALS = [
    ([{"chosen_ids": [5, 6]}], ValueError, r"example 0: has no rejected tokens.*'rejected_ids'"),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}],
        ValueError,
        r"example 0: carries 'ref_chosen_logps', a field of DPO pairs.*Collator.for_preference",
    ),
    (
        [{"chosen_input_ids": [5], "rejected_input_ids": [6], "chosen_labels": [5], "rejected_labels": [6]}],
        ValueError,
        r"example 0: carries 'chosen_labels', a field of DPO pairs",
    ),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "margin": 1.0}, {"chosen_ids": [5], "rejected_ids": [6]}],
        ValueError,
        r"example 1: lacks 'margin', which other pairs of the batch carry",
    ),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "margin": "high"}],
        TypeError,
        r"example 0: 'margin' is 'high'.*one real number",
    ),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "margin": [1.0, 2.0]}],
        ValueError,
        r"example 0: 'margin' is .*one real number",
    ),
    ([{"chosen_ids": [5], "rejected_ids": [6], "margin": True}], TypeError, r"example 0: 'margin' is True"),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "margin": float("nan")}],
        ValueError,
        r"'margin' is nan.*finite",
    ),
    (
        [{"chosen_ids": [5], "rejected_ids": [6], "margin": torch.tensor(float("inf"))}],
        ValueError,
        r"'margin' is inf",
    ),
    (
        [{"chosen_ids": [5], "rejected_ids": []}],
        ValueError,
        r"example 0: its rejected side \('rejected_ids'\) holds no tokens",
    ),
    (
        [{"chosen_ids": [5, 0], "chosen_attention_mask": [0, 0], "rejected_ids": [6]}],
        ValueError,
        r"example 0: its chosen side .* holds no tokens \(once its padding is dropped\)",
    ),
    (
        [{"chosen_ids": [5], "reject_ids": [6], "extra": 0.0, "prompt_ids": [1]}],
        ValueError,
        r"example 0: carries 'reject_ids' \(OpenRLHF's reward pairs.*beside 'prompt_ids'.*one format",
    ),
    ([{"chosen_ids": [5], "reject_ids": [6], "extra": None}], TypeError, r"example 0: 'extra' is None"),
    ([{"chosen_ids": [5, 6, 7], "rejected_ids": [6]}, "pair"], TypeError, r"example 1: must be a dict"),
]


@pytest.mark.parametrize("samples, kind, match", REFUSALS)
def test_refusals_name_the_example_the_field_and_the_fix(samples, kind, match):
    before = repr(samples)
    with pytest.raises(Exception) as info:
        Collator.for_rewards(pad_token_id=PAD)(samples)
    assert type(info.value) is kind, info.value
    assert re.search(match, str(info.value)), str(info.value)
    assert repr(samples) == before  # inputs never changed


def test_option_refusals():
    with pytest.raises(ValueError, match=r"for_rewards: shared_prompt is not offered for reward pairs"):
        Collator.for_rewards(pad_token_id=PAD, shared_prompt=True)
    with pytest.raises(TypeError, match=r"for_rewards: last_token_skip_id must be an int >= 0"):
        Collator.for_rewards(pad_token_id=PAD, last_token_skip_id="eos")
    with pytest.raises(ValueError, match=r"for_rewards: the padded layout needs pad_token_id"):
        Collator.for_rewards()
    with pytest.raises(
        ValueError, match=r"example 0: its chosen sequence has 3 tokens, more than max_length=2"
    ):
        Collator.for_rewards(pad_token_id=PAD, max_length=2)([{"chosen_ids": [5, 6, 7], "rejected_ids": [6]}])
    with pytest.raises(ValueError, match=r"for_rewards: the batch holds no pairs"):
        Collator.for_rewards(pad_token_id=PAD)([])


def test_tokens_per_step_on_a_length_mix():
    """The measured saving the docs quote: pairs of 20 to 400 tokens, batches of 8 pairs."""
    data = pairs(256, low=20, high=400, seed=3)
    padded = packed = 0
    for start in range(0, len(data), 8):
        chunk = data[start : start + 8]
        padded += DataCollatorForPreference(pad_token_id=PAD)(chunk)["input_ids"].numel()
        packed += Collator.for_rewards(padding_free=True)(chunk)["input_ids"].numel()
    assert 1.4 < padded / packed < 2.0, padded / packed
    np.testing.assert_equal(packed, sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in data))
