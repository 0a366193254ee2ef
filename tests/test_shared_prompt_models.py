"""PackedDPOTrainer and PackedGRPOTrainer across model families, with and without shared prompts.

Each cell (trainer x family x ``shared_prompt``) is either refused by name when the trainer is built (the
message names the model's class and the fix) or trains to stock TRL's numbers: one batch's loss and
gradients (DPO: ``compute_loss``; GRPO: ``_compute_loss``, the MoE load-balancing loss included when TRL
turns it on). Tiny models from configs, float64 weights (the MoE experts run eagerly, which float64 needs).
The sequences are longer than every window and chunk below, so a window that a branch would change shows.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")

import transformers
import trl_dpo
from test_trl_dpo import one_batch
from test_trl_grpo import rows
from test_trl_grpo import trainer as grpo_trainer
from trl import DPOTrainer, GRPOTrainer

from zephon_collate.trainers import PackedDPOTrainer, PackedGRPOTrainer
from zephon_collate.trainers.view import check_packing

SMALL = {"vocab_size": 64, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}
DECODER = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 128, **SMALL}  # fmt: skip
MOE = {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
       "num_experts_per_tok": 2}  # fmt: skip


def _config(name: str, **settings: Any) -> Any:
    return getattr(transformers, name)(**settings)


# Each family: its model class, its config, and the attention it is loaded with (None: the model's default).
FAMILIES: dict[str, tuple[str, Callable[[], Any], str | None]] = {
    "llama": ("LlamaForCausalLM", lambda: _config("LlamaConfig", **DECODER), "sdpa"),
    "llama-eager": ("LlamaForCausalLM", lambda: _config("LlamaConfig", **DECODER), "eager"),
    # TRL turns the load-balancing loss on whenever the config's router_aux_loss_coef is not 0 (0.001 here).
    "qwen2-moe": ("Qwen2MoeForCausalLM", lambda: _config("Qwen2MoeConfig", **DECODER, **MOE), "sdpa"),
    "qwen2-moe-router-logits": (
        "Qwen2MoeForCausalLM",
        lambda: _config("Qwen2MoeConfig", **DECODER, **MOE, output_router_logits=True),
        "sdpa",
    ),
    "qwen2-moe-no-aux": (
        "Qwen2MoeForCausalLM",
        lambda: _config(
            "Qwen2MoeConfig", **DECODER, **MOE, output_router_logits=True, router_aux_loss_coef=0.0
        ),
        "sdpa",
    ),
    "mistral-window": (
        "MistralForCausalLM",
        lambda: _config("MistralConfig", **DECODER, sliding_window=4),
        "sdpa",
    ),
    "mistral-window-eager": (
        "MistralForCausalLM",
        lambda: _config("MistralConfig", **DECODER, sliding_window=4),
        "eager",
    ),
    # Layer 0 full attention, layer 1 a window of 4 (config.layer_types mixes them).
    "qwen2-mixed-window": (
        "Qwen2ForCausalLM",
        lambda: _config(
            "Qwen2Config", **DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
        "sdpa",
    ),
    "gemma3-mixed-window": (
        "Gemma3ForCausalLM",
        lambda: _config(
            "Gemma3TextConfig",
            **DECODER,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "sdpa",
    ),
    # Attention sinks, windows of 4 on every other layer (eager: GPT-OSS has no SDPA path).
    "gpt-oss-sinks": (
        "GptOssForCausalLM",
        lambda: _config(
            "GptOssConfig",
            **DECODER,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            router_aux_loss_coef=0.0,
        ),
        "eager",
    ),
    "gpt2-absolute": (
        "GPT2LMHeadModel",
        lambda: _config("GPT2Config", n_embd=16, n_layer=2, n_head=2, n_positions=128, **SMALL),
        "sdpa",
    ),
    "opt": (
        "OPTForCausalLM",
        lambda: _config(
            "OPTConfig",
            hidden_size=16,
            num_hidden_layers=2,
            ffn_dim=32,
            num_attention_heads=2,
            max_position_embeddings=128,
            word_embed_proj_dim=16,
            **SMALL,
        ),
        "sdpa",
    ),
    "bloom-alibi": (
        "BloomForCausalLM",
        lambda: _config("BloomConfig", hidden_size=16, n_layer=2, n_head=2, **SMALL),
        None,
    ),
    "mamba": (
        "MambaForCausalLM",
        lambda: _config("MambaConfig", hidden_size=16, state_size=4, num_hidden_layers=2, **SMALL),
        None,
    ),
}

# Families stock TRL cannot train (its fused head finds no decoder under Llama4ForCausalLM): checked at the model.
MODEL_ONLY: dict[str, tuple[str, Callable[[], Any], str | None]] = {
    # Chunks of 4 on layer 0, full attention on layer 1; no MoE load-balancing loss.
    "llama4-chunked": (
        "Llama4ForCausalLM",
        lambda: _config(
            "Llama4TextConfig",
            **DECODER,
            intermediate_size_mlp=32,
            head_dim=8,
            num_local_experts=2,
            attention_chunk_size=4,
            layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 1],
            router_aux_loss_coef=0.0,
        ),
        "sdpa",
    ),
}

ACROSS = r"lets packed sequences attend to each other.*train it with TRL's own trainer"
AUX = r"load-balancing loss.*router_aux_loss_coef=0\.0.*shared_prompt=False"
STATEFUL = r"has linear_attention layers \(config.layer_types\), which carry state.*TRL's own trainer"
# family: (without shared_prompt, with it): None, trains as stock; a pattern, the refusal's message.
EXPECTED: dict[str, tuple[str | None, str | None]] = {
    "llama": (None, None),
    "llama-eager": (None, None),
    "qwen2-moe": (None, AUX),
    "qwen2-moe-router-logits": (None, AUX),
    "qwen2-moe-no-aux": (None, None),
    "mistral-window": (None, None),
    "mistral-window-eager": (None, None),
    "qwen2-mixed-window": (None, None),
    "gemma3-mixed-window": (None, None),
    "gpt-oss-sinks": (ACROSS, ACROSS),
    "gpt2-absolute": (None, None),
    "opt": (ACROSS, ACROSS),
    "bloom-alibi": (ACROSS, ACROSS),
    "mamba": (STATEFUL, STATEFUL),  # named by its layer kind (the probe's refusal before)
}


def model(family: str) -> Any:
    """The family's tiny model, seeded, float64 (its experts, if any, run eagerly: grouped_mm has no float64);
    float32 under eager attention, where stock's left-padded rows turn NaN in float64."""
    name, make, attention = {**FAMILIES, **MODEL_ONLY}[family]
    transformers.utils.logging.set_verbosity_error()
    config = make()
    if attention is not None:
        config._attn_implementation = attention
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    dtype = torch.float32 if config._attn_implementation == "eager" else torch.float64
    return getattr(transformers, name)(config).to(dtype)


