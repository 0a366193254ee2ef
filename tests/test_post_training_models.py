"""Against the real thing: a tiny random GPT-2, TRL's DPO loss, and a GRPO clipped loss, in every layout.

Per-sequence log-probs from packed batches (padded and padding-free, shared prompt on and off) equal
those of each sequence run alone through the model; the DPO loss from any layout equals the loss of the
pairs run one by one and TRL 1.16's ``DPOTrainer.compute_loss`` on the same pairs; a GRPO clipped loss
with old log-probs and advantages equals its unpacked reference in every ``aggregate_loss`` mode, with
the same gradient.
"""

from __future__ import annotations

import random
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F

from zephon_collate import Collator, FloatField, aggregate_loss, sequence_logprobs, token_logprobs
from zephon_collate.functional.attention import dense_branch_mask
from zephon_collate.losses import MODES

transformers = pytest.importorskip("transformers")
VOCAB = 32
LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padded-shared": {"pad_token_id": 0, "shared_prompt": True},
    "padding-free": {"padding_free": True},
    "padding-free-shared": {"padding_free": True, "shared_prompt": True},
}


def gpt2(seed: int) -> torch.nn.Module:
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    model.config._attn_implementation = "sdpa"  # takes a 4-D boolean mask as given
    return model


def forward(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model on a post-training batch: the attention from its document and branch ids."""
    mask = dense_branch_mask(batch["document_ids"], batch["branch_ids"])
    extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    return model(input_ids=batch["input_ids"], attention_mask=mask, **extra).logits


def alone(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The response's summed log-prob, the sequence run by itself."""
    ids = torch.tensor([prompt + response])
    lp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :].sum()


