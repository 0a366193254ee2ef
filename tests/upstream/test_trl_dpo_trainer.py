"""TRL's DPOTrainer tests, run against ``PackedDPOTrainer``.

Upstream: huggingface/trl ``tests/test_dpo_trainer.py`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (HEAD of the
source store, 1.10.0.dev0; every feature it tests is in the pinned trl 1.16: ``evaluate`` on a raw dataset with
``precompute_ref_log_probs``, the ``IterableDataset`` refusals, ``chat_template_kwargs``, JSON ``tools``, the
dropping of fully truncated examples). Classes ``TestDataCollatorForPreference`` (its collator wrapped in this
package's ``PackedPreference``) and ``TestDPOTrainer``; ``TestDataCollatorForVisionPreference``,
``TestDPOTrainerVLM`` and ``TestDPOTrainerSlow`` (vision-language models, whose image batches run TRL's own padded
forward under ``PackedDPOTrainer``, and a gated model) are left out: their processors and image datasets are hub
downloads, and ``tests/test_trl_dpo.py`` compares the packed Qwen-VL text path with stock.

What was swapped, and nothing else (every assertion is kept):

- ``DPOTrainer(...)`` -> ``PackedDPOTrainer(..., shared_prompt=shared_prompt)``, each training test parametrized
  over ``shared_prompt`` False and True (the loss-type tests, which ``tests/test_trl_dpo.py`` already compares
  with stock batch by batch, run unshared only, to keep the file short);
- ``DataCollatorForPreference(...)`` -> ``PackedPreference(DataCollatorForPreference(...), shared_prompt=...)``;
- the hub, which tests may not reach: each model id names a model built once per module from a config (2 layers,
  hidden size 16, float32; windowed models a window of 8 tokens, so that the zen sequences reach past it) saved
  with ``save_pretrained`` beside a byte-level tokenizer (259 tokens: the 256 bytes, ``<|endoftext|>`` as the pad,
  ``<|im_start|>``, and ``<|im_end|>`` as the EOS) and a Qwen-style chat template that renders ``tools`` and
  ``tool_calls``; ``tiny-Lfm2ForCausalLM-2.5`` (upstream: LFM2 with LFM2.5's tokenizer) is a second LFM2;
  ``tiny-RemoteForCausalLM`` is a Llama under ``model_type="remote"`` with its own ``configuration_remote.py`` /
  ``modeling_remote.py`` (``auto_map``), so it loads only with ``trust_remote_code``;
- ``load_dataset("trl-internal-testing/zen", config)`` -> the same configs and column shapes synthesized (19 short
  "X is Y" statements of varied lengths: 17 train, 2 test, as upstream's ``train_test_split(test_size=0.1)``;
  standard: strings, conversational: lists of ``{role, content}``, implicit prompt: ``chosen`` / ``rejected``
  only); ``streaming=True`` -> ``Dataset.to_iterable_dataset()``;
- ``load_dataset("trl-internal-testing/toolcall", "preference")`` -> 8 synthesized rows (a conversational prompt,
  a ``chosen`` assistant turn calling a tool, a ``rejected`` plain answer, ``tools`` a JSON string of schemas);
- the ``chat_template_kwargs`` test's "simplified version of the Qwen chat template" -> a shorter one that renders
  these messages the same way, ``role_capital`` included;
- ``TrlTestCase``'s ``self.tmp_dir`` -> pytest's ``tmp_path``; ``test_tag_added*``, which pass no ``args`` (so
  ``DPOConfig("<model>-DPO")``, a relative ``output_dir``), run in ``tmp_path``;
- ``DPOConfig(...)`` -> ``DPOConfig(..., use_cpu=True)`` where there is no CUDA device (its default ``bf16=True`` is
  refused on a CPU without it; the two ``args``-less tests get it by patching the name ``DPOTrainer`` builds its
  default config with), and ``max_steps=3`` where upstream gives none: one epoch (3 steps of 8, 8 and 1 pairs)
  instead of ``DPOConfig``'s 3 epochs, to keep the file under a few minutes on two CPU cores. Every evaluation
  upstream asserts on (``eval_steps=3``) still happens, at step 3, and the log entries sit where upstream's do.

The GPU, liger-kernel and bitsandbytes tests keep upstream's markers and skip where those are missing.
``test_train_gpt_oss`` is left out: its harmony dataset and GPT-OSS's harmony chat template are hub files, and
GPT-OSS is refused by ``PackedDPOTrainer`` (see below).

Where this package deliberately differs (docs/post_training.md, "DPO"), the case stays and asserts this package's
behaviour, marked ``DIFFERENCE``:

- a model whose layers carry state from one packed sequence into the next (``config.layer_types`` other than
  attention: LFM2's ``conv``, Nemotron-H's Mamba ``linear_attention``), or whose attention does not restart at
  ``position_ids`` 0 (GPT-OSS), is refused when the trainer is built (``ValueError``), as packing would change what
  is trained;
- ``shared_prompt=True`` with an MoE trained with its load-balancing loss (the ``router_aux_loss_coef`` of Qwen3-MoE
  and GPT-OSS; GLM-4-MoE declares none) is refused when the trainer is built, before any other check: over a shared
  prompt that loss would count the prompt once, not once per sequence;
- ``PackedPreference`` (the collate function the collator tests wrap TRL's in) adds the packed sequences
  to TRL's batch, under ``"packed"``.

Checked beside stock while porting (not asserted here, as upstream asserts no values): every training and
evaluation in this file run again with stock ``trl.DPOTrainer`` in float32 (bf16 off, every step logged) logs the
same history: the first step's log-probs and loss to float32 rounding, the later steps' to about 1e-4 relative
(rounding carried through Adam at ``learning_rate`` 0.1 and 1.0; ``test_train_peft_model`` compared at one seed,
as its LoRA initialisation draws from the global generator), except ``test_train_model_dtype`` (float16 weights:
the near-subnormal attention gradients round differently, and Adam's first step turns their signs into 0.1-sized
updates, so the runs part after step 1). The ``iterable_*`` cases of ``test_evaluate_with_eval_dataset``, whose
batches accelerate dispatches, log stock's numbers too (``tests/test_trl_dpo.py`` asserts it).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from datasets import Dataset, DatasetDict, IterableDatasetDict
from packaging.version import Version
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    Cohere2Config,
    Cohere2ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.testing_utils import torch_device
from transformers.utils import is_kernels_available, is_peft_available

trl = pytest.importorskip("trl")

from trl.import_utils import is_liger_kernel_available  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

from zephon_collate.trainers import PackedDPOTrainer, PackedPreference  # noqa: E402

if is_peft_available():
    import peft
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from peft.utils import TaskType

try:
    from transformers.utils import is_bitsandbytes_available
except ImportError:  # pragma: no cover
    from transformers.utils.import_utils import is_bitsandbytes_available

require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")
require_liger_kernel = pytest.mark.skipif(
    not is_liger_kernel_available(), reason="test requires liger-kernel"
)
require_kernels = pytest.mark.skipif(not is_kernels_available(), reason="test requires kernels")
require_bitsandbytes = pytest.mark.skipif(
    not is_bitsandbytes_available(), reason="test requires bitsandbytes"
)


def is_ampere_or_newer(device_index: int = 0) -> bool:
    """Whether CUDA device ``device_index`` has compute capability 8.0 or more (upstream's helper)."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 8


def DPOConfig(*args, **options) -> trl.DPOConfig:
    """``trl.DPOConfig``: on the CPU where there is no CUDA device, one epoch (``max_steps=3``) unless given."""
    options.setdefault("max_steps", STEPS)
    return trl.DPOConfig(*args, **options, use_cpu=not torch.cuda.is_available())


STEPS = 3
"""One epoch of the 17 training rows at DPOConfig's 8 pairs a step; upstream trains 3 epochs (9 steps)."""

SHARED = pytest.mark.parametrize("shared_prompt", [False, True], ids=["unshared", "shared"])

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

REMOTE_CONFIGURATION = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
"""

REMOTE_MODELING = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: every byte a token, so every string tokenizes, prefix-stably."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


DENSE = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
DENSE_GQA = {**DENSE, "num_key_value_heads": 2}
WINDOWED = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}

QWEN2 = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
QWEN3_MOE = "trl-internal-testing/tiny-Qwen3MoeForCausalLM"
GPT_OSS = "trl-internal-testing/tiny-GptOssForCausalLM"
NEMOTRON_H = "trl-internal-testing/tiny-NemotronHForCausalLM-nano"
LFM2 = "trl-internal-testing/tiny-Lfm2ForCausalLM"
LFM2_5 = "trl-internal-testing/tiny-Lfm2ForCausalLM-2.5"
REMOTE = "trl-internal-testing/tiny-RemoteForCausalLM"

TINY_MODELS: dict[str, tuple[type, type, dict]] = {
    "trl-internal-testing/tiny-Cohere2ForCausalLM": (
        Cohere2ForCausalLM,
        Cohere2Config,
        {**DENSE_GQA, **WINDOWED},
    ),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": (
        Glm4MoeForCausalLM,
        Glm4MoeConfig,
        {
            **DENSE_GQA,
            "head_dim": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
        }
        | {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    ),
    GPT_OSS: (
        GptOssForCausalLM,
        GptOssConfig,
        {**DENSE_GQA, **WINDOWED, "head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    QWEN2: (Qwen2ForCausalLM, Qwen2Config, DENSE_GQA),
    QWEN3_MOE: (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        {**DENSE_GQA, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    NEMOTRON_H: (
        NemotronHForCausalLM,
        NemotronHConfig,
        {**DENSE_GQA, "head_dim": 4, "layers_block_type": ["mamba", "attention", "moe"], "mamba_num_heads": 4}
        | {"mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16, "n_routed_experts": 4}
        | {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16}
        | {"n_group": 1, "topk_group": 1},
    ),
    "trl-internal-testing/tiny-Olmo3ForCausalLM": (Olmo3ForCausalLM, Olmo3Config, {**DENSE_GQA, **WINDOWED}),
    LFM2: (Lfm2ForCausalLM, Lfm2Config, {**DENSE_GQA, "layer_types": ["conv", "full_attention"]}),
    LFM2_5: (Lfm2ForCausalLM, Lfm2Config, {**DENSE_GQA, "layer_types": ["conv", "full_attention"]}),
}


def save_remote(path: pathlib.Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """A Llama saved as ``model_type="remote"``, loadable only through its own code (``auto_map``)."""
    torch.manual_seed(0)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **DENSE_GQA, **ids)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "configuration_remote.py").write_text(REMOTE_CONFIGURATION)
    (path / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "remote"
    config["architectures"] = ["RemoteForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each hub id the tests name -> a local directory standing in for it."""
    root = tmp_path_factory.mktemp("hub")
    paths: dict[str, str] = {}
    for model_id, (model_class, config_class, options) in TINY_MODELS.items():
        tokenizer = byte_tokenizer()
        ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        torch.manual_seed(0)
        model = model_class(config_class(vocab_size=len(tokenizer), **options, **ids))
        path = root / model_id.split("/")[-1]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[model_id] = str(path)
    remote = root / REMOTE.split("/")[-1]
    save_remote(remote, byte_tokenizer())
    paths[REMOTE] = str(remote)
    return paths


# -- the local datasets -----------------------------------------------------------------------------

STATEMENTS = [
    ("The wide sky above the quiet hills on a clear summer afternoon", "blue", "green"),
    ("Snow", "white", "black"),
    ("Grass", "green", "purple"),
    ("Fire", "hot", "cold"),
    ("The deep water of the northern sea in the middle of a long winter", "cold", "boiling"),
    ("Sugar", "sweet", "salty"),
    ("A lemon", "sour", "sweet"),
    ("Night", "dark", "bright"),
    ("The old stone bridge that has crossed the river for three hundred years", "sturdy", "made of paper"),
    ("A feather", "light", "heavy"),
    ("Ice", "solid", "gaseous"),
    ("The sun", "a star", "a planet"),
    ("The long road that winds through the mountains toward the distant village", "narrow", "a river"),
    ("Honey", "sticky", "dry"),
    ("Coal", "black", "white"),
    ("A circle", "round", "square"),
    ("The small cat sleeping on the warm windowsill in the late morning light", "calm", "a dog"),
    ("Rain", "wet", "dry"),
    ("Salt", "salty", "sweet"),
]
"""(subject, right, wrong): 19 statements, four about 3x as long as the rest (rows hold several sequences)."""


def _split(columns: dict[str, list]) -> DatasetDict:
    """``train_test_split(test_size=0.1, shuffle=False)``, as upstream's generator: 17 train, 2 test."""
    return Dataset.from_dict(columns).train_test_split(test_size=0.1, shuffle=False)


def zen(config: str) -> DatasetDict:
    """The stand-in for a ``trl-internal-testing/zen`` config."""
    subjects, right, wrong = (list(column) for column in zip(*STATEMENTS, strict=True))

    def user(subject: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"What is {subject.lower()}?"}]

    def assistant(subject: str, value: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": f"{subject} is {value}."}]

    if config == "standard_preference":
        return _split(
            {
                "prompt": [f"{subject} is" for subject in subjects],
                "chosen": [f" {value}." for value in right],
                "rejected": [f" {value}." for value in wrong],
            }
        )
    if config == "standard_implicit_prompt_preference":
        return _split(
            {
                "chosen": [f"{s} is {v}." for s, v in zip(subjects, right, strict=True)],
                "rejected": [f"{s} is {v}." for s, v in zip(subjects, wrong, strict=True)],
            }
        )
    if config == "standard_unpaired_preference":
        return _split(
            {
                "prompt": [f"{subject} is" for subject in subjects],
                "completion": [
                    f" {r if i % 2 else w}." for i, (r, w) in enumerate(zip(right, wrong, strict=True))
                ],
                "label": [bool(i % 2) for i in range(len(subjects))],
            }
        )
    if config == "conversational_preference":
        return _split(
            {
                "prompt": [user(subject) for subject in subjects],
                "chosen": [assistant(s, v) for s, v in zip(subjects, right, strict=True)],
                "rejected": [assistant(s, v) for s, v in zip(subjects, wrong, strict=True)],
            }
        )
    if config == "conversational_implicit_prompt_preference":
        return _split(
            {
                "chosen": [user(s) + assistant(s, v) for s, v in zip(subjects, right, strict=True)],
                "rejected": [user(s) + assistant(s, v) for s, v in zip(subjects, wrong, strict=True)],
            }
        )
    raise ValueError(f"no stand-in for zen config {config!r}")


TOOLS = [
    {"name": "get_weather", "parameters": {"city": "string"}},
    {"name": "add", "parameters": {"a": "number", "b": "number"}},
    {"name": "translate", "parameters": {"text": "string", "to": "string", "formal": "boolean"}},
    {"name": "lookup", "parameters": {"word": "string"}},
]


def toolcall() -> DatasetDict:
    """The stand-in for ``trl-internal-testing/toolcall``'s ``preference``: 8 rows, a tool call chosen."""
    rows = {"prompt": [], "chosen": [], "rejected": [], "tools": []}
    asks = [
        ("What is the weather in Paris?", 0, {"city": "Paris"}),
        ("Add 2 and 3.", 1, {"a": 2, "b": 3}),
        ("Translate 'hello' to French, formally.", 2, {"text": "hello", "to": "fr", "formal": True}),
        ("What does 'ephemeral' mean?", 3, {"word": "ephemeral"}),
        ("Is it raining in Oslo?", 0, {"city": "Oslo"}),
        ("Add 40 and 2.", 1, {"a": 40, "b": 2}),
        ("Translate 'thanks' to German.", 2, {"text": "thanks", "to": "de", "formal": False}),
        ("Define 'laconic'.", 3, {"word": "laconic"}),
    ]
    for i, (question, tool, arguments) in enumerate(asks):
        call = {"type": "function", "function": {"name": TOOLS[tool]["name"], "arguments": arguments}}
        rows["prompt"].append([{"role": "user", "content": question}])
        rows["chosen"].append([{"role": "assistant", "content": "", "tool_calls": [call]}])
        rows["rejected"].append([{"role": "assistant", "content": "I cannot help with that."}])
        rows["tools"].append(json.dumps([TOOLS[tool], TOOLS[(tool + 1 + i) % len(TOOLS)]]))
    return DatasetDict({"train": Dataset.from_dict(rows)})


ZEN = "trl-internal-testing/zen"
TOOLCALL = "trl-internal-testing/toolcall"


def load_dataset(path: str, name: str, split: str | None = None, streaming: bool = False):
    """The stand-in for ``datasets.load_dataset`` on the two hub datasets the tests name."""
    splits = zen(name) if path == ZEN else toolcall()
    if streaming:
        splits = IterableDatasetDict({key: value.to_iterable_dataset() for key, value in splits.items()})
    return splits if split is None else splits[split]


# -- the tests --------------------------------------------------------------------------------------


@SHARED
class TestDataCollatorForPreference:
    def test_padding_and_masks(self, shared_prompt):
        collator = PackedPreference(DataCollatorForPreference(pad_token_id=0), shared_prompt=shared_prompt)
        examples = [
            {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
            {"prompt_ids": [7, 8], "chosen_ids": [9, 10], "rejected_ids": [11, 12, 13]},
        ]
        result = collator(examples)

        expected_input_ids = torch.tensor(
            [
                [1, 2, 3, 4, 5],  # prompt + chosen (example 1)
                [7, 8, 9, 10, 0],  # prompt + chosen (example 2, padded)
                [1, 2, 3, 6, 0],  # prompt + rejected (example 1, padded)
                [7, 8, 11, 12, 13],  # prompt + rejected (example 2)
            ]
        )
        expected_attention_mask = torch.tensor(
            [
                [1, 1, 1, 1, 1],
                [1, 1, 1, 1, 0],
                [1, 1, 1, 1, 0],
                [1, 1, 1, 1, 1],
            ]
        )
        expected_completion_mask = torch.tensor(
            [
                [0, 0, 0, 1, 1],  # chosen completion (example 1)
                [0, 0, 1, 1, 0],  # chosen completion (example 2, padded)
                [0, 0, 0, 1, 0],  # rejected completion (example 1, padded)
                [0, 0, 1, 1, 1],  # rejected completion (example 2)
            ]
        )

        # DIFFERENCE: the batch also holds its sequences packed, under "packed"
        assert set(result.keys()) == {"input_ids", "attention_mask", "completion_mask", "packed"}
        torch.testing.assert_close(result["input_ids"], expected_input_ids)
        torch.testing.assert_close(result["attention_mask"], expected_attention_mask)
        torch.testing.assert_close(result["completion_mask"], expected_completion_mask)

    def test_optional_reference_logps(self, shared_prompt):
        collator = PackedPreference(DataCollatorForPreference(pad_token_id=0), shared_prompt=shared_prompt)
        examples = [
            {
                "prompt_ids": [1, 2],
                "chosen_ids": [3],
                "rejected_ids": [4],
                "ref_chosen_logps": 0.1,
                "ref_rejected_logps": 0.2,
            },
            {
                "prompt_ids": [5],
                "chosen_ids": [6, 7],
                "rejected_ids": [8, 9],
                "ref_chosen_logps": 0.3,
                "ref_rejected_logps": 0.4,
            },
        ]
        result = collator(examples)

        expected_ref_chosen_logps = torch.tensor([0.1, 0.3])
        expected_ref_rejected_logps = torch.tensor([0.2, 0.4])

        assert set(result.keys()) == {
            "input_ids",
            "attention_mask",
            "completion_mask",
            "ref_chosen_logps",
            "ref_rejected_logps",
            "packed",  # DIFFERENCE: the batch also holds its sequences packed
        }
        torch.testing.assert_close(result["ref_chosen_logps"], expected_ref_chosen_logps)
        torch.testing.assert_close(result["ref_rejected_logps"], expected_ref_rejected_logps)

    def test_with_pad_to_multiple_of(self, shared_prompt):
        collator = PackedPreference(
            DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=5), shared_prompt=shared_prompt
        )
        examples = [
            {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]},
            {"prompt_ids": [4, 5], "chosen_ids": [6, 7], "rejected_ids": [8, 9]},
        ]
        result = collator(examples)

        expected_input_ids = torch.tensor(
            [
                [1, 2, 0, 0, 0],  # prompt + chosen (example 1, padded to multiple of 5)
                [4, 5, 6, 7, 0],  # prompt + chosen (example 2)
                [1, 3, 0, 0, 0],  # prompt + rejected (example 1, padded to multiple of 5)
                [4, 5, 8, 9, 0],  # prompt + rejected (example 2)
            ]
        )

        # DIFFERENCE: the batch also holds its sequences packed, under "packed"
        assert set(result.keys()) == {"input_ids", "attention_mask", "completion_mask", "packed"}
        torch.testing.assert_close(result["input_ids"], expected_input_ids)


