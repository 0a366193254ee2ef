"""verl's rollout rows, read as verl keeps them: response-aligned fields placed on the row's last tokens.

verl lays a rollout out as ``input_ids = cat(prompts, responses)`` (the prompt
left padded, the response right padded) and keeps ``response_mask``,
``old_log_probs`` and ``advantages`` ``[batch, response_length]``. Read with
``FloatField(name, align="response")``, a batch must equal the same rollouts
given token-aligned, in every layout; and a policy's log-probs scored on the
packed batch must meet verl's own ``old_log_probs`` token for token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FloatField, pack_flat, token_logprobs

LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padding-free": {"padding_free": True},
    "padded-shared": {"pad_token_id": 0, "shared_prompt": True},
    "padding-free-shared": {"padding_free": True, "shared_prompt": True},
}
RESPONSE = [FloatField("old_log_probs", align="response"), FloatField("advantages", align="response")]
TOKEN = ["old_log_probs", "advantages"]


def verl_rows(prompts, responses, old, advantages, mask=None):
    """verl's batch ``[B, P + R]`` / ``[B, R]``: prompts left padded, responses right padded, the position
    ids verl computes from the attention mask; a value under padding is garbage (9.0), as verl leaves it."""
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    rows = {"input_ids": [], "attention_mask": [], "response_mask": [], "old_log_probs": [], "advantages": []}
    for index, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        left, right = width_p - len(prompt), width_r - len(response)
        rows["input_ids"].append([0] * left + prompt + response + [0] * right)
        rows["attention_mask"].append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        trained = mask[index] if mask is not None else [1] * len(response)
        rows["response_mask"].append(trained + [0] * right)
        rows["old_log_probs"].append(old[index] + [9.0] * right)
        rows["advantages"].append(advantages[index] + [9.0] * right)
    out = {key: torch.tensor(value) for key, value in rows.items()}
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # a DataProto carries them
    return out


def token_rows(prompts, responses, old, advantages, mask=None):
    """The same rollouts, one example each, every field one value per token (0 on the prompt)."""
    out = []
    for index, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        trained = mask[index] if mask is not None else [1] * len(response)
        out.append({
            "input_ids": prompt + response,
            "completion_mask": [0] * len(prompt) + trained,
            "old_log_probs": [0.0] * len(prompt) + old[index],
            "advantages": [0.0] * len(prompt) + advantages[index],
        })  # fmt: skip
    return out


def differing(got, want) -> list[str]:
    """The keys on which two batches differ (in presence, order, dtype or a value)."""
    if list(got) != list(want):
        return sorted(set(got) ^ set(want)) or ["(order)"]
    return [
        key
        for key, value in want.items()
        if not (
            got[key].dtype == value.dtype and torch.equal(got[key], value)
            if isinstance(value, torch.Tensor)
            else got[key] == value
        )
    ]


def rollouts(seed, count=6):
    rng = random.Random(seed)
    prompts, responses, old, advantages = [], [], [], []
    for group in range(count // 2):
        prompt = [rng.randint(2, 31) for _ in range(rng.randint(1, 5))]
        for _ in range(2):  # two responses per prompt: a group a shared prompt lays out once
            response = [rng.randint(2, 31) for _ in range(rng.randint(1, 6))]
            prompts.append(prompt)
            responses.append(response)
            old.append([round(rng.uniform(-4, -0.1), 3) for _ in response])
            advantages.append(
                [round(rng.uniform(-1, 1), 3) for _ in response] if group else [0.5] * len(response)
            )
    return prompts, responses, old, advantages


def test_a_response_aligned_row_worked_by_hand():
    """Prompt [5, 6, 7] left padded by one, response [10, 11] right padded by one: the field's first two
    values go to tokens 10 and 11; its padding value (9.0) is dropped with the padding."""
    batch = verl_rows(
        [[5, 6, 7], [8, 9, 4, 3]], [[10, 11], [12, 13, 14]], [[-0.5, -1.5], [-1, -2, -3]], [[1, 1], [2, 2, 2]]
    )
    out = Collator.for_rollouts(padding_free=True, float_fields=RESPONSE)(batch)
    assert out["input_ids"].tolist() == [[5, 6, 7, 10, 11, 8, 9, 4, 3, 12, 13, 14]]
    assert out["labels"].tolist() == [[-100, -100, -100, 10, 11, -100, -100, -100, -100, 12, 13, 14]]
    assert out["old_log_probs"].tolist() == [[0, 0, 0, -0.5, -1.5, 0, 0, 0, 0, -1, -2, -3]]
    assert out["advantages"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 0, 2, 2, 2]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verl_rows_equal_the_same_rollouts_token_aligned(layout):
    prompts, responses, old, advantages = rollouts(0)
    want = Collator.for_rollouts(float_fields=TOKEN, **LAYOUTS[layout])(
        token_rows(prompts, responses, old, advantages)
    )
    collate = Collator.for_rollouts(float_fields=RESPONSE, **LAYOUTS[layout])
    batch = verl_rows(prompts, responses, old, advantages)
    assert differing(collate(batch), want) == []  # verl's DataProto batch: a dict of [B, ...] tensors
    as_list = [{key: value[index] for key, value in batch.items()} for index in range(len(prompts))]
    assert differing(collate(as_list), want) == []  # or its rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), layout=st.sampled_from(sorted(LAYOUTS)), holes=st.booleans())
def test_property_response_aligned_equals_token_aligned(seed, layout, holes):
    """Any lengths and paddings, a response_mask with zeros inside the response (verl masks tool output so)."""
    prompts, responses, old, advantages = rollouts(seed, count=2 * random.Random(seed).randint(1, 4))
    rng = random.Random(seed + 1)
    mask = [[int(not holes or k == 0 or rng.random() < 0.7) for k in range(len(r))] for r in responses]
    want = Collator.for_rollouts(float_fields=TOKEN, **LAYOUTS[layout])(
        token_rows(prompts, responses, old, advantages, mask)
    )
    got = Collator.for_rollouts(float_fields=RESPONSE, **LAYOUTS[layout])(
        verl_rows(prompts, responses, old, advantages, mask)
    )
    assert differing(got, want) == []


def test_packed_logprobs_meet_verls_old_log_probs():
    """verl's old_log_probs, computed its way on the padded batch (position ids from the attention mask, the
    response's log-probs from ``logits[:, -R - 1:-1]``), equal the policy's token log-probs on the packed
    batch at every trained token: the alignment is exact end to end (float64)."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().eval()
    prompts, responses, _, advantages = rollouts(3)
    batch = verl_rows(prompts, responses, [[0.0] * len(r) for r in responses], advantages)
    width_r = batch["response_mask"].shape[1]
    with torch.no_grad():
        position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(
            batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids
        ).logits
        verl_old = logits[:, -width_r - 1 : -1].log_softmax(-1)
        verl_old = verl_old.gather(-1, batch["input_ids"][:, -width_r:, None])[..., 0]
    batch["old_log_probs"] = verl_old
    spec = FloatField("old_log_probs", align="response", dtype=torch.float64)
    packed = Collator.for_rollouts(padding_free=True, float_fields=[spec])(batch)
    with torch.no_grad():
        logits = model(packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        new = token_logprobs(logits, packed)
    trained = packed["labels"] != -100
    assert int(trained.sum()) == int(batch["response_mask"].sum())
    torch.testing.assert_close(new[trained], packed["old_log_probs"][trained], rtol=0, atol=1e-10)
    assert torch.equal(packed["old_log_probs"][trained], verl_old[batch["response_mask"].bool()])


def test_response_aligned_refusals():
    tokens = {"input_ids": [5, 6, 7], "response_mask": [1, 1]}
    collate = Collator.for_rollouts(pad_token_id=0, float_fields=[FloatField("lp", align="response")])
    with pytest.raises(
        ValueError, match=r"example 1: field 'lp' holds 4 values, but the token row has 3; a "
    ):
        collate([{**tokens, "lp": [0.1, 0.2]}, {**tokens, "lp": [0.1, 0.2, 0.3, 0.4]}])
    with pytest.raises(
        ValueError, match=r"example 0: float field 'lp' holds shape \(1, 2\).*align='response'"
    ):
        collate([{**tokens, "lp": [[0.1, 0.2]]}])
    with pytest.raises(ValueError, match=r"example 0: float field 'lp' holds nan at lp\[1\]"):
        collate([{**tokens, "lp": [0.1, float("nan")]}])
    with pytest.raises(
        ValueError, match=r"example 0: field 'response_mask' holds 4 values, but the token row"
    ):
        collate([{"input_ids": [5, 6, 7], "response_mask": [1, 1, 1, 1], "lp": [0.1]}])
    with pytest.raises(ValueError, match=r"example 0:.*'response_mask'.*0 and 1"):
        collate([{"input_ids": [5, 6, 7], "response_mask": [1, 2], "lp": [0.1]}])
    with pytest.raises(ValueError, match=r"example 1: .*'response_mask'"):
        collate([{**tokens, "lp": [0.1]}, {"input_ids": [5, 6], "lp": [0.1]}])
    with pytest.raises(ValueError, match=r"align must be 'token', 'input', 'label', 'response' or"):
        FloatField("lp", align="responses")  # type: ignore[arg-type]


def test_response_mask_is_never_dropped_elsewhere():
    """Every other reader refuses verl's response_mask (read as all trained, the prompt would be trained)."""
    row = {"input_ids": [5, 6, 7], "response_mask": [1]}
    with pytest.raises(ValueError, match=r"example 0: carries 'response_mask'.*Collator.for_rollouts"):
        Collator.for_transformers(pad_token_id=0)([row])
    with pytest.raises(ValueError, match=r"record 0 .*'response_mask'.*Collator.for_rollouts"):
        Collator(return_labels=True)([row])
    with pytest.raises(ValueError, match=r"'response_mask'.*loss_mask = \[0\] \* \(len\(input_ids\)"):
        pack_flat([row], seq_len=8, pad_token_id=0)
    # A response_mask of ones over the whole row changes nothing, and passes, in each of them.
    whole = {"input_ids": [5, 6, 7], "response_mask": [1, 1, 1]}
    assert Collator(return_labels=True)([whole])["labels"].tolist() == [[6, 7]]
    assert Collator.for_transformers(pad_token_id=0)([whole])["labels"].tolist() == [[5, 6, 7]]
    assert pack_flat([whole], seq_len=8, pad_token_id=0)[0].payload["input_ids"][:3].tolist() == [5, 6, 7]
    # Pairs, KTO examples and reward pairs train each side whole: a mask that would leave tokens out is refused.
    pair = {"prompt_ids": [5], "chosen_ids": [6, 7], "rejected_ids": [8], "response_mask": [1, 0]}
    with pytest.raises(
        ValueError, match=r"example 0: carries 'response_mask', which this collator does not read"
    ):
        Collator.for_preference(pad_token_id=0)([pair])
    kto = {"prompt_ids": [5, 6], "completion_ids": [7, 8], "label": True, "completion_mask": [0, 1]}
    with pytest.raises(
        ValueError, match=r"example 0: carries 'completion_mask', which this collator does not"
    ):
        Collator.for_preference(pad_token_id=0)([kto])
    reward = {"chosen_ids": [5, 6], "rejected_ids": [7], "labels": [5, 6]}
    with pytest.raises(ValueError, match=r"example 0: carries 'labels', which this collator does not read"):
        Collator.for_rewards(pad_token_id=0)([reward])


def test_inputs_are_not_changed():
    prompts, responses, old, advantages = rollouts(5)
    batch = verl_rows(prompts, responses, old, advantages)
    before = {key: value.clone() for key, value in batch.items()}
    Collator.for_rollouts(padding_free=True, float_fields=RESPONSE)(batch)
    for key, value in before.items():
        assert torch.equal(batch[key], value)
    assert np.isfinite(before["old_log_probs"].numpy()).all()
