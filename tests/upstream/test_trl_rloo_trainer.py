"""TRL's RLOOTrainer tests, run against ``PackedRLOOTrainer``.

Upstream: huggingface/trl ``tests/test_rloo_trainer.py`` at 016013e88acec9257c7476fdcdb12e5479938a5f (the version
in the source store; it holds none at 004b40afc9e2b56fb4d5d181eb0d6d1cfbdf595e, the GRPO port's, and its other,
61c7fa287dfc978ae1bc6837dc31689e7c4064c2, tests the old ``RLOOTrainer(config=, policy=, ...)``, which trl 1.16 no
longer has), class ``TestRLOOTrainer``. Left out:

- what upstream skips or needs packages absent here: the vLLM tests (``test_train_vllm_and_peft``,
  ``test_train_vllm_structured_outputs``, ``test_train_vllm_with_additional_generation_kwargs``: skipped upstream);
- ``TestRLOOTrainerVLM`` (``test_train_vlm*``): transformers' vision processors cannot be built without
  torchvision, which is not installed, its image datasets are hub files, and ``PackedRLOOTrainer`` hands a batch
  with vision inputs to TRL's own padded forward (``docs/post_training.md``), so they would run TRL's code.

Every other test of ``TestRLOOTrainer`` is here; every feature it tests is in the pinned trl 1.16.

What was swapped, and nothing else (every assertion is kept), as in ``tests/upstream/test_trl_grpo_trainer.py``,
whose local hub, datasets and parameter checks this file imports:

- ``RLOOTrainer`` -> ``PackedRLOOTrainer`` (``patch.object`` wraps its ``training_step``);
- the hub, which tests may not reach: each model id names a model built once per module from a config (2 layers,
  hidden size 16, float32) and saved beside the GRPO port's byte-level tokenizer (``save_hub``, ``tiny_models``;
  ``test_train``'s Cohere2, GLM-4-MoE, GPT-OSS and Nemotron-H are built from ``tests/upstream/test_trl_dpo_trainer.py``'s
  configs, with the Qwen2.5 tokenizer: the test trains on ``standard_prompt_only``, no chat template is applied);
- ``load_dataset("trl-internal-testing/zen", ...)`` -> the GRPO port's synthesized configs (17 train, 2 test rows);
- ``TrlTestCase``'s ``self.tmp_dir`` -> pytest's ``tmp_path``; ``test_init_minimal``, which passes no ``args``
  (``RLOOConfig("<model>-RLOO")``, a relative ``output_dir``), runs in ``tmp_path``;
- ``RLOOConfig(...)`` -> ``RLOOConfig(..., use_cpu=True)`` where there is no CUDA device: its default ``bf16=True``
  is refused on a CPU without it (``test_init_minimal`` gets it by patching the name ``RLOOTrainer`` builds its
  default config with);
- the mocked generation's EOS and pad ids in ``test_train_with_mask_truncated_completions`` (upstream writes out
  Qwen's 151645 and 151643): the hub tokenizer's;
- ``test_train_multiple_dataloader_workers`` sets the ``spawn`` start method as upstream does, and puts the one it
  found back when it ends (upstream leaves ``spawn`` set for every later test of the session).

Steps: the tests that share upstream's small options (``SMALL``: a step of one prompt and 3 completions) train 6
steps where upstream trains 3 epochs (51 steps; every assertion, that the weights moved among them, holds after 6);
so do the tests without a learning rate (``test_train_with_eval``, ``test_train_with_num_generations_eval``,
``test_train_with_reward_func_accessing_trainer_state``, ``test_train_reward_func_with_log_*``; evaluations at
steps 2, 4 and 6). ``test_prepare_input_called_with_correct_data`` counts the training steps of 3 epochs and trains
them. Marked ``here:``: ``test_init_minimal`` asserts the rows the trainer packs, and the two evaluation tests that
an evaluation ran (upstream asserts nothing in them).

Added (marked by the ``shared_prompt`` parameter): ``shared_prompt=True`` variants of ``test_train_dataset_format``,
``test_train_multiple_iterations``, ``test_train_peft_config`` and ``test_train_beta_zero`` (the others train with
RLOO's default ``beta=0.05``, so their reference passes are packed too).

Where this package deliberately differs (``docs/post_training.md``), the case stays and asserts this package's
behaviour, marked ``DIFFERENCE``: a model whose attention does not restart at ``position_ids`` 0 (GPT-OSS) or whose
layers carry state from one packed sequence into the next (Nemotron-H's Mamba ``linear_attention``) is refused when
the trainer is built (``ValueError``), as packing would change what is trained: ``test_train``'s GPT-OSS and
Nemotron-H cases and ``test_train_moe_peft_model`` (a GPT-OSS). Checked while porting (not here): with stock
``trl.RLOOTrainer`` swapped back in (``shared_prompt`` ignored, nothing refused), every case passes, the GPT-OSS and
Nemotron-H ``test_train`` cases trained, except ``test_train_moe_peft_model``: its ``assert "ref" not in
trainer.model.peft_config`` is behind the pinned trl 1.16, which adds the "ref" adapter beside one using
``target_parameters`` from PEFT 0.20 on (0.22 here).
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
import transformers
import trl
from packaging.version import Version
from test_trl_dpo_trainer import GPT_OSS, NEMOTRON_H, TINY_MODELS  # the DPO port's configs (same directory)
from test_trl_grpo_trainer import (  # the GRPO port's local hub, datasets and checks (same directory)
    QWEN2,
    QWEN2_RM,
    QWEN3,
    SMALL,
    ZEN_ID,
    assert_every_param_changed,
    load_dataset,
    params_of,
    require_peft,
    save_hub,
    tiny_models,
)
from test_trl_reward_trainer import assert_only_adapter_changed  # upstream's PEFT loop, as RLOO's writes it
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import is_peft_available

from zephon_collate.trainers import PackedRLOOTrainer

if is_peft_available():
    from peft import LoraConfig, get_peft_model


def RLOOConfig(*args, **options) -> trl.RLOOConfig:
    """``trl.RLOOConfig``, on the CPU where there is no GPU (its default ``bf16=True`` needs one or ``use_cpu``)."""
    return trl.RLOOConfig(*args, **options, use_cpu=not torch.cuda.is_available())


QWEN3_RM = "trl-internal-testing/tiny-Qwen3ForSequenceClassification"
STEPS = SMALL["max_steps"]
"""The steps of the tests upstream gives no learning rate (3 epochs, 51 steps, upstream)."""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each hub id the tests name -> a local directory standing in for it: the GRPO port's models, and
    ``test_train``'s others from the DPO port's configs."""
    others = {
        model_id: (model_class, config_class, options, "qwen2")
        for model_id, (model_class, config_class, options) in TINY_MODELS.items()
        if model_id
        in {
            "trl-internal-testing/tiny-Cohere2ForCausalLM",
            "trl-internal-testing/tiny-Glm4MoeForCausalLM",
            GPT_OSS,
            NEMOTRON_H,
        }
    }
    return save_hub(tmp_path_factory.mktemp("hub"), {**tiny_models(), **others})


