"""TRL's RewardTrainer tests, run against ``PackedRewardTrainer``.

Upstream: huggingface/trl ``tests/test_reward_trainer.py``, class ``TestRewardTrainer``, at
012afbbc8801bdc112b238242ce95b285162e74f (the newest version in the source store; every feature it
tests is in the pinned trl 1.16: ``evaluate`` on a raw dataset, the legacy ``chosen_input_ids``
columns, ``chat_template_kwargs``, JSON ``tools``). ``TestDataCollatorForPreference`` is left out: the
collator is compared with TRL's in ``tests/test_trl_reward.py``.

What was swapped, and nothing else (every assertion is kept):

- ``RewardTrainer`` -> ``PackedRewardTrainer``;
- the hub, which tests may not reach: each model id names a model built once per session from a
  config (2 layers, hidden size 16, float32) and saved with ``save_pretrained`` beside a byte-level
  tokenizer (259 tokens: the 256 bytes, ``<|endoftext|>`` as the pad, ``<|im_start|>`` and
  ``<|im_end|>`` as the EOS) and a Qwen-style chat template that renders ``tools`` and
  ``tool_calls``; ``tiny-GPTNeoXForCausalLM``'s has no chat template (as upstream's) and no pad token;
  ``Qwen/Qwen3-4B`` (the chat template cloned) is such a tokenizer alone;
- ``load_dataset("trl-internal-testing/zen", config)`` -> the same configs and column shapes
  synthesized (19 "X is Y" statements: 17 train, 2 test; standard: strings, conversational:
  lists of ``{role, content}``; implicit prompt: ``chosen`` / ``rejected`` only); ``streaming=True``
  -> ``Dataset.to_iterable_dataset()``;
- ``load_dataset("trl-internal-testing/toolcall", "preference")`` -> 8 synthesized rows: a
  conversational ``prompt``, a ``chosen`` assistant turn calling a tool (``tool_calls``, whose
  arguments differ in schema from row to row), a ``rejected`` plain answer, ``tools`` a JSON string
  of function schemas that also differ from row to row;
- the ``chat_template_kwargs`` test's "simplified version of the Qwen chat template" -> a shorter one
  that renders these datasets' messages (system, user, assistant) the same way, ``role_capital``
  included;
- ``lazy_shared_datadir / "template.jinja"`` -> a small Jinja template written to a temporary file;
- ``TrlTestCase``'s ``self.tmp_dir`` -> pytest's ``tmp_path``; ``test_tag_added*``, which pass no
  ``args`` (so ``RewardConfig("<model>-Reward")``, a relative ``output_dir``), run in ``tmp_path``;
- ``RewardConfig(...)`` -> ``RewardConfig(..., use_cpu=True)`` where there is no CUDA device: its
  default ``bf16=True`` is refused on a CPU without it (the two ``args``-less tests get it by
  patching the name ``RewardTrainer`` builds its default config with);
- the two tool-call tests share their body (``train_on_toolcalls``).

The epochs and batch sizes are upstream's (RewardConfig's defaults: 3 epochs of 8 pairs, 9 steps on
17 rows, as upstream's ``checkpoint-9`` assumes), and so are bf16 and gradient checkpointing, which
``RewardConfig`` turns on by default. The statements differ in length (4 are about 3x the others), so
that under SDPA the packed rows (best fit, as wide as the longest sequence) hold several sequences: the
16 sequences of a step's 8 pairs take 6 rows. No test needed a ``DIFFERENCE``: all 36 pass as they do
with stock ``trl.RewardTrainer``; and, checked while porting (not here), in float32 with bf16 off the
two trainers' logged histories (3 steps, loss, grad norm, every reward metric) agree to 1e-5 relative
in every scenario of this file (pure float16 training, where Adam's ``v`` underflows, diverges after
the first steps with either trainer's rounding; the first steps agree).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import trl
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import is_peft_available

from zephon_collate.trainers import PackedRewardTrainer

if is_peft_available():
    from peft import LoraConfig, get_peft_model


def RewardConfig(*args, **options) -> trl.RewardConfig:
    """``trl.RewardConfig``, on the CPU where there is no GPU (its default ``bf16=True`` needs one or ``use_cpu``)."""
    return trl.RewardConfig(*args, **options, use_cpu=not torch.cuda.is_available())


require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")

# -- the local hub ----------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{ message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>' }}{{ call['function'] | tojson }}{{ '</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A Qwen-style template: ``<|im_start|>role\\ncontent<|im_end|>\\n``, tools first, tool calls as JSON."""