def dpo(cls: type, family: str, shared: bool = False, **options: Any) -> Any:
    """``cls`` on 12 pairs (prompts of 2 to 12 words, responses of 1 to 10), the family's model and a copy
    of it as the reference."""
    args = trl_dpo.DPOConfig(
        output_dir="/tmp/zephon-shared-models", per_device_train_batch_size=4, max_steps=1, report_to=[],
        use_cpu=True, seed=0, bf16=False, **options,
    )  # fmt: skip
    policy = model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl_dpo.disable_progress_bars()
        return cls(
            model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=trl_dpo.pairs(12),
            processing_class=trl_dpo.tokenizer(), **({"shared_prompt": True} if shared else {}),
        )  # fmt: skip


def dpo_step(run: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One loss (TRL's compute_loss on 4 pairs, the load-balancing loss included where TRL adds it) and its
    gradients."""
    loss = run.compute_loss(run.model, run.data_collator([run.train_dataset[i] for i in range(4)]))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in run.model.parameters()]


def grpo(cls: type, family: str, shared: bool = False) -> Any:
    return grpo_trainer(cls, model(family), shared_prompt=shared)


def grpo_step(run: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One loss and its gradients on two groups of two completions (prompts of 3 and 5 tokens, completions
    of 6, 2, 4 and 1: longer than every window and chunk here), after the completions' log-probs and
    entropies (the loss alone, its ratios at 1, would not show them)."""
    batch: dict[str, Any] = dict(rows(grouped=True))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, entropies, _ = run._get_per_token_logps_and_entropies(
            run.model, ids, mask, 6, compute_entropy=True
        )
    batch["advantages"] = torch.tensor([0.5, -1.0, 1.5, -0.2], dtype=torch.float64)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    run.model.train()
    loss = run._compute_loss(run.model, batch)
    loss.backward()
    return loss.detach(), [
        logps,
        entropies,
        *(p.grad.clone() for p in run.model.parameters() if p.grad is not None),
    ]


def assert_refused(build: Callable[[], Any], family: str, pattern: str, owner: str) -> None:
    with pytest.raises(ValueError) as caught:
        build()
    message = str(caught.value)
    assert message.startswith(f"{owner}: "), message
    assert FAMILIES[family][0] in message, message  # names the model's class
    assert re.search(pattern, message, flags=re.DOTALL), message


def assert_same(got: tuple[Any, list[torch.Tensor]], want: tuple[Any, list[torch.Tensor]]) -> None:
    assert float(got[0]) == pytest.approx(float(want[0]), abs=1e-6)
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())


_STOCK: dict[tuple[str, str], tuple[Any, list[torch.Tensor]]] = {}


def stock(trainer: str, family: str) -> tuple[Any, list[torch.Tensor]]:
    """Stock TRL's loss and gradients, once per trainer and family."""
    if (trainer, family) not in _STOCK:
        run = dpo(DPOTrainer, family) if trainer == "dpo" else grpo(GRPOTrainer, family)
        _STOCK[trainer, family] = dpo_step(run) if trainer == "dpo" else grpo_step(run)
    return _STOCK[trainer, family]


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dpo_is_refused_by_name_or_equals_stock(family, shared):
    refusal = EXPECTED[family][shared]
    if refusal is not None:
        assert_refused(lambda: dpo(PackedDPOTrainer, family, shared), family, refusal, "PackedDPOTrainer")
        return
    assert_same(dpo_step(dpo(PackedDPOTrainer, family, shared)), stock("dpo", family))


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "gpt2-absolute"])
def test_grpo_is_refused_by_name_or_equals_stock(family, shared):
    """(GPT-2 is left out: stock GRPO passes no positions, so its left-padded prompts sit at shifted absolute
    positions; packed, they count from 0, as documented.)"""
    refusal = EXPECTED[family][shared]
    if refusal is not None:
        assert_refused(lambda: grpo(PackedGRPOTrainer, family, shared), family, refusal, "PackedGRPOTrainer")
        return
    assert_same(grpo_step(grpo(PackedGRPOTrainer, family, shared)), stock("grpo", family))


