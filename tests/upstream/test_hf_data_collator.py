"""transformers' own collator tests, run against ``Collator.for_transformers``.

Upstream: huggingface/transformers ``tests/trainer/test_data_collator.py``.

- The refactored layout ("Tests are organized by collator type"), the newest
  version of that file in the source store (its commit is not reported there;
  it predates transformers 5.24: it still imports ``DataCollatorForWholeWordMask``).
  Run as is on the pinned transformers 5.24 (without that class), its 68 tests pass.
- The NumPy twins and integration blocks of the older 4.x layout
  (``DataCollatorIntegrationTest._test_data_collator_for_seq2seq``,
  ``DataCollatorImmutabilityTest.test_seq2seq_collator_immutability``,
  ``NumpyDataCollatorIntegrationTest.test_data_collator_with_flattening`` /
  ``test_data_collator_for_seq2seq`` / ``_test_no_pad_and_pad``), at the bottom.

What was swapped, and nothing else (every assertion is kept):

- ``DataCollatorForSeq2Seq(tokenizer, ...)`` -> ``Collator.for_transformers(tokenizer, ...)``;
- ``DataCollatorWithFlattening(...)`` -> ``Collator.for_transformers(padding_free=True, ...)``;
- ``DataCollatorForLanguageModeling(tokenizer, mlm=False, ...)`` -> ``Collator.for_transformers(tokenizer, ...)``.

Where this package deliberately differs (its safety defaults), the case stays
and asserts this package's behaviour, marked ``DIFFERENCE``:

- labels that are neither -100 nor the token at their place (upstream's
  ``labels=[10, 11, 12]`` for ``input_ids=[1, 2, 3]``) are refused: a causal LM
  shifts labels itself, so such labels are shifted already or another sequence;
- examples without labels get labels made from their tokens (``DataCollatorForSeq2Seq``
  returns ``labels: None``, so a causal LM would compute no loss);
- a token equal to the pad id is trained like any other (``DataCollatorForLanguageModeling``
  sets its label to -100): padding is found by length, not by value;
- a tokenizer without a pad token is refused when the collator is built, not on
  the first batch that needs padding;
- left-padded, each row's first token is not trained (label -100): the model's shift
  would predict it from the padding place before it;
- ``return_tensors`` is an option of the collator, not of each call.

Not adapted: the masked-LM, whole-word, permutation, NSP/SOP, token-classification,
``DataCollatorWithPadding`` and ``default_data_collator`` classes (other tasks than a
causal LM's). The options upstream never tests (left padding, ``position_ids_start``,
``separator_id``, empty examples) are tested here against the values transformers 5.24
returns, and side by side in ``tests/test_hf_peers.py``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import unittest

import numpy as np
import pytest
import torch

from zephon_collate import Collator

transformers = pytest.importorskip("transformers")
BertTokenizer = transformers.BertTokenizer
PaddingStrategy = transformers.utils.PaddingStrategy


class DataCollatorTestMixin:
    """Mixin providing common setup and utility methods for data collator tests."""

    def setUp(self):
        self.tmpdirname = tempfile.mkdtemp()
        vocab_tokens = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
        self.vocab_file = os.path.join(self.tmpdirname, "vocab.txt")
        with open(self.vocab_file, "w", encoding="utf-8") as vocab_writer:
            vocab_writer.write("".join([x + "\n" for x in vocab_tokens]))

    def tearDown(self):
        shutil.rmtree(self.tmpdirname)

    def _check_immutability(self, collator, features):
        """Verify that collator does not mutate input data."""
        original = copy.deepcopy(features)
        collator(features)

        for orig, feat in zip(original, features, strict=True):
            for key in orig:
                orig_val, feat_val = orig[key], feat[key]
                if isinstance(orig_val, (np.ndarray, torch.Tensor)):
                    self.assertEqual(orig_val.tolist(), feat_val.tolist())
                else:
                    self.assertEqual(orig_val, feat_val)


# =============================================================================
# DataCollatorWithFlattening tests
# =============================================================================


class TestDataCollatorWithFlattening(DataCollatorTestMixin, unittest.TestCase):
    """Upstream: tests for DataCollatorWithFlattening."""

    def _get_features(self):
        return [
            {"input_ids": [10, 11, 12]},
            {"input_ids": [20, 21, 22, 23, 24, 25]},
            {"input_ids": [30, 31, 32, 33, 34, 35, 36]},
        ]

    def test_basic_flattening(self):
        """Test that sequences are concatenated with per-sequence position_ids."""
        collator = Collator.for_transformers(padding_free=True, return_tensors="pt")
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, torch.Size([1, 16]))
        self.assertEqual(
            batch["input_ids"][0].tolist(),
            [10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36],
        )
        self.assertEqual(batch["position_ids"][0].tolist(), [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6])

        # Should not include attention_mask or flash attn kwargs by default
        for key in ["attention_mask", "cu_seq_lens_k", "cu_seq_lens_q", "seq_idx"]:
            self.assertNotIn(key, batch)

    def test_flash_attn_kwargs(self):
        """Test flattening with Flash Attention kwargs."""
        collator = Collator.for_transformers(
            padding_free=True, return_tensors="pt", return_flash_attn_kwargs=True
        )
        batch = collator(self._get_features())

        self.assertEqual(batch["cu_seq_lens_k"].tolist(), [0, 3, 9, 16])
        self.assertEqual(batch["cu_seq_lens_q"].tolist(), [0, 3, 9, 16])
        self.assertEqual(batch["max_length_k"], 7)
        self.assertEqual(batch["max_length_q"], 7)

    def test_seq_idx(self):
        """Test flattening with seq_idx for sequence identification."""
        collator = Collator.for_transformers(padding_free=True, return_tensors="pt", return_seq_idx=True)
        batch = collator(self._get_features())

        self.assertEqual(batch["seq_idx"][0].tolist(), [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2])

    def test_with_labels(self):
        """Test flattening with tensor and list labels."""
        # Tensor labels
        features = [
            {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([10, 11, 12])},
            {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([13, 14])},
        ]
        collator = Collator.for_transformers(padding_free=True, return_tensors="pt")
        # DIFFERENCE: labels that are not the tokens (shifted already, or another sequence) are refused.
        with pytest.raises(ValueError, match=r"example 0: labels\[0\] is 10, neither -100 nor the token"):
            collator(features)
        features = [
            {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])},
            {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([-100, 5])},
        ]
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, (1, 5))
        self.assertEqual(batch["labels"].shape, (1, 5))
        self.assertEqual(batch["labels"].tolist(), [[-100, 2, 3, -100, 5]])

        # List labels
        features = [
            {"input_ids": [1, 2, 3], "labels": [10, 11, 12]},
            {"input_ids": [4, 5], "labels": [13, 14]},
        ]
        with pytest.raises(ValueError, match="neither -100 nor the token"):  # DIFFERENCE, as above
            collator(features)
        batch = collator(
            [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
        )
        self.assertEqual(batch["labels"].shape, (1, 5))

    def test_numpy_output(self):
        """Test flattening with NumPy output."""
        collator = Collator.for_transformers(padding_free=True, return_tensors="np")
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, (1, 16))
        self.assertEqual(batch["position_ids"].shape, (1, 16))

    def test_numpy_flash_attn_kwargs(self):
        """Test flattening with Flash Attention kwargs and NumPy output."""
        collator = Collator.for_transformers(
            padding_free=True, return_tensors="np", return_flash_attn_kwargs=True
        )
        batch = collator(self._get_features())

        self.assertEqual(batch["cu_seq_lens_k"].tolist(), [0, 3, 9, 16])
        self.assertEqual(batch["max_length_k"], 7)

    def test_immutability(self):
        """Test that flattening does not mutate input data."""
        for return_tensors in ["pt", "np"]:
            collator = Collator.for_transformers(padding_free=True, return_tensors=return_tensors)
            self._check_immutability(collator, self._get_features())

    # -- options upstream does not test: the values transformers 5.24 returns -------------------

    def test_switches_separator_and_position_start(self):
        features = [{"input_ids": [10, 11, 12]}, {"input_ids": [20, 21, 22, 23]}, {"input_ids": [30, 31]}]
        with self.assertRaisesRegex(ValueError, "separates its documents"):  # documented: nothing would
            Collator.for_transformers(padding_free=True, return_position_ids=False)
        off = Collator.for_transformers(
            padding_free=True, return_position_ids=False, return_flash_attn_kwargs=True
        )(features)
        keys = ["cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "labels", "max_length_k", "max_length_q"]
        self.assertEqual(sorted(off), keys)
        labels = Collator.for_transformers(padding_free=True, separator_id=-1)(features)["labels"]
        self.assertEqual(labels.tolist(), [[-1, 11, 12, -1, 21, 22, 23, -1, 31]])
        start = Collator.for_transformers(padding_free=True, position_ids_start=2)(features)
        self.assertEqual(start["position_ids"].tolist(), [[2, 3, 4, 2, 3, 4, 5, 2, 3]])
        self.assertEqual(start["labels"].tolist(), [[-100, 11, 12, -100, 21, 22, 23, -100, 31]])

    def test_empty_examples_are_dropped_and_all_empty_is_refused(self):
        collator = Collator.for_transformers(
            padding_free=True, return_flash_attn_kwargs=True, return_seq_idx=True
        )
        batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4, 5]}])
        self.assertEqual(batch["input_ids"].tolist(), [[1, 2, 3, 4, 5]])
        self.assertEqual(batch["seq_idx"].tolist(), [[0, 0, 0, 1, 1]])
        self.assertEqual(batch["cu_seq_lens_q"].tolist(), [0, 3, 5])
        self.assertEqual(batch["max_length_q"], 3)
        single = collator([{"input_ids": [5]}, {"input_ids": [6, 7]}])
        self.assertEqual(single["labels"].tolist(), [[-100, -100, 7]])
        self.assertEqual(single["position_ids"].tolist(), [[0, 0, 1]])
        self.assertEqual(single["cu_seq_lens_k"].tolist(), [0, 1, 3])
        with self.assertRaises(ValueError):
            collator([{"input_ids": []}, {"input_ids": []}])

    def test_labels_in_some_examples_only(self):
        """DIFFERENCE: upstream decides from the first example (a KeyError when a later one lacks labels,
        labels of later examples ignored when the first has none); here each example is read on its own."""
        collator = Collator.for_transformers(padding_free=True)
        first_only = collator([{"input_ids": [1, 2, 3], "labels": [1, -100, 3]}, {"input_ids": [4, 5]}])
        self.assertEqual(first_only["labels"].tolist(), [[-100, -100, 3, -100, 5]])
        second_only = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [4, 5, -100]}])
        self.assertEqual(second_only["labels"].tolist(), [[-100, 2, 3, -100, 5, -100]])


# =============================================================================
# DataCollatorForSeq2Seq tests
# =============================================================================


class TestDataCollatorForSeq2Seq(DataCollatorTestMixin, unittest.TestCase):
    """Upstream: tests for DataCollatorForSeq2Seq."""

    def _get_features(self):
        return [
            {"input_ids": list(range(3)), "labels": list(range(3))},
            {"input_ids": list(range(6)), "labels": list(range(6))},
        ]

    def test_padding(self):
        """Test basic padding behavior."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST)
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["input_ids"][0].tolist(), [0, 1, 2] + [tokenizer.pad_token_id] * 3)
        self.assertEqual(batch["labels"][0].tolist(), [0, 1, 2, -100, -100, -100])

    def test_with_tensor_inputs(self):
        """Test with PyTorch tensor inputs."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [
            {"input_ids": torch.tensor(list(range(3))), "labels": torch.tensor(list(range(3)))},
            {"input_ids": torch.tensor(list(range(6))), "labels": torch.tensor(list(range(6)))},
        ]

        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST)
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 6]))

    def test_max_length_padding(self):
        """Test padding to max_length."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.MAX_LENGTH, max_length=10)
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 10]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 10]))

    def test_pad_to_multiple_of(self):
        """Test padding to multiple of 8."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST, pad_to_multiple_of=8)
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 8]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 8]))

    def test_custom_label_pad_token(self):
        """Test custom label padding token."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, label_pad_token_id=-1
        )
        batch = collator(self._get_features())

        self.assertEqual(batch["labels"][0].tolist(), [0, 1, 2, -1, -1, -1])

    def test_do_not_pad(self):
        """Test DO_NOT_PAD raises on unequal lengths, works on equal."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.DO_NOT_PAD)

        # Unequal lengths should raise
        with self.assertRaises(ValueError):
            collator(self._get_features())

        # Equal lengths should work
        features = [{"input_ids": list(range(3)), "labels": list(range(3))}] * 2
        batch = collator(features)
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)))

    def test_without_labels(self):
        """Test collator works without labels."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(3))}, {"input_ids": list(range(6))}]

        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST)
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        # Labels should either not be present or be None
        # DIFFERENCE: labels are made from the tokens (what a causal LM trains on), -100 on the padding.
        self.assertEqual(batch["labels"].tolist(), [[0, 1, 2, -100, -100, -100], list(range(6))])

    def test_numpy_output(self):
        """Test with NumPy output."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST, return_tensors="np")
        batch = collator(self._get_features())

        self.assertEqual(batch["input_ids"].shape, (2, 6))
        self.assertEqual(batch["labels"].shape, (2, 6))

    def test_immutability(self):
        """Test that collation does not mutate input data."""
        tokenizer = BertTokenizer(self.vocab_file)

        for return_tensors in ["pt", "np"]:
            collator = Collator.for_transformers(
                tokenizer, padding=PaddingStrategy.LONGEST, return_tensors=return_tensors
            )
            self._check_immutability(collator, self._get_features())

    # -- options upstream does not test: the values transformers 5.24 returns -------------------

    def test_left_padding_tokenizer(self):
        tokenizer = BertTokenizer(self.vocab_file, padding_side="left")
        features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12]}]
        batch = Collator.for_transformers(tokenizer)(features)
        self.assertEqual(batch["input_ids"].tolist(), [[3, 3, 5, 6, 7], [8, 9, 10, 11, 12]])
        self.assertEqual(batch["attention_mask"].tolist(), [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        # DIFFERENCE: each row's first token untrained (transformers 5.24 keeps 8 at [1, 0]).
        self.assertEqual(batch["labels"].tolist(), [[-100, -100, -100, 6, 7], [-100, 9, 10, 11, 12]])

    def test_max_length_padding_with_pad_to_multiple_of(self):
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(
            tokenizer, padding="max_length", max_length=6, pad_to_multiple_of=4
        )
        batch = collator(self._get_features())
        self.assertEqual(batch["input_ids"].shape, (2, 8))
        self.assertEqual(batch["labels"][1].tolist(), [0, 1, 2, 3, 4, 5, -100, -100])

    def test_max_length_shorter_than_an_example(self):
        """Upstream's tokenizer cannot pad a longer example to max_length and fails building the tensor;
        here the error names the example and the fix (truncation_mode)."""
        tokenizer = BertTokenizer(self.vocab_file)
        collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.MAX_LENGTH, max_length=4)
        with pytest.raises(
            ValueError, match="example 1: has 6 tokens, more than max_length=4; pass truncation"
        ):
            collator(self._get_features())

    def test_encoder_decoder_targets_are_refused(self):
        """DIFFERENCE: DataCollatorForSeq2Seq(model=t5) makes decoder_input_ids from labels of their own
        length; this collator is for causal LMs and says so."""
        tokenizer = BertTokenizer(self.vocab_file)
        config = transformers.T5Config(
            vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
            pad_token_id=3, decoder_start_token_id=3,
        )  # fmt: skip
        t5 = transformers.T5ForConditionalGeneration(config)
        with pytest.raises(
            ValueError, match=r"encoder-decoder model.*for causal LMs.*DataCollatorForSeq2Seq"
        ):
            Collator.for_transformers(tokenizer, model=t5)
        gpt2 = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=2)
        )
        # a causal LM changes nothing, as upstream
        collator = Collator.for_transformers(tokenizer, model=gpt2)
        self.assertEqual(collator(self._get_features())["labels"].shape, (2, 6))
        collator = Collator.for_transformers(tokenizer)
        with pytest.raises(ValueError, match="labels of their own length: an encoder-decoder target"):
            collator([{"input_ids": [0, 1, 2], "labels": [1, 2]}])
        with pytest.raises(ValueError, match=r"'decoder_input_ids' .* for causal LMs"):
            collator([{"input_ids": [0, 1, 2], "labels": [0, 1, 2], "decoder_input_ids": [3, 0, 1]}])
        with pytest.raises(
            ValueError, match=r"an encoder-decoder target needs transformers\.DataCollatorForSeq2Seq"
        ):
            collator([{"input_ids": [0, 1, 2], "labels": [4, 0, 1]}])


# =============================================================================
# DataCollatorForLanguageModeling tests (mlm=False, the causal-LM mode)
# =============================================================================


class TestDataCollatorForLanguageModeling(DataCollatorTestMixin, unittest.TestCase):
    """Upstream: tests for DataCollatorForLanguageModeling, its CLM half."""

    def test_clm_mode(self):
        """Test CLM mode (no masking)."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(10))}, {"input_ids": list(range(10))}]

        collator = Collator.for_transformers(tokenizer)
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 10]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 10]))
        # DIFFERENCE: token 3 is the pad id; upstream labels it -100, here it is trained like any token.
        self.assertEqual(batch["labels"].tolist(), [list(range(10))] * 2)

    def test_clm_with_padding(self):
        """Test CLM mode with different length sequences."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(5))}, {"input_ids": list(range(10))}]

        collator = Collator.for_transformers(tokenizer)
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 10]))

    def test_clm_pad_to_multiple_of(self):
        """Test CLM with pad_to_multiple_of."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(10))}, {"input_ids": list(range(10))}]

        collator = Collator.for_transformers(tokenizer, pad_to_multiple_of=8)
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 16]))

    def test_with_raw_list_features(self):
        """Test LM collator with raw list features (not dicts)."""
        tokenizer = BertTokenizer(self.vocab_file)

        # CLM with raw lists
        collator = Collator.for_transformers(tokenizer)
        features = [list(range(10)), list(range(10))]
        batch = collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 10]))

        # CLM with raw lists requiring padding
        features = [list(range(5)), list(range(10))]
        batch = collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 10]))

    def test_missing_pad_token_error(self):
        """Test error when pad token is missing and padding is needed."""
        tokenizer = BertTokenizer(self.vocab_file)
        tokenizer.pad_token = None
        features = [{"input_ids": list(range(5))}, {"input_ids": list(range(10))}]

        # DIFFERENCE: refused when the collator is built (it names the fix), not at the first ragged batch.
        with self.assertRaises(ValueError):
            collator = Collator.for_transformers(tokenizer)
            collator(features)

    def test_numpy_output(self):
        """Test with NumPy output."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(10))}, {"input_ids": list(range(10))}]

        collator = Collator.for_transformers(tokenizer, return_tensors="np")
        batch = collator(features)

        self.assertEqual(batch["input_ids"].shape, (2, 10))
        self.assertEqual(batch["labels"].shape, (2, 10))

    def test_immutability(self):
        """Test that collation does not mutate input data."""
        tokenizer = BertTokenizer(self.vocab_file)
        features = [{"input_ids": list(range(10))}, {"input_ids": list(range(10))}]

        for return_tensors in ["pt", "np"]:
            collator = Collator.for_transformers(tokenizer, return_tensors=return_tensors)
            self._check_immutability(collator, copy.deepcopy(features))


# =============================================================================
# The 4.x layout: torch integration, immutability and the NumPy twins
# =============================================================================


class DataCollatorIntegrationTest(DataCollatorTestMixin, unittest.TestCase):
    """Upstream (4.x): ``_test_data_collator_for_seq2seq`` with lists and with torch tensors."""

    def _test_data_collator_for_seq2seq(self, to_torch):
        def create_features(to_torch):
            if to_torch:
                features = [
                    {"input_ids": torch.tensor(list(range(3))), "labels": torch.tensor(list(range(3)))},
                    {"input_ids": torch.tensor(list(range(6))), "labels": torch.tensor(list(range(6)))},
                ]
            else:
                features = [
                    {"input_ids": list(range(3)), "labels": list(range(3))},
                    {"input_ids": list(range(6)), "labels": list(range(6))},
                ]
            return features

        tokenizer = BertTokenizer(self.vocab_file)
        features = create_features(to_torch)

        data_collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST)
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-100] * 3)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)))

        data_collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.MAX_LENGTH, max_length=7)
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 7]))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 4)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)) + [tokenizer.pad_token_id] * 1)
        self.assertEqual(batch["labels"].shape, torch.Size([2, 7]))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-100] * 4)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)) + [-100] * 1)

        data_collator = Collator.for_transformers(tokenizer, padding=PaddingStrategy.DO_NOT_PAD)
        with self.assertRaises(ValueError):
            # expects an error due to unequal shapes to create tensor
            data_collator(features)
        batch = data_collator([features[0], features[0]])
        input_ids = features[0]["input_ids"] if not to_torch else features[0]["input_ids"].tolist()
        labels = features[0]["labels"] if not to_torch else features[0]["labels"].tolist()
        self.assertEqual(batch["input_ids"][0].tolist(), input_ids)
        self.assertEqual(batch["input_ids"][1].tolist(), input_ids)
        self.assertEqual(batch["labels"][0].tolist(), labels)
        self.assertEqual(batch["labels"][1].tolist(), labels)

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, pad_to_multiple_of=8
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 8]))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 8]))

        # side effects on labels cause mismatch on longest strategy
        features = create_features(to_torch)

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, label_pad_token_id=-1
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)))
        self.assertEqual(batch["labels"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-1] * 3)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)))

        for feature in features:
            feature.pop("labels")

        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, torch.Size([2, 6]))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)
        return batch

    # -- below: each test also checks the last batch its upstream helper collated ------------------------

    def test_data_collator_for_seq2seq_with_lists(self):
        batch = self._test_data_collator_for_seq2seq(to_torch=False)
        self.assertEqual(
            batch["labels"].tolist(), [[0, 1, 2, -1, -1, -1], list(range(6))]
        )  # made from tokens

    def test_data_collator_for_seq2seq_with_pt(self):
        batch = self._test_data_collator_for_seq2seq(to_torch=True)
        self.assertEqual(batch["labels"].tolist(), [[0, 1, 2, -1, -1, -1], list(range(6))])


class DataCollatorImmutabilityTest(DataCollatorTestMixin, unittest.TestCase):
    """Upstream (4.x): ``test_seq2seq_collator_immutability`` (torch) and its NumPy twin."""

    def _validate_original_data_against_collated_data_on_specified_keys_and_datatypes(
        self, collator, base_data, input_key, input_datatype, label_key, label_datatype, ignore_label=False
    ):
        # Upstream's helper (not in the stored excerpt), written out: build the features of the datatypes,
        # collate a deep copy's original, and check the features are unchanged.
        features = [
            {
                input_key: input_datatype(item[input_key]),
                **({} if ignore_label else {label_key: label_datatype(item[label_key])}),
            }
            for item in base_data
        ]
        original = copy.deepcopy(features)
        collator(features)
        for orig, feat in zip(original, features, strict=True):
            for key in orig:
                as_list = (
                    (lambda v: v.tolist()) if isinstance(orig[key], (torch.Tensor, np.ndarray)) else list
                )
                self.assertEqual(as_list(orig[key]), as_list(feat[key]))

    def _collators(self, return_tensors):
        tokenizer = BertTokenizer(self.vocab_file)
        options = {"return_tensors": return_tensors}
        return [
            Collator.for_transformers(tokenizer, padding=PaddingStrategy.LONGEST, **options),
            Collator.for_transformers(tokenizer, padding=PaddingStrategy.MAX_LENGTH, max_length=7, **options),
            Collator.for_transformers(
                tokenizer, padding=PaddingStrategy.LONGEST, pad_to_multiple_of=8, **options
            ),
            Collator.for_transformers(
                tokenizer, padding=PaddingStrategy.LONGEST, label_pad_token_id=-1, **options
            ),
        ], Collator.for_transformers(tokenizer, padding=PaddingStrategy.DO_NOT_PAD, **options)

    def _test_seq2seq_collator_immutability(self, return_tensors, datatypes):
        features_base = [
            {"input_ids": list(range(3)), "labels": list(range(3))},
            {"input_ids": list(range(6)), "labels": list(range(6))},
        ]
        seq2seq_collators, seq2seq_no_padding_collator = self._collators(return_tensors)

        for datatype_input, datatype_label in datatypes:
            for collator in seq2seq_collators:
                self._validate_original_data_against_collated_data_on_specified_keys_and_datatypes(
                    collator=collator,
                    base_data=features_base,
                    input_key="input_ids",
                    input_datatype=datatype_input,
                    label_key="labels",
                    label_datatype=datatype_label,
                )

        self._validate_original_data_against_collated_data_on_specified_keys_and_datatypes(
            collator=seq2seq_collators[-1],
            base_data=features_base,
            input_key="input_ids",
            input_datatype=datatype_input,
            label_key="labels",
            label_datatype=datatype_label,
            ignore_label=True,
        )

        features_base_no_pad = [
            {"input_ids": list(range(3)), "labels": list(range(3))},
            {"input_ids": list(range(3)), "labels": list(range(3))},
        ]
        for datatype_input, datatype_label in datatypes:
            self._validate_original_data_against_collated_data_on_specified_keys_and_datatypes(
                collator=seq2seq_no_padding_collator,
                base_data=features_base_no_pad,
                input_key="input_ids",
                input_datatype=datatype_input,
                label_key="labels",
                label_datatype=datatype_label,
            )
        return features_base

    def test_seq2seq_collator_immutability(self):
        base = self._test_seq2seq_collator_immutability("pt", [(list, list), (torch.tensor, torch.tensor)])
        self.assertEqual(base[1], {"input_ids": list(range(6)), "labels": list(range(6))})  # still as built

    def test_numpy_seq2seq_collator_immutability(self):
        base = self._test_seq2seq_collator_immutability("np", [(list, list)])
        self.assertEqual(base[1], {"input_ids": list(range(6)), "labels": list(range(6))})


class NumpyDataCollatorIntegrationTest(DataCollatorTestMixin, unittest.TestCase):
    """Upstream (4.x): the NumPy integration tests of the causal-LM collators."""

    def test_data_collator_with_flattening(self):
        features = [
            {"input_ids": [10, 11, 12]},
            {"input_ids": [20, 21, 22, 23, 24, 25]},
            {"input_ids": [30, 31, 32, 33, 34, 35, 36]},
        ]

        data_collator = Collator.for_transformers(padding_free=True, return_tensors="np")
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (1, 16))
        self.assertEqual(
            batch["input_ids"][0].tolist(), [10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36]
        )
        self.assertNotIn("attention_mask", batch)
        self.assertIn("position_ids", batch)
        self.assertEqual(batch["position_ids"].shape, (1, 16))
        self.assertEqual(batch["position_ids"][0].tolist(), [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6])

    def test_data_collator_for_seq2seq(self):
        def create_features():
            return [
                {"input_ids": list(range(3)), "labels": list(range(3))},
                {"input_ids": list(range(6)), "labels": list(range(6))},
            ]

        tokenizer = BertTokenizer(self.vocab_file)
        features = create_features()

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, return_tensors="np"
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (2, 6))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)))
        self.assertEqual(batch["labels"].shape, (2, 6))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-100] * 3)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)))

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.MAX_LENGTH, max_length=7, return_tensors="np"
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (2, 7))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 4)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)) + [tokenizer.pad_token_id] * 1)
        self.assertEqual(batch["labels"].shape, (2, 7))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-100] * 4)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)) + [-100] * 1)

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.DO_NOT_PAD, return_tensors="np"
        )
        # numpy doesn't have issues handling unequal shapes via `dtype=object`
        # (upstream's comment; transformers 5.24 raises ValueError for ragged features, and so does this collator)
        with self.assertRaises(ValueError):
            data_collator(features)
        batch = data_collator([features[0], features[0]])
        self.assertEqual(batch["input_ids"][0].tolist(), features[0]["input_ids"])
        self.assertEqual(batch["input_ids"][1].tolist(), features[0]["input_ids"])
        self.assertEqual(batch["labels"][0].tolist(), features[0]["labels"])
        self.assertEqual(batch["labels"][1].tolist(), features[0]["labels"])

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, pad_to_multiple_of=8, return_tensors="np"
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (2, 8))
        self.assertEqual(batch["labels"].shape, (2, 8))

        # side effects on labels cause mismatch on longest strategy
        features = create_features()

        data_collator = Collator.for_transformers(
            tokenizer, padding=PaddingStrategy.LONGEST, label_pad_token_id=-1, return_tensors="np"
        )
        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (2, 6))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)
        self.assertEqual(batch["input_ids"][1].tolist(), list(range(6)))
        self.assertEqual(batch["labels"].shape, (2, 6))
        self.assertEqual(batch["labels"][0].tolist(), list(range(3)) + [-1] * 3)
        self.assertEqual(batch["labels"][1].tolist(), list(range(6)))

        for feature in features:
            feature.pop("labels")

        batch = data_collator(features)
        self.assertEqual(batch["input_ids"].shape, (2, 6))
        self.assertEqual(batch["input_ids"][0].tolist(), list(range(3)) + [tokenizer.pad_token_id] * 3)

    def _test_no_pad_and_pad(self, no_pad_features, pad_features):
        tokenizer = BertTokenizer(self.vocab_file)
        data_collator = Collator.for_transformers(tokenizer, return_tensors="np")
        batch = data_collator(no_pad_features)
        self.assertEqual(batch["input_ids"].shape, (2, 10))
        self.assertEqual(batch["labels"].shape, (2, 10))

        # DIFFERENCE: return_tensors is the collator's option, not each call's.
        with pytest.raises(TypeError):
            data_collator(pad_features, return_tensors="np")
        batch = data_collator(pad_features)
        self.assertEqual(batch["input_ids"].shape, (2, 10))
        self.assertEqual(batch["labels"].shape, (2, 10))

        data_collator = Collator.for_transformers(tokenizer, pad_to_multiple_of=8, return_tensors="np")
        batch = data_collator(no_pad_features)
        self.assertEqual(batch["input_ids"].shape, (2, 16))
        self.assertEqual(batch["labels"].shape, (2, 16))

        batch = data_collator(pad_features)
        self.assertEqual(batch["input_ids"].shape, (2, 16))
        self.assertEqual(batch["labels"].shape, (2, 16))

        tokenizer.pad_token = None
        with self.assertRaises(ValueError):
            # Expect error due to padding token missing (DIFFERENCE: when the collator is built)
            data_collator = Collator.for_transformers(tokenizer, return_tensors="np")
            data_collator(pad_features)
        return batch

    def test_data_collator_for_language_modeling(self):
        no_pad_features = [{"input_ids": list(range(10))}, {"input_ids": list(range(10))}]
        pad_features = [{"input_ids": list(range(5))}, {"input_ids": list(range(10))}]
        batch = self._test_no_pad_and_pad(no_pad_features, pad_features)  # padded to a multiple of 8
        self.assertEqual(batch["labels"][0].tolist(), list(range(5)) + [-100] * 11)

        no_pad_features = [list(range(10)), list(range(10))]
        pad_features = [list(range(5)), list(range(10))]
        self._test_no_pad_and_pad(no_pad_features, pad_features)