REFUSED = {
    GPT_OSS: "attend to each other",
    NEMOTRON_H: "linear_attention layers",
    LFM2: "conv layers",
    LFM2_5: "conv layers",
}
"""DIFFERENCE: the models PackedDPOTrainer refuses when built, and what its error says."""

AUX_LOSS = {QWEN3_MOE, GPT_OSS}
"""DIFFERENCE: the MoE models trained with their load-balancing loss, which shared_prompt=True refuses first."""


class TestDPOTrainer:
    @SHARED
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
    def test_train(self, model_id, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        refusal = (
            "router_aux_loss_coef=0.0" if shared_prompt and model_id in AUX_LOSS else REFUSED.get(model_id)
        )
        if refusal is not None:  # DIFFERENCE: packing (or sharing the prompt) would change what is trained
            with pytest.raises(ValueError, match=refusal):
                PackedDPOTrainer(
                    model=hub[model_id],
                    args=training_args,
                    train_dataset=dataset,
                    shared_prompt=shared_prompt,
                )
            return
        trainer = PackedDPOTrainer(
            model=hub[model_id], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # MoE models log the load-balancing auxiliary loss (on by default)
        if trainer.aux_loss_enabled:
            assert trainer.state.log_history[-1]["aux_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @pytest.mark.parametrize("precompute_ref_log_probs", [False, True])
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
    def test_evaluate_with_eval_dataset(self, eval_dataset_type, precompute_ref_log_probs, hub, tmp_path):
        # `evaluate` accepts a raw (unprepared) dataset passed directly, not only a preprocessed `eval_dataset` set
        # at init. See https://github.com/huggingface/trl/issues/6115.
        train_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        streaming = "iterable" in eval_dataset_type
        eval_split = load_dataset(
            "trl-internal-testing/zen", "standard_preference", split="test", streaming=streaming
        )
        if eval_dataset_type in ("dataset", "iterable_dataset"):
            eval_dataset = eval_split
        elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
            dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
            eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
        else:  # "dict_of_dataset" or "dict_of_iterable_dataset"
            eval_dataset = {"data1": eval_split, "data2": eval_split}

        training_args = DPOConfig(
            output_dir=str(tmp_path), precompute_ref_log_probs=precompute_ref_log_probs, report_to="none"
        )
        trainer = PackedDPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=train_dataset)

        if streaming and precompute_ref_log_probs:
            with pytest.raises(
                ValueError, match=r"precompute_ref_log_probs.*not supported with IterableDataset"
            ):
                trainer.evaluate(eval_dataset=eval_dataset)
            return

        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        if eval_dataset_type in ("dataset", "iterable_dataset"):
            assert metrics["eval_loss"] is not None
        else:
            assert metrics["eval_data1_loss"] is not None
            assert metrics["eval_data2_loss"] is not None

    @SHARED
    def test_evaluate_precompute_ref_log_probs_after_training_raises(self, shared_prompt, hub, tmp_path):
        # Full fine-tuning with `precompute_ref_log_probs=True` and no `ref_model` uses `self.model` as the reference.
        # That's valid only before training; a dataset passed to `evaluate()` afterwards can't get a correct reference.
        train_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        eval_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="test")
        training_args = DPOConfig(
            output_dir=str(tmp_path), max_steps=1, precompute_ref_log_probs=True, report_to="none"
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=train_dataset, shared_prompt=shared_prompt
        )

        # Before training the reference is available, so evaluating a new dataset works.
        assert trainer.evaluate(eval_dataset=eval_dataset)["eval_loss"] is not None

        trainer.train()

        with pytest.raises(ValueError, match="Cannot compute reference log-probs for a dataset passed to"):
            trainer.evaluate(eval_dataset=eval_dataset)

    @pytest.mark.parametrize("eval_dataset_type", ["dataset", "dataset_dict", "dict_of_dataset"])
    def test_evaluate_precompute_ref_log_probs_at_init_after_training(self, eval_dataset_type, hub, tmp_path):
        # Regression for the guard above: an `eval_dataset` set at init has its reference log-probs precomputed once
        # (against the untrained reference) and stored, so no-arg `evaluate()` reuses those stored values and must not
        # raise after training, even with full fine-tuning and `precompute_ref_log_probs=True`.
        train_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        eval_split = load_dataset("trl-internal-testing/zen", "standard_preference", split="test")
        if eval_dataset_type == "dataset":
            eval_dataset = eval_split
        elif eval_dataset_type == "dataset_dict":
            eval_dataset = DatasetDict({"data1": eval_split, "data2": eval_split})
        else:  # "dict_of_dataset"
            eval_dataset = {"data1": eval_split, "data2": eval_split}

        training_args = DPOConfig(
            output_dir=str(tmp_path), max_steps=1, precompute_ref_log_probs=True, report_to="none"
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )

        trainer.train()

        metrics = trainer.evaluate()
        if eval_dataset_type == "dataset":
            assert metrics["eval_loss"] is not None
        else:
            assert metrics["eval_data1_loss"] is not None
            assert metrics["eval_data2_loss"] is not None

    def test_trust_remote_code(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        model_id = hub["trl-internal-testing/tiny-RemoteForCausalLM"]

        with pytest.raises(ValueError, match="custom code"):
            PackedDPOTrainer(
                model=model_id,
                args=DPOConfig(output_dir=str(tmp_path), report_to="none"),
                train_dataset=dataset,
            )

        trainer = PackedDPOTrainer(
            model=model_id,
            args=DPOConfig(output_dir=str(tmp_path), report_to="none", trust_remote_code=True),
            train_dataset=dataset,
        )
        assert type(trainer.model).__name__ == "RemoteForCausalLM"

    @SHARED
    @pytest.mark.parametrize(
        "config_name",
        [
            "standard_preference",
            "conversational_preference",
            "standard_implicit_prompt_preference",
            "conversational_implicit_prompt_preference",
        ],
    )
    def test_train_dataset_format(self, config_name, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", config_name, split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_model(self, shared_prompt, hub, tmp_path):
        model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=model, args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @pytest.mark.parametrize(
        "loss_type",
        [
            "sigmoid",
            "hinge",
            "ipo",
            "exo_pair",
            "nca_pair",
            "robust",
            "bco_pair",
            "sppo_hard",
            "aot",
            "aot_unpaired",
            "apo_zero",
            "apo_down",
            "discopop",
            "sft",
            "sigmoid_norm",
        ],
    )
    def test_train_loss_types(self, loss_type, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            loss_type=loss_type,
            label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0,
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
            eval_strategy="steps",
            eval_steps=3,
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_multi_loss_types(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            loss_type=["sigmoid", "bco_pair", "sft"],  # this specific combination is used in MPO
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_with_wpo(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
            use_weighting=True,
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_with_ld(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
            ld_alpha=0.5,
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @pytest.mark.parametrize(
        "f_divergence_type",
        ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"],
    )
    def test_train_with_f_divergence(self, f_divergence_type, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
            f_divergence_type=f_divergence_type,
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_with_explicit_ref_model(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        # When specifying a ref model, it's usually because we want it to be a different checkpoint, but for testing
        # purposes we will just just use the same checkpoint
        ref_model = AutoModelForCausalLM.from_pretrained(hub[QWEN2], dtype="float32")
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            ref_model=ref_model,
            args=training_args,
            train_dataset=dataset,
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            new_ref_param = trainer.ref_model.get_parameter(n)
            torch.testing.assert_close(
                param, new_ref_param, msg=f"Reference model parameter {n} has changed."
            )

    @SHARED
    def test_train_with_sync_ref_model(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            sync_ref_model=True,
            ref_model_sync_steps=2,  # reduce sync steps to ensure a sync happens
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
        assert trainer.ref_model is not None
        previous_ref_params = {n: param.clone() for n, param in trainer.ref_model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
            new_ref_param = trainer.ref_model.get_parameter(n)
            assert not torch.equal(previous_ref_params[n], new_ref_param), (
                f"Ref Parameter {n} has not changed."
            )

    @SHARED
    def test_train_model_dtype(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            model_init_kwargs={"dtype": torch.float16},
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            # For some reasonn model.layers.0.input_layernorm.weight doesn't change in GitHub Actions but does
            # locally. We ignore this parameter for now
            if "layernorm" in n:
                continue
            new_param = trainer.model.get_parameter(n)
            # Check the torch dtype
            assert new_param.dtype == torch.float16
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    @require_peft
    def test_train_dense_with_peft_config_lora(self, shared_prompt, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=1.0,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )

        trainer = PackedDPOTrainer(
            model=model_id,
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(),
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the peft params have changed and the base model params have not changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif (
                "base_layer" not in n
            ):  # We expect the peft params to be different (except for the base layer)
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_moe_with_peft_config(self, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-GptOssForCausalLM"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]  # noqa: F841

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )

        # DIFFERENCE: GPT-OSS's packed sequences attend to each other, so PackedDPOTrainer refuses it
        with pytest.raises(ValueError, match=REFUSED[GPT_OSS]):
            PackedDPOTrainer(
                model=model_id,
                args=training_args,
                train_dataset=dataset,
                peft_config=LoraConfig(
                    target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
                ),
            )

    @SHARED
    @require_peft
    def test_train_peft_model(self, shared_prompt, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")

        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

        lora_config = LoraConfig()
        model = get_peft_model(model, lora_config)

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=1.0,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=model, args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the peft params have changed and the base model params have not changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif (
                "base_layer" not in n and "ref" not in n
            ):  # and the peft params to be different (except base and ref)
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_peft
    def test_train_moe_peft_model(self, hub, tmp_path):
        # Regression test for https://github.com/huggingface/trl/issues/5222. PEFT only supports one adapter per model
        # when the LoRA config uses `target_parameters` (see peft#3340), so no "ref" adapter can be created and the
        # reference log probs are computed with adapters disabled instead.
        model_id = hub["trl-internal-testing/tiny-GptOssForCausalLM"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]  # noqa: F841

        lora_config = LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
        model = get_peft_model(model, lora_config)

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )
        # DIFFERENCE: GPT-OSS's packed sequences attend to each other, so PackedDPOTrainer refuses it
        with pytest.raises(ValueError, match=REFUSED[GPT_OSS]):
            PackedDPOTrainer(model=model, args=training_args, train_dataset=dataset)

    # In practice, this test is the same as `test_train_dense_with_peft_config_lora`, since gradient checkpointing is
    # enabled by default in `DPOTrainer`. We keep it as a regression guard: if the default ever changes, we still
    # explicitly test PEFT + gradient checkpointing, which has caused issues in the past.
    @SHARED
    @require_peft
    def test_train_with_peft_config_and_gradient_checkpointing(self, shared_prompt, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            gradient_checkpointing=True,
            report_to="none",
        )

        trainer = PackedDPOTrainer(
            model=model_id,
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(),
            shared_prompt=shared_prompt,
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the peft params have changed and the base model params have not changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:  # We expect the base model params to be the same
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif (
                "base_layer" not in n
            ):  # We expect the peft params to be different (except for the base layer)
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_liger_kernel
    def test_train_with_liger(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            use_liger_kernel=True,
            report_to="none",
        )
        trainer = PackedDPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_liger_kernel
    @require_peft
    def test_train_with_liger_kernel_and_peft(self, hub, tmp_path):
        # A LoRA adapter that does not target lm_head leaves the head as a plain Linear, so Liger reads the real
        # weight. Verify the full PEFT+Liger path actually trains (peft params change, base params stay frozen).
        model_id = hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype="float32")
        base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            use_liger_kernel=True,
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=model_id,
            args=training_args,
            train_dataset=dataset,
            peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]),
        )
        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
        trainer.train()
        assert trainer.state.log_history[-1]["train_loss"] is not None
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            if n in base_param_names:
                torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
            elif "base_layer" not in n:
                assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_liger_kernel
    @require_peft
    def test_liger_kernel_with_peft_lm_head_raises(self, hub, tmp_path):
        # The Liger fused DPO loss reads `lm_head.weight` directly, so a LoRA adapter on `lm_head` is silently
        # ignored and never trained. The trainer must fail fast instead of training a silently-frozen head.
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        training_args = DPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to="none")
        # `ensure_weight_tying=True` silences PEFT's weight-tying warning fired when lm_head is in the adapter on a
        # model with untied embeddings; once tying respects `tie_word_embeddings`, the flag itself warns that no tied
        # modules were found, so it must only be set on the affected range.
        # - Introduced in PEFT 0.19.0 (peft#2879); fixed on main, unreleased as of 0.19.2.dev0 (peft#3171)
        needs_ensure_weight_tying = Version("0.19.0") <= Version(peft.__version__) < Version("0.19.2.dev0")
        lora_config = LoraConfig(
            target_modules=["q_proj", "v_proj", "lm_head"],
            **({"ensure_weight_tying": True} if needs_ensure_weight_tying else {}),
        )
        with pytest.raises(ValueError, match="lm_head"):
            PackedDPOTrainer(
                model=hub[QWEN2],
                args=training_args,
                train_dataset=dataset,
                peft_config=lora_config,
            )

    @require_liger_kernel
    @require_peft
    def test_liger_kernel_with_peft_prompt_learning_raises(self, hub, tmp_path):
        # Prompt-learning methods inject virtual tokens via PeftModel.forward(), which the Liger DPO loss bypasses.
        # The trainer must fail fast to avoid computing the loss on the wrong (truncated) sequence.
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        training_args = DPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to="none")
        with pytest.raises(ValueError, match="prompt-learning"):
            PackedDPOTrainer(
                model=hub[QWEN2],
                args=training_args,
                train_dataset=dataset,
                peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8),
            )

    @require_liger_kernel
    def test_init_fails_with_moe_aux_loss_and_liger(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        # The MoE auxiliary loss is on by default; it is incompatible with the Liger fused loss.
        training_args = DPOConfig(
            output_dir=str(tmp_path),
            use_liger_kernel=True,
            report_to="none",
        )

        with pytest.raises(
            ValueError, match="does not support the Mixture-of-Experts load-balancing auxiliary loss"
        ):
            PackedDPOTrainer(
                model=hub["trl-internal-testing/tiny-Qwen3MoeForCausalLM"],
                args=training_args,
                train_dataset=dataset,
            )

    @require_liger_kernel
    def test_init_fails_with_compute_metrics_and_liger(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_unpaired_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            use_liger_kernel=True,
            report_to="none",
        )

        with pytest.raises(ValueError, match="compute_metrics is not supported with the Liger kernel"):
            PackedDPOTrainer(
                model=hub[QWEN2],
                args=training_args,
                train_dataset=dataset,
                compute_metrics=lambda _: {},
            )

    @pytest.mark.parametrize("iterable_as", ["train", "eval", "eval_dict", "eval_iterable_dataset_dict"])
    def test_precompute_ref_log_probs_raises_for_iterable_dataset(self, iterable_as, hub, tmp_path):
        # `precompute_ref_log_probs=True` caches reference log-probs by index, which requires random access and is
        # therefore incompatible with a streaming `IterableDataset` — whether passed directly or nested in a dict or
        # `IterableDatasetDict` as the eval dataset.
        map_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")
        iterable_dataset = load_dataset(
            "trl-internal-testing/zen", "standard_preference", split="train", streaming=True
        )

        train_dataset, eval_dataset = map_dataset, None
        if iterable_as == "train":
            train_dataset = iterable_dataset
        elif iterable_as == "eval":
            eval_dataset = iterable_dataset
        elif iterable_as == "eval_dict":
            eval_dataset = {"eval": iterable_dataset}
        elif iterable_as == "eval_iterable_dataset_dict":
            eval_dataset = IterableDatasetDict({"eval": iterable_dataset})

        # `max_steps` lets the iterable-train case reach the precompute check instead of failing earlier on the
        # missing dataset length required by the learning-rate scheduler.
        training_args = DPOConfig(
            output_dir=str(tmp_path), max_steps=1, report_to="none", precompute_ref_log_probs=True
        )
        with pytest.raises(ValueError, match=r"precompute_ref_log_probs.*not supported with IterableDataset"):
            PackedDPOTrainer(
                model=hub[QWEN2],
                args=training_args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
            )

    @SHARED
    def test_train_with_iterable_dataset(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset(
            "trl-internal-testing/zen", "standard_preference", split="train", streaming=True
        )

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            max_steps=3,
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @require_kernels
    @pytest.mark.skipif(
        not is_ampere_or_newer() and torch_device != "xpu",
        reason="Flash Attention 2 requires Ampere or newer GPU, or XPU",
    )
    def test_train_padding_free(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            padding_free=True,
            model_init_kwargs={"attn_implementation": "kernels-community/flash-attn2"},
            bf16=True,  # flash_attention_2 only supports bf16 and fp16
            report_to="none",
        )
        trainer = PackedDPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_with_chat_template_kwargs(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "conversational_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            report_to="none",
        )

        tokenizer = AutoTokenizer.from_pretrained(hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"])
        # The following template is a simplified version of the Qwen chat template, where an additional argument
        # `role_capital` is used to control the capitalization of roles.
        tokenizer.chat_template = ROLE_CAPITAL_TEMPLATE

        dataset = dataset.add_column(
            "chat_template_kwargs", [{"role_capital": bool(i % 2)} for i in range(len(dataset))]
        )
        assert "chat_template_kwargs" in dataset.features

        trainer = PackedDPOTrainer(
            model=hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"],
            args=training_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            shared_prompt=shared_prompt,
        )

        assert trainer.processing_class.chat_template == tokenizer.chat_template

        for i in range(2):
            role = "SYSTEM" if i else "system"
            system_prompt = f"<|im_start|>{role}\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
            system_prompt_ids = trainer.processing_class(system_prompt)["input_ids"]
            assert trainer.train_dataset[i]["prompt_ids"][: len(system_prompt_ids)] == system_prompt_ids

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    def test_fully_truncated_completion_examples_dropped(self, hub, tmp_path):
        """With `keep_start` truncation, an example whose prompt alone fills `max_length` loses every completion token
        in the collator, so it's dropped during dataset preparation."""
        dataset = Dataset.from_dict(
            {
                "prompt": [
                    "Hi",
                    "This is a very long prompt that fills up the whole max_length budget on its own",
                ],
                "chosen": [" there", " yes"],
                "rejected": [" bye", " no"],
            }
        )

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            max_length=6,
            truncation_mode="keep_start",
            report_to="none",
        )
        trainer = PackedDPOTrainer(model=hub[QWEN2], args=training_args, train_dataset=dataset)

        # Only the short-prompt example survives.
        assert len(trainer.train_dataset) == 1
        assert trainer.train_dataset[0]["prompt_ids"] == trainer.processing_class("Hi")["input_ids"]

    @SHARED
    def test_train_toolcall_data(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/toolcall", "preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            per_device_train_batch_size=2,  # toolcall sequences are longer than standard data, reduce batch size to avoid OOM
            max_length=512,  # toolcall sequences are longer than standard data, limit length to avoid OOM
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    @SHARED
    def test_train_with_eval(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference")

        training_args = DPOConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            shared_prompt=shared_prompt,
        )

        trainer.train()

        assert trainer.state.log_history[0]["eval_loss"] is not None

    def test_train_with_multiple_eval_dataset(self, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference")

        training_args = DPOConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=3, report_to="none"
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset={"data1": dataset["test"], "data2": dataset["test"]},
        )
        trainer.train()

        assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
        assert trainer.state.log_history[-2]["eval_data2_loss"] is not None

    def test_train_dataset_required(self, hub, tmp_path):
        training_args = DPOConfig(output_dir=str(tmp_path), report_to="none")
        with pytest.raises(ValueError, match="`train_dataset` is required"):
            PackedDPOTrainer(model=hub[QWEN2], args=training_args)

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
    def test_init_with_eval_dataset(self, eval_dataset_type, hub, tmp_path):
        train_dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        if eval_dataset_type == "none":
            eval_dataset = None
        else:
            streaming = "iterable" in eval_dataset_type
            eval_split = load_dataset(
                "trl-internal-testing/zen", "standard_preference", split="test", streaming=streaming
            )
            if eval_dataset_type in ("dataset", "iterable_dataset"):
                eval_dataset = eval_split
            elif eval_dataset_type in ("dataset_dict", "iterable_dataset_dict"):
                dataset_dict_cls = IterableDatasetDict if streaming else DatasetDict
                eval_dataset = dataset_dict_cls({"data1": eval_split, "data2": eval_split})
            else:  # "dict_of_dataset" or "dict_of_iterable_dataset"
                eval_dataset = {"data1": eval_split, "data2": eval_split}

        training_args = DPOConfig(output_dir=str(tmp_path), report_to="none")
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )

        if eval_dataset_type == "none":
            assert trainer.eval_dataset is None
        elif isinstance(trainer.eval_dataset, dict):
            assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
            # Each split was tokenized independently.
            assert "prompt_ids" in next(iter(trainer.eval_dataset["data1"]))
            assert "prompt_ids" in next(iter(trainer.eval_dataset["data2"]))
        else:
            assert "prompt_ids" in next(iter(trainer.eval_dataset))

    @SHARED
    def test_train_with_compute_metrics(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference")

        def dummy_compute_metrics(eval_pred):
            return {"my_metric": 0.123}

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            eval_strategy="steps",
            eval_steps=3,
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            args=training_args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            compute_metrics=dummy_compute_metrics,
            shared_prompt=shared_prompt,
        )

        trainer.train()

        assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123

    # In practice, this test is the same as `test_train`, since gradient checkpointing is enabled by default in
    # `DPOTrainer`. We keep it as a regression guard: if the default ever changes, we still explicitly test gradient
    # checkpointing, which has caused issues in the past.
    @SHARED
    def test_train_with_gradient_checkpointing(self, shared_prompt, hub, tmp_path):
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        training_args = DPOConfig(
            output_dir=str(tmp_path),
            learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
            gradient_checkpointing=True,
            report_to="none",
        )
        trainer = PackedDPOTrainer(
            model=hub[QWEN2], args=training_args, train_dataset=dataset, shared_prompt=shared_prompt
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None

        # Check that the params have changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."

    def test_tag_added(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.dpo_trainer.DPOConfig", DPOConfig)  # no args: the default config
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            train_dataset=dataset,
        )

        for tag in ["dpo", "trl"]:
            assert tag in trainer.model.model_tags

    @require_peft
    def test_tag_added_peft(self, hub, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("trl.trainer.dpo_trainer.DPOConfig", DPOConfig)  # no args: the default config
        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        trainer = PackedDPOTrainer(
            model=hub[QWEN2],
            train_dataset=dataset,
            peft_config=LoraConfig(),
        )

        for tag in ["dpo", "trl"]:
            assert tag in trainer.model.model_tags

    @require_peft
    @require_bitsandbytes
    def test_peft_with_quantization(self, hub, tmp_path):
        model_id = hub["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]

        quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.float16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_id,
            dtype="float32",
            quantization_config=quantization_config,
        )

        dataset = load_dataset("trl-internal-testing/zen", "standard_preference", split="train")

        # Initialize the trainer with the already configured PeftModel
        training_args = DPOConfig(output_dir=str(tmp_path), learning_rate=0.1, report_to="none")
        trainer = PackedDPOTrainer(
            model=model, args=training_args, train_dataset=dataset, peft_config=LoraConfig()
        )

        previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

        trainer.train()

        assert trainer.state.log_history[-1]["train_loss"] is not None
        assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None

        # Check that the peft params have changed and the base model params have not changed
        for n, param in previous_trainable_params.items():
            new_param = trainer.model.get_parameter(n)
            # In bitsandbytes, bias parameters are automatically cast to the input dtype during the forward pass if
            # their dtype doesn’t match. This causes the module to change unexpectedly during the first forward pass of
            # the training. To handle this, we cast these specific bias parameters to float32 before comparison.
            # https://github.com/bitsandbytes-foundation/bitsandbytes/blob/45553f7392e524eacf400b132cfe01261f6477be/bitsandbytes/nn/modules.py#L518
            # We still need to investigate why the compute dtype ends up being different than for these parameters.
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
