"""TRL's GRPOTrainer tests, run against ``PackedGRPOTrainer``.

Upstream: huggingface/trl ``tests/test_grpo_trainer.py`` at 004b40afc9e2b56fb4d5d181eb0d6d1cfbdf595e (the
version in the source store), classes ``TestGetHighEntropyMask`` and ``TestGRPOTrainer``. Left out:

- the tests of what the pinned trl 1.16 lacks: ``test_get_sapo_token_loss`` (no ``get_sapo_token_loss``) and
  ``test_tool_completion_idx_injection`` (no ``_completion_idx``);
- what upstream skips or needs hardware or packages absent here: the vLLM tests (skipped upstream), the Liger
  tests, ``TestGRPOTrainerSlow`` (an accelerator);
- the vision tests (``test_training_vlm*``): transformers' Qwen2.5-VL processor cannot be built without
  torchvision, which is not installed; and ``PackedGRPOTrainer`` hands a batch with vision inputs to TRL's
  own padded forward (``docs/post_training.md``), so they would run TRL's code.

What was swapped, and nothing else (every assertion is kept):

- ``GRPOTrainer`` -> ``PackedGRPOTrainer`` (the static and mocked-``self`` helpers are called through it too);
- the hub, which tests may not reach: each model id names a model built once per module from a config (2
  layers, hidden size 16, float32) and saved with ``save_pretrained`` beside a byte-level tokenizer (the 256
  bytes, the family's special tokens, ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``, and 2,000
  ``<|filler_i|>`` tokens no text contains, so that as with upstream's 151k-token vocabulary sampling rarely
  draws the EOS, which ``test_training_with_mask_truncated_completions_all_masked`` relies on) with TRL's copy
  of the family's chat template (Qwen2.5, Qwen3, Llama 3.2; ``add_response_schema`` recognizes Qwen3's for
  tool calls); Gemma2 ties its embeddings, as upstream's;
- ``load_dataset("trl-internal-testing/zen", "standard_prompt_only" | "conversational_prompt_only")`` -> the
  same configs synthesized from the Zen of Python: 17 train and 2 test rows, ``prompt`` a string cut as
  ``test_prepare_input_called_with_correct_data`` expects, or one user message;
- ``TrlTestCase``'s ``self.tmp_dir`` -> pytest's ``tmp_path``; ``test_init_minimal``, which passes no ``args``
  (``GRPOConfig("<model>-GRPO")``, a relative ``output_dir``), runs in ``tmp_path``;
- ``GRPOConfig(...)`` -> ``GRPOConfig(..., use_cpu=True)`` where there is no CUDA device: its default
  ``bf16=True`` is refused on a CPU without it (``test_init_minimal`` gets it by patching the name
  ``GRPOTrainer`` builds its default config with);
- the mocked generations' token ids (upstream writes out Qwen's ids): the EOS and pad ids of the hub's
  tokenizer in ``test_training_with_mask_truncated_completions``, the same texts tokenized in
  ``test_training_with_tools``, whose ``max_completion_length`` is 512 instead of 128 (a byte is a token here:
  the failed call's error message would overflow 128, and TRL drops a tool result that overflows);
  ``@require_jmespath`` is dropped (TRL 1.16 needs jmespath only below transformers 5.13).

Added (marked by the ``shared_prompt`` parameter): ``shared_prompt=True`` variants of ``test_training``,
``test_training_multiple_iterations``, ``test_training_peft_config``, ``test_training_beta_non_zero`` and
``test_training_sequence_importance_sampling``.

The batch sizes and completion lengths are upstream's (steps of one prompt and 3 completions); the tests that
share upstream's small options train 6 steps where upstream trains 3 epochs (51 steps; every assertion, that
the weights moved among them, holds after 6), the tool tests 3. bf16 and gradient checkpointing are
upstream's (``GRPOConfig`` turns both on by default). No test needed a ``DIFFERENCE``: all pass, as they do
with stock ``trl.GRPOTrainer``. Checked while porting (not here), in float32 with bf16 off, with 2 prompts of different lengths per step (left padding) and completions
cut at random by an EOS (right padding), the two trainers' logged histories (4 steps: loss, grad norm, KL,
entropy, clip ratios, rewards) agree to 7e-6 relative for dapo, grpo with 2 accumulation steps, cispo, sapo,
luspo, vespo and dr_grpo with ``mask_truncated_completions``, ``beta`` with and without the bias-corrected KL,
``num_iterations=2`` with sequence-level importance sampling, ``top_entropy_quantile``, LoRA (with ``beta``),
the conversational Qwen3, Gemma2 with ``cast_lm_head_to_fp32`` and Qwen3-MoE, ``shared_prompt`` on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest.mock import Mock, patch

import pytest
import torch
import trl
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import is_peft_available
from trl.chat_template_utils import llama3_2_chat_template, qwen2_5_chat_template, qwen3_chat_template

from zephon_collate.trainers import PackedGRPOTrainer

if is_peft_available():
    from peft import LoraConfig, get_peft_model

require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")


def GRPOConfig(*args, **options) -> trl.GRPOConfig:
    """``trl.GRPOConfig``, on the CPU where there is no GPU (its default ``bf16=True`` needs one or ``use_cpu``)."""
    return trl.GRPOConfig(*args, **options, use_cpu=not torch.cuda.is_available())


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


# -- the local hub ----------------------------------------------------------------------------------

FILLERS = 2000
"""Tokens no text contains (``<|filler_i|>``): a vocabulary wide enough that sampling rarely draws the EOS."""


def byte_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges (every byte a token, prefix-stable), the family's special tokens
    and TRL's copy of the family's chat template (``add_response_schema`` recognizes it for tool calls)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if family == "llama":
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            additional_special_tokens=[
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|finetune_right_pad_id|>",
            ],
        )
        tokenizer.chat_template = llama3_2_chat_template
    else:  # Qwen's: <|endoftext|> pads, <|im_end|> ends a turn
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token="<|endoftext|>",
            eos_token="<|im_end|>",
            additional_special_tokens=["<|im_start|>"],
        )
        tokenizer.chat_template = qwen3_chat_template if family == "qwen3" else qwen2_5_chat_template
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(FILLERS)])
    return tokenizer


DENSE = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def tiny_models() -> dict[str, tuple[type, type, dict, str]]:
    """Model id -> (model class, config class, config options, tokenizer family)."""
    gqa = {**DENSE, "num_key_value_heads": 2}
    return {
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": (Qwen2ForCausalLM, Qwen2Config, gqa, "qwen2"),
        "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
            Qwen2ForSequenceClassification,
            Qwen2Config,
            {**gqa, "num_labels": 1},
            "qwen2",
        ),
        "trl-internal-testing/tiny-Qwen3ForCausalLM": (
            Qwen3ForCausalLM,
            Qwen3Config,
            {**gqa, "head_dim": 4},
            "qwen3",
        ),
        "trl-internal-testing/tiny-Qwen3ForSequenceClassification": (
            Qwen3ForSequenceClassification,
            Qwen3Config,
            {**gqa, "head_dim": 4, "num_labels": 1},
            "qwen3",
        ),
        "trl-internal-testing/tiny-Qwen3MoeForCausalLM": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig,
            {**gqa, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
            "qwen3",
        ),
        "trl-internal-testing/tiny-Gemma2ForCausalLM": (
            Gemma2ForCausalLM,
            Gemma2Config,
            {**gqa, "head_dim": 4, "tie_word_embeddings": True},
            "qwen2",
        ),
        "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": (
            LlamaForSequenceClassification,
            LlamaConfig,
            {**gqa, "num_labels": 1},
            "llama",
        ),
    }


def save_hub(root, models: dict[str, tuple[type, type, dict, str]]) -> dict[str, str]:
    """Each of ``models`` (as :func:`tiny_models` gives them) saved under ``root``: hub id -> its directory."""
    paths: dict[str, str] = {}
    for model_id, (model_class, config_class, options, family) in models.items():
        tokenizer = byte_tokenizer(family)
        ids = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
        if tokenizer.pad_token_id is not None:
            ids["pad_token_id"] = tokenizer.pad_token_id
        torch.manual_seed(0)
        model = model_class(config_class(vocab_size=len(tokenizer), **options, **ids))
        path = root / model_id.split("/")[-1]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[model_id] = str(path)
    return paths


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each hub id the tests name -> a local directory standing in for it."""
    return save_hub(tmp_path_factory.mktemp("hub"), tiny_models())


