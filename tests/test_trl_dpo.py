"""PackedDPOTrainer against stock trl.DPOTrainer: the same loss, gradients and metrics, and the same model after
several optimizer steps, for every loss type TRL ships (tiny Llama from a config, float64 weights; TRL's fused
head computes its log-probs in float32, which sets the tolerance)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import sys
from pathlib import Path

from trl import DPOTrainer

from zephon_collate.trainers import PackedDPOTrainer, PackedPreference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import trl_dpo
from trl_dpo import llama


def trainer(cls: type, steps: int = 3, **options: Any) -> Any:
    return trl_dpo.trainer(cls, trl_dpo.pairs(12), steps, **options)


def one_batch(stock: Any, packed: Any) -> dict[str, Any]:
    """Loss, gradients and metrics of one batch through both trainers."""
    examples = [stock.train_dataset[i] for i in range(4)]
    out = {}
    for name, run in (("stock", stock), ("packed", packed)):
        loss = run.compute_loss(run.model, run.data_collator(examples))
        loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in run.model.parameters()]
        metrics = {key: values[-1] for key, values in run._metrics["train"].items()}
        out[name] = (loss.detach(), grads, metrics)
    return out


LOSS_TYPES = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
SMOOTHED = {"exo_pair", "robust", "aot", "aot_unpaired"}
CASES = [
    {"loss_type": [kind], **({"label_smoothing": 0.1} if kind in SMOOTHED else {})} for kind in LOSS_TYPES
] + [
    {"f_divergence_type": "forward_kl"},
    {"f_divergence_type": "js_divergence"},
    {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    {"ld_alpha": 0.5},
    {"use_weighting": True},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
]


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_one_batch_equals_stock(options, shared):
    """Loss and metrics to 1e-6, gradients to 1e-6 + 1e-5 relative (TRL's head computes in float32)."""
    out = one_batch(
        trainer(DPOTrainer, **options), trainer(PackedDPOTrainer, shared_prompt=shared, **options)
    )
    (stock_loss, stock_grads, stock_metrics), (loss, grads, metrics) = out["stock"], out["packed"]
    assert torch.allclose(loss, stock_loss, atol=1e-6, rtol=0), (float(loss), float(stock_loss))
    for a, b in zip(grads, stock_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    assert metrics.keys() == stock_metrics.keys()
    for key, value in stock_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_training_steps_equal_stock(shared):
    """Five optimizer steps with gradient accumulation: the same logged history and the same weights."""
    runs = []
    for cls, options in ((DPOTrainer, {}), (PackedDPOTrainer, {"shared_prompt": shared})):
        runs.append(trainer(cls, steps=5, gradient_accumulation_steps=2, **options))
        runs[-1].train()  # each built, then trained: Trainer seeds at build
    stock, packed = (run.state.log_history for run in runs)
    losses = [(a["loss"], b["loss"]) for a, b in zip(stock, packed, strict=True) if "loss" in a]
    assert len(losses) == 5
    for a, b in losses:
        assert b == pytest.approx(a, abs=1e-6)
    weights = zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True)
    # TRL's head rounds its log-probs to float32; a shared prompt's rows are of another width, so the
    # float64 hidden states differ in their last bits and Adam carries the rounding over five steps.
    assert max(float((a - b).abs().max()) for a, b in weights) < (5e-6 if shared else 1e-6)


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_precomputed_reference_equals_stock(shared):
    """precompute_ref_log_probs: the same reference columns, then the same loss."""
    stock = trainer(DPOTrainer, precompute_ref_log_probs=True)
    packed = trainer(PackedDPOTrainer, precompute_ref_log_probs=True, shared_prompt=shared)
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        assert packed.train_dataset[key] == pytest.approx(stock.train_dataset[key], abs=1e-9)
    out = one_batch(stock, packed)
    assert float(out["packed"][0]) == pytest.approx(float(out["stock"][0]), abs=1e-6)


def test_the_transformer_sees_only_real_tokens():
    """Under SDPA the sequences are best-fit into rows as wide as the longest; in one row (FlashAttention's
    layout) every real token is there once, and nothing else."""
    run = trainer(PackedDPOTrainer)
    examples = [run.train_dataset[i] for i in range(4)]
    batch = run.packing(examples)
    grid, real = batch["packed"]["input_ids"], int(batch["attention_mask"].sum())
    assert grid.shape[1] == int(batch["attention_mask"].sum(dim=1).max())
    assert real <= grid.numel() <= batch["input_ids"].numel()
    one = PackedPreference(run.data_collator, rows="one")(examples)["packed"]
    assert one["input_ids"].shape == (1, real)
    assert sorted(one["input_ids"][0].tolist()) == sorted(
        batch["input_ids"][batch["attention_mask"].bool()].tolist()
    )


def test_generation_runs_the_stock_forward():
    """A call without the packed batch (generation, evaluation of other code) is untouched."""
    run = trainer(PackedDPOTrainer)
    prompt = torch.tensor([[3, 4, 5]])
    reference = llama()
    expected = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(
        run.model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0), expected
    )


