"""TRL's SFT collator tests, run against ``Collator.for_transformers``.

Upstream: huggingface/trl ``tests/test_sft_trainer.py``, class ``TestDataCollatorForLanguageModeling``:

- at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (HEAD of the source store, 1.10.0.dev0);
  the pinned trl 1.16 has the same fields plus ``return_position_ids`` and adds
  ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx`` to padding-free batches
  (``TestTRL116`` checks those side by side with the installed collator);
- the tests of the collator's ``completion_mask``, ``assistant_masks``,
  ``max_length`` and ``truncation_mode`` at v1.6.0
  (0dac440542c2ef9b575f56534f29f6fca1febe4a) and v1.7.1
  (f279c2342c3c795256d382050cc17c928c96db61): TRL 1.8 moved them out of the
  collator into ``SFTTrainer``'s dataset preparation, so they run here against
  the values those versions' tests assert (TRL 1.16 is not installed with them).

What was swapped, and nothing else (every assertion is kept):

- ``DataCollatorForLanguageModeling(pad_token_id=..., padding_free=..., pad_to_multiple_of=...)`` ->
  ``Collator.for_transformers(pad_token_id=..., padding_free=..., pad_to_multiple_of=...)``;
- TRL <= 1.7's ``max_length=L`` (which defaulted to ``truncation_mode="keep_start"``) ->
  ``max_length=L, truncation_mode="keep_start"``;
- the static ``get_position_ids_from_packed_seq_lengths`` -> the ``position_ids`` of a
  padding-free batch of rows with those ``seq_lengths``.

Where this package deliberately differs (its safety defaults), the case stays and
asserts this package's behaviour, marked ``DIFFERENCE``:

- every field that says what is trained is applied, the ``completion_mask`` and
  ``assistant_masks`` beside ``labels`` included (TRL 1.16 ignores them in the
  collator); to train every token, drop the mask column;
- a padded row holding several documents (``seq_lengths`` of more than one) is
  refused: padded, its documents would attend to each other;
- ``max_length`` without ``truncation_mode`` is a limit: a longer example is refused;
- an unknown ``truncation_mode`` is refused when the collator is built;
- an example whose supervised tokens truncation cuts away entirely is refused
  (TRL 1.16's dataset preparation drops it).
"""

from __future__ import annotations

import pytest
import torch

from zephon_collate import Collator

trl = pytest.importorskip("trl")

TRL_PADDING_FREE = {"return_flash_attn_kwargs": True, "return_seq_idx": True}
"""The switches that give TRL 1.16's padding-free keys."""


def get_position_ids_from_packed_seq_lengths(batch_seq_lengths: list[list[int]]) -> list[torch.Tensor]:
    """The swap of TRL's static helper: each row's ``position_ids`` in a padding-free batch."""
    rows = [{"input_ids": [1] * sum(lengths), "seq_lengths": lengths} for lengths in batch_seq_lengths]
    positions = Collator.for_transformers(padding_free=True)(rows)["position_ids"][0]
    return list(positions.split([sum(lengths) for lengths in batch_seq_lengths]))


