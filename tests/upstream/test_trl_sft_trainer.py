"""TRL's SFTTrainer tests, run with ``Collator.for_transformers`` as the trainer's collator.

Upstream: huggingface/trl ``tests/test_sft_trainer.py`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (HEAD of the
source store), class ``TestSFTTrainer``; every feature it tests is in the pinned trl 1.16 (labels built and examples
truncated in dataset preparation, the dropping of fully masked examples, the ``skip_prepare_dataset`` guard,
``evaluate`` on a raw dataset, ``chat_template_kwargs``). ``TestDataCollatorForLanguageModeling`` runs against this
package in ``tests/upstream/test_trl_collator.py``; ``TestDFTLoss``, ``TestChunkedCrossEntropyLoss`` and
``TestPatchChunkedCELMHead`` test TRL's losses, not its collator, and are left out.

What was swapped, and nothing else (every assertion is kept):

- the collator ``SFTTrainer`` builds for text: the name ``DataCollatorForLanguageModeling`` in
  ``trl.trainer.sft_trainer`` is patched (for every test) with ``ZephonDataCollatorForLanguageModeling``, a subclass of
  TRL's (so that the trainer's ``isinstance`` checks and its ``return_position_ids = True`` under sequence parallelism
  still apply) whose ``torch_call`` is ``Collator.for_transformers`` with the equivalent options, as
  docs/hugging_face.md gives them: padded, ``pad_token_id``, ``pad_to_multiple_of``, ``return_position_ids``;
  padding-free, ``pad_token_id``, ``padding_free=True``, ``pad_to_multiple_of``, ``return_flash_attn_kwargs=True``,
  ``return_seq_idx=True``;
- the hub, which tests may not reach: each model id names a model built once per module from a config (2 layers,
  hidden size 16, float32; the models and the byte-level tokenizer with its Qwen-style chat template are
  ``tests/upstream/test_trl_dpo_trainer.py``'s); ``tiny-Qwen3ForCausalLM`` is a Qwen3 whose chat template has
  ``{% generation %}`` markers (as the real Qwen3's training template does), ``tiny-GPTNeoXForCausalLM`` has no chat
  template and no pad token (as upstream's), ``Qwen/Qwen3-4B`` (whose chat template is cloned) is a chat tokenizer
  alone;
- ``load_dataset("trl-internal-testing/zen", config)`` -> the same configs and column shapes synthesized (19 short
  statements, 17 train and 2 test, short enough that ``max_length=64`` packs the train split into 3 rows and the
  test split into 1, as upstream's real zen does with Qwen's tokenizer); ``load_dataset("trl-internal-testing/toolcall",
  "language_modeling")`` -> 8 synthesized conversations calling a tool, ``tools`` a JSON string of schemas;
  ``streaming=True`` -> ``Dataset.to_iterable_dataset()``;
- the ``chat_template_kwargs`` test's "simplified version of the Qwen chat template" -> a shorter one rendering these
  messages the same way, ``role_capital`` included; ``lazy_shared_datadir / "template.jinja"`` -> a small template
  written to a temporary file;
- ``TrlTestCase``'s ``self.tmp_dir`` -> pytest's ``tmp_path``; ``test_tag_added*`` (no ``args``) run in ``tmp_path``;
- ``SFTConfig(...)`` -> ``SFTConfig(..., use_cpu=True)`` where there is no CUDA device (its default ``bf16=True`` is
  refused on a CPU without it; the ``args``-less tests get it by patching the name ``SFTTrainer`` builds its default
  config with), and ``max_steps=3`` where upstream gives none: one epoch (3 steps of 8, 8 and 1 examples) instead of
  ``SFTConfig``'s 3 epochs, to keep the file to a few minutes on two CPU cores. ``test_train_with_set_chat_template_from_path``,
  which asserts ``checkpoint-9``, trains upstream's 9 steps. Every evaluation upstream asserts on (``eval_steps=3``)
  still happens, at step 3, and the log entries sit where upstream's do.

- ``tiny-NemotronHForCausalLM-nano``'s Mamba time steps are drawn from 0.5 to 1.0 (its config's default 0.001 to
  0.1 leaves ``dt_bias`` and ``A_log`` unchanged after 3 steps at hidden size 16, with stock TRL as with this
  package: their ~1e-10 gradients move them by under half a float32 ulp);
- one test is added, ``test_collator_is_swapped``: the trainer's collator is the swapped one.

No test needed a ``DIFFERENCE``: every case passes as it does with stock TRL's collator. ``SFTTrainer`` builds the
``labels`` column (from ``completion_mask`` / ``assistant_masks``) and truncates during dataset preparation, and its
default ``remove_unused_columns=True`` hands the collator only ``input_ids``, ``labels`` and ``seq_lengths``, so
none of this package's deliberate differences (docs/hugging_face.md, **Differs**) is reached by these tests.
Checked while porting (not asserted here, as upstream asserts no values): every training and evaluation of this
file run again with stock ``trl.SFTTrainer`` (its own collator) in float32 (bf16 off), every step logged, same
seed, logs the same history bit for bit (loss, grad norm, num_tokens, mean_token_accuracy, entropy, aux_loss, every
eval metric) and ends on the same weights bit for bit, and every collated batch is equal key for key and dtype for
dtype; so do padding-free training without packing, ``pad_to_multiple_of`` (padded and padding-free),
``bfd_split`` and ``wrapped`` packing, gradient accumulation, ``dataloader_num_workers=2`` and the other
scenarios tried beside them.

Left out: ``test_train_gpt_oss`` and ``test_train_completion_only_harmony`` (the harmony dataset and GPT-OSS's
harmony chat template are hub files), the vision-language tests (``test_train_nll_loss_vlm``, ``test_train_vlm*``,
``test_vision_dataset_with_text_model_raises``: hub processors and image datasets; ``SFTTrainer`` uses its own
vision collator for them, not the one swapped here) and ``TestSFTTrainerSlow`` (hub models on GPUs). The GPU,
kernels, liger-kernel and bitsandbytes tests keep upstream's markers and skip where those are missing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from unittest.mock import MagicMock, patch

import pytest
import torch
import transformers
import trl
import trl.trainer.sft_trainer as sft_trainer_module
from datasets import Dataset, DatasetDict, IterableDatasetDict
from packaging.version import Version
from test_trl_dpo_trainer import (  # the DPO port's local hub (same directory)
    DENSE_GQA,
    NEMOTRON_H,
    REMOTE,
    ROLE_CAPITAL_TEMPLATE,
    TINY_MODELS,
    byte_tokenizer,
    is_ampere_or_newer,
    require_bitsandbytes,
    require_kernels,
    require_liger_kernel,
    require_peft,
    save_remote,
)
from test_trl_reward_trainer import (  # upstream's parameter checks, as the reward port writes them
    assert_every_param_changed,
    assert_only_adapter_changed,
    params_of,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    TrainingArguments,
)
from transformers.testing_utils import torch_device
from transformers.utils import is_peft_available

from zephon_collate import Collator

if is_peft_available():
    import peft
    from peft import (
        LoraConfig,
        PrefixTuningConfig,
        PromptEncoderConfig,
        PromptTuningConfig,
        TaskType,
        get_peft_model,
    )

SFTTrainer = trl.SFTTrainer
StockDataCollatorForLanguageModeling = sft_trainer_module.DataCollatorForLanguageModeling

require_torch_accelerator = pytest.mark.skipif(not torch.cuda.is_available(), reason="test requires a GPU")
require_vision = pytest.mark.skip(reason="vision-language tests use hub processors and image datasets")

STEPS = 3
"""One epoch of the 17 training rows at SFTConfig's 8 examples a step; upstream trains 3 epochs (9 steps)."""


