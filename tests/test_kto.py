"""TRL's unpaired (KTO) examples through ``Collator.for_preference``: the same sequences as TRL's collator,
each completion (and its KL completion) exact in every layout, ``label`` kept apart from ``labels``."""

from __future__ import annotations

import random

import pytest
import torch

from zephon_collate import Collator, sequence_logprobs

LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padded-shared": {"pad_token_id": 0, "shared_prompt": True},
    "padding-free": {"padding_free": True},
    "padding-free-shared": {"padding_free": True, "shared_prompt": True},
}


def kto_examples(count: int, seed: int = 0, kl: bool = True, reference: bool = False) -> list[dict]:
    """TRL's tokenized KTO rows: the KL completion of example i is example i - 1's completion (TRL's roll)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        rows.append({
            "prompt_ids": [rng.randint(2, 31) for _ in range(rng.randint(1, 6))],
            "completion_ids": [rng.randint(2, 31) for _ in range(rng.randint(1, 7))],
            "label": index % 3 != 1,
        })  # fmt: skip
    for index, row in enumerate(rows):
        if kl:
            row["KL_completion_ids"] = rows[index - 1]["completion_ids"]
        if reference:
            row["ref_logps"] = -1.5 - index
            if kl:
                row["ref_KL_logps"] = -2.5 - index
    return rows


def test_a_kto_batch_worked_by_hand():
    rows = [
        {"prompt_ids": [5, 6], "completion_ids": [7, 8], "KL_completion_ids": [9], "label": True},
        {"prompt_ids": [4], "completion_ids": [9], "KL_completion_ids": [7, 8], "label": False},
    ]
    out = Collator.for_preference(pad_token_id=0)(rows)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [4, 9, 0, 0], [5, 6, 9, 0], [4, 7, 8, 0]]
    assert out["labels"].tolist() == [
        [-100, -100, 7, 8],
        [-100, 9, -100, -100],
        [-100, -100, 9, -100],
        [-100, 7, 8, -100],
    ]
    assert out["completion_index"].tolist() == [0, 1] and out["KL_index"].tolist() == [2, 3]
    assert out["label"].dtype == torch.bool and out["label"].tolist() == [True, False]
    assert "chosen_index" not in out and "rejected_index" not in out
    shared = Collator.for_preference(padding_free=True, shared_prompt=True)(rows)
    assert shared["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 9, 7, 8]]  # each prompt once
    assert shared["branch_ids"].tolist() == [[0, 0, 1, 1, 2, 0, 1, 2, 2]]
    assert shared["completion_index"].tolist() == [0, 1] and shared["KL_index"].tolist() == [2, 3]


def test_padded_kto_batch_equals_trls_collator():
    trl = pytest.importorskip("trl.trainer.kto_trainer")
    rows = kto_examples(7, reference=True)
    theirs = trl.DataCollatorForUnpairedPreference(pad_token_id=0)(rows)
    ours = Collator.for_preference(pad_token_id=0)(rows)
    for prefix, index in (("", "completion_index"), ("KL_", "KL_index")):
        width = theirs[f"{prefix}input_ids"].shape[1]
        got = ours["input_ids"][ours[index]]
        assert torch.equal(got[:, :width], theirs[f"{prefix}input_ids"])
        assert not got[:, width:].any()
        want = theirs[f"{prefix}input_ids"].masked_fill(theirs[f"{prefix}completion_mask"] == 0, -100)
        assert torch.equal(ours["labels"][ours[index]][:, :width], want)
        assert torch.equal(ours["attention_mask"][ours[index]][:, :width], theirs[f"{prefix}attention_mask"])
    assert torch.equal(ours["label"], theirs["label"])
    for name in ("ref_logps", "ref_KL_logps"):
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], theirs[name].float())


@pytest.mark.parametrize("kl", [True, False])
def test_completion_and_kl_logps_equal_each_sequence_alone(kl):
    """KTO's completion log-probs and its KL term's, from every layout, equal each sequence run alone
    (float64, a tiny Llama)."""
    transformers = pytest.importorskip("transformers")
    from zephon_collate.functional.attention import dense_branch_mask

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.config._attn_implementation = "sdpa"
    rows = kto_examples(6, seed=2, kl=kl)

    def alone(prompt, completion):
        ids = torch.tensor([prompt + completion])
        lp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[len(prompt) - 1 :].sum()

    with torch.no_grad():
        want = torch.stack([alone(r["prompt_ids"], r["completion_ids"]) for r in rows])
        want_kl = torch.stack([alone(r["prompt_ids"], r["KL_completion_ids"]) for r in rows]) if kl else None
        for name, layout in LAYOUTS.items():
            batch = Collator.for_preference(**layout)(rows)
            mask = dense_branch_mask(batch["document_ids"], batch["branch_ids"])
            logits = model(
                batch["input_ids"], attention_mask=mask, position_ids=batch.get("position_ids")
            ).logits
            sums = sequence_logprobs(logits, batch).sums
            torch.testing.assert_close(sums[batch["completion_index"]], want, rtol=0, atol=1e-10, msg=name)
            if kl:
                torch.testing.assert_close(sums[batch["KL_index"]], want_kl, rtol=0, atol=1e-10, msg=name)
            else:
                assert "KL_index" not in batch and int(batch["num_sequences"]) == len(rows)


def test_shared_prompt_lays_each_kto_prompt_out_once():
    rows = kto_examples(16, seed=4)
    flat = Collator.for_preference(padding_free=True)(rows)
    shared = Collator.for_preference(padding_free=True, shared_prompt=True)(rows)
    prompts = sum(len(r["prompt_ids"]) for r in rows)
    assert flat["input_ids"].shape[1] - shared["input_ids"].shape[1] == prompts


def test_kto_truncation_follows_the_pairs_rules():
    rows = [{"prompt_ids": [5, 6, 7], "completion_ids": [8, 9, 10], "KL_completion_ids": [11], "label": True}]
    out = Collator.for_preference(pad_token_id=0, max_length=4)(rows)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [5, 6, 7, 11]]
    out = Collator.for_preference(pad_token_id=0, max_completion_length=1, max_prompt_length=2)(rows)
    assert out["input_ids"].tolist() == [[6, 7, 8], [6, 7, 11]]
    with pytest.raises(
        ValueError, match=r"example 0: its prompt of 3 tokens fills max_length=3, so none of the completion"
    ):
        Collator.for_preference(pad_token_id=0, max_length=3)(rows)


def test_kto_refusals():
    collate = Collator.for_preference(pad_token_id=0)
    row = {"prompt_ids": [5, 6], "completion_ids": [7], "label": True}
    with pytest.raises(ValueError, match=r"example 1: 'label' is 1, but KTO's label is one bool per example"):
        collate([row, {**row, "label": 1}])
    with pytest.raises(ValueError, match=r"example 0: carries 'completion_ids' .* without 'label'"):
        collate([{"prompt_ids": [5], "completion_ids": [7]}])
    with pytest.raises(ValueError, match=r"example 0: carries 'completion_ids' .* beside 'chosen_ids'"):
        collate([{**row, "chosen_ids": [7], "rejected_ids": [8]}])
    with pytest.raises(ValueError, match=r"carry 'ref_KL_logps' but no 'KL_completion_ids'"):
        collate([{**row, "ref_logps": -1.0, "ref_KL_logps": -1.0}])
    with pytest.raises(ValueError, match=r"carry 'ref_logps' but not 'ref_KL_logps'"):
        collate([{**row, "KL_completion_ids": [8], "ref_logps": -1.0}])
    with pytest.raises(ValueError, match=r"example 0: has no prompt tokens"):
        collate([{"completion_ids": [7], "label": True}])
    before = [dict(r) for r in kto_examples(3)]
    rows = kto_examples(3)
    collate(rows)
    assert rows == before  # inputs are never changed


def test_a_batched_dict_of_kto_examples_reads_as_its_rows():
    """A ``datasets`` batch (a dict of columns) of KTO examples, as for pairs."""
    rows = kto_examples(3)
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    collate = Collator.for_preference(pad_token_id=0)
    got, want = collate(columns), collate(rows)
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