class TestDataCollatorForLanguageModeling:
    """Upstream HEAD (f2cd577)."""

    def test_basic_padding(self):
        """Test basic padding."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_without_labels(self):
        """When no labels are provided, they default to the input IDs (padding excluded)."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_provided_labels_not_reconstructed_from_masks(self):
        """Provided labels are used as is, never rebuilt from the mask columns. Here the labels match the input IDs
        (every token trainable); the masks would introduce -100 if they were consumed, so the labels staying equal to
        the input IDs proves the masks are ignored."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [
            {
                "input_ids": [1, 2, 3],
                "labels": [1, 2, 3],
                "completion_mask": [0, 0, 1],
                "assistant_masks": [0, 0, 1],
            },
            {"input_ids": [4, 5], "labels": [4, 5], "completion_mask": [0, 1], "assistant_masks": [0, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        # DIFFERENCE: the masks are applied with the labels (a token is trained where all of them agree).
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, -100, 3], [-100, 5, -100]]))
        without_masks = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        torch.testing.assert_close(collator(without_masks)["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_padding_free_mode(self):
        """Test padding-free mode where sequences are concatenated."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)
        examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3, -100, 5]]))

    def test_padding_free_without_labels(self):
        """Padding-free mode without labels: labels default to the input IDs (document starts masked)."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3, -100, 5]]))

    def test_packing(self):
        """Test that when using packing with position_ids, attention_mask is dropped with fa2."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)

        # Simulate packed sequences with position_ids that restart (typical of BFD packing)
        examples = [
            {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [3, 3], "labels": [1, 2, 3, 4, 5, 6]},
            {"input_ids": [7, 8, 9, 10, 11], "seq_lengths": [4, 1], "labels": [7, 8, 9, 10, 11]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0]]))
        torch.testing.assert_close(
            result["labels"], torch.tensor([[-100, 2, 3, -100, 5, 6, -100, 8, 9, 10, -100]])
        )

    def test_pad_to_multiple_of(self):
        """Test padding to multiple of specified value."""
        collator = Collator.for_transformers(pad_token_id=0, pad_to_multiple_of=4)
        examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]]))

    def test_pad_to_multiple_of_and_padding_free(self):
        """Test padding to multiple of specified value."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)
        examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3, -100, 5, -100, -100, -100]]))

    def test_custom_position_ids_but_no_padding_free(self):
        """Test that custom position_ids are ignored if padding_free is False."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [
            {"input_ids": [1, 2, 3], "seq_lengths": [1, 2], "labels": [1, 2, 3]},
            {"input_ids": [4, 5], "seq_lengths": [2], "labels": [4, 5]},
        ]

        # DIFFERENCE: a padded row of two documents is refused (they would attend to each other) ...
        with pytest.raises(ValueError, match=r"example 0: holds several documents .* padding_free=True"):
            collator(examples)
        # ... and a row of one document is read as upstream reads every row.
        examples[0]["seq_lengths"] = [3]
        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_single_example(self):
        """Test collator with a single example."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3, 4]]))

    def test_different_pad_token_id(self):
        """Test with different pad token ID."""
        collator = Collator.for_transformers(pad_token_id=999)
        examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 999]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_single_example_single_doc(self):
        batch_seq_lengths = [[5]]
        result = get_position_ids_from_packed_seq_lengths(batch_seq_lengths)
        assert len(result) == 1
        assert torch.equal(result[0], torch.arange(5))

    def test_single_example_multiple_docs(self):
        batch_seq_lengths = [[3, 2]]
        result = get_position_ids_from_packed_seq_lengths(batch_seq_lengths)
        assert len(result) == 1
        # First sequence: 0, 1, 2; second sequence: 0, 1
        assert torch.equal(result[0], torch.tensor([0, 1, 2, 0, 1]))

    def test_multiple_examples(self):
        batch_seq_lengths = [[2, 2], [3]]
        result = get_position_ids_from_packed_seq_lengths(batch_seq_lengths)
        assert len(result) == 2
        assert torch.equal(result[0], torch.tensor([0, 1, 0, 1]))
        assert torch.equal(result[1], torch.arange(3))


TRL116_CASES = [
    ({}, [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]),
    ({}, [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]),
    (
        {},
        [
            {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [3, 3], "labels": [1, 2, 3, 4, 5, 6]},
            {"input_ids": [7, 8, 9, 10, 11], "seq_lengths": [4, 1], "labels": [7, 8, 9, 10, 11]},
        ],
    ),
    ({"pad_to_multiple_of": 4}, [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]),
]


class TestTRL116:
    """The padding-free tests above against the installed TRL 1.16, whose batches carry 5 more keys."""

    @pytest.mark.parametrize(("options", "examples"), TRL116_CASES)
    def test_padding_free_equals_trl_1_16_key_for_key(self, options, examples):
        theirs = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
            pad_token_id=0, padding_free=True, **options
        )
        ours = Collator.for_transformers(pad_token_id=0, padding_free=True, **TRL_PADDING_FREE, **options)
        expected, result = theirs(examples), ours(examples)
        assert list(result) == list(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(result[key], value)
            else:
                assert type(result[key]) is type(value) and result[key] == value

    def test_packing_hand_worked(self):
        """TRL 1.16's packed-row batch (probe values), pads at every position 0 included."""
        examples = [
            {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [3, 3]},
            {"input_ids": [7, 8, 9, 10, 11], "seq_lengths": [4, 1]},
        ]
        result = Collator.for_transformers(pad_token_id=0, padding_free=True, **TRL_PADDING_FREE)(examples)
        assert (
            result["cu_seq_lens_q"].tolist() == [0, 3, 6, 10, 11]
            and result["cu_seq_lens_q"].dtype == torch.int32
        )
        assert result["max_length_q"] == result["max_length_k"] == 4
        assert result["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]]
        padded = Collator.for_transformers(
            pad_token_id=0, padding_free=True, pad_to_multiple_of=8, **TRL_PADDING_FREE
        )
        result = padded([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
        assert result["cu_seq_lens_k"].tolist() == [0, 3, 5, 6, 7, 8]
        assert result["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 4]]
        assert result["max_length_k"] == 3

    def test_padded_return_position_ids(self):
        theirs = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
            pad_token_id=0, return_position_ids=True
        )
        ours = Collator.for_transformers(pad_token_id=0, return_position_ids=True)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
        expected, result = theirs(examples), ours(examples)
        assert set(result) == set(expected)
        for key in expected:
            torch.testing.assert_close(result[key], expected[key])
        assert result["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]


class TestDataCollatorForLanguageModelingV16:
    """Upstream v1.6.0 (0dac440) and v1.7.1 (f279c23): the collator's masks and truncation."""

    def test_basic_padding(self):
        """Test basic padding functionality without completion masks."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_completion_mask(self):
        """Test completion mask functionality."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [4, 5], "completion_mask": [0, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3], [-100, 5, -100]]))

    def test_completion_only_loss_disabled(self):
        """Test behavior when completion_only_loss is disabled."""
        # DIFFERENCE: there is no completion_only_loss switch: a completion_mask given is applied; to train
        # every token, leave the column out (what the collator then returns is upstream's result).
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [4, 5], "completion_mask": [0, 1]},
        ]
        with pytest.raises(TypeError, match="unknown option 'completion_only_loss'"):
            Collator.for_transformers(pad_token_id=0, completion_only_loss=False)

        result = collator([{"input_ids": example["input_ids"]} for example in examples])

        # Labels should not be masked when completion_only_loss=False
        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_padding_free_mode(self):
        """Test padding-free mode where sequences are concatenated."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3, -100, 5]]))

    def test_padding_free_with_completion_mask(self):
        """Test padding-free mode with completion masks."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)
        examples = [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 0, 1]},
            {"input_ids": [4, 5], "completion_mask": [1, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, -100, 3, -100, 5]]))

    def test_packing(self):
        """Test that when using packing with position_ids, attention_mask is dropped with fa2."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True)

        # Simulate packed sequences with position_ids that restart (typical of BFD packing)
        examples = [
            {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [3, 3]},
            {"input_ids": [7, 8, 9, 10, 11], "seq_lengths": [4, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0]]))
        torch.testing.assert_close(
            result["labels"], torch.tensor([[-100, 2, 3, -100, 5, 6, -100, 8, 9, 10, -100]])
        )

    def test_pad_to_multiple_of(self):
        """Test padding to multiple of specified value."""
        collator = Collator.for_transformers(pad_token_id=0, pad_to_multiple_of=4)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]]))

    def test_pad_to_multiple_of_and_padding_free(self):
        """Test padding to multiple of specified value."""
        collator = Collator.for_transformers(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "position_ids", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0]]))
        torch.testing.assert_close(result["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3, -100, 5, -100, -100, -100]]))

    def test_assistant_masks(self):
        """Test handling of assistant masks in examples."""
        collator = Collator.for_transformers(pad_token_id=0)
        examples = [
            {"input_ids": [1, 2, 3], "assistant_masks": [0, 1, 1]},
            {"input_ids": [4, 5], "assistant_masks": [0, 1]},
        ]

        result = collator(examples)

        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 2, 3], [-100, 5, -100]]))

    def test_max_length_keep_start(self):
        """Test that sequences longer than max_length are truncated from the start."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_start")
        examples = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [6, 7, 8]]))
        # DIFFERENCE: max_length alone (TRL <= 1.7 defaulted to keep_start) is a limit, not a cut.
        with pytest.raises(
            ValueError, match="example 0: has 5 tokens, more than max_length=3; pass truncation_mode"
        ):
            Collator.for_transformers(pad_token_id=0, max_length=3)(examples)

    def test_max_length_keep_end(self):
        """Test that sequences longer than max_length are truncated from the end (keeping last tokens)."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_end")
        examples = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[3, 4, 5], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[3, 4, 5], [6, 7, 8]]))

    def test_max_length_no_truncation_needed(self):
        """Test that max_length larger than sequences does not alter the output."""
        for truncation_mode in (None, "keep_start"):
            collator = Collator.for_transformers(
                pad_token_id=0, max_length=10, truncation_mode=truncation_mode
            )
            examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]

            result = collator(examples)

            assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
            torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 0]]))
            torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
            torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [4, 5, -100]]))

    def test_max_length_with_completion_mask(self):
        """Test that truncation is applied correctly when completion masks are present."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_start")
        examples = [
            {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [6, 7, 8], "completion_mask": [0, 1, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, -100, 3], [-100, 7, 8]]))

    def test_max_length_keep_end_with_completion_mask(self):
        """Test keep_end truncation with completion masks preserves the final tokens."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_end")
        examples = [
            {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [6, 7, 8], "completion_mask": [0, 1, 1]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[3, 4, 5], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[3, 4, 5], [-100, 7, 8]]))

    def test_max_length_invalid_truncation_mode(self):
        """Test that an invalid truncation_mode raises ValueError."""
        examples = [{"input_ids": [1, 2, 3, 4, 5]}]

        # DIFFERENCE: refused when the collator is built, naming the modes.
        with pytest.raises(ValueError, match="truncation_mode must be one of"):
            collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="invalid")
            collator(examples)

    def test_max_length_keep_start_with_labels(self):
        """v1.7.1: the labels are cut with the same window."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_start")
        examples = [
            {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]},
            {"input_ids": [6, 7, 8], "labels": [6, 7, 8]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [6, 7, 8]]))

    def test_max_length_keep_end_with_labels(self):
        """v1.7.1."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_end")
        examples = [
            {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]},
            {"input_ids": [6, 7, 8], "labels": [6, 7, 8]},
        ]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[3, 4, 5], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[3, 4, 5], [6, 7, 8]]))

    def test_max_length_without_labels(self):
        """Truncation without labels: labels default to the input IDs and are truncated with the same window."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_start")
        examples = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7, 8]}]

        result = collator(examples)

        assert set(result.keys()) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 2, 3], [6, 7, 8]]))
        torch.testing.assert_close(result["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[1, 2, 3], [6, 7, 8]]))

    # -- what TRL 1.16's dataset preparation does after truncation, and the EOS choice ----------------

    def test_fully_masked_after_truncation_is_refused(self):
        """DIFFERENCE: TRL 1.16 drops such rows during preparation; a collator cannot drop an example
        without changing the batch size, so it refuses it, naming it."""
        collator = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_start")
        examples = [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [4, 5, 6, 7, 8], "completion_mask": [0, 0, 0, 1, 1]},
        ]
        with pytest.raises(ValueError, match="example 1: has no supervised token left after truncation"):
            collator(examples)
        keep_end = Collator.for_transformers(pad_token_id=0, max_length=3, truncation_mode="keep_end")
        torch.testing.assert_close(keep_end(examples)["labels"], torch.tensor([[-100, 2, 3], [-100, 7, 8]]))

    def test_keep_eos(self):
        """A cut assistant turn keeps its EOS (id 2) as its last token, trained as it was."""
        examples = [
            {"input_ids": [1, 5, 6, 7, 2], "completion_mask": [0, 1, 1, 1, 1]},
            {"input_ids": [1, 8, 2], "completion_mask": [0, 1, 1]},
        ]
        collator = Collator.for_transformers(
            pad_token_id=0, max_length=4, truncation_mode="keep_start", keep_eos=True, eos_token_id=2
        )
        result = collator(examples)
        torch.testing.assert_close(result["input_ids"], torch.tensor([[1, 5, 6, 2], [1, 8, 2, 0]]))
        torch.testing.assert_close(result["labels"], torch.tensor([[-100, 5, 6, 2], [-100, 8, 2, -100]]))
        plain = Collator.for_transformers(pad_token_id=0, max_length=4, truncation_mode="keep_start")
        torch.testing.assert_close(plain(examples)["input_ids"], torch.tensor([[1, 5, 6, 7], [1, 8, 2, 0]]))