def _view(rows: dict[str, list[list[int]]]) -> Any:
    return lambda examples: {key: torch.tensor(value) for key, value in rows.items()}


def test_packed_preference_refuses_left_padding():
    view = _view(
        {
            "input_ids": [[5, 6], [0, 7]],
            "attention_mask": [[1, 1], [0, 1]],
            "completion_mask": [[0, 1], [0, 1]],
        }
    )
    with pytest.raises(ValueError, match=r"row 1's attention_mask is not ones then zeros.*pad on the right"):
        PackedPreference(view)([])


def test_packed_preference_names_missing_keys():
    view = _view({"input_ids": [[5, 6]], "attention_mask": [[1, 1]]})
    with pytest.raises(ValueError, match=r"lacks \['completion_mask'\].*DataCollatorForPreference"):
        PackedPreference(view)([])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sft"])
def test_one_row_layout_equals_stock(loss_type):
    """The FlashAttention layout (every sequence in one row), run here through SDPA's packed mask."""
    packed = trainer(PackedDPOTrainer, loss_type=[loss_type])
    packed.packing.rows = "one"
    out = one_batch(trainer(DPOTrainer, loss_type=[loss_type]), packed)
    assert float(out["packed"][0]) == pytest.approx(float(out["stock"][0]), abs=1e-6)
    for a, b in zip(out["packed"][1], out["stock"][1], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_inputs_packing_does_not_lay_out_run_trls_own_forward():
    """Token types (or vision inputs, inputs_embeds) are not laid out by packing: TRL's padded forward runs,
    and gives its own numbers; PEFT's None-valued keywords do not count."""
    run = trainer(PackedDPOTrainer)
    batch = run.packing([run.train_dataset[i] for i in range(2)])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    view = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
    with torch.no_grad():
        stock = run.model(**view, fused_lm_head=True, token_type_ids=torch.zeros_like(labels))
        packed = run.model(
            **view, fused_lm_head=True, packed=batch["packed"], token_type_ids=torch.zeros_like(labels)
        )
        nones = run.model(
            **view, fused_lm_head=True, packed=batch["packed"], inputs_embeds=None, return_dict=None
        )
    assert torch.equal(packed.log_probs, stock.log_probs)
    assert torch.allclose(nones.log_probs, stock.log_probs, atol=1e-6)


def test_the_packed_forwards_loss_counts_a_shared_token_once_per_row():
    """Two completions of one prompt that start alike: the tree scores the shared token once, TRL's padded
    batch once per row; the forward's ``loss`` is TRL's (it was the tree's, 4.201615 for 4.202002)."""
    from trl.trainer.utils import add_fused_lm_head

    from zephon_collate.trainers.view import pack_view, wrap_forward

    model = llama(dtype=torch.float64)
    add_fused_lm_head(model, outputs=("log_probs",))
    wrap_forward(model)
    ids = torch.tensor([[5, 6, 7, 9, 10, 11], [5, 6, 7, 9, 10, 12]])
    trained = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    view = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(trained == 0, -100),
    }
    with torch.no_grad():
        stock = model(**view, fused_lm_head=True)
        for shared in (False, True):
            packed = pack_view(ids, view["attention_mask"], trained, "one", "test", shared_prompt=shared)
            out = model(**view, fused_lm_head=True, packed=packed)
            assert torch.equal(out.log_probs, stock.log_probs)
            assert float(out.loss) == pytest.approx(float(stock.loss), abs=1e-12)
            counted = model(**view, fused_lm_head=True, packed=packed, num_items_in_batch=torch.tensor(4))
            assert float(counted.loss) == pytest.approx(float(-stock.log_probs.sum() / 4), abs=1e-12)