# -- the local datasets -----------------------------------------------------------------------------

ZEN = [
    ("Beautiful is better than", " ugly.", "What is better than ugly?"),
    ("Explicit is", " better than implicit.", "What is better than implicit?"),
    ("Simple is better", " than complex.", "What is better than complex?"),
    ("Complex", " is better than complicated.", "What is better than complicated?"),
    ("Flat is better than", " nested.", "What is better than nested?"),
    ("Sparse is better", " than dense.", "What is better than dense?"),
    ("Readability", " counts.", "What counts?"),
    (
        "Special cases aren't special",
        " enough to break the rules.",
        "Are special cases enough to break the rules?",
    ),
    ("Although practicality beats", " purity.", "What does practicality beat?"),
    ("Errors should never", " pass silently.", "What should never pass silently?"),
    ("Unless explicitly", " silenced.", "When can errors pass silently?"),
    (
        "In the face of ambiguity, refuse",
        " the temptation to guess.",
        "What should you do in the face of ambiguity?",
    ),
    (
        "There should be one-- and preferably",
        " only one --obvious way to do it.",
        "How many ways should there be to do it?",
    ),
    (
        "Although that way may not be",
        " obvious at first unless you're Dutch.",
        "For whom is the way obvious at first?",
    ),
    ("Now is", " better than never.", "What is better than never?"),
    ("Although never is often", " better than *right* now.", "What is never often better than?"),
    (
        "If the implementation is hard to explain,",
        " it's a bad idea.",
        "What if the implementation is hard to explain?",
    ),
    (
        "If the implementation is easy",
        " to explain, it may be a good idea.",
        "What if it is easy to explain?",
    ),
    ("Namespaces are one", " honking great idea -- let's do more of those!", "What are namespaces?"),
]
"""The Zen of Python as zen's prompt-only configs cut it: (prompt, rest, question); 17 train rows, 2 test."""