def test_the_load_balancing_loss_off_in_the_trainer_lets_a_shared_prompt_through():
    """The refusal's fix: router_aux_loss_coef=0.0 in the trainer's config, and the numbers are stock's."""
    options = {"router_aux_loss_coef": 0.0}
    run = dpo(PackedDPOTrainer, "qwen2-moe-router-logits", shared=True, **options)
    out = one_batch(dpo(DPOTrainer, "qwen2-moe-router-logits", **options), run)
    assert_same(out["packed"][:2], out["stock"][:2])


def test_a_reference_model_is_checked_too():
    """DPO's reference model runs the same packed rows: one that would read them otherwise is refused."""
    args = trl_dpo.DPOConfig(output_dir="/tmp/zephon-shared-models", report_to=[], use_cpu=True, bf16=False)
    refusal = r"PackedDPOTrainer: the reference model OPTForCausalLM lets packed"
    with pytest.raises(ValueError, match=refusal), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PackedDPOTrainer(
            model=model("llama"), ref_model=model("opt"), args=args, train_dataset=trl_dpo.pairs(4),
            processing_class=trl_dpo.tokenizer(),
        )  # fmt: skip


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared-prompt"])
def test_the_probe_is_longer_than_the_window(shared):
    """The probe's sequences reach past the window (a probe of 4 tokens let Mistral's window of 4 through
    unfolded), so a window the packed rows would change shows."""
    mistral = model("mistral-window")
    mistral.config.sliding_window = 9
    lengths: list[int] = []
    forward = mistral.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None:  # a sequence alone
            lengths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    mistral.forward = recording
    check_packing(mistral, "test", shared_prompt=shared)
    assert max(lengths) > 9 + 1  # its last token does not see its first ones