TEMPLATE_FILE = (
    "{%- for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- endfor %}{{ eos_token }}"
)
"""The stand-in for upstream's ``tests/data/template.jinja``."""

ROLE_CAPITAL_TEMPLATE = (
    "{%- set system = 'SYSTEM' if role_capital else 'system' %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>' + system + '\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + system + '\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + (message['role'].upper() if role_capital else message['role']) + '\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|im_start|>' + ('ASSISTANT' if role_capital else 'assistant') + '\\n' }}{%- endif %}"
)
"""The stand-in for the test's simplified Qwen template (upstream's renders these messages alike)."""


def byte_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: every byte a token, so every string tokenizes, prefix-stably."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if not chat:  # as GPT-NeoX's: <|endoftext|> for BOS and EOS, no pad token, no chat template
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_models() -> dict[str, tuple[type, type, dict, bool]]:
    """Model id -> (model class, config class, config options, chat tokenizer)."""
    dense = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    return {
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": (
            Qwen2ForCausalLM,
            Qwen2Config,
            {**dense, "num_key_value_heads": 2},
            True,
        ),
        "trl-internal-testing/tiny-Qwen3MoeForCausalLM": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig,
            {**dense, "num_key_value_heads": 2, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2}
            | {"moe_intermediate_size": 16},
            True,
        ),
        "trl-internal-testing/tiny-LlamaForCausalLM-3.2": (
            LlamaForCausalLM,
            LlamaConfig,
            {**dense, "num_key_value_heads": 2},
            True,
        ),
        "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
            Qwen2ForSequenceClassification,
            Qwen2Config,
            {**dense, "num_key_value_heads": 2, "num_labels": 1},
            True,
        ),
        "trl-internal-testing/tiny-GPTNeoXForCausalLM": (GPTNeoXForCausalLM, GPTNeoXConfig, dense, False),
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each hub id the tests name -> a local directory (or file) standing in for it."""
    root = tmp_path_factory.mktemp("hub")
    paths: dict[str, str] = {}
    for model_id, (model_class, config_class, options, chat) in tiny_models().items():
        tokenizer = byte_tokenizer(chat)
        ids = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.eos_token_id}
        if tokenizer.pad_token_id is not None:
            ids["pad_token_id"] = tokenizer.pad_token_id
        torch.manual_seed(0)
        model = model_class(config_class(vocab_size=len(tokenizer), **options, **ids))
        path = root / model_id.split("/")[-1]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[model_id] = str(path)
    chat_source = root / "Qwen3-4B"
    byte_tokenizer(chat=True).save_pretrained(chat_source)
    paths["Qwen/Qwen3-4B"] = str(chat_source)
    template = root / "template.jinja"
    template.write_text(TEMPLATE_FILE)
    paths["template.jinja"] = str(template)
    return paths


# -- the local datasets -----------------------------------------------------------------------------

STATEMENTS = [
    ("The wide sky above the quiet hills on a clear summer afternoon", "blue", "green"),
    ("Snow", "white", "black"),
    ("Grass", "green", "purple"),
    ("Fire", "hot", "cold"),
    ("Ice", "cold", "hot"),
    ("Sugar", "sweet", "salty"),
    ("A lemon", "sour", "sweet"),
    ("The sun, seen at noon from a boat in the middle of the lake", "bright", "dark"),
    ("A feather", "light", "heavy"),
    ("An elephant", "large", "tiny"),
    ("A mouse", "small", "huge"),
    ("Water", "wet", "dry"),
    ("A desert", "dry", "wet"),
    ("A rock picked up from the bed of a cold mountain stream", "hard", "soft"),
    ("A pillow", "soft", "hard"),
    ("A cheetah", "fast", "slow"),
    ("A snail", "slow", "fast"),
    ("Night in a forest far from any town or road", "dark", "bright"),
    ("Honey", "sticky", "crunchy"),
]
"""(subject, chosen, rejected): 17 train rows, then 2 test rows; some long, so that packed rows hold several."""


def zen_row(config: str, subject: str, good: str, bad: str) -> dict:
    """One row of a zen config: standard rows are strings, conversational rows lists of messages."""
    question = [{"role": "user", "content": f"What is {subject[0].lower()}{subject[1:]} like?"}]

    def answer(word: str) -> list[dict]:
        return [{"role": "assistant", "content": f"{subject} is {word}."}]

    if config == "standard_preference":
        return {"prompt": f"{subject} is", "chosen": f" {good}.", "rejected": f" {bad}."}
    if config == "standard_implicit_prompt_preference":
        return {"chosen": f"{subject} is {good}.", "rejected": f"{subject} is {bad}."}
    if config == "conversational_preference":
        return {"prompt": question, "chosen": answer(good), "rejected": answer(bad)}
    if config == "conversational_implicit_prompt_preference":
        return {"chosen": question + answer(good), "rejected": question + answer(bad)}
    raise ValueError(f"no zen config {config!r} here")


TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
    {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object", "properties": {}}},
]


def toolcall_row(index: int) -> dict:
    """A tool-calling preference pair; the tools (1 to 3) and the call arguments differ from row to row."""
    tool = TOOLS[index % len(TOOLS)]
    arguments = [{"city": f"City{index}"}, {"a": index, "b": index + 1}, {"word": f"w{index}"}][index % 3]
    call = {"type": "function", "function": {"name": tool["name"], "arguments": arguments}}
    return {
        "prompt": [{"role": "user", "content": f"Please use {tool['name']} for request {index}."}],
        "chosen": [{"role": "assistant", "content": "", "tool_calls": [call]}],
        "rejected": [{"role": "assistant", "content": f"I cannot help with request {index}."}],
        "tools": json.dumps([tool, *[other for other in TOOLS if other is not tool][: index % 3]]),  # 1 to 3
    }


def load_dataset(path: str, name: str, split: str | None = None, streaming: bool = False):
    """The stand-in for ``datasets.load_dataset`` on TRL's two test datasets."""
    if path == "trl-internal-testing/zen":
        rows = [zen_row(name, *statement) for statement in STATEMENTS]
        splits = {"train": rows[:17], "test": rows[17:]}
    elif path == "trl-internal-testing/toolcall" and name == "preference":
        splits = {"train": [toolcall_row(index) for index in range(8)]}
    else:
        raise ValueError(f"no local stand-in for {path} {name}")
    made = DatasetDict({key: Dataset.from_list(value) for key, value in splits.items()})
    if streaming:
        return {key: value.to_iterable_dataset() for key, value in made.items()}[split]
    return made if split is None else made[split]