def SFTConfig(*args, **options) -> trl.SFTConfig:
    """``trl.SFTConfig``: on the CPU where there is no CUDA device, one epoch (``max_steps=3``) unless given."""
    options.setdefault("max_steps", STEPS)
    return trl.SFTConfig(*args, **options, use_cpu=not torch.cuda.is_available())


# -- the swap ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class ZephonDataCollatorForLanguageModeling(StockDataCollatorForLanguageModeling):
    """TRL's collator's fields, collated by ``Collator.for_transformers`` with the equivalent options."""

    def _collator(self) -> Collator:
        key = (self.pad_token_id, self.padding_free, self.pad_to_multiple_of, self.return_position_ids)
        if getattr(self, "_key", None) != key:
            if self.padding_free:  # TRL returns position_ids padding-free whatever return_position_ids says
                options = {"padding_free": True, "return_flash_attn_kwargs": True, "return_seq_idx": True}
            else:
                options = {"return_position_ids": self.return_position_ids}
            self._zephon = Collator.for_transformers(
                pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of, **options
            )
            self._key = key
        return self._zephon

    def torch_call(self, examples):
        return self._collator()(examples)


@pytest.fixture(autouse=True)
def swap_collator(monkeypatch):
    """``SFTTrainer`` builds this package's collator wherever it would build TRL's for text."""
    monkeypatch.setattr(
        sft_trainer_module, "DataCollatorForLanguageModeling", ZephonDataCollatorForLanguageModeling
    )


# -- the local hub ----------------------------------------------------------------------------------

GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3's training template in short: the assistant's content and its ``<|im_end|>`` inside ``generation``."""

TEMPLATE_FILE = (
    "{%- for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- endfor %}{{ eos_token }}"
)
"""The stand-in for upstream's ``tests/data/template.jinja``."""

QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
QWEN3 = "trl-internal-testing/tiny-Qwen3ForCausalLM"
NEOX = "trl-internal-testing/tiny-GPTNeoXForCausalLM"
GPT_OSS = "trl-internal-testing/tiny-GptOssForCausalLM"


def neox_tokenizer() -> PreTrainedTokenizerFast:
    """As GPT-NeoX's: ``<|endoftext|>`` for BOS and EOS, no pad token, no chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each hub id the tests name -> a local directory (or file) standing in for it."""
    root = tmp_path_factory.mktemp("hub")
    paths: dict[str, str] = {}
    extra = {QWEN3: (Qwen3ForCausalLM, Qwen3Config, {**DENSE_GQA, "head_dim": 4})}
    # Nemotron-H's Mamba time steps drawn larger than its defaults (0.001 to 0.1): at hidden size 16, the
    # gradients of dt_bias and A_log (about 1e-10) move them by less than half a float32 ulp at the default
    # dt_bias (-3 to -7), so upstream's "every parameter changed" would fail with stock TRL as well
    nemotron_class, nemotron_config, nemotron_options = TINY_MODELS[NEMOTRON_H]
    extra[NEMOTRON_H] = (
        nemotron_class,
        nemotron_config,
        {**nemotron_options, "time_step_min": 0.5, "time_step_max": 1.0},
    )
    for model_id, (model_class, config_class, options) in {**TINY_MODELS, **extra}.items():
        tokenizer = byte_tokenizer()
        if model_id == QWEN3:
            tokenizer.chat_template = GENERATION_TEMPLATE
        ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        torch.manual_seed(0)
        model = model_class(config_class(vocab_size=len(tokenizer), **options, **ids))
        path = root / model_id.split("/")[-1]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[model_id] = str(path)
    tokenizer = neox_tokenizer()
    torch.manual_seed(0)
    ids = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    neox = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            **ids,
        )
    )
    path = root / NEOX.split("/")[-1]
    neox.save_pretrained(path)
    tokenizer.save_pretrained(path)
    paths[NEOX] = str(path)
    remote = root / REMOTE.split("/")[-1]
    save_remote(remote, byte_tokenizer())
    paths[REMOTE] = str(remote)
    chat_source = root / "Qwen3-4B"
    byte_tokenizer().save_pretrained(chat_source)
    paths["Qwen/Qwen3-4B"] = str(chat_source)
    template = root / "template.jinja"
    template.write_text(TEMPLATE_FILE)
    paths["template.jinja"] = str(template)
    return paths