def test_the_models_own_error_during_the_probe_is_a_refusal():
    class Strict(torch.nn.Module):
        """Takes no 4-D mask: raises as BLOOM does."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 4, dtype=torch.float64))

        def forward(self, input_ids, position_ids=None, use_cache=False, attention_mask=None):
            if attention_mask is not None:
                raise RuntimeError("too many values to unpack")
            return type("Out", (), {"logits": self.weight[input_ids]})

    with pytest.raises(
        ValueError, match=r"owner: Strict .*RuntimeError: too many values.*shared_prompt=False"
    ) as caught:
        check_packing(Strict(), "owner", shared_prompt=True)
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "family", [*MODEL_ONLY, "mistral-window", "qwen2-mixed-window", "mistral-window-eager"]
)
def test_packed_shared_prompt_logprobs_equal_each_sequence_alone(family):
    """At the model: DPO pairs (prompts of 2 to 12 tokens, responses of 1 to 10) packed with shared prompts,
    through the mask the wrapped forward gives the model, score as each sequence alone (Llama 4's chunks of
    4 included, which stock TRL cannot train)."""
    from zephon_collate.trainers.view import branch_attention, pack_view

    net = model(family).eval()
    check_packing(net, "test", shared_prompt=True)
    generator = torch.Generator().manual_seed(3)
    sequences, trained = [], []
    for _ in range(3):
        prompt = torch.randint(
            3, 64, (int(torch.randint(2, 13, (1,), generator=generator)),), generator=generator
        )
        for _side in range(2):
            response = torch.randint(
                3, 64, (int(torch.randint(1, 11, (1,), generator=generator)),), generator=generator
            )
            sequences.append(torch.cat([prompt, response]))
            trained.append(torch.cat([torch.zeros_like(prompt), torch.ones_like(response)]))
    width = max(len(s) for s in sequences)
    ids, mask, marks = (torch.zeros(len(sequences), width, dtype=torch.long) for _ in range(3))
    for row, (tokens, scored) in enumerate(zip(sequences, trained, strict=True)):
        ids[row, : len(tokens)], mask[row, : len(tokens)], marks[row, : len(tokens)] = tokens, 1, scored
    packed = pack_view(ids, mask, marks, "fit", "test", shared_prompt=True)
    assert packed["input_ids"].numel() < int(mask.sum())  # each prompt once
    with torch.no_grad():
        logits = net(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
                     attention_mask=branch_attention(net, packed)).logits  # fmt: skip
        got = logits.log_softmax(-1).flatten(0, 1)[packed["source"]]
        alone = torch.zeros(len(sequences), width - 1, 64, dtype=logits.dtype)
        for row, tokens in enumerate(sequences):
            alone[row, : len(tokens) - 1] = (
                net(input_ids=tokens[None], use_cache=False).logits[0, :-1].log_softmax(-1)
            )
    want = alone.flatten(0, 1)[packed["target"]]
    tolerance = 1e-5 if logits.dtype == torch.float32 else 1e-10
    if family == "llama4-chunked":
        # Llama 4 rounds q and k to float32 for its rotary embedding (apply_rotary_emb's .float()), even in
        # a float64 model: a last-bit difference upstream can flip a float32 rounding. 1e-8 still catches
        # a wrong mask by six orders of magnitude.
        tolerance = 1e-8
    assert torch.allclose(got, want, atol=tolerance, rtol=0), float((got - want).abs().max())


def test_layers_a_branch_mask_cannot_express_are_named():
    """Recurrent layers (config.layer_types 'linear_attention') carry a state along the row."""
    from zephon_collate.trainers.view import layer_limits

    with pytest.raises(
        ValueError, match=r"owner: MambaForCausalLM has linear_attention layers.*shared_prompt=False"
    ):
        layer_limits(model("mamba"), "owner")
    assert layer_limits(model("gemma3-mixed-window")) == {"sliding_attention": 4, "full_attention": 0}
    assert layer_limits(model("mistral-window")) == {"sliding_attention": 4}
    assert layer_limits(model("llama4-chunked")) == {"chunked_attention": 4, "full_attention": 0}


def test_stateful_layers_are_refused_by_name_even_where_the_probe_misses_their_leak():
    """LFM2's short convolutions carry state into the next packed sequence; with a tiny model's weights
    the leak (3.8e-4 in the log-probs, conv weights x3) hid under the probe's rounding tolerance."""
    from zephon_collate.trainers.view import check_packing

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = _config("Lfm2Config", **DECODER, layer_types=["conv", "full_attention"])
    lfm2 = transformers.Lfm2ForCausalLM(config).double()
    with torch.no_grad():
        for name, parameter in lfm2.named_parameters():
            if "conv" in name:
                parameter.mul_(3)
    for shared in (False, True):
        with pytest.raises(ValueError, match=r"owner: Lfm2ForCausalLM has conv layers .*carry state"):
            check_packing(lfm2, "owner", shared_prompt=shared)