REFUSED = {GPT_OSS: "attend to each other", NEMOTRON_H: "linear_attention layers"}
"""DIFFERENCE: the models PackedRLOOTrainer refuses when built, and what its error says."""


class TestRLOOTrainer:
    def test_init_minimal(self, hub, tmp_path, monkeypatch):
        # Test that RLOOTrainer can be instantiated with only model, reward_model and train_dataset
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.rloo_trainer.RLOOConfig", RLOOConfig)  # no args: the default
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        trainer = PackedRLOOTrainer(model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], train_dataset=dataset)
        assert trainer.packed_rows == "fit"  # here: SDPA's best-fit rows, the packed forward wrapped

    @pytest.mark.parametrize(
        "model_id",
        [
            "trl-internal-testing/tiny-Cohere2ForCausalLM",
            pytest.param(
                "trl-internal-testing/tiny-Glm4MoeForCausalLM",
                marks=pytest.mark.skipif(
                    Version(transformers.__version__) < Version("5.0.0"),
                    reason="GLM4 tokenizer requires transformers>=5.0.0",
                ),
            ),
            "trl-internal-testing/tiny-GptOssForCausalLM",
            "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
            "trl-internal-testing/tiny-Qwen3MoeForCausalLM",
            pytest.param(
                "trl-internal-testing/tiny-NemotronHForCausalLM-nano",
                marks=pytest.mark.skipif(
                    Version(transformers.__version__) < Version("5.7.0"),
                    reason="Nemotron 3 gradient checkpointing requires transformers>=5.7.0 (see transformers#45625)",
                ),
            ),
        ],
    )
    def test_train(self, hub, tmp_path, model_id):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        if model_id in REFUSED:  # DIFFERENCE: packing would change what is trained
            with pytest.raises(ValueError, match=REFUSED[model_id]):
                PackedRLOOTrainer(
                    model=hub[model_id], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
                )
            return
        trainer = PackedRLOOTrainer(
            model=hub[model_id], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @pytest.mark.parametrize("shared_prompt", [False, True])
    @pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
    def test_train_dataset_format(self, hub, tmp_path, config_name, shared_prompt):
        dataset = load_dataset(ZEN_ID, config_name, split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            per_device_eval_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            eval_strategy="steps",
            eval_steps=2,
            report_to="none",
            max_steps=STEPS,  # here: upstream trains 3 epochs
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )
        trainer.train()
        assert any("eval_loss" in entry for entry in trainer.state.log_history)  # here: an evaluation ran

    def test_train_with_num_generations_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            per_device_eval_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            num_generations_eval=1,
            eval_strategy="steps",
            eval_steps=2,
            report_to="none",
            max_steps=STEPS,  # here: upstream trains 3 epochs
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )
        trainer.train()
        assert any("eval_loss" in entry for entry in trainer.state.log_history)  # here: an evaluation ran

    @pytest.mark.parametrize("shared_prompt", [False, True])
    def test_train_multiple_iterations(self, hub, tmp_path, shared_prompt):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, num_iterations=2)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @require_peft
    @pytest.mark.parametrize("shared_prompt", [False, True])
    def test_train_peft_config(self, hub, tmp_path, shared_prompt):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=model,
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(),
            shared_prompt=shared_prompt,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    @require_peft
    def test_train_peft_model(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        model = get_peft_model(model, LoraConfig())
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=model, reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            # and the peft params to be different (except base and ref)
            elif "base_layer" not in n and "ref" not in n:
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_moe_peft_model(self, hub, tmp_path):
        # Upstream: a regression test for huggingface/trl#5222, a LoRA on GPT-OSS's experts (target_parameters).
        model = AutoModelForCausalLM.from_pretrained(hub[GPT_OSS], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        lora_config = LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
        model = get_peft_model(model, lora_config)
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        if GPT_OSS in REFUSED:  # DIFFERENCE: packing would change what is trained
            with pytest.raises(ValueError, match=REFUSED[GPT_OSS]):
                PackedRLOOTrainer(
                    model=model, reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
                )
            return
        trainer = PackedRLOOTrainer(
            model=model, reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        assert "ref" not in trainer.model.peft_config
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    # Upstream: the same as test_train_peft_config while gradient checkpointing is on by default, kept as a
    # guard should the default change.
    @require_peft
    def test_train_peft_with_gradient_checkpointing(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, gradient_checkpointing=True)
        trainer = PackedRLOOTrainer(
            model=model,
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(),
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    def test_train_different_reward_model(self, hub, tmp_path):
        # Use a reward model different from the model: different chat template, tokenization, etc.
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")
        reward_model_id = hub["trl-internal-testing/tiny-LlamaForSequenceClassification-3.2"]
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_id)
        reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_id)
        # Upstream: the EOS token appears in Llama's chat template, so a separate pad token keeps the score the
        # one of the last token before the padding.
        reward_tokenizer.pad_token = "<|finetune_right_pad_id|>"
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=reward_model,
            args=training_args,
            train_dataset=dataset,
            reward_processing_classes=reward_tokenizer,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_reward_func_standard(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            """Reward function that rewards longer completions."""
            return [float(len(completion)) for completion in completions]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_reward_func_conversational(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            """Reward function that gives higher scores to longer completion content."""
            completion_contents = [completion[0]["content"] for completion in completions]
            return [float(len(content)) for content in completion_contents]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_multiple_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def reward_func2(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func1, reward_func2],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_sync_and_async_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def sync_reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def sync_reward_func2(completions, **kwargs):
            return [1 for _ in completions]

        async def async_reward_func(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[sync_reward_func1, sync_reward_func2, async_reward_func],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_multiple_reward_funcs_with_None_output(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def applicable_reward_func(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def non_applicable_reward_func(completions, **kwargs):
            return [None] * len(completions)

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[applicable_reward_func, non_applicable_reward_func],
            args=training_args,
            train_dataset=dataset,
        )
        previous = {n: param.clone() for n, param in trainer.model.named_parameters() if param.requires_grad}
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_multiple_reward_funcs_with_weights(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def reward_func2(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, reward_weights=[0.7, 0.3])
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func1, reward_func2],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert "rewards/reward_func1/mean" in trainer.state.log_history[-1]
        assert "rewards/reward_func1/std" in trainer.state.log_history[-1]
        assert "rewards/reward_func2/mean" in trainer.state.log_history[-1]
        assert "rewards/reward_func2/std" in trainer.state.log_history[-1]
        assert_every_param_changed(trainer, previous)

    def test_reward_metric_reflects_reward_weights(self, hub, tmp_path):
        """The logged 'reward' metric uses reward_weights, not an unweighted sum."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def constant_reward_1(completions, **kwargs):
            return [1.0] * len(completions)

        def constant_reward_0(completions, **kwargs):
            return [0.0] * len(completions)

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, reward_weights=[0.7, 0.3])
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[constant_reward_1, constant_reward_0],
            args=training_args,
            train_dataset=dataset,
        )
        trainer.train()
        log = trainer.state.log_history[-1]
        # With reward_weights=[0.7, 0.3] and rewards [1.0, 0.0]: weighted 0.7, unweighted 1.0
        assert abs(log["reward"] - 0.7) < 1e-5, (
            f"Expected logged reward to be ~0.7 (weighted), got {log['reward']}. "
            "The reward metric should reflect reward_weights."
        )

    def test_train_multiple_mixed_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func, hub[QWEN2_RM]],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_reward_func_additional_column(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        some_values = list(range(len(dataset)))
        dataset = dataset.add_column("some_values", some_values)

        def reward_func(completions, some_values, **kwargs):
            return [
                float(abs(len(completion) - value))
                for completion, value in zip(completions, some_values, strict=True)
            ]

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_sync_ref_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            beta=0.1,  # ensure ref model is created so sync can update it
            **SMALL,
            sync_ref_model=True,
            ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        assert trainer.ref_model is not None
        previous_ref_params = {n: param.clone() for n, param in trainer.ref_model.named_parameters()}
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            new_ref_param = trainer.ref_model.get_parameter(n)
            assert not torch.equal(previous_ref_params[n], new_ref_param), (
                f"Ref Parameter {n} has not changed."
            )

    @pytest.mark.parametrize("shared_prompt", [False, True])
    def test_train_beta_zero(self, hub, tmp_path, shared_prompt):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            beta=0.0,  # set beta to zero value to test the case where the reference model is not used
            **SMALL,
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_pad_to_multiple_of(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, pad_to_multiple_of=8)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_additional_generation_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path), **SMALL, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_normalized_advantages(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, normalize_advantages=True)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_clipped_rewards(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, reward_clip_range=(-1, 1))
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @patch("transformers.generation.utils.GenerationMixin.generate")
    def test_train_with_mask_truncated_completions(self, mock_generate, hub, tmp_path):
        """Training works with mask_truncated_completions=True (generate mocked: a random model rarely ends)."""
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id  # upstream's 151645 and 151643

        def fake_generate(input_ids, **kwargs):
            completion_ids = torch.tensor(
                [
                    [1, 2, 3, 4, 5, 6, 7, 8],  # this one is truncated
                    [9, 10, 11, eos, pad, pad, pad, pad],  # this one contains eos
                    # particular case, eos is generated just within the limit
                    [12, 13, 14, 15, 16, 17, 18, eos],
                ],
                device=input_ids.device,
            )
            return torch.cat([input_ids, completion_ids], dim=1)

        mock_generate.side_effect = fake_generate
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, mask_truncated_completions=True)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_mask_truncated_completions_all_masked(self, hub, tmp_path):
        """Every completion truncated (a random model rarely samples the EOS) and masked: no parameter moves."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, mask_truncated_completions=True)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous.items():
            new_param = trainer.model.get_parameter(n)
            assert torch.equal(param, new_param), f"Parameter {n} has changed."

    def test_warning_raised_all_rewards_none(self, hub, tmp_path, caplog):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def always_none_reward_func(completions, **kwargs):
            return [None] * len(completions)

        training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=always_none_reward_func, args=training_args, train_dataset=dataset
        )
        with caplog.at_level("WARNING", logger="trl.trainer.rloo_trainer"):
            trainer.train()
        expected_warning = "All reward functions returned None for the following kwargs:"
        assert expected_warning in caplog.text

    def test_train_num_generations_larger_than_batch_size(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            **{**SMALL, "num_generations": 6},  # the number of generations is larger than the batch size, but
            gradient_accumulation_steps=2,  # gradient accumulation should allow that
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_multiple_dataloader_workers(self, hub, tmp_path):
        # Upstream: "spawn", as "fork" in a process pytest has started threads in may deadlock (Python 3.12 warns).
        # Here: the start method found is put back when the test ends.
        start_method = torch.multiprocessing.get_start_method(allow_none=True)
        torch.multiprocessing.set_start_method("spawn", force=True)
        try:
            dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
            training_args = RLOOConfig(output_dir=str(tmp_path), **SMALL, dataloader_num_workers=2)
            trainer = PackedRLOOTrainer(
                model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
            )
            previous = params_of(trainer)
            trainer.train()
            assert trainer.state.log_history[-1]["train_loss"] is not None
            assert_every_param_changed(trainer, previous)
        finally:
            torch.multiprocessing.set_start_method(start_method, force=True)

    def test_train_with_generation_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            **SMALL,
            generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_reward_func_accessing_trainer_state(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            trainer_state = kwargs.get("trainer_state")
            assert trainer_state is not None
            assert hasattr(trainer_state, "global_step")
            return [float(len(set(completion))) for completion in completions]

        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            report_to="none",
            max_steps=STEPS,  # here: upstream trains 3 epochs
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        trainer.train()

    def test_train_reward_func_with_log_extra(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            log_extra = kwargs.get("log_extra")
            assert log_extra is not None
            log_extra("test_column", [completion[:5] for completion in completions])
            return [float(len(completion)) for completion in completions]

        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            report_to="none",
            log_completions=True,
            max_steps=STEPS,  # here: upstream trains 3 epochs
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        trainer.train()
        assert "test_column" in trainer._logs["extra"]

    def test_train_reward_func_with_log_metric(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            log_metric = kwargs.get("log_metric")
            assert log_metric is not None
            log_metric("custom_accuracy", 0.75)
            return [float(len(completion)) for completion in completions]

        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            report_to="none",
            max_steps=STEPS,  # here: upstream trains 3 epochs
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        trainer.train()
        # log_metric appends to _metrics, which gets averaged and merged into log_history
        logged_keys = {k for entry in trainer.state.log_history for k in entry}
        assert "custom_accuracy" in logged_keys

    def test_prepare_input_called_with_correct_data(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,
            max_completion_length=8,
            gradient_accumulation_steps=3,  # can be anything in this test
            # steps_per_generation*per_device_train_batch_size=24 is divisible by num_generations=4
            steps_per_generation=4,
            num_generations=4,
            per_device_train_batch_size=6,
            num_iterations=2,
            shuffle_dataset=False,
            report_to="none",
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        # A generation batch of 24 samples (steps_per_generation * per_device_train_batch_size): 6 prompts, each
        # repeated 4 times (num_generations).
        expected_first_generation_batch = (
            [{"prompt": "Beautiful is better than"}] * 4
            + [{"prompt": "Explicit is"}] * 4
            + [{"prompt": "Simple is better"}] * 4
            + [{"prompt": "Complex"}] * 4
            + [{"prompt": "Flat is better than"}] * 4
            + [{"prompt": "Sparse is better"}] * 4
        )
        expected_second_generation_batch = (
            [{"prompt": "Readability"}] * 4
            + [{"prompt": "Special cases aren't special"}] * 4
            + [{"prompt": "Although practicality beats"}] * 4
            + [{"prompt": "Errors should never"}] * 4
            + [{"prompt": "Unless explicitly"}] * 4
            + [{"prompt": "In the face of ambiguity, refuse"}] * 4
        )
        with patch.object(PackedRLOOTrainer, "training_step", wraps=trainer.training_step) as mock_prepare:
            trainer.train()
            # 3 epochs * 2 iterations * 2 generation batches to cover the dataset * 4 steps_per_generation
            assert mock_prepare.call_count == 48
            for i in range(0, 8):  # Generation batch repeated 8 times (steps_per_generation*num_iterations)
                assert mock_prepare.call_args_list[i].args[1] == expected_first_generation_batch
            for i in range(8, 16):
                assert mock_prepare.call_args_list[i].args[1] == expected_second_generation_batch

    def test_train_with_chat_template_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")
        training_args = RLOOConfig(
            output_dir=str(tmp_path), **SMALL, chat_template_kwargs={"enable_thinking": False}
        )
        trainer = PackedRLOOTrainer(
            model=hub[QWEN3], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_mismatched_reward_processing_classes_length(self, hub, tmp_path):
        """Mismatched lengths of reward_funcs and reward_processing_classes raise."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_models = [hub[QWEN2_RM], hub[QWEN3_RM]]
        single_processing_class = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        training_args = RLOOConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(ValueError, match="must match"):
            PackedRLOOTrainer(
                model=hub[QWEN2],
                reward_funcs=reward_models,
                reward_processing_classes=single_processing_class,  # only one, but need two
                args=training_args,
                train_dataset=dataset,
            )

    def test_correct_reward_processing_classes_list(self, hub, tmp_path):
        """A list of reward_processing_classes as long as reward_funcs works."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_models = [hub[QWEN2_RM], hub[QWEN3_RM]]
        processing_class1 = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        processing_class2 = AutoTokenizer.from_pretrained(hub[QWEN3_RM])
        training_args = RLOOConfig(output_dir=str(tmp_path), report_to="none")
        correct_processing_classes = [processing_class1, processing_class2]
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=reward_models,
            reward_processing_classes=correct_processing_classes,
            args=training_args,
            train_dataset=dataset,
        )
        assert len(trainer.reward_processing_classes) == len(reward_models)

    def test_single_reward_model_with_single_processing_class(self, hub, tmp_path):
        """A single reward model with a single processing class works."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_model = hub[QWEN2_RM]
        single_processing_class = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        training_args = RLOOConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRLOOTrainer(
            model=hub[QWEN2],
            reward_funcs=reward_model,
            reward_processing_classes=single_processing_class,  # single object for single reward model
            args=training_args,
            train_dataset=dataset,
        )
        assert len(trainer.reward_processing_classes) == 1
        assert trainer.reward_processing_classes[0] == single_processing_class