# -- the local datasets -----------------------------------------------------------------------------

STATEMENTS = [
    ("Sky", "blue"),
    ("Snow", "white"),
    ("Moss", "green"),
    ("Fire", "hot"),
    ("Ice", "cold"),
    ("Jam", "sweet"),
    ("Lime", "sour"),
    ("Sun at noon", "bright"),
    ("Lead", "heavy"),
    ("Mice", "small"),
    ("Water", "wet"),
    ("Sand", "dry"),
    ("Rock", "hard"),
    ("Down", "soft"),
    ("Owls", "wise"),
    ("Slugs", "slow"),
    ("Night", "dark"),
    ("Honey", "sticky"),
    ("Salt", "salty"),
]
"""(subject, value): 17 train rows, then 2 test rows, of 7 to 18 bytes."""


def _split(columns: dict[str, list]) -> DatasetDict:
    """``train_test_split(test_size=0.1, shuffle=False)``, as upstream's generator: 17 train, 2 test."""
    return Dataset.from_dict(columns).train_test_split(test_size=0.1, shuffle=False)


def zen(config: str) -> DatasetDict:
    """The stand-in for a ``trl-internal-testing/zen`` config."""
    subjects, values = (list(column) for column in zip(*STATEMENTS, strict=True))
    pairs = list(zip(subjects, values, strict=True))

    def user(subject: str) -> dict[str, str]:
        return {"role": "user", "content": f"What is {subject.lower()}?"}

    def assistant(subject: str, value: str) -> dict[str, str]:
        return {"role": "assistant", "content": f"{subject} is {value}."}

    if config == "standard_language_modeling":
        return _split({"text": [f"{s} {v}" for s, v in pairs]})
    if config == "conversational_language_modeling":
        return _split({"messages": [[user(s), assistant(s, v)] for s, v in pairs]})
    if config == "standard_prompt_completion":
        return _split({"prompt": [f"{s} is" for s in subjects], "completion": [f" {v}." for v in values]})
    if config == "conversational_prompt_completion":
        return _split(
            {"prompt": [[user(s)] for s in subjects], "completion": [[assistant(s, v)] for s, v in pairs]}
        )
    if config == "standard_implicit_prompt_preference":
        return _split(
            {"chosen": [f"{s} is {v}." for s, v in pairs], "rejected": [f"{s} is not {v}." for s, v in pairs]}
        )
    raise ValueError(f"no stand-in for zen config {config!r}")


TOOLS = [
    {"name": "get_weather", "parameters": {"city": "string"}},
    {"name": "add", "parameters": {"a": "number", "b": "number"}},
    {"name": "translate", "parameters": {"text": "string", "to": "string", "formal": "boolean"}},
    {"name": "lookup", "parameters": {"word": "string"}},
]


def toolcall() -> DatasetDict:
    """The stand-in for ``trl-internal-testing/toolcall``'s ``language_modeling``: 8 conversations calling a tool."""
    rows = {"messages": [], "tools": []}
    asks = [
        ("What is the weather in Paris?", 0, {"city": "Paris"}, "Sunny."),
        ("Add 2 and 3.", 1, {"a": 2, "b": 3}, "5"),
        (
            "Translate 'hello' to French, formally.",
            2,
            {"text": "hello", "to": "fr", "formal": True},
            "Bonjour",
        ),
        ("What does 'ephemeral' mean?", 3, {"word": "ephemeral"}, "short-lived"),
        ("Is it raining in Oslo?", 0, {"city": "Oslo"}, "Rain."),
        ("Add 40 and 2.", 1, {"a": 40, "b": 2}, "42"),
        ("Translate 'thanks' to German.", 2, {"text": "thanks", "to": "de", "formal": False}, "Danke"),
        ("Define 'laconic'.", 3, {"word": "laconic"}, "using few words"),
    ]
    for i, (question, tool, arguments, result) in enumerate(asks):
        call = {"type": "function", "function": {"name": TOOLS[tool]["name"], "arguments": arguments}}
        rows["messages"].append(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": TOOLS[tool]["name"], "content": result},
                {"role": "assistant", "content": f"The answer: {result}"},
            ]
        )
        rows["tools"].append(json.dumps([TOOLS[tool], TOOLS[(tool + 1 + i) % len(TOOLS)]]))
    return DatasetDict({"train": Dataset.from_dict(rows)})


ZEN = "trl-internal-testing/zen"
TOOLCALL = "trl-internal-testing/toolcall"