def load_dataset(path: str, name: str, split: str | None = None):
    """The stand-in for ``datasets.load_dataset`` on ``trl-internal-testing/zen``'s prompt-only configs."""
    if path != "trl-internal-testing/zen":
        raise ValueError(f"no local stand-in for {path} {name}")
    if name == "standard_prompt_only":
        rows = [{"prompt": prompt} for prompt, _, _ in ZEN]
    elif name == "conversational_prompt_only":
        rows = [{"prompt": [{"role": "user", "content": question}]} for _, _, question in ZEN]
    else:
        raise ValueError(f"no zen config {name!r} here")
    made = DatasetDict({"train": Dataset.from_list(rows[:17]), "test": Dataset.from_list(rows[17:])})
    return made if split is None else made[split]


# -- what every training test checks ---------------------------------------------------------------


def params_of(trainer) -> dict[str, torch.Tensor]:
    return {n: param.clone() for n, param in trainer.model.named_parameters()}


def assert_every_param_changed(trainer, previous, skip: tuple[str, ...] = ()) -> None:
    """Upstream's loop: every parameter has changed (bar those whose names start with ``skip``)."""
    for n, param in previous.items():
        if skip and n.startswith(skip):
            continue
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def assert_only_adapter_changed(trainer, previous, base_param_names, skip: tuple[str, ...] = ()) -> None:
    """Upstream's PEFT loop: base parameters unchanged, the adapter's (not the base layers') changed."""
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n and not any(part in n for part in skip):
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."


QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
QWEN2_RM = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
QWEN3 = "trl-internal-testing/tiny-Qwen3ForCausalLM"
QWEN3_MOE = "trl-internal-testing/tiny-Qwen3MoeForCausalLM"
ZEN_ID = "trl-internal-testing/zen"
SMALL = {
    "learning_rate": 0.1,  # use higher lr because gradients are tiny and default lr can stall updates
    "per_device_train_batch_size": 3,  # reduce the batch size to reduce memory usage
    "num_generations": 3,  # reduce the number of generations to reduce memory usage
    "max_completion_length": 8,  # reduce the completion length to reduce memory usage
    "report_to": "none",
    "max_steps": 6,  # here: upstream trains 3 epochs (51 steps); 6 reach every assertion
}
"""The options nearly every upstream test repeats."""