def test_a_model_that_attends_across_packed_sequences_is_refused():
    """OPT's attention does not restart at position_ids 0: packed, a sequence would see the one before it."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=16, pad_token_id=0)  # fmt: skip
    model = OPTForCausalLM(config)
    with pytest.raises(ValueError, match=r"PackedDPOTrainer: OPTForCausalLM lets packed sequences attend"):
        PackedDPOTrainer(model=model, ref_model=OPTForCausalLM(config), args=trl_dpo.DPOConfig(
            output_dir="/tmp/zephon-dpo-opt", report_to=[], use_cpu=True, bf16=False),
            train_dataset=trl_dpo.pairs(4), processing_class=trl_dpo.tokenizer())  # fmt: skip


def test_layout_follows_the_attention_and_generation_keeps_the_signature():
    import inspect

    from zephon_collate.trainers.view import packed_rows

    model = llama()
    assert packed_rows(model) == "fit"
    model.config._attn_implementation = "flash_attention_2"
    assert packed_rows(model) == "one"
    model.config._attn_implementation = "sdpa"
    model.config.output_router_logits = True  # an MoE's load-balancing loss counts every token of a row
    assert packed_rows(model) == "one"
    run = trainer(PackedDPOTrainer)
    assert "input_ids" in inspect.signature(run.model.forward).parameters  # generate validates against it


def test_packed_preference_refuses_an_unknown_row_layout():
    with pytest.raises(ValueError, match=r"rows must be 'one' or 'fit', got 'two'"):
        PackedPreference(_view({}), rows="two")  # type: ignore[arg-type]


def test_a_shared_prompt_goes_through_the_transformer_once():
    """Each pair's prompt once (its last token copied to open each branch), both responses after it; the
    4-D mask keeps a response from its sibling."""
    run = trainer(PackedDPOTrainer, shared_prompt=True)
    examples = [run.train_dataset[i] for i in range(4)]
    batch = run.packing(examples)
    packed, mask = batch["packed"], batch["attention_mask"]
    pairs = mask.shape[0] // 2
    prompts = (batch["completion_mask"].cumsum(dim=1) == 0) & mask.bool()
    real = int(mask.sum()) - int(prompts[pairs:].sum()) + pairs  # the rejected copies of the prompt go
    assert int(packed["attention_mask"].shape[-1]) == packed["input_ids"].shape[1]
    kept = sum(int(row.diagonal().sum()) for row in packed["attention_mask"][:, 0])
    assert kept == packed["input_ids"].numel()  # every place attends to itself (padding too)
    assert int((packed["shift_labels"] != -100).sum()) == int((batch["completion_mask"][:, 1:] != 0).sum())
    counted = PackedPreference(run.data_collator, rows="one", shared_prompt=True)(examples)["packed"]
    assert counted["input_ids"].shape == (1, real)


def test_shared_prompt_refusals():
    from zephon_collate.trainers.view import check_packing, packed_rows

    model = llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"FlashAttention's varlen kernels cannot keep apart.*'sdpa'"):
        packed_rows(model, shared_prompt=True)

    class SegmentSums(torch.nn.Module):
        """Restarts at position_ids 0 but ignores a 4-D mask: a branch would see its sibling."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 4, dtype=torch.float64))

        def forward(self, input_ids, position_ids=None, use_cache=False, attention_mask=None):
            embedded = self.weight[input_ids]
            if position_ids is None:
                return type("Out", (), {"logits": embedded.cumsum(dim=1)})
            segment = (position_ids == 0).cumsum(dim=1)
            out = torch.stack([embedded[:, : t + 1][segment[:, : t + 1] == segment[:, t : t + 1]].sum(0)
                               for t in range(input_ids.shape[1])])  # fmt: skip
            return type("Out", (), {"logits": out[None]})

    check_packing(SegmentSums(), "PackedDPOTrainer")  # packed end to end: kept apart
    with pytest.raises(
        ValueError, match=r"does not keep a shared prompt's responses apart.*shared_prompt=False"
    ):
        check_packing(SegmentSums(), "PackedDPOTrainer", shared_prompt=True)
    view = _view({"input_ids": [[5, 6]], "attention_mask": [[1, 1]], "completion_mask": [[0, 1]]})
    # Shared prefixes are found in the whole batch (a prefix tree), so the rows need not come in pairs.
    one = PackedPreference(view, shared_prompt=True)([])["packed"]
    assert one["input_ids"].tolist() == [[5, 6]] and one["shift_labels"].tolist() == [[6, -100]]
    with pytest.raises(TypeError, match=r"shared_prompt must be a bool, got 'yes'"):
        PackedPreference(view, shared_prompt="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_a_lora_adapter_trains_as_stock(shared):
    """LoRA with no reference model (TRL scores the reference with the adapter disabled): the same logged
    history, rewards included, and the same weights after three steps."""
    peft = pytest.importorskip("peft")
    from datasets import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()
    logging.set_verbosity_error()
    runs = []
    for cls, options in ((DPOTrainer, {}), (PackedDPOTrainer, {"shared_prompt": shared})):
        args = trl_dpo.DPOConfig(
            output_dir="/tmp/zephon-dpo", per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, beta=0.1, bf16=False,
        )  # fmt: skip
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        runs.append(
            cls(model=llama(32), args=args, train_dataset=trl_dpo.pairs(12), processing_class=trl_dpo.tokenizer(),
                peft_config=lora, **options)
        )  # fmt: skip
        runs[-1].train()
    stock, packed = (run.state.log_history for run in runs)
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    assert len([entry for entry in stock if "loss" in entry]) == 3
    for a, b in zip(stock, packed, strict=True):
        for key in keys:
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
    trained = [dict(run.model.named_parameters()) for run in runs]
    assert any("lora_" in name for name in trained[0]) and trained[0].keys() == trained[1].keys()
    assert max(float((trained[0][k] - trained[1][k]).abs().max()) for k in trained[0]) < 1e-6


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_model_trains_text_packed_as_stock(family, shared):
    """Multimodal RoPE: the packed positions go in as 4 rows, the text row first, from which the text model
    builds the packed mask (given 2 rows, Qwen2-VL and Qwen2.5-VL keep none and mask nothing, so they
    were refused as attending across sequences). A text batch's loss, gradients and metrics equal stock's."""
    import copy

    from vlm_models import tiny_model

    runs = []
    for cls, options in ((DPOTrainer, {}), (PackedDPOTrainer, {"shared_prompt": shared})):
        model = tiny_model(family, torch.float64).train()
        model.config.pad_token_id = 0
        args = trl_dpo.DPOConfig(
            output_dir="/tmp/zephon-dpo", per_device_train_batch_size=4, max_steps=1, report_to=[],
            use_cpu=True, bf16=False, gradient_checkpointing=False, beta=0.1,
        )  # fmt: skip
        runs.append(
            cls(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=trl_dpo.pairs(12),
                processing_class=trl_dpo.tokenizer(), **options)
        )  # fmt: skip
    out = one_batch(*runs)
    (stock_loss, stock_grads, stock_metrics), (loss, grads, metrics) = out["stock"], out["packed"]
    assert torch.allclose(loss, stock_loss, atol=1e-6, rtol=0), (float(loss), float(stock_loss))
    for a, b in zip(grads, stock_grads, strict=True):  # the vision tower has none from a text batch
        assert (a is None) == (b is None)
        assert a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    assert any(a is not None for a in grads)
    for key, value in stock_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_dispatched_batches_score_as_stock(shared):
    """accelerate dispatches an iterable dataset's batches (and any with ``dispatch_batches=True``),
    slicing every tensor by rows: the trainer packs each batch after that, so its evaluation of an
    iterable dataset and its dispatched training steps log stock's numbers (a packed view made by the
    collator lost all but its first rows' worth of scored tokens)."""
    pairs = trl_dpo.pairs(8)
    logged = {}
    for cls, options in ((DPOTrainer, {}), (PackedDPOTrainer, {"shared_prompt": shared})):
        run = trainer(cls, steps=2, accelerator_config={"dispatch_batches": True}, **options)
        run.train()
        train = [entry for entry in run.state.log_history if "loss" in entry]
        logged[cls] = (
            train,
            run.evaluate(eval_dataset=pairs),
            run.evaluate(eval_dataset=pairs.to_iterable_dataset()),
        )
    (stock_train, stock_eval, stock_iterable), (train, eval_, iterable) = logged.values()
    keys = ("loss", "logps/chosen", "logps/rejected", "rewards/margins")
    for a, b in zip(stock_train, train, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    for key in keys:
        for want, got in ((stock_eval, eval_), (stock_iterable, iterable), (stock_eval, iterable)):
            assert got[f"eval_{key}"] == pytest.approx(want[f"eval_{key}"], abs=1e-5), key