def load_dataset(path: str, name: str, split: str | None = None, streaming: bool = False):
    """The stand-in for ``datasets.load_dataset`` on the two hub datasets the tests name."""
    splits = zen(name) if path == ZEN else toolcall()
    if streaming:
        splits = IterableDatasetDict({key: value.to_iterable_dataset() for key, value in splits.items()})
    if split is not None and split.endswith("]"):  # "train[:2]"
        base, rows = split[:-1].split("[:")
        return splits[base].select(range(int(rows)))
    return splits if split is None else splits[split]


# -- what every training test checks ---------------------------------------------------------------


def train_and_check(trainer) -> None:
    """Upstream's most common body: train, a final ``train_loss``, every parameter changed."""
    previous = params_of(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_every_param_changed(trainer, previous)


def train_peft_and_check(trainer, base_param_names) -> None:
    previous = params_of(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_only_adapter_changed(trainer, previous, base_param_names)


# -- the tests --------------------------------------------------------------------------------------


class TestSFTTrainer:
    def test_collator_is_swapped(self, hub, tmp_path):
        # not upstream's: the trainer collates with this package
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        trainer = SFTTrainer(
            model=hub[QWEN2],
            args=SFTConfig(output_dir=str(tmp_path), report_to="none"),
            train_dataset=dataset,
        )
        assert isinstance(trainer.data_collator, ZephonDataCollatorForLanguageModeling)

    def test_init_with_training_arguments(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=args, train_dataset=dataset)
        # (added) what the build made of plain TrainingArguments: this package's collator
        assert isinstance(trainer.data_collator, ZephonDataCollatorForLanguageModeling)

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
            pytest.param(
                "trl-internal-testing/tiny-Olmo3ForCausalLM",
                marks=pytest.mark.skipif(
                    Version(transformers.__version__) < Version("4.57.0"),
                    reason="Olmo 3 requires transformers>=4.57.0",
                ),
            ),
            "trl-internal-testing/tiny-Lfm2ForCausalLM",
            pytest.param(
                "trl-internal-testing/tiny-Lfm2ForCausalLM-2.5",
                marks=pytest.mark.skipif(
                    Version(transformers.__version__) < Version("5.0.0"),
                    reason="LFM2.5 tokenizer requires transformers>=5.0.0",
                ),
            ),
        ],
    )
    def test_train(self, hub, tmp_path, model_id):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")

        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[model_id], args=training_args, train_dataset=dataset)

        previous_trainable_params = params_of(trainer)

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # MoE models log the load-balancing auxiliary loss (on by default)
        if trainer.aux_loss_enabled:
            assert trainer.state.log_history[-1]["aux_loss"] is not None

        assert_every_param_changed(trainer, previous_trainable_params)

    @pytest.mark.parametrize(
        "config_name",
        [
            "standard_language_modeling",
            "conversational_language_modeling",
            "standard_prompt_completion",
            "conversational_prompt_completion",
        ],
    )
    def test_train_dataset_format(self, hub, tmp_path, config_name):
        dataset = load_dataset(ZEN, config_name, split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_trust_remote_code(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        model_id = hub[REMOTE]

        with pytest.raises(ValueError, match="custom code"):
            SFTTrainer(
                model=model_id,
                args=SFTConfig(output_dir=str(tmp_path), report_to="none"),
                train_dataset=dataset,
            )

        trainer = SFTTrainer(
            model=model_id,
            args=SFTConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
            train_dataset=dataset,
        )
        assert type(trainer.model).__name__ == "RemoteForCausalLM"

    def test_train_model(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_dft_loss(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            loss_type="dft",
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
            eval_strategy="steps",
            eval_steps=3,
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )
        train_and_check(trainer)

    def test_train_nll_loss(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), loss_type="nll", report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @require_peft
    def test_train_nll_loss_peft(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), loss_type="nll", report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        train_peft_and_check(trainer, base_param_names)

    def test_train_with_formatting_func(self, hub, tmp_path):
        # Dummy formatting function
        def formatting_prompts_func(example):
            chosen, rejected = example["chosen"], example["rejected"]
            return f"### Chosen: {chosen}\n### Rejected: {rejected}"

        dataset = load_dataset(ZEN, "standard_implicit_prompt_preference", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
            formatting_func=formatting_prompts_func,
        )
        train_and_check(trainer)

    def test_train_model_dtype(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            model_init_kwargs={"dtype": torch.float16},
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        previous_trainable_params = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous_trainable_params.items():
            # upstream ignores the layernorms (one does not change in its CI)
            if "layernorm" in n:
                continue
            new_param = trainer.model.get_parameter(n)
            assert new_param.dtype == torch.float16
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_dense_with_peft_config_lora(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        train_peft_and_check(trainer, base_param_names)

    @pytest.mark.parametrize("peft_type", ["prompt_tuning", "prefix_tuning", "prompt_encoder"])
    @require_peft
    def test_train_with_peft_config_prompt_tuning(self, hub, tmp_path, peft_type):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")

        # Initialize the trainer, p-tuning doesn't support gradient checkpointing
        training_args = SFTConfig(
            bf16=False, output_dir=str(tmp_path), report_to="none", gradient_checkpointing=False
        )
        if peft_type == "prompt_tuning":
            peft_config = PromptTuningConfig(
                task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, tokenizer_name_or_path=hub[QWEN2]
            )
        elif peft_type == "prefix_tuning":
            if Version(peft.__version__) <= Version("0.17.1"):
                pytest.xfail(
                    "Prefix tuning with device_map='auto' is broken in peft 0.17.1 and below. See "
                    "https://github.com/huggingface/peft/issues/2821"
                )
            peft_config = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
        elif peft_type == "prompt_encoder":
            peft_config = PromptEncoderConfig(
                task_type=TaskType.CAUSAL_LM,
                num_virtual_tokens=4,
                encoder_hidden_size=model.config.hidden_size,  # This will be overwritten below
            )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=peft_config
        )
        previous_trainable_params = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            else:  # We expect the peft params to be different
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_moe_with_peft_config(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[GPT_OSS], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(
            model=hub[GPT_OSS],
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]),
        )
        train_peft_and_check(trainer, base_param_names)

    @require_peft
    def test_train_peft_model(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        model = get_peft_model(model, LoraConfig())
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset)
        train_peft_and_check(trainer, base_param_names)

    @require_peft
    def test_train_with_peft_config_and_gradient_checkpointing(self, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        train_peft_and_check(trainer, base_param_names)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    @require_peft
    def test_train_with_peft_config_and_gradient_checkpointing_reentrant(self, hub, tmp_path, use_reentrant):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
            report_to="none",
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )
        train_peft_and_check(trainer, base_param_names)

    @require_liger_kernel
    def test_train_with_liger(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @require_torch_accelerator
    @require_liger_kernel
    def test_compute_loss_skip_logits_on_eval_without_metrics_with_liger(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train[:1]")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            use_liger_kernel=False,
            loss_type="nll",
            report_to="none",
            max_length=8,
            bf16=False,
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, compute_metrics=None
        )
        trainer.args.use_liger_kernel = True
        trainer.model.eval()

        captured = {}

        def mock_super_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            captured["skip_logits"] = inputs.get("skip_logits")
            dummy_loss = torch.tensor(1.0, requires_grad=True)
            dummy_outputs = MagicMock()
            dummy_outputs.token_accuracy = torch.tensor(0.5)
            dummy_outputs.logits = torch.randn(1, 5, trainer.model.config.vocab_size)
            return (dummy_loss, dummy_outputs)

        inputs = {
            "input_ids": torch.tensor([[1, 2, 3, 4, 5]]),
            "labels": torch.tensor([[1, 2, 3, 4, 5]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1]]),
        }
        with patch("transformers.Trainer.compute_loss", side_effect=mock_super_compute_loss):
            trainer.compute_loss(trainer.model, inputs)
        assert captured["skip_logits"] is True

    @require_torch_accelerator
    @require_liger_kernel
    def test_predict_does_not_skip_logits_with_liger(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train[:1]")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            use_liger_kernel=False,
            loss_type="nll",
            report_to="none",
            max_length=8,
            bf16=False,
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, compute_metrics=None
        )
        trainer.args.use_liger_kernel = True
        trainer.model.eval()

        captured = {}

        def mock_super_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            captured["skip_logits"] = inputs.get("skip_logits")
            dummy_loss = torch.tensor(1.0, requires_grad=True)
            DummyOutput = collections.namedtuple("DummyOutput", ["loss", "logits", "token_accuracy"])
            dummy_outputs = DummyOutput(
                loss=dummy_loss,
                logits=torch.randn(1, 5, trainer.model.config.vocab_size),
                token_accuracy=torch.tensor(0.5),
            )
            return (dummy_loss, dummy_outputs)

        with patch("transformers.Trainer.compute_loss", side_effect=mock_super_compute_loss):
            trainer.predict(trainer.train_dataset)
        assert captured["skip_logits"] is False

    def test_train_with_non_chatml_conversational_data(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")

        # Rename role/content to from/value to ensure SFT works with non-chatML conversational data
        def rename_fields(example: list[dict]):
            return {
                "conversations": [{"from": m["role"], "value": m["content"]} for m in example["messages"]]
            }

        dataset = dataset.map(rename_fields, remove_columns="messages")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_with_pretokenized_data(self, hub, tmp_path):
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")

        def tokenize_example(example):
            return tokenizer(example["text"])

        tokenized_dataset = dataset.map(tokenize_example, remove_columns=["text"])
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=tokenized_dataset)
        train_and_check(trainer)

    def test_dataset_with_transform_requires_skip_prepare_dataset(self, hub, tmp_path):
        dataset = Dataset.from_dict({"text": ["hello world"]})

        def add_suffix(batch):
            batch["text"] = [text + " <AUG>" for text in batch["text"]]
            return batch

        dataset = dataset.with_transform(add_suffix)
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(
            ValueError, match=r"Dataset\.with_transform\(\).*skip_prepare_dataset.*trainer-ready"
        ):
            SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    def test_padding_free_without_packing_and_max_length_raises(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train[:2]")
        training_args = SFTConfig(
            output_dir=str(tmp_path), max_length=16, padding_free=True, report_to="none"
        )
        with pytest.raises(ValueError, match="`max_length` is not enforced"):
            SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    def test_train_with_iterable_dataset(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train", streaming=True)
        training_args = SFTConfig(output_dir=str(tmp_path), max_steps=3, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @require_kernels
    @pytest.mark.skipif(
        not is_ampere_or_newer() and torch_device != "xpu",
        reason="Flash Attention 2 requires Ampere or newer GPU, or XPU",
    )
    def test_train_padding_free(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            padding_free=True,
            max_length=None,  # padding-free without packing doesn't enforce max_length
            model_init_kwargs={"attn_implementation": "kernels-community/flash-attn2"},
            bf16=True,  # flash_attention_2 only supports bf16 and fp16
            report_to="none",
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @pytest.mark.parametrize("packing_strategy", ["bfd", "wrapped"])
    @pytest.mark.filterwarnings("ignore:You are using packing, but the attention implementation is not.*")
    @pytest.mark.filterwarnings("ignore:Padding-free training is enabled, but the attention.*")
    def test_train_packing(self, hub, tmp_path, packing_strategy):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            packing=True,
            packing_strategy=packing_strategy,
            max_length=10,
            report_to="none",
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @pytest.mark.filterwarnings("ignore:You are using packing, but the attention implementation is not.*")
    @pytest.mark.filterwarnings("ignore:Padding-free training is enabled, but the attention.*")
    def test_eval_packing(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )

        # Check the number of sequences in train and eval datasets
        num_train_seqs = sum(len(x) for x in trainer.train_dataset["seq_lengths"])
        num_eval_seqs = sum(len(x) for x in trainer.eval_dataset["seq_lengths"])
        assert num_train_seqs == 17  # we should still have 17 seqs
        assert num_eval_seqs == 2  # we should still have 2 seqs

        # Check that all sequences are shorter than the max length
        assert all(sum(x) <= 64 for x in trainer.train_dataset["seq_lengths"])
        assert all(sum(x) <= 64 for x in trainer.eval_dataset["seq_lengths"])

        # Check the number of sequences in train and eval datasets
        assert len(trainer.train_dataset["input_ids"]) == 3
        assert len(trainer.eval_dataset["input_ids"]) == 1

    @pytest.mark.filterwarnings("ignore:You are using packing, but the attention implementation is not.*")
    @pytest.mark.filterwarnings("ignore:Padding-free training is enabled, but the attention.*")
    def test_only_train_packing(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(
            output_dir=str(tmp_path), packing=True, eval_packing=False, max_length=64, report_to="none"
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )

        num_train_seqs = sum(len(x) for x in trainer.train_dataset["seq_lengths"])
        assert num_train_seqs == 17  # we should still have 17 seqs

        # We expect eval dataset not having "seq_lengths" as eval_packing is False
        assert "seq_lengths" not in trainer.eval_dataset

        assert all(sum(x) <= 64 for x in trainer.train_dataset["seq_lengths"])

        assert len(trainer.train_dataset["input_ids"]) == 3
        assert len(trainer.eval_dataset["input_ids"]) == 2

    def test_train_with_chat_template_kwargs(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        tokenizer = AutoTokenizer.from_pretrained(hub[QWEN2])
        # a simplified Qwen chat template where `role_capital` controls the capitalization of roles
        tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE

        dataset = dataset.add_column(
            "chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))]
        )
        assert "chat_template_kwargs" in dataset.features

        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, processing_class=tokenizer
        )

        assert trainer.processing_class.chat_template == tokenizer.chat_template

        for i in range(2):
            role = "SYSTEM" if i else "system"
            system_prompt = f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
            system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
            assert trainer.train_dataset[i]["input_ids"][: len(system_prompt_ids)] == system_prompt_ids

        train_and_check(trainer)

    def test_train_assistant_only(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN3], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_dataset_preparation_builds_labels_for_assistant_only_loss(self, hub, tmp_path):
        """Dataset preparation must bake the assistant masks into a labels column."""
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN3], args=training_args, train_dataset=dataset)

        assert "labels" in trainer.train_dataset.column_names
        for example in trainer.train_dataset:
            labels, input_ids = example["labels"], example["input_ids"]
            assert len(labels) == len(input_ids)
            assert all(
                label == -100 or label == token_id for label, token_id in zip(labels, input_ids, strict=True)
            )
            assert any(label != -100 for label in labels)  # assistant tokens contribute to the loss
            assert any(label == -100 for label in labels)  # non-assistant tokens are masked

    def test_fully_masked_examples_dropped_after_truncation(self, hub, tmp_path):
        # Example 0's assistant tokens all lie beyond `max_length=3`, so keep_start truncation leaves it fully masked;
        # example 1 keeps a trainable token and survives.
        dataset = Dataset.from_list(
            [
                {"input_ids": [1, 2, 3, 4, 5], "assistant_masks": [0, 0, 0, 1, 1]},
                {"input_ids": [6, 7, 8], "assistant_masks": [1, 1, 1]},
            ]
        )
        training_args = SFTConfig(output_dir=str(tmp_path), max_length=3, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        assert trainer.train_dataset[:]["labels"] == [[6, 7, 8]]

    def test_dataset_truncated_to_max_length(self, hub, tmp_path):
        """Dataset preparation truncates every example to `max_length`."""
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), max_length=4, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        for example in trainer.train_dataset:
            assert len(example["input_ids"]) <= 4
            assert len(example["labels"]) <= 4

    def test_dataset_preparation_builds_labels_for_completion_only(self, hub, tmp_path):
        """Dataset preparation bakes the completion mask into a labels column when completion_only_loss resolves to
        True (the default for prompt-completion datasets)."""
        dataset = load_dataset(ZEN, "standard_prompt_completion", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

        assert "labels" in trainer.train_dataset.column_names
        for example in trainer.train_dataset:
            labels, input_ids = example["labels"], example["input_ids"]
            assert len(labels) == len(input_ids)
            assert all(
                label == -100 or label == token_id for label, token_id in zip(labels, input_ids, strict=True)
            )
            assert any(label != -100 for label in labels)  # completion tokens contribute to the loss
            assert any(label == -100 for label in labels)  # prompt tokens are masked

    def test_dataset_preparation_respects_existing_labels(self, hub, tmp_path):
        """A user-provided labels column must be taken as is, even when mask columns are also present."""
        dataset = Dataset.from_list(
            [
                {"input_ids": [1, 2, 3, 4], "labels": [1, -100, 3, -100], "assistant_masks": [1, 1, 1, 1]},
                {"input_ids": [5, 6], "labels": [-100, 6], "assistant_masks": [1, 1]},
            ]
        )
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        assert trainer.train_dataset[:]["labels"] == [[1, -100, 3, -100], [-100, 6]]

    def test_dataset_preparation_builds_labels_for_pretokenized_with_masks(self, hub, tmp_path):
        """Pre-tokenized datasets that carry mask columns but no labels must get labels built at preparation."""
        dataset = Dataset.from_list(
            [
                {"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]},
                {"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 0]},
            ]
        )
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        assert trainer.train_dataset[:]["labels"] == [[-100, -100, 3, 4], [-100, 6, -100]]

    def test_packing_carries_labels(self, hub, tmp_path):
        """With packing enabled, the labels column must be packed alongside input_ids (replacing the masks)."""
        dataset = load_dataset(ZEN, "standard_prompt_completion", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

        column_names = trainer.train_dataset.column_names
        assert "labels" in column_names
        assert "completion_mask" not in column_names
        for example in trainer.train_dataset:
            assert len(example["labels"]) == len(example["input_ids"])
        assert any(label != -100 for example in trainer.train_dataset for label in example["labels"])

    def test_skip_prepare_dataset_with_masks_but_no_labels_raises(self, hub, tmp_path):
        """With `skip_prepare_dataset=True`, labels are not built at preparation time and TRL's collator doesn't
        consume the mask columns; such datasets are rejected instead of silently training on the full sequence."""
        dataset = Dataset.from_list(
            [{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]} for _ in range(2)]
        )
        training_args = SFTConfig(
            output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": True}, report_to="none"
        )
        with pytest.raises(ValueError, match="Add a 'labels' column"):
            SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

    def test_train_completion_only(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_prompt_completion", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN3], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_assistant_only_and_completion_only(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_prompt_completion", split="train")

        # To test this case, we need to add user messages in the completion (they'll be masked in the loss)
        def add_to_completion(example):
            example["completion"].append(example["prompt"][0])
            example["completion"].append(example["completion"][0])
            return example

        dataset = dataset.map(add_to_completion)
        training_args = SFTConfig(
            output_dir=str(tmp_path), assistant_only_loss=True, completion_only_loss=True, report_to="none"
        )
        trainer = SFTTrainer(model=hub[QWEN3], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_assistant_only_iterable_dataset(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train", streaming=True)
        training_args = SFTConfig(
            output_dir=str(tmp_path), assistant_only_loss=True, max_steps=3, report_to="none"
        )
        trainer = SFTTrainer(model=hub[QWEN3], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_with_set_chat_template_from_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path), chat_template_path=hub["Qwen/Qwen3-4B"], report_to="none"
        )
        # tiny-GPTNeoXForCausalLM doesn't have a chat template set by default
        trainer = SFTTrainer(model=hub[NEOX], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_with_set_chat_template_from_path(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "conversational_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            chat_template_path=hub["template.jinja"],
            max_steps=-1,  # upstream's 3 epochs: the checkpoint asserted on is checkpoint-9
            report_to="none",
        )
        # tiny-GPTNeoXForCausalLM doesn't have a chat template set by default
        trainer = SFTTrainer(model=hub[NEOX], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

        # Check that the template saved in the output directory is the same as the one used for training
        template_path = pathlib.Path(tmp_path) / "checkpoint-9" / "chat_template.jinja"
        assert template_path.exists(), f"Chat template not found at {template_path}"
        with open(template_path) as f:
            template_content = f.read()
        with open(training_args.chat_template_path) as f:
            original_template_content = f.read()
        assert template_content == original_template_content, (
            "Chat template content does not match the original"
        )

    def test_train_toolcall_data(self, hub, tmp_path):
        dataset = load_dataset(TOOLCALL, "language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=512, report_to="none"
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_toolcall_data_as_json(self, hub, tmp_path):
        # `tools` given as a list of dicts (which Arrow may fill with None for missing keys) rather than JSON
        dataset = load_dataset(TOOLCALL, "language_modeling", split="train")

        def convert_to_json(example):
            return {"tools": json.loads(example["tools"])}

        dataset = dataset.map(convert_to_json)
        training_args = SFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=512, report_to="none"
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_train_with_eval(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )
        trainer.train()
        assert trainer.state.log_history[0]["eval_loss"] is not None

    @pytest.mark.parametrize(
        "eval_dataset_type",
        [
            "dataset",
            "iterable_dataset",
            "dataset_dict",
            "iterable_dataset_dict",
            "dict_of_dataset",
            "dict_of_iterable_dataset",
        ],
    )
    def test_evaluate_with_eval_dataset(self, hub, tmp_path, eval_dataset_type):
        # `evaluate` accepts a raw (unprepared) dataset passed directly (trl issue #6115)
        train_dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        streaming = "iterable" in eval_dataset_type
        eval_split = load_dataset(ZEN, "standard_language_modeling", split="test", streaming=streaming)
        if eval_dataset_type in ("dataset", "iterable_dataset"):
            eval_dataset = eval_split
        elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
            dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
            eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
        else:  # "dict_of_dataset" or "dict_of_iterable_dataset"
            eval_dataset = {"data1": eval_split, "data2": eval_split}

        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=train_dataset)

        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        if eval_dataset_type in ("dataset", "iterable_dataset"):
            assert metrics["eval_loss"] is not None
        else:
            assert metrics["eval_data1_loss"] is not None
            assert metrics["eval_data2_loss"] is not None

    def test_train_with_metric_for_best_model(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            eval_strategy="steps",
            eval_steps=3,
            # a key SFTTrainer adds itself (trainer-specific metrics must reach the dict `evaluate()` returns)
            metric_for_best_model="eval_mean_token_accuracy",
            report_to="none",
        )
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
        )
        trainer.train()
        # (added) the metric reached the evaluation's log, where the best model is chosen from
        assert any("eval_mean_token_accuracy" in entry for entry in trainer.state.log_history)

    def test_train_with_multiple_eval_dataset(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")
        training_args = SFTConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = SFTTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
        )
        trainer.train()
        assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
        assert trainer.state.log_history[-2]["eval_data2_loss"] is not None

    def test_train_dataset_required(self, hub, tmp_path):
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(ValueError, match="`train_dataset` is required"):
            SFTTrainer(model=hub[QWEN2], args=training_args)

    @pytest.mark.parametrize(
        "eval_dataset_type",
        [
            "dataset",
            "iterable_dataset",
            "dataset_dict",
            "iterable_dataset_dict",
            "dict_of_dataset",
            "dict_of_iterable_dataset",
            "none",
        ],
    )
    def test_init_with_eval_dataset(self, hub, tmp_path, eval_dataset_type):
        train_dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        if eval_dataset_type == "none":
            eval_dataset = None
        else:
            streaming = "iterable" in eval_dataset_type
            eval_split = load_dataset(ZEN, "standard_language_modeling", split="test", streaming=streaming)
            if eval_dataset_type in ("dataset", "iterable_dataset"):
                eval_dataset = eval_split
            elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
                dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
                eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
            else:
                eval_dataset = {"data1": eval_split, "data2": eval_split}

        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset
        )

        if eval_dataset_type == "none":
            assert trainer.eval_dataset is None
        elif isinstance(trainer.eval_dataset, dict):
            assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
            assert "input_ids" in next(iter(trainer.eval_dataset["data1"]))
            assert "input_ids" in next(iter(trainer.eval_dataset["data2"]))
        else:
            assert "input_ids" in next(iter(trainer.eval_dataset))

    def test_train_with_compute_metrics(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling")

        def dummy_compute_metrics(eval_pred):
            return {"my_metric": 0.123}

        training_args = SFTConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = SFTTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            compute_metrics=dummy_compute_metrics,
        )
        trainer.train()
        assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123

    def test_train_with_gradient_checkpointing(self, hub, tmp_path):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_train_with_gradient_checkpointing_reentrant(self, hub, tmp_path, use_reentrant):
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(
            output_dir=str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
            report_to="none",
        )
        trainer = SFTTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)
        train_and_check(trainer)

    def test_tag_added(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)  # the default SFTConfig's output_dir is relative
        monkeypatch.setattr(sft_trainer_module, "SFTConfig", SFTConfig)
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        trainer = SFTTrainer(model=hub[QWEN2], train_dataset=dataset)
        for tag in ["sft", "trl"]:
            assert tag in trainer.model.model_tags

    @require_peft
    def test_tag_added_peft(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sft_trainer_module, "SFTConfig", SFTConfig)
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        trainer = SFTTrainer(model=hub[QWEN2], train_dataset=dataset, peft_config=LoraConfig())
        for tag in ["sft", "trl"]:
            assert tag in trainer.model.model_tags

    @require_peft
    def test_prompt_tuning(self, hub, tmp_path):
        """Test that SFT works with Prompt Tuning."""
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
            peft_config=PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8),
        )
        previous_trainable_params = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if "base_model" in n:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif "prompt_encoder" in n:  # We expect the peft params to be different
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            else:
                raise ValueError(f"Unexpected parameter {n} in model: {trainer.model}")

    @require_peft
    @require_bitsandbytes
    def test_peft_with_quantization(self, hub, tmp_path):
        quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.float16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            hub[QWEN2], dtype="float32", quantization_config=quantization_config
        )
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), learning_rate=0.1, report_to="none")
        trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, peft_config=LoraConfig())
        previous_trainable_params = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in [
                "base_model.model.model.layers.1.self_attn.k_proj.bias",
                "base_model.model.model.layers.1.self_attn.q_proj.base_layer.bias",
                "base_model.model.model.layers.1.self_attn.v_proj.base_layer.bias",
            ]:
                param = param.float()
            if "lora" not in n:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif "lora" in n:  # We expect the peft params to be different
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            else:
                raise ValueError(f"Unexpected parameter {n} in model: {trainer.model}")

    @require_peft
    def test_prompt_tuning_peft_model(self, hub, tmp_path):
        """Test that SFT works with Prompt Tuning and a pre-converted PeftModel"""
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        model = get_peft_model(model, PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
        dataset = load_dataset(ZEN, "standard_language_modeling", split="train")
        training_args = SFTConfig(output_dir=str(tmp_path), report_to="none")
        trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset)
        previous_trainable_params = params_of(trainer)
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if "base_model" in n:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif "prompt_encoder" in n:  # We expect the peft params to be different
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            else:
                raise ValueError(f"Unexpected parameter {n} in model: {trainer.model}")