def random_pairs(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randint(2, VOCAB - 1) for _ in range(rng.randint(low, high))]

    return [
        {
            "prompt_input_ids": tokens(1, 6),
            "chosen_input_ids": tokens(1, 8),
            "rejected_input_ids": tokens(1, 8),
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_sequence_logprobs_equal_each_sequence_alone(layout):
    model = gpt2(0)
    pairs = random_pairs(5)
    pairs[3]["prompt_input_ids"] = pairs[2]["prompt_input_ids"]  # two pairs of one prompt: shared by 4
    batch = Collator.for_preference(**LAYOUTS[layout])(pairs)
    with torch.no_grad():
        sums = sequence_logprobs(forward(model, batch), batch).sums
        for side, index in (("chosen_input_ids", "chosen_index"), ("rejected_input_ids", "rejected_index")):
            want = torch.stack([alone(model, p["prompt_input_ids"], p[side]) for p in pairs])
            assert torch.allclose(sums[batch[index]], want, atol=2e-5), (layout, side)
    if layout == "padded":  # the standard transformers path: the 2-D attention_mask
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.allclose(sequence_logprobs(logits, batch).sums, sums, atol=2e-5)


def dpo_loss(policy, reference, batch, beta=0.1):
    policy_sums = sequence_logprobs(forward(policy, batch), batch).sums
    with torch.no_grad():
        reference_sums = sequence_logprobs(forward(reference, batch), batch).sums
    chosen, rejected = batch["chosen_index"], batch["rejected_index"]
    margin = (policy_sums[chosen] - reference_sums[chosen]) - (
        policy_sums[rejected] - reference_sums[rejected]
    )
    return -F.logsigmoid(beta * margin).mean()


def test_dpo_loss_packed_equals_unpacked_and_trls():
    """TRL 1.16's DPOTrainer.compute_loss on its own collated batch of the same pairs (sigmoid loss)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(VOCAB - 3))]
    word_level = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    policy, reference = gpt2(1), gpt2(2)
    rng = random.Random(3)
    text = lambda n: " ".join(f"w{rng.randint(0, VOCAB - 4)}" for _ in range(n))  # noqa: E731
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(4):
        rows["prompt"].append(text(rng.randint(1, 5)))
        rows["chosen"].append(" " + text(rng.randint(1, 6)))
        rows["rejected"].append(" " + text(rng.randint(1, 6)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notices about its own defaults
        args = trl.DPOConfig(
            output_dir=tempfile.mkdtemp(), report_to="none", per_device_train_batch_size=4, beta=0.1,
            max_length=None, use_cpu=True, bf16=False,
        )  # fmt: skip
        trainer = trl.DPOTrainer(
            model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_dict(rows),
            processing_class=tokenizer,
        )  # fmt: skip
    prepared = [trainer.train_dataset[i] for i in range(4)]
    with torch.no_grad():
        theirs = float(trainer.compute_loss(trainer.model, trainer.data_collator(prepared)))
    pairs = [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]
    with torch.no_grad():
        one_by_one = torch.stack(
            [dpo_loss(policy, reference, Collator.for_preference(pad_token_id=0)([p])) for p in pairs]
        )
        for layout in LAYOUTS.values():
            ours = float(dpo_loss(policy, reference, Collator.for_preference(**layout)(pairs)))
            assert ours == pytest.approx(float(one_by_one.mean()), abs=2e-6)
            assert ours == pytest.approx(theirs, abs=2e-6), layout


def rollouts(count: int, seed: int = 0) -> list[dict]:
    """GRPO groups of 3 completions per prompt, old log-probs per completion token, one advantage each."""
    rng = random.Random(seed)
    out = []
    for group in range(count // 3):
        prompt = [rng.randint(2, VOCAB - 1) for _ in range(rng.randint(2, 6))]
        for _ in range(3):
            completion = [rng.randint(2, VOCAB - 1) for _ in range(rng.randint(1, 9 if group % 2 else 3))]
            old = [0.0] * len(prompt) + [rng.uniform(-4.0, -0.5) for _ in completion]
            out.append({
                "input_ids": prompt + completion,
                "completion_mask": [0] * len(prompt) + [1] * len(completion),
                "old_logprobs": old,
                "advantage": rng.uniform(-1.5, 1.5),
            })  # fmt: skip
    return out


def clipped(logprobs, old, advantages, epsilon=0.2):
    ratio = torch.exp(logprobs - old)
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)


def test_grpo_clipped_loss_packed_equals_unpacked_in_every_mode():
    model = gpt2(4)
    examples = rollouts(12)
    normalizer = 16.0
    specs = ["old_logprobs", FloatField("advantage", "sequence", broadcast=True)]
    # The unpacked reference: each rollout alone, verl's formulas over its completion tokens.
    losses = []
    for example in examples:
        ids = torch.tensor([example["input_ids"]])
        lp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        prompt = example["completion_mask"].index(1)
        old = torch.tensor(example["old_logprobs"][prompt:])
        losses.append(clipped(lp[prompt - 1 :], old, example["advantage"]))
    total = sum(loss.sum() for loss in losses)
    reference = {
        "token-mean": total / sum(loss.numel() for loss in losses),
        "seq-mean-token-sum": total / len(losses),
        "seq-mean-token-mean": sum(loss.mean() for loss in losses) / len(losses),
        "seq-mean-token-sum-norm": total / len(losses) / normalizer,
        "token-sum": total,
    }
    gradients = {}
    for mode, want in reference.items():
        model.zero_grad()
        want.backward(retain_graph=True)
        gradients[mode] = [p.grad.clone() for p in model.parameters()]
    for name, layout in LAYOUTS.items():
        batch = Collator.for_rollouts(float_fields=specs, **layout)(examples)
        per_token = clipped(
            token_logprobs(forward(model, batch), batch), batch["old_logprobs"], batch["advantage"]
        )
        for mode in MODES:
            model.zero_grad()
            loss = aggregate_loss(per_token, batch, mode=mode, normalizer=normalizer)
            loss.backward(retain_graph=True)
            assert float(loss.detach()) == pytest.approx(float(reference[mode].detach()), abs=1e-6), (
                name,
                mode,
            )
            for got, want in zip((p.grad for p in model.parameters()), gradients[mode], strict=True):
                assert torch.allclose(got, want, atol=1e-5), (name, mode)