class TestGetHighEntropyMask:
    def get_high_entropy_mask(self, entropies, mask, threshold):
        """Helper method to test the get_high_entropy_mask functionality."""
        # Create a mock accelerator
        mock_accelerator = Mock()
        mock_accelerator.num_processes = 1  # Single process for testing

        # Create a minimal trainer instance just to access the method
        trainer = Mock(spec=PackedGRPOTrainer)
        trainer.accelerator = mock_accelerator
        trainer.accelerator.gather = lambda x: x
        trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x

        # Call the actual method from GRPOTrainer
        return PackedGRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)

    def test_compute_entropy_mask_0(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=0.8)
        expected_mask = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)

    def test_compute_entropy_mask_1(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 1.4, 0.5, 0.14], [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]])
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=0.8)
        expected_mask = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)

    def test_compute_entropy_mask_lower_threshold(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=0.5)
        expected_mask = torch.tensor([[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)

    def test_compute_entropy_threshold_0(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=0.0)
        expected_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)

    def test_compute_entropy_threshold_1(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=1.0)
        expected_mask = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)

    def test_compute_entropy_all_masked(self):
        entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        mask = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
        entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold=0.5)
        expected_mask = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(entropy_mask, expected_mask)


class TestGRPOTrainer:
    def test_init_minimal(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.grpo_trainer.GRPOConfig", GRPOConfig)  # no args: the default
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        trainer = PackedGRPOTrainer(model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], train_dataset=dataset)
        assert trainer.packed_rows == "fit"  # here: SDPA's best-fit rows, the packed forward wrapped

    @pytest.mark.parametrize("shared_prompt", [False, True])
    @pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
    def test_training(self, hub, tmp_path, config_name, shared_prompt):
        dataset = load_dataset(ZEN_ID, config_name, split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
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

    @pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
    def test_training_loss_types(self, hub, tmp_path, loss_type):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            **{**SMALL, "max_completion_length": 32},
            gradient_accumulation_steps=2,  # set to 2 to test than DAPO can operate with accumulated batch
            loss_type=loss_type,
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            per_device_eval_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            eval_strategy="steps",
            eval_steps=2,
            report_to="none",
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )
        trainer.train()
        assert any("eval_loss" in entry for entry in trainer.state.log_history)  # here: an evaluation ran

    def test_training_with_num_generations_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=3,
            per_device_eval_batch_size=3,
            num_generations=3,
            max_completion_length=8,
            num_generations_eval=1,
            eval_strategy="steps",
            eval_steps=2,
            report_to="none",
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )
        trainer.train()
        assert any("eval_loss" in entry for entry in trainer.state.log_history)  # here: an evaluation ran

    # Upstream: a regression test for eval_on_start with loss_type="grpo", which reads
    # current_gradient_accumulation_steps before the first training step sets it.
    def test_training_eval_on_start(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            **SMALL,
            per_device_eval_batch_size=3,
            loss_type="grpo",
            eval_strategy="steps",
            eval_steps=2,
            eval_on_start=True,
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )
        trainer.train()
        assert any("eval_loss" in entry for entry in trainer.state.log_history)  # here: an evaluation ran

    @pytest.mark.parametrize("shared_prompt", [False, True])
    def test_training_multiple_iterations(self, hub, tmp_path, shared_prompt):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, num_iterations=2)
        trainer = PackedGRPOTrainer(
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
    def test_training_peft_config(self, hub, tmp_path, shared_prompt):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
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
    def test_training_peft_model(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        model = get_peft_model(model, LoraConfig())
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=model, reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        # and the peft params to be different (except base and ref)
        assert_only_adapter_changed(trainer, previous, base_param_names, skip=("ref",))

    # Upstream: the same as test_training_peft_config while gradient checkpointing is on by default, kept as a
    # guard should the default change.
    @require_peft
    def test_training_peft_with_gradient_checkpointing(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, gradient_checkpointing=True)
        trainer = PackedGRPOTrainer(
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

    def test_training_different_reward_model(self, hub, tmp_path):
        # Use a reward model different from the model: different chat template, tokenization, etc.
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")
        reward_model_id = hub["trl-internal-testing/tiny-LlamaForSequenceClassification-3.2"]
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_id)
        reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_id)
        # Upstream: the EOS token appears in Llama's chat template, so a separate pad token keeps the score the
        # one of the last token before the padding.
        reward_tokenizer.pad_token = "<|finetune_right_pad_id|>"
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
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

    def test_training_reward_func_standard(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            """Reward function that rewards longer completions."""
            return [float(len(completion)) for completion in completions]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_reward_func_conversational(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            """Reward function that gives higher scores to longer completion content."""
            completion_contents = [completion[0]["content"] for completion in completions]
            return [float(len(content)) for content in completion_contents]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_multiple_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def reward_func2(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func1, reward_func2],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_sync_and_async_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def sync_reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def sync_reward_func2(completions, **kwargs):
            return [1 for _ in completions]

        async def async_reward_func(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=[sync_reward_func1, sync_reward_func2, async_reward_func],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_multiple_reward_funcs_with_None_output(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def applicable_reward_func(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def non_applicable_reward_func(completions, **kwargs):
            return [None] * len(completions)

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=[applicable_reward_func, non_applicable_reward_func],
            args=training_args,
            train_dataset=dataset,
        )
        previous = {n: param.clone() for n, param in trainer.model.named_parameters() if param.requires_grad}
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_multiple_reward_funcs_with_weights(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def reward_func2(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, reward_weights=[0.7, 0.3])
        trainer = PackedGRPOTrainer(
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

    def test_training_multiple_mixed_reward_funcs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func, hub[QWEN2_RM]],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_reward_func_additional_column(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        some_values = list(range(len(dataset)))
        dataset = dataset.add_column("some_values", some_values)

        def reward_func(completions, some_values, **kwargs):
            return [
                float(abs(len(completion) - value))
                for completion, value in zip(completions, some_values, strict=True)
            ]

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_sync_ref_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            beta=0.1,  # ensure ref model is created so sync can update it
            **SMALL,
            sync_ref_model=True,
            ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
        )
        trainer = PackedGRPOTrainer(
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
    def test_training_beta_non_zero(self, hub, tmp_path, shared_prompt):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, **SMALL)
        trainer = PackedGRPOTrainer(
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

    def test_get_off_policy_mask(self):
        """Keep if advantage >= 0 or KL <= threshold; drop if advantage < 0 and KL > threshold."""
        mask = torch.ones((3, 4))  # B=3 sequences, T=4 tokens
        advantages = torch.tensor([1.0, -1.0, -1.0]).unsqueeze(-1)
        sampling_per_token_logps = torch.zeros((3, 4))
        per_token_logps = torch.zeros((3, 4))
        per_token_logps[0, :] = -2.0  # Pos adv + High KL (0-(-2)=2) -> Keep
        per_token_logps[1, :] = -0.5  # Neg adv + Low KL (0.5) -> Keep
        per_token_logps[2, :] = -2.0  # Neg adv + High KL (2.0) -> Drop
        off_policy_threshold = 1.0
        expected_mask = torch.tensor([[1.0], [1.0], [0.0]])
        off_policy_mask = PackedGRPOTrainer.get_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )
        torch.testing.assert_close(off_policy_mask, expected_mask)

    def test_get_off_policy_mask_padding(self):
        """Padding is ignored in the KL."""
        mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # 2 valid tokens
        advantages = torch.tensor([[-1.0]])  # Negative advantage
        sampling_per_token_logps = torch.zeros((1, 4))
        per_token_logps = torch.zeros((1, 4))
        per_token_logps[0, 0] = -2.0  # Valid tokens have High KL (2.0)
        per_token_logps[0, 1] = -2.0
        per_token_logps[0, 2] = -10_000.0  # Padding tokens have abnormal values (should be ignored)
        per_token_logps[0, 3] = 10_000.0
        off_policy_threshold = 1.0
        expected_mask = torch.tensor([[0.0]])  # Avg KL on valid tokens = (2+2)/2 = 2.0 > 1.0 -> Drop
        off_policy_mask = PackedGRPOTrainer.get_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )
        torch.testing.assert_close(off_policy_mask, expected_mask)
        per_token_logps[0, 0] = -0.5  # Now test with Low KL on valid tokens
        per_token_logps[0, 1] = -0.5
        expected_mask_keep = torch.tensor([[1.0]])  # Avg KL = 0.5 <= 1.0 -> Keep
        off_policy_mask_keep = PackedGRPOTrainer.get_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )
        torch.testing.assert_close(off_policy_mask_keep, expected_mask_keep)

    def test_training_with_off_policy_mask(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), off_policy_mask_threshold=0.5, **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert_every_param_changed(trainer, previous)

    def test_training_with_bias_correction_kl(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, use_bias_correction_kl=True, **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @pytest.mark.parametrize(
        "model_name",
        [QWEN3, "trl-internal-testing/tiny-Gemma2ForCausalLM"],
        # Gemma2 has the input word embeddings and lm_head tied, Qwen3 does not
    )
    def test_training_with_cast_lm_head_to_fp32(self, hub, tmp_path, model_name):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, cast_lm_head_to_fp32=True)
        trainer = PackedGRPOTrainer(
            model=hub[model_name], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.model.lm_head.weight.dtype == torch.float32
        assert_every_param_changed(trainer, previous)

    def test_training_with_entropy_filter(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, top_entropy_quantile=0.2)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_additional_generation_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path), **SMALL, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_normalize_then_sum_aggregation(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func1(completions, **kwargs):
            return [float(len(completion)) for completion in completions]

        def reward_func2(completions, **kwargs):
            return [float(len(set(completion))) for completion in completions]

        training_args = GRPOConfig(
            output_dir=str(tmp_path), **SMALL, multi_objective_aggregation="normalize_then_sum"
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=[reward_func1, reward_func2],
            args=training_args,
            train_dataset=dataset,
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @pytest.mark.parametrize("scale_rewards", [False, "group", "batch", True, "none"])
    def test_training_scale_rewards(self, hub, tmp_path, scale_rewards):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, scale_rewards=scale_rewards)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @patch("transformers.generation.utils.GenerationMixin.generate")
    def test_training_with_mask_truncated_completions(self, mock_generate, hub, tmp_path):
        """Training works with mask_truncated_completions=True (generate mocked: a random model rarely ends)."""
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id  # upstream's 151645 and 151643

        def fake_generate(input_ids, **kwargs):
            completion_ids = torch.tensor(
                [
                    [1, 2, 3, 4, 5, 6, 7, 8],  # this one is truncated
                    [9, 10, 11, eos, pad, pad, pad, pad],  # this one contains eos
                    [
                        12,
                        13,
                        14,
                        15,
                        16,
                        17,
                        18,
                        eos,
                    ],  # particular case, eos is generated just within the limit
                ],
                device=input_ids.device,
            )
            return torch.cat([input_ids, completion_ids], dim=1)

        mock_generate.side_effect = fake_generate
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, mask_truncated_completions=True)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_mask_truncated_completions_all_masked(self, hub, tmp_path):
        """Every completion truncated (a random model rarely samples the EOS) and masked: no parameter moves."""
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, mask_truncated_completions=True)
        trainer = PackedGRPOTrainer(
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

        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=always_none_reward_func, args=training_args, train_dataset=dataset
        )
        with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
            trainer.train()
        expected_warning = "All reward functions returned None for the following kwargs:"
        assert expected_warning in caplog.text

    def test_training_num_generations_larger_than_batch_size(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            **{**SMALL, "num_generations": 6},  # the number of generations is larger than the batch size, but
            gradient_accumulation_steps=2,  # gradient accumulation should allow that
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_delta_clipping(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, delta=2.0)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_multiple_dataloader_workers(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(output_dir=str(tmp_path), **SMALL, dataloader_num_workers=2)
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_generation_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            **SMALL,
            generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_training_with_reward_func_accessing_trainer_state(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")

        def reward_func(completions, **kwargs):
            trainer_state = kwargs.get("trainer_state")
            assert trainer_state is not None
            assert hasattr(trainer_state, "global_step")
            return [float(len(set(completion))) for completion in completions]

        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            report_to="none",
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2], reward_funcs=reward_func, args=training_args, train_dataset=dataset
        )
        trainer.train()

    def test_prepare_input_called_with_correct_data(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
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
        trainer = PackedGRPOTrainer(
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
        with patch.object(PackedGRPOTrainer, "training_step", wraps=trainer.training_step) as mock_prepare:
            trainer.train()
            # 3 epochs * 2 iterations * 2 generation batches to cover the dataset * 4 steps_per_generation
            assert mock_prepare.call_count == 48
            for i in range(0, 8):  # Generation batch repeated 8 times (steps_per_generation*num_iterations)
                assert mock_prepare.call_args_list[i].args[1] == expected_first_generation_batch
            for i in range(8, 16):
                assert mock_prepare.call_args_list[i].args[1] == expected_second_generation_batch

    @pytest.mark.parametrize("shared_prompt", [False, True])
    def test_training_sequence_importance_sampling(self, hub, tmp_path, shared_prompt):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path),
            **SMALL,
            num_iterations=2,  # the importance sampling weights won't be 0 in this case
            importance_sampling_level="sequence",
        )
        trainer = PackedGRPOTrainer(
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

    def test_training_with_chat_template_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")
        training_args = GRPOConfig(
            output_dir=str(tmp_path), **SMALL, chat_template_kwargs={"enable_thinking": False}
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN3], reward_funcs=hub[QWEN2_RM], args=training_args, train_dataset=dataset
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @pytest.mark.parametrize("tools", [[multiply_tool], [async_multiply_tool]])
    def test_training_with_tools(self, hub, tmp_path, tools: list[Callable]):
        # A tool that multiplies two integers. Whatever the prompt, the model generates 3 completions, 2 of them
        # tool calls: one succeeds, the other fails (a wrong argument name).
        dataset = load_dataset(ZEN_ID, "conversational_prompt_only", split="train")
        # Upstream: 128; a byte is a token here, and the failed call's error message would not fit (TRL drops a
        # tool result that overflows max_completion_length, and that completion would not regenerate).
        # Port: 3 steps, not 51 (each step trains the same mocked rollout; 51 of these took a minute here).
        training_args = GRPOConfig(
            output_dir=str(tmp_path), **{**SMALL, "max_completion_length": 512, "max_steps": 3}
        )
        trainer = PackedGRPOTrainer(
            model=hub[QWEN3_MOE],
            reward_funcs=hub[QWEN2_RM],
            args=training_args,
            train_dataset=dataset,
            tools=tools,
        )
        previous = params_of(trainer)
        tool_name = tools[0].__name__
        tokenizer = trainer.processing_class

        def ids(texts: list[str]) -> torch.Tensor:
            """The texts' token ids (upstream writes out Qwen's), padded on the right with the pad token."""
            rows = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
            width = max(map(len, rows))
            return torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])

        def fake_generate(input_ids, **kwargs):
            if input_ids.shape[0] == 3:  # first call
                call = '<tool_call>\n{"name": "%s", "arguments": {"a": 3, "%s": 4}}\n</tool_call><|im_end|>'
                completion_ids = ids(
                    [
                        call % (tool_name, "b"),
                        call % (tool_name, "c"),  # an invalid tool call with wrong argument name
                        "I don't know any tool<|im_end|>",
                    ]
                )
            else:  # second call will only have two inputs in the batch, because two examples have a tool call.
                completion_ids = ids(["Done!<|im_end|>", "Done!<|im_end|>"])
            return torch.cat([input_ids, completion_ids.to(input_ids.device)], dim=-1)

        with patch.object(trainer.model, "generate", side_effect=fake_generate):
            trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.state.log_history[-1]["tools/call_frequency"] is not None
        assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
        assert trainer.state.log_history[-1]["tools/failure_frequency"] is not None
        assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
        assert_every_param_changed(trainer, previous)

    def test_mismatched_reward_processing_classes_length(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_models = [hub[QWEN2_RM], hub["trl-internal-testing/tiny-Qwen3ForSequenceClassification"]]
        single_processing_class = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(ValueError, match="must match"):
            PackedGRPOTrainer(
                model=hub[QWEN2],
                reward_funcs=reward_models,
                reward_processing_classes=single_processing_class,  # only one, but need two
                args=training_args,
                train_dataset=dataset,
            )

    def test_correct_reward_processing_classes_list(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_models = [hub[QWEN2_RM], hub["trl-internal-testing/tiny-Qwen3ForSequenceClassification"]]
        processing_class1 = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        processing_class2 = AutoTokenizer.from_pretrained(
            hub["trl-internal-testing/tiny-Qwen3ForSequenceClassification"]
        )
        training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
        correct_processing_classes = [processing_class1, processing_class2]
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=reward_models,
            reward_processing_classes=correct_processing_classes,
            args=training_args,
            train_dataset=dataset,
        )
        assert len(trainer.reward_processing_classes) == len(reward_models)

    def test_single_reward_model_with_single_processing_class(self, hub, tmp_path):
        dataset = load_dataset(ZEN_ID, "standard_prompt_only", split="train")
        reward_model = hub[QWEN2_RM]
        single_processing_class = AutoTokenizer.from_pretrained(hub[QWEN2_RM])
        training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedGRPOTrainer(
            model=hub[QWEN2],
            reward_funcs=reward_model,
            reward_processing_classes=single_processing_class,  # single object for single reward model
            args=training_args,
            train_dataset=dataset,
        )
        assert len(trainer.reward_processing_classes) == 1
        assert trainer.reward_processing_classes[0] == single_processing_class
