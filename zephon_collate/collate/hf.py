"""TransformersCollator: Hugging Face examples in, the batch a ``transformers`` causal LM takes out.

A ``transformers`` causal LM shifts its labels inside ``forward``, so it takes
*unshifted* labels: a copy of ``input_ids`` with -100 wherever no loss is taken.
This collator reads the examples Hugging Face datasets hand over and writes one
of two layouts:

- **padded** (``padding_free=False``): ``input_ids``, ``attention_mask`` and
  ``labels``, ``[B, L]`` int64, ``L`` the longest example rounded up to
  ``pad_to_multiple_of``: what ``DataCollatorForSeq2Seq(tokenizer,
  label_pad_token_id=-100)`` returns for a right-padding tokenizer.
- **padding-free** (``padding_free=True``): the examples one after the other in
  a single row: ``input_ids``, ``labels``, ``position_ids`` ``[1, N]`` int64,
  ``cu_seq_lens_q``/``cu_seq_lens_k`` ``[B + 1]`` int32, ``max_length_q``/
  ``max_length_k`` Python ints and ``seq_idx`` ``[1, N]`` int32: what
  ``DataCollatorWithFlattening(return_position_ids=True,
  return_flash_attn_kwargs=True, return_seq_idx=True)`` returns.

An example is a dict with ``input_ids`` and, optionally, fields that say what
is supervised; every one given is applied (a token is supervised where all agree):

- ``labels``: -100 for unsupervised tokens, else the token at that place.
- ``attention_mask``: 1 on the tokens, then 0 on trailing (right) padding,
  which is dropped before the batch is built.
- ``loss_mask``, ``assistant_masks`` (as ``apply_chat_template(...,
  return_assistant_tokens_mask=True)`` names it): 1 where the token is trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate.checks import check_bool
from zephon_collate.collate.padding import RowPadding
from zephon_collate.functional.segments import cu_seqlens_flat, segment_ids_from_positions, segment_starts
from zephon_collate.keys import (
    ASSISTANT_MASKS,
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    SEQ_IDX,
)
from zephon_collate.read import Kind, as_numpy, to_row
from zephon_collate.records import SampleRecord
from zephon_collate.text import shown, shown_fields

__all__ = ["TransformersCollator"]

OWNER = "Collator.for_transformers"
READ_FIELDS = (INPUT_IDS, ATTENTION_MASK, LABELS, LOSS_MASK, ASSISTANT_MASKS, POSITION_IDS)
"""The example fields this collator reads; any other field is not looked at."""

Example = tuple[np.ndarray, np.ndarray]
"""One read example: its real tokens and their unshifted labels (-100 where not trained), int64."""


def as_examples(features: object) -> list[Mapping[str, Any]]:
    """Per-example dicts from a list of them, or from a batched dict of lists (``dataset[:8]``)."""
    if isinstance(features, Mapping):
        if INPUT_IDS not in features:
            raise ValueError(
                f"{OWNER}: the batch has no 'input_ids' (its fields: {shown_fields(features)}); "
                "tokenize the examples first"
            )
        ids = features[INPUT_IDS]
        if not hasattr(ids, "__len__") or isinstance(ids, (str, bytes)):
            raise TypeError(f"{OWNER}: 'input_ids' must be a list of token rows, got {type(ids).__name__}")
        if len(ids) and getattr(ids[0], "ndim", 0 if isinstance(ids[0], (int, np.integer)) else 1) == 0:
            raise ValueError(
                f"{OWNER}: got one example (a dict whose 'input_ids' is a row of ints), not a batch; "
                "pass a list of examples ([example]) or a batched dict of lists"
            )
        count = len(ids)
        fields = [name for name in READ_FIELDS if name in features]
        for name in fields:
            if not hasattr(features[name], "__len__") or len(features[name]) != count:
                raise ValueError(
                    f"{OWNER}: the batched field {shown(name)} does not hold one entry per example "
                    f"('input_ids' holds {count}); give every field as a list with one row per example"
                )
        return [{name: features[name][index] for name in fields} for index in range(count)]
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise TypeError(
            f"{OWNER}: expected a list of example dicts or a batched dict of lists, got "
            f"{type(features).__name__}"
        )
    return list(features)


def _field(example: Mapping[str, Any], name: str, where: str, kind: Kind, length: int) -> np.ndarray:
    """``example[name]`` as a 1-D array of ``length`` entries."""
    values = as_numpy(to_row(example[name], where, name, kind))
    if values.shape != (length,):
        raise ValueError(
            f"{where}: field {shown(name)} has shape {values.shape}, but 'input_ids' has {length} tokens; "
            "give one value per token"
        )
    return values


def _zero_one(values: np.ndarray, where: str, name: str, meaning: str) -> np.ndarray:
    """``values != 0``, after checking that ``values`` holds only 0 and 1."""
    if not ((values == 0) | (values == 1)).all():
        raise ValueError(f"{where}: field {shown(name)} must hold only 0 and 1 ({meaning})")
    return values != 0


def read_example(example: object, where: str) -> Example:
    """Check one example and return its real tokens and unshifted labels; see the module doc.

    Raises:
        TypeError: if the example is not a dict, or a field is not a row of numbers.
        ValueError: for a missing ``input_ids``, a field whose length differs from it,
            negative ids, masks other than 0/1, an ``attention_mask`` that is not 1s then 0s,
            a label that is neither -100 nor its token, or ``position_ids`` (pre-packed rows).
    """
    if isinstance(example, SampleRecord):
        raise TypeError(
            f"{where}: is a SampleRecord; this collator takes Hugging Face example dicts: pass the "
            "payloads, or collate records (pack_flat's rows) with Collator(...)"
        )
    if not isinstance(example, Mapping):
        raise TypeError(
            f"{where}: must be a dict of fields such as 'input_ids', got {type(example).__name__}"
        )
    if INPUT_IDS not in example:
        raise ValueError(
            f"{where}: has no 'input_ids' (its fields: {shown_fields(example)}); tokenize the examples first"
        )
    if POSITION_IDS in example:
        raise ValueError(
            f"{where}: carries 'position_ids', i.e. several documents packed into one row; this collator "
            "takes one document per example: pass the documents unpacked (padding_free=True puts them in "
            "one row itself), or use Collator with segment-restarting 'positions'"
        )
    tokens = as_numpy(to_row(example[INPUT_IDS], where, INPUT_IDS, "ids"))
    if tokens.ndim != 1:
        raise ValueError(f"{where}: 'input_ids' must be one row of token ids, got shape {tokens.shape}")
    tokens = tokens.astype(np.int64, copy=False)
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"{where}: token ids must be >= 0, found {int(tokens.min())} in 'input_ids'")
    length = tokens.shape[0]
    real = length
    if ATTENTION_MASK in example:
        attended = _zero_one(
            _field(example, ATTENTION_MASK, where, "values", length), where, ATTENTION_MASK, "1 on tokens"
        )
        real = int(attended.sum())
        if not attended[:real].all():
            raise ValueError(
                f"{where}: 'attention_mask' must be 1 on the tokens then 0 on trailing padding; it has a 0 "
                "before a 1 (left padding, or a hole); pad on the right (tokenizer.padding_side = 'right')"
            )
    supervised = np.ones(length, dtype=bool)
    if LABELS in example:
        labels = _field(example, LABELS, where, "ids", length)
        trained = labels != IGNORE_INDEX
        wrong = np.flatnonzero((trained & (labels != tokens))[:real])  # padding is dropped, unread
        if wrong.size:
            t = int(wrong[0])
            raise ValueError(
                f"{where}: labels[{t}] is {int(labels[t])}, neither -100 nor the token there "
                f"(input_ids[{t}] = {int(tokens[t])}); "
                "transformers models take unshifted labels (input_ids with -100 where no loss is taken) and "
                "shift them in forward: if yours are shifted already, unshift them, or give a loss_mask"
            )
        supervised &= trained
    for name in (LOSS_MASK, ASSISTANT_MASKS):
        if name in example:
            values = _field(example, name, where, "values", length)
            supervised &= _zero_one(values, where, name, "1 where the token is trained")
    return tokens[:real], np.where(supervised, tokens, IGNORE_INDEX)[:real]


class TransformersCollator:
    """The ``collate_fn`` of :meth:`Collator.for_transformers`: HF examples to a ``transformers`` batch.

    Parameters:
        padding_free: put the batch in one row with ``position_ids`` and the
            FlashAttention kwargs (``DataCollatorWithFlattening``'s layout) instead
            of padding it (``DataCollatorForSeq2Seq``'s layout).
        pad_token_id: the id padding gets (``tokenizer.pad_token_id``); required
            unless ``padding_free``.
        pad_to_multiple_of: round the padded length up to a multiple of this
            (padded layout only).
        boundary_safe_labels: make each example's first label -100 in the
            padding-free row, so no label predicts the next example's first token
            (as ``DataCollatorWithFlattening`` does). In the padded layout each
            row holds one example and the model drops its first label itself:
            nothing is masked there.

    Returns (from a call on a list of examples, or a batched dict of lists):
        the dict of tensors described in the module doc.

    Raises:
        TypeError, ValueError: for bad arguments, and for a bad example, naming it
            (see :func:`read_example`); ``ValueError`` for a padding-free batch
            whose examples are all empty, as ``DataCollatorWithFlattening`` does.

    Example:
        >>> from zephon_collate import Collator
        >>> collate = Collator.for_transformers(pad_token_id=0)
        >>> batch = collate([
        ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        ...     {"input_ids": [8, 9]},
        ... ])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, 7], [8, 9, -100]])
        >>> flatten = Collator.for_transformers(padding_free=True)
        >>> flat = flatten([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> flat["labels"].tolist(), flat["position_ids"].tolist(), flat["cu_seq_lens_q"].tolist()
        ([[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5])
    """

    def __init__(
        self,
        *,
        padding_free: bool = False,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        boundary_safe_labels: bool = True,
    ) -> None:
        self.padding_free = check_bool("padding_free", padding_free, owner=OWNER)
        self.boundary_safe_labels = check_bool("boundary_safe_labels", boundary_safe_labels, owner=OWNER)
        if self.padding_free and pad_to_multiple_of is not None:
            raise ValueError(f"{OWNER}: pad_to_multiple_of pads rows; padding_free=True adds no padding")
        if not self.padding_free and pad_token_id is None:
            raise ValueError(
                f"{OWNER}: the padded layout needs pad_token_id (e.g. tokenizer.pad_token_id, or "
                "tokenizer.eos_token_id for a tokenizer without one), or pass padding_free=True"
            )
        self.padding = RowPadding.create(pad_token_id, pad_to_multiple_of, owner=OWNER)

    def __repr__(self) -> str:
        return (
            f"{OWNER}(padding_free={self.padding_free}, padding={self.padding}, "
            f"boundary_safe_labels={self.boundary_safe_labels})"
        )

    def __call__(self, features: object) -> dict[str, Any]:
        examples = [read_example(example, f"example {i}") for i, example in enumerate(as_examples(features))]
        if not examples:
            raise ValueError(f"{OWNER}: the batch holds no examples")
        return self._flat(examples) if self.padding_free else self._padded(examples)

    def _padded(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        assert self.padding is not None  # __init__ requires pad_token_id here
        lengths = np.array([tokens.shape[0] for tokens, _ in examples])
        width = self.padding.length(int(lengths.max()))
        real = np.arange(width) < lengths[:, None]
        input_ids = np.full(real.shape, self.padding.pad_token_id, dtype=np.int64)
        input_ids[real] = np.concatenate([tokens for tokens, _ in examples])
        labels = np.full(real.shape, IGNORE_INDEX, dtype=np.int64)
        labels[real] = np.concatenate([row for _, row in examples])
        return {
            INPUT_IDS: torch.from_numpy(input_ids),
            ATTENTION_MASK: torch.from_numpy(real.astype(np.int64)),
            LABELS: torch.from_numpy(labels),
        }

    def _flat(self, examples: list[Example]) -> dict[str, Any]:
        examples = [example for example in examples if example[0].size]  # as DataCollatorWithFlattening
        if not examples:
            raise ValueError(f"{OWNER}: every example of the batch is empty; padding_free needs a token")
        lengths = np.array([tokens.shape[0] for tokens, _ in examples])
        offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = (np.arange(int(lengths.sum())) - offsets)[None]
        labels = np.concatenate([row for _, row in examples])[None]
        if self.boundary_safe_labels:
            labels[segment_starts(positions)] = IGNORE_INDEX
        cu_seq_lens, longest = cu_seqlens_flat.unchecked(positions)  # arrays in, arrays out
        return {
            INPUT_IDS: torch.from_numpy(np.concatenate([tokens for tokens, _ in examples])[None]),
            LABELS: torch.from_numpy(labels),
            POSITION_IDS: torch.from_numpy(positions),
            SEQ_IDX: torch.from_numpy(segment_ids_from_positions(positions)),
            CU_SEQ_LENS_Q: torch.from_numpy(cu_seq_lens),
            CU_SEQ_LENS_K: torch.from_numpy(cu_seq_lens.copy()),
            MAX_LENGTH_Q: int(longest),
            MAX_LENGTH_K: int(longest),
        }