TREE_FAMILIES = [
    "llama", "mistral-window", "qwen2-mixed-window", "gemma3-mixed-window", "gemma2-softcap", "gpt-oss-sinks",
    "llama4-chunked",
]  # fmt: skip


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_tree_attention_scores_every_path_as_it_scores_alone(family):
    """``use_tree_attention`` keeps what each layer's attention does: windows and chunks by position along the
    path, Gemma 2's soft-capped scores, GPT-OSS's sinks. Trajectories longer than every window and chunk,
    branching at several depths."""
    from zephon_collate import Collator
    from zephon_collate.functional.trees import TreeBlocks, use_tree_attention
    from zephon_collate.losses import along_paths, token_logprobs

    if family == "gemma2-softcap":  # windows of 4 on layer 0, scores capped at 0.5 (they reach it)
        config = _config("Gemma2Config", **DECODER, head_dim=8, sliding_window=4, attn_logit_softcapping=0.5,
                         layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        net = transformers.Gemma2ForCausalLM(config).double()
    else:
        net = model(family)
    net = net.eval()
    generator = torch.Generator().manual_seed(5)
    stem = torch.randint(3, 64, (6,), generator=generator).tolist()
    paths = [stem + torch.randint(3, 64, (n,), generator=generator).tolist() for n in (3, 7)]
    paths += [paths[1][:9] + torch.randint(3, 64, (4,), generator=generator).tolist(), [*stem[:2], 5, 6, 7]]
    batch = Collator.for_trees()(
        [{"input_ids": p, "completion_mask": [0] * 2 + [1] * (len(p) - 2)} for p in paths]
    )
    assert batch["input_ids"].numel() < sum(map(len, paths))  # shared at several depths
    with torch.no_grad():
        alone = [net(input_ids=torch.tensor([p]), use_cache=False).logits[0].log_softmax(-1) for p in paths]
        want = torch.cat([torch.cat([torch.zeros(1, dtype=a.dtype), a[torch.arange(len(p) - 1), p[1:]]])
                          for p, a in zip(paths, alone, strict=True)])  # fmt: skip
        use_tree_attention(net)
        logits = net(batch["input_ids"], position_ids=batch["position_ids"], tree=TreeBlocks.from_batch(batch),
                     use_cache=False).logits  # fmt: skip
        got = along_paths(token_logprobs(logits, batch), batch)
    tolerance = 1e-5 if want.dtype == torch.float32 else 1e-8 if family == "llama4-chunked" else 1e-10
    assert torch.allclose(got.to(want.dtype), want, atol=tolerance, rtol=0), float((got - want).abs().max())