# -- what every training test checks ---------------------------------------------------------------


def params_of(trainer) -> dict[str, torch.Tensor]:
    return {n: param.clone() for n, param in trainer.model.named_parameters()}


def assert_every_param_changed(trainer, previous, skip=lambda name: False) -> None:
    """Upstream's loop: every parameter has changed (bar those ``skip`` names)."""
    for n, param in previous.items():
        if skip(n):
            continue
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def assert_only_adapter_changed(trainer, previous, base_param_names) -> None:
    """Upstream's PEFT loop: base parameters unchanged, the adapter's (not the base layers') changed."""
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # We expect the base model params to be the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n:  # We expect the peft params to be different (except for the base layer)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
QWEN2_SEQ_CLS = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
NEOX = "trl-internal-testing/tiny-GPTNeoXForCausalLM"
ZEN = "trl-internal-testing/zen"


class TestRewardTrainer:
    def test_raises_error_when_model_num_labels_not_one(self, hub, tmp_path):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2], dtype="float32")  # 2 labels
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(ValueError, match=r"reward models require `num_labels=1`"):
            PackedRewardTrainer(model=model, args=training_args, train_dataset=dataset)

    @pytest.mark.parametrize(
        "model_id",
        [
            QWEN2,
            "trl-internal-testing/tiny-Qwen3MoeForCausalLM",
            "trl-internal-testing/tiny-LlamaForCausalLM-3.2",
        ],
    )
    def test_train(self, hub, tmp_path, model_id):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=hub[model_id], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_evaluate_with_raw_dataset(self, hub, tmp_path):
        # `evaluate` takes the unprocessed dataset types the trainer takes (trl issue #6115)
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), max_steps=1, report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        trainer.train()
        metrics = trainer.evaluate(eval_dataset=dataset)
        assert metrics["eval_loss"] is not None

    @pytest.mark.parametrize(
        "config_name",
        [
            "standard_preference",
            "conversational_preference",
            "standard_implicit_prompt_preference",
            "conversational_implicit_prompt_preference",
        ],
    )
    def test_train_dataset_types(self, hub, tmp_path, config_name):
        dataset = load_dataset(ZEN, config_name, split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_model(self, hub, tmp_path):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2], num_labels=1, dtype="float32")
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=model, args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_from_sequence_classification_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2_SEQ_CLS], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_model_dtype(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path),
            model_init_kwargs={"dtype": torch.float16},
            learning_rate=0.1,  # upstream: a higher lr, as the tiny gradients stall at the default one
            report_to="none",
        )
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous.items():
            if "layernorm" in n:  # upstream skips these (unchanged on its CI)
                continue
            new_param = trainer.model.get_parameter(n)
            assert new_param.dtype == torch.float16
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_dense_with_peft_config(self, hub, tmp_path):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    @require_peft
    def test_train_moe_with_peft_config(self, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-Qwen3MoeForCausalLM"]
        model = AutoModelForSequenceClassification.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(
            model=model_id,
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj", "score"]),
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    @require_peft
    def test_train_peft_model(self, hub, tmp_path):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2], num_labels=1, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        model = get_peft_model(model, LoraConfig())
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=model, args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    # Upstream: the same as test_train_dense_with_peft_config while gradient checkpointing is on by
    # default, kept as a guard should the default change.
    @require_peft
    def test_train_with_peft_config_and_gradient_checkpointing(self, hub, tmp_path):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
        trainer = PackedRewardTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    @require_peft
    def test_train_with_peft_config_and_gradient_checkpointing_reentrant(self, hub, tmp_path, use_reentrant):
        model = AutoModelForSequenceClassification.from_pretrained(hub[QWEN2_SEQ_CLS], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
            report_to="none",
        )
        trainer = PackedRewardTrainer(
            model=hub[QWEN2_SEQ_CLS], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_only_adapter_changed(trainer, previous, base_param_names)

    @pytest.mark.parametrize(
        "chosen_column,rejected_column,expect_deprecation_warning",
        [("chosen_ids", "rejected_ids", False), ("chosen_input_ids", "rejected_input_ids", True)],
    )
    def test_train_with_pretokenized_data(
        self, hub, tmp_path, chosen_column, rejected_column, expect_deprecation_warning
    ):
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")

        def tokenize_example(example):
            return {
                chosen_column: tokenizer(example["chosen"]).input_ids,
                rejected_column: tokenizer(example["rejected"]).input_ids,
            }

        tokenized_dataset = dataset.map(tokenize_example, remove_columns=["chosen", "rejected"])
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        if expect_deprecation_warning:
            with pytest.warns(FutureWarning, match=r"will not be supported in v1"):
                trainer = PackedRewardTrainer(
                    model=hub[QWEN2], args=training_args, train_dataset=tokenized_dataset
                )
        else:
            trainer = PackedRewardTrainer(
                model=hub[QWEN2], args=training_args, train_dataset=tokenized_dataset
            )

        assert "chosen_ids" in trainer.train_dataset.column_names
        assert "rejected_ids" in trainer.train_dataset.column_names
        assert "chosen_input_ids" not in trainer.train_dataset.column_names
        assert "rejected_input_ids" not in trainer.train_dataset.column_names

        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_iterable_dataset(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train", streaming=True)
        training_args = RewardConfig(output_dir=str(tmp_path), max_steps=3, report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_chat_template_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        # A Qwen-like template whose extra argument `role_capital` capitalizes the roles.
        tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE
        dataset = dataset.add_column(
            "chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))]
        )
        assert "chat_template_kwargs" in dataset.features

        trainer = PackedRewardTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, processing_class=tokenizer
        )

        assert trainer.processing_class.chat_template == tokenizer.chat_template
        for i in range(2):
            role = "SYSTEM" if i else "system"
            system_prompt = f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
            system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
            assert trainer.train_dataset[i]["chosen_ids"][: len(system_prompt_ids)] == system_prompt_ids
            assert trainer.train_dataset[i]["rejected_ids"][: len(system_prompt_ids)] == system_prompt_ids

        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_set_chat_template_from_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path), chat_template_path=hub["Qwen/Qwen3-4B"], report_to="none"
        )
        # the tiny GPT-NeoX has no chat template
        trainer = PackedRewardTrainer(model=hub[NEOX], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        # Upstream: the loss is shift-free in the scores, so the bias of GPT-NeoX's final LayerNorm gets no
        # gradient and stays as it is.
        assert_every_param_changed(trainer, previous, skip=lambda n: n == "gpt_neox.final_layer_norm.bias")

    def test_train_with_set_chat_template_from_path(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path), chat_template_path=hub["template.jinja"], report_to="none"
        )
        trainer = PackedRewardTrainer(model=hub[NEOX], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous, skip=lambda n: n == "gpt_neox.final_layer_norm.bias")

        # The template saved with the checkpoint is the one trained with
        template_path = pathlib.Path(tmp_path) / "checkpoint-9" / "chat_template.jinja"
        assert template_path.exists(), f"Chat template not found at {template_path}"
        template_content = template_path.read_text()
        original_template_content = pathlib.Path(training_args.chat_template_path).read_text()
        assert template_content == original_template_content, (
            "Chat template content does not match the original"
        )

    def test_train_toolcall_data(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/toolcall", "preference", split="train")
        trainer, previous = self.train_on_toolcalls(hub, tmp_path, dataset)
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_toolcall_data_as_json(self, hub, tmp_path):
        # Upstream: Arrow fills the keys a row's `tools` dicts lack with None where the schemas differ; tools
        # given as a list of dicts must train as the JSON string does.
        dataset = load_dataset("trl-internal-testing/toolcall", "preference", split="train")
        dataset = dataset.map(lambda example: {"tools": json.loads(example["tools"])})
        trainer, previous = self.train_on_toolcalls(hub, tmp_path, dataset)
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @staticmethod
    def train_on_toolcalls(hub, tmp_path, dataset):
        """The body both tool-call tests share: the trained trainer and its parameters before."""
        training_args = RewardConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,  # upstream: tool-call sequences are longer
            max_length=512,
            report_to="none",
        )
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        return trainer, previous

    def test_train_with_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference")
        training_args = RewardConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = PackedRewardTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )
        trainer.train()
        assert trainer.state.log_history[0]["eval_loss"] is not None

    def test_train_with_multiple_eval_dataset(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference")
        training_args = RewardConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = PackedRewardTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
        )
        trainer.train()
        assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
        assert trainer.state.log_history[-2]["eval_data2_loss"] is not None

    def test_train_with_compute_metrics(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference")

        def dummy_compute_metrics(eval_pred):
            return {"my_metric": 0.123}

        training_args = RewardConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = PackedRewardTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            compute_metrics=dummy_compute_metrics,
        )
        trainer.train()
        assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123

    # Upstream: the same as test_train while gradient checkpointing is on by default, kept as a guard.
    def test_train_with_gradient_checkpointing(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_train_with_gradient_checkpointing_reentrant(self, hub, tmp_path, use_reentrant):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
            report_to="none",
        )
        trainer = PackedRewardTrainer(model=hub[QWEN2_SEQ_CLS], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_tag_added(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.reward_trainer.RewardConfig", RewardConfig)  # no args: the default
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        trainer = PackedRewardTrainer(model=hub[QWEN2], train_dataset=dataset)
        for tag in ["reward-trainer", "trl"]:
            assert tag in trainer.model.model_tags

    @require_peft
    def test_tag_added_peft(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.reward_trainer.RewardConfig", RewardConfig)  # no args: the default
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        trainer = PackedRewardTrainer(model=hub[QWEN2], train_dataset=dataset, peft_config=LoraConfig())
        for tag in ["reward-trainer", "trl"]:
            assert tag in trainer.model.model_tags

    def test_train_with_margin(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        dataset = dataset.map(lambda example: {"margin": len(example["chosen"])})  # a dummy margin
        training_args = RewardConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)

    def test_train_with_center_rewards_coefficient(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = RewardConfig(
            output_dir=str(tmp_path), center_rewards_coefficient=0.01, report_to="none"
        )
        trainer = PackedRewardTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert_every_param_changed(trainer, previous)
