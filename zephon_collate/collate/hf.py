"""TransformersCollator: Hugging Face examples in, the batch a ``transformers`` causal LM takes out.

A layout over the :class:`~zephon_collate.Collator`'s machinery, not a second
implementation: the examples are read by the one reader, checked and stacked
into the same kind of batch, and a chain of the package's transforms
(:class:`~zephon_collate.UnshiftedLabels`, :class:`~zephon_collate.LossMask`,
:class:`~zephon_collate.AttentionMask`, :class:`~zephon_collate.BoundaryMask`,
:class:`~zephon_collate.CuSeqlens`, :class:`~zephon_collate.SegmentIds`,
:class:`~zephon_collate.LeftPadding`) turns it into Hugging Face's keys, in
``__call__``, or ``stack`` in workers and ``finish`` on the device, compiled
when asked, with transforms of yours at the end.

A ``transformers`` causal LM shifts its labels inside ``forward``, so it takes
*unshifted* labels: a copy of ``input_ids`` with -100 wherever no loss is taken.
Two layouts:

- **padded** (``padding_free=False``): ``input_ids``, ``attention_mask`` and
  ``labels``, ``[B, L]`` int64, ``L`` the longest example rounded up to
  ``pad_to_multiple_of`` (or ``max_length`` with ``padding="max_length"``):
  what ``DataCollatorForSeq2Seq(tokenizer)`` returns. Padding goes on the
  tokenizer's ``padding_side``.
- **padding-free** (``padding_free=True``): the examples one after the other in
  a single row ``[1, N]``: ``input_ids``, ``labels`` and ``position_ids``, plus
  ``cu_seq_lens_q/k`` ``[D + 1]`` int32 and ``max_length_q/k`` (ints) with
  ``return_flash_attn_kwargs``, ``seq_idx`` ``[1, N]`` int32 with
  ``return_seq_idx``: what ``DataCollatorWithFlattening`` returns with the same
  switches (and TRL's ``DataCollatorForLanguageModeling(padding_free=True)``
  with both on)::

      examples   [a a a] [b b]           (one packed TRL row: seq_lengths [3, 2])
      input_ids  [a a a b b]
      position_ids [0 1 2 0 1]
      labels     [- a a - b]             (each document's first label -100)
      cu_seq_lens [0 3 5]

An example is a dict with ``input_ids`` and, optionally, fields that say what
is supervised; every one given is applied (a token is supervised where all agree):

- ``labels``: -100 for unsupervised tokens, else the token at that place.
- ``attention_mask``: 1 on the tokens, 0 on padding before them (left) or
  after them (right), which is dropped before the batch is built.
- ``loss_mask``, ``assistant_masks`` / ``assistant_mask`` (chat templates'),
  ``completion_mask`` (TRL's): 1 where the token is trained.
- ``seq_lengths`` (TRL's packed rows) or segment-restarting ``position_ids``:
  several documents in one example, kept apart (padding-free only).
- ``token_type_ids``: padded with 0 and passed on.
- the ``float_fields`` named (log-probs, advantages, rewards): each in its own
  float dtype, 0.0 on padding, placed with the unshifted labels as its
  alignment says (:mod:`zephon_collate.fields`); one value per sequence gives a
  ``[B]`` output (or is broadcast to the tokens).

Any other field (text columns) is not read. A per-example ``label`` (sequence
classification), ``decoder_input_ids`` or labels of another length (encoder-decoder
targets) are refused: this collator is for causal LMs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import numpy as np
import torch

from zephon_collate._checks import (
    Keywords,
    check_bool,
    check_eos_token_id,
    check_ignore_index,
    check_int,
    suggest_options,
)
from zephon_collate._columns import Columns, columns_of, read_by_rows
from zephon_collate._read import (
    MISSING,
    Ragged,
    as_numpy,
    as_tensor,
    check_flat,
    check_ids,
    check_zero_one,
    concat,
    misspelled,
    payload_get,
    places,
    read_field,
    read_ragged,
    row_any,
    row_of,
)
from zephon_collate._text import shown, shown_fields
from zephon_collate.collate import _host
from zephon_collate.collate._native import Stacked, check_boundary_count
from zephon_collate.collate._output import convert
from zephon_collate.collate._plan import Plan, Plans
from zephon_collate.collate._stack import RowPadding, dense
from zephon_collate.collate.collator import Collator, CollatorOptions
from zephon_collate.fields import FloatField, check_float_fields, read_floats, to_label_positions
from zephon_collate.functional.segments import segment_starts
from zephon_collate.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    CHOSEN_INDEX,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOGITS_INDEX,
    LOSS_MASK,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MAX_PAD_MULTIPLE,
    MAX_SEQLEN,
    NUM_SEQUENCES,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    REF_CHOSEN_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_INDEX,
    SEGMENT_IDS,
    SEQ_IDX,
    SEQ_LENGTHS,
    SEQUENCE_INDEX,
    SUPERVISION_MASKS,
    TOKEN_TYPE_IDS,
)
from zephon_collate.records import PADDING_LENGTH_TAG, SampleRecord
from zephon_collate.transforms import (
    AttentionMask,
    BoundaryMask,
    Chain,
    CuSeqlens,
    LeftPadding,
    LossMask,
    PaddingMask,
    SegmentIds,
    Transform,
    UnshiftedLabels,
)

__all__ = [
    "TRANSFORMERS_COLLATOR_OPTIONS",
    "TRANSFORMERS_OPTION_NAMES",
    "Transformers",
    "TransformersCollator",
    "TransformersOptions",
    "as_examples",
]

_OWNER = "Collator.for_transformers"
_MASK_FIELDS = SUPERVISION_MASKS
"""The 0/1 fields that say, token by token, what is trained."""
_SUPERVISION_FIELDS = (LABELS, *_MASK_FIELDS)
_READ_FIELDS = (INPUT_IDS, ATTENTION_MASK, *_SUPERVISION_FIELDS, TOKEN_TYPE_IDS, POSITION_IDS, SEQ_LENGTHS)
"""The example fields this collator reads; any other field is not looked at."""
_READ_SET = frozenset(_READ_FIELDS)
_PER_TOKEN: tuple[tuple[str, Literal["ids", "values"]], ...] = (
    (ATTENTION_MASK, "values"),
    *((name, "values") for name in _MASK_FIELDS),
    (LABELS, "ids"),
    (TOKEN_TYPE_IDS, "ids"),
    (POSITION_IDS, "ids"),
)
"""The per-token fields beside ``input_ids``, in the order they are read, and how: 0/1 ``values`` or
``ids`` (integers; ``labels`` -100 too)."""
_WRITTEN = (
    LABELS,
    CU_SEQ_LENS_Q,
    CU_SEQ_LENS_K,
    MAX_LENGTH_Q,
    MAX_LENGTH_K,
    SEQ_IDX,
    DOCUMENT_IDS,
    BRANCH_IDS,
    LOGITS_INDEX,
    SEQUENCE_INDEX,
    NUM_SEQUENCES,
    CHOSEN_INDEX,
    REJECTED_INDEX,
    REF_CHOSEN_LOGPS,
    REF_REJECTED_LOGPS,
)
"""Keys this layout and the post-training presets over it write, which a float field may not take."""
_PADDINGS = {True: "longest", "longest": "longest", "max_length": "max_length", False: "do_not_pad"}
_PADDINGS["do_not_pad"] = "do_not_pad"


def _names(index: int) -> str:
    return f"example {index}"


def as_examples(
    features: object, extra: Sequence[str] = (), *, key: str = INPUT_IDS, owner: str = _OWNER
) -> list[Mapping[str, Any]]:
    """Per-example dicts from a list of them, or from a batched dict of lists (``dataset[:8]``).

    A batched dict keeps the fields this collator reads, and those named in
    ``extra``; ``key`` is the field every batch has (its rows tell the batch
    size), ``owner`` the collator that errors name.

    Raises:
        TypeError: for anything else, naming what was given.
        ValueError: for a batched dict without ``input_ids``, one example given as a batch, or a
            batched field without one entry per example.
    """
    if isinstance(features, Mapping):
        if key not in features:
            raise ValueError(
                f"{owner}: the batch has no {shown(key)} (its fields: {shown_fields(features)}); "
                "tokenize the examples first"
            )
        ids = features[key]
        if not hasattr(ids, "__len__") or isinstance(ids, (str, bytes)):
            raise TypeError(f"{owner}: {shown(key)} must be a list of token rows, got {type(ids).__name__}")
        if len(ids) and getattr(ids[0], "ndim", 0 if isinstance(ids[0], (int, np.integer)) else 1) == 0:
            raise ValueError(
                f"{owner}: got one example (a dict whose {shown(key)} is a row of ints), not a batch; "
                "pass a list of examples ([example]) or a batched dict of lists"
            )
        count = len(ids)
        near = misspelled(features, _MASK_FIELDS)  # kept, so that the reader names it (or its fix)
        known = (*_READ_FIELDS, "label", "decoder_input_ids", *extra, *(near[:1] if near else ()))
        fields = [name for name in dict.fromkeys((key, *known)) if name in features]
        for name in fields:
            if not hasattr(features[name], "__len__") or len(features[name]) != count:
                raise ValueError(
                    f"{owner}: the batched field {shown(name)} does not hold one entry per example "
                    f"({shown(key)} holds {count}); give every field as a list with one row per example"
                )
        return [{name: features[name][index] for name in fields} for index in range(count)]
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise TypeError(
            f"{owner}: expected a list of example dicts or a batched dict of lists, got "
            f"{type(features).__name__}"
        )
    examples = list(features)
    if examples and type(examples[0]) is not dict and all(_token_row(row) for row in examples):
        return [{INPUT_IDS: row} for row in examples]  # raw token rows, as DataCollatorForLanguageModeling
    return examples


def _token_row(value: object) -> bool:
    """Whether ``value`` is a row of token ids given alone (a list, tuple, array or tensor, not a dict)."""
    return isinstance(value, (list, tuple, np.ndarray, torch.Tensor))


def _check_examples(examples: Sequence[object], supervision: str | None) -> set[str]:
    """The refusals that look at each example's fields, before any is read; the fields present."""
    for index, example in enumerate(examples):
        if type(example) is dict:
            continue  # the common case: the checks below are for anything else
        if isinstance(example, SampleRecord):
            raise TypeError(
                f"{_names(index)}: is a SampleRecord; this collator takes Hugging Face example dicts: pass "
                "the payloads, or collate records (pack_flat's rows) with Collator(...)"
            )
        if not isinstance(example, Mapping):
            raise TypeError(
                f"{_names(index)}: must be a dict of fields such as 'input_ids', got {type(example).__name__}"
            )
    present: set[str] = set().union(*cast(Sequence[Mapping[str, Any]], examples))
    if supervision is None:
        _check_misspelled(examples, present)
    if (
        INPUT_IDS in present
        and supervision is None  # a declared field is looked for in every example below
        and not present.intersection(("label", "decoder_input_ids", LABELS))
        and all(INPUT_IDS in example for example in cast(Sequence[Mapping[str, Any]], examples))
    ):
        return present  # the common case again: nothing to refuse
    for index, example in enumerate(cast(Sequence[Mapping[str, Any]], examples)):
        where = _names(index)
        if INPUT_IDS not in example:
            raise ValueError(
                f"{where}: has no 'input_ids' (its fields: {shown_fields(example)}); tokenize the examples "
                "first"
            )
        if "label" in example and not _scalar(example["label"]) and example["label"] is not None:
            raise ValueError(
                f"{where}: carries 'label' of one value per token; this collator reads per-token labels "
                "from 'labels': rename the field 'labels'"
            )
        if "label" in example or _scalar(payload_get(example, LABELS, MISSING)):
            raise ValueError(
                f"{where}: carries one label for the whole example (sequence classification); this "
                "collator makes causal-LM labels, one per token: use transformers.DataCollatorWithPadding "
                "for a classifier, or give per-token 'labels'"
            )
        if "decoder_input_ids" in example:
            raise ValueError(
                f"{where}: carries 'decoder_input_ids' (an encoder-decoder target); this collator is for "
                "causal LMs, whose labels align with input_ids: use "
                "transformers.DataCollatorForSeq2Seq(tokenizer, model=model) for encoder-decoder models"
            )
        if supervision is not None and supervision not in example:
            raise ValueError(
                f"{where}: lacks {shown(supervision)}, the field this collator was told carries the "
                f"supervision (its fields: {shown_fields(example)}); transformers.Trainer drops dataset "
                "columns its model's forward does not name: pass "
                "TrainingArguments(remove_unused_columns=False), or build the collator without "
                "supervision=..."
            )
    return present


def _check_misspelled(examples: Sequence[object], present: Iterable[object]) -> None:
    """Refuse a supervision mask under a near-miss name (``completion_masks``): read by nothing, every
    token of its example would be trained."""
    found = misspelled(present, _MASK_FIELDS)
    if found is None:
        return
    name, meant = found
    index = next(i for i, e in enumerate(examples) if isinstance(e, Mapping) and name in e)
    raise ValueError(
        f"{_names(index)}: has {shown(name)}, which nothing reads: did you mean {shown(meant)}? Read under "
        f"no name, every token would be trained; rename it {shown(meant)} (or name the field that carries "
        "the supervision with supervision=...)"
    )


def _check_uniform_supervision(examples: Sequence[Mapping[str, Any]], present: set[str], owner: str) -> None:
    """Refuse an example that lacks a supervising field another example carries: read as all trained, its
    prompt would be trained (rollouts carry their supervision in every example)."""
    for name in _SUPERVISION_FIELDS:
        if name not in present:
            continue
        lacking = next((index for index, example in enumerate(examples) if name not in example), None)
        if lacking is not None:
            carrier = next(index for index, example in enumerate(examples) if name in example)
            raise ValueError(
                f"{_names(lacking)}: lacks {shown(name)}, which {_names(carrier)} carries to say which "
                "tokens are trained; read as all trained, its prompt would be trained. Give every example "
                f"{shown(name)} (0 on the prompt), or drop it from every example ({owner})"
            )


def _none_labels_dropped(examples: list[Any]) -> list[Any]:
    """The examples, those whose ``labels`` is ``None`` without it: no labels given, as
    ``DataCollatorForSeq2Seq`` reads them."""
    for example in examples:  # a plain loop: the common case is one dict lookup per example
        if type(example) is dict:
            if example.get(LABELS, MISSING) is None:
                break
        elif isinstance(example, Mapping) and payload_get(example, LABELS, MISSING) is None:
            break
    else:
        return examples
    return [
        {key: e[key] for key in e if key != LABELS}
        if isinstance(e, Mapping) and payload_get(e, LABELS, MISSING) is None
        else e
        for e in examples
    ]


def _scalar(value: object) -> bool:
    if value is MISSING:
        return False
    if isinstance(value, (int, float, np.generic)) and not isinstance(value, bool):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0


@dataclass(frozen=True, kw_only=True)
class TransformersOptions(Keywords):
    """The layout options of :class:`TransformersCollator`, checked once (see it for each one).

    Raises:
        TypeError, ValueError: for a value of the wrong type or out of range, or options that
            contradict each other (naming the fix).
    """

    padding_free: bool = False
    pad_token_id: int | None = None
    padding: bool | Literal["longest", "max_length", "do_not_pad"] = True
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] | None = None
    keep_eos: bool = False
    eos_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    padding_side: Literal["right", "left"] | None = None
    label_pad_token_id: int = IGNORE_INDEX
    return_tensors: Literal["pt", "np"] = "pt"
    boundary_safe_labels: bool = True
    return_position_ids: bool | None = None
    return_flash_attn_kwargs: bool = False
    return_seq_idx: bool = False
    return_sequence_map: bool = False
    separator_id: int | None = None
    position_ids_start: int = 0
    supervision: str | None = None
    float_fields: Sequence[str | FloatField] = ()
    _row_padding: RowPadding | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        for name in ("padding_free", "keep_eos", "boundary_safe_labels", "return_flash_attn_kwargs"):
            put(self, name, check_bool(name, getattr(self, name), owner=_OWNER))
        for name in ("return_seq_idx", "return_sequence_map"):
            put(self, name, check_bool(name, getattr(self, name), owner=_OWNER))
        if self.padding not in _PADDINGS or (
            isinstance(self.padding, int) and not isinstance(self.padding, bool)
        ):
            raise ValueError(
                f"{_OWNER}: padding must be True/'longest', 'max_length' or False/'do_not_pad', got "
                f"{shown(self.padding)}"
            )
        put(self, "padding", _PADDINGS[self.padding])
        choices: tuple[tuple[str, tuple[Any, ...]], ...] = (
            ("truncation_mode", (None, "keep_start", "keep_end")),
        )
        choices += (("padding_side", (None, "right", "left")), ("return_tensors", ("pt", "np")))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{_OWNER}: {name} must be one of {allowed}, got {shown(getattr(self, name))}"
                )
        if self.max_length is not None:
            put(self, "max_length", check_int(_OWNER, "max_length", self.max_length, 1, INT32_MAX))
        if self.pad_to_multiple_of is not None:
            multiple = check_int(_OWNER, "pad_to_multiple_of", self.pad_to_multiple_of, 1, MAX_PAD_MULTIPLE)
            put(self, "pad_to_multiple_of", multiple)
        if self.pad_token_id is not None:
            put(self, "pad_token_id", check_int(_OWNER, "pad_token_id", self.pad_token_id, 0))
        if self.eos_token_id is not None:  # a token id: >= 0 (a negative one would match no token)
            put(self, "eos_token_id", check_eos_token_id(self.eos_token_id, owner=_OWNER))
        if self.separator_id is not None:  # a label value: -100 and other negatives allowed
            put(self, "separator_id", check_ignore_index(self.separator_id, owner=_OWNER))
        put(self, "label_pad_token_id", check_ignore_index(self.label_pad_token_id, owner=_OWNER))
        put(self, "position_ids_start", check_int(_OWNER, "position_ids_start", self.position_ids_start, 0))
        if self.return_position_ids is not None:
            put(
                self,
                "return_position_ids",
                check_bool("return_position_ids", self.return_position_ids, owner=_OWNER),
            )
        if self.supervision is not None and self.supervision not in _SUPERVISION_FIELDS:
            raise ValueError(
                f"{_OWNER}: supervision must name a field that says what is trained, one of "
                f"{_SUPERVISION_FIELDS}, got {shown(self.supervision)}"
            )
        reserved = (*_READ_FIELDS, "label", POSITIONS, PADDING_LENGTH, *_WRITTEN)
        put(self, "float_fields", check_float_fields(_OWNER, self.float_fields, reserved))
        self._check_combinations()
        length = self.max_length if self.padding == "max_length" else None
        padding = None
        if self.pad_token_id is not None:
            padding = RowPadding.create(self.pad_token_id, self.pad_to_multiple_of, _OWNER, length)
        put(self, "_row_padding", padding)  # built once: every padded batch uses it

    def _check_combinations(self) -> None:
        if self.padding_free:
            if self.padding == "max_length" or self.padding_side == "left":
                raise ValueError(
                    f"{_OWNER}: padding_free=True puts the batch in one row; padding='max_length' and "
                    "padding_side='left' pad rows of a padded batch: drop them, or pass padding_free=False"
                )
        elif self.pad_token_id is None:
            raise ValueError(
                f"{_OWNER}: the padded layout needs pad_token_id (or a tokenizer with a pad token; for one "
                "without, tokenizer.pad_token = tokenizer.eos_token), or pass padding_free=True"
            )
        if self.pad_to_multiple_of is not None and self.pad_token_id is None:
            raise ValueError(
                f"{_OWNER}: pad_to_multiple_of pads with pad_token_id: give it (or a tokenizer with a pad "
                "token)"
            )
        if self.padding == "do_not_pad" and self.pad_to_multiple_of is not None and not self.padding_free:
            raise ValueError(
                f"{_OWNER}: padding=False pads nothing, so pad_to_multiple_of cannot apply: drop it, or pass "
                "padding=True"
            )
        if self.padding == "max_length" and self.max_length is None:
            raise ValueError(f"{_OWNER}: padding='max_length' needs max_length, the padded row length")
        if self.truncation_mode is not None and self.max_length is None:
            raise ValueError(
                f"{_OWNER}: truncation_mode={self.truncation_mode!r} needs max_length, the cut length"
            )
        if self.keep_eos and (self.truncation_mode != "keep_start" or self.eos_token_id is None):
            raise ValueError(
                f"{_OWNER}: keep_eos=True puts the EOS back at the end of an example cut by "
                "truncation_mode='keep_start'; it needs that mode and eos_token_id (or a tokenizer with one)"
            )
        if self.separator_id is not None and not self.boundary_safe_labels:
            raise ValueError(
                f"{_OWNER}: separator_id is the label of each packed example's first token, which "
                "boundary_safe_labels=False keeps as given; drop one of them"
            )
        if self.return_sequence_map and not self.padding_free:
            raise ValueError(
                f"{_OWNER}: return_sequence_map=True describes the sequences of a padding-free row; padded "
                "rows are one sequence each, which the loss helpers read from attention_mask: drop it, or "
                "pass padding_free=True"
            )
        if not self.padding_free and (self.return_flash_attn_kwargs or self.return_seq_idx):
            raise ValueError(
                f"{_OWNER}: return_flash_attn_kwargs and return_seq_idx describe the padding-free row; "
                "pass padding_free=True"
            )

    @property
    def positions_out(self) -> bool:
        """Whether ``position_ids`` is an output (padding-free: by default, as DataCollatorWithFlattening)."""
        if self.return_position_ids is None:
            return self.padding_free
        return self.return_position_ids

    @property
    def floats(self) -> tuple[FloatField, ...]:
        """The float fields, as specs (checked in ``__post_init__``)."""
        return cast(tuple[FloatField, ...], self.float_fields)

    @property
    def token_floats(self) -> tuple[str, ...]:
        """The float fields that hold one value per token."""
        return tuple(spec.name for spec in self.floats if spec.per_token) if self.float_fields else ()

    @property
    def row_padding(self) -> RowPadding | None:
        """How padded rows are padded (``None`` without ``pad_token_id``)."""
        return self._row_padding


TRANSFORMERS_OPTION_NAMES = TransformersOptions.names()
""":class:`TransformersCollator`'s layout keywords, in its signature's order."""


def _read(
    examples: Sequence[Mapping[str, Any]],
    name: str,
    kind: Literal["ids", "values"],
    tokens: Ragged | None,
    fill: Callable[[int], Any] | None = None,
) -> Ragged | None:
    """``name`` of every example that has it, on the host (a tensor on a device is copied back); those
    without get ``fill(index)`` (all trained). Each row is one value per token of ``tokens`` (or, for
    ``tokens=None``, a 1-D row: the tokens themselves), else a ``ValueError`` names the example."""
    try:
        field = read_ragged(examples, name, INPUT_IDS, kind, _names, required=False, fill=fill)
    except ValueError:
        rows = read_field(examples, name, INPUT_IDS, kind, _names, required=False, fill=fill)
        _check_shapes(rows or [], tokens, name)  # rows whose shapes differ: named here
        raise
    if field is None:
        return None
    if not field.on_host:
        field = Ragged(field.host, field.offsets)
    if field.values.ndim == 1 and (tokens is None or np.array_equal(field.offsets, tokens.offsets)):
        return field
    _check_shapes([field.row(index) for index in range(field.rows)], tokens, name)
    raise AssertionError("unreachable: a row of the wrong shape is named above")  # pragma: no cover


def _check_shapes(rows: Sequence[Any], tokens: Ragged | None, name: str) -> None:
    """Name the first row that is not one value per token (``tokens=None``: not 1-D)."""
    for index, row in enumerate(rows):
        if tokens is None and row.ndim != 1:
            raise ValueError(
                f"{_names(index)}: 'input_ids' must be one row of token ids, got shape {tuple(row.shape)}"
            )
        if tokens is not None and (row.ndim != 1 or row.shape[0] != tokens.lengths[index]):
            hint = (
                " (labels of their own length: an encoder-decoder target; this collator is for causal LMs, "
                "use transformers.DataCollatorForSeq2Seq(tokenizer, model=model))"
                if name == LABELS
                else ""
            )
            raise ValueError(
                f"{_names(index)}: field {shown(name)} has shape {tuple(row.shape)}, but 'input_ids' has "
                f"{int(tokens.lengths[index])} tokens; give one value per token{hint}"
            )


def _ones(lengths: np.ndarray) -> Callable[[int], np.ndarray]:
    """What an example without a mask field reads as: every token trained."""
    return lambda index: np.ones(int(lengths[index]), dtype=np.int64)


def _counting(lengths: np.ndarray) -> Callable[[int], np.ndarray]:
    """What an example without ``position_ids`` reads as: one document, 0, 1, 2, ..."""
    return lambda index: np.arange(int(lengths[index]), dtype=np.int64)


def _whole(lengths: np.ndarray) -> Callable[[int], np.ndarray]:
    """What an example without ``seq_lengths`` reads as: one document of all its tokens."""
    return lambda index: np.array([int(lengths[index])], dtype=np.int64)


def _copy_of(tokens: Ragged) -> Callable[[int], np.ndarray]:
    """What an example without ``labels`` reads as: its tokens, every one trained."""
    return lambda index: np.asarray(tokens.row(index))


@dataclass(frozen=True)
class Transformers:
    """The ``transformers`` layout: HF examples to a causal LM's batch; see the module doc."""

    options: TransformersOptions
    padding_side: Literal["right", "left"] = "right"
    num_boundaries: int | None = None
    _plans: Plans = dataclasses.field(default_factory=Plans, init=False, repr=False, compare=False)
    uniform_supervision: ClassVar[bool] = False
    """Refuse an example without a supervising field that another example carries (rollouts)."""
    owner: ClassVar[str] = _OWNER
    item: ClassVar[str] = "example"

    def plan(self, keys: tuple[str, ...]) -> Plan:
        """The plan of this layout on a stacked batch holding ``keys``, built once."""
        found = self._plans.get(keys)
        if found is None:
            found = self._plans[keys] = Plan(self, keys)
        return found

    # -- reading ---------------------------------------------------------------------------------

    def read(self, features: object) -> list[Stacked]:
        """Read, check and stack the examples into one batch; see the module doc.

        Examples are read on the host (their fields as NumPy arrays), whatever
        device a tensor field is on; the collator's ``device`` moves the batch.
        A columnar batch (an Arrow table, ``(values, offsets)`` pairs: see
        :mod:`zephon_collate._columns`) is read column by column, then goes the same way.

        Raises:
            TypeError, ValueError: for a bad example, naming it, the field and the fix.
            ImportError: for Arrow data without ``pyarrow``.
        """
        options = self.options
        columns = columns_of(features)
        if columns is not None:
            if options.float_fields:
                raise read_by_rows(_OWNER, "float_fields")
            return [self._interpret(*self._read_columns(columns))]
        examples = as_examples(
            features, [spec.name for spec in options.floats] if options.float_fields else ()
        )
        if not examples:
            raise ValueError(f"{self.owner}: the batch holds no {self.item}s")
        examples = _none_labels_dropped(examples)
        present = _check_examples(examples, options.supervision) & _READ_SET
        if self.uniform_supervision:
            _check_uniform_supervision(examples, present, self.owner)
        tokens = _read(examples, INPUT_IDS, "ids", None)
        assert tokens is not None  # every example has input_ids (_check_examples)
        check_ids(tokens, INPUT_IDS, _names)
        tokens = tokens.cast(torch.int64)
        lengths = tokens.lengths
        fields: dict[str, Ragged] = {INPUT_IDS: tokens}
        for name, kind in _PER_TOKEN:
            if name not in present:
                continue
            if name in (LABELS, POSITION_IDS):  # missing: the tokens all trained; one document
                fill: Callable[[int], Any] | None = _copy_of(tokens) if name == LABELS else _counting(lengths)
            else:
                fill = _ones(lengths) if kind == "values" else None
            field = _read(examples, name, kind, tokens, fill)
            if field is not None:
                fields[name] = field
        segment_rows = (
            read_field(examples, SEQ_LENGTHS, INPUT_IDS, "ids", _names, required=False, fill=_whole(lengths))
            if SEQ_LENGTHS in present
            else None
        )
        segments = None
        if segment_rows is not None:  # each example's document lengths, end to end
            segments = concat([as_numpy(row).reshape(-1) for row in segment_rows], SEQ_LENGTHS, _names)
        per_sequence: dict[str, list[np.ndarray]] = {}
        for spec in options.floats:
            rows = read_field(examples, spec.name, INPUT_IDS, "values", _names, required=True) or []
            floats = read_floats(rows, lengths, spec, _names)
            if isinstance(floats, Ragged):
                fields[spec.name] = floats
            else:
                per_sequence[spec.name] = floats
        return [self._interpret(fields, segments, per_sequence)]

    def _read_columns(self, columns: Columns) -> tuple[dict[str, Ragged], Ragged | None]:
        """The fields of a columnar batch, as :meth:`read` reads them from examples, and its
        ``seq_lengths``; the refusals that look at an example's fields run once for all rows."""
        if not columns.rows:
            raise ValueError(f"{self.owner}: the batch holds no {self.item}s")
        if PADDING_LENGTH_TAG in columns:
            raise ValueError(
                f"{_OWNER}: the batch has a {shown(PADDING_LENGTH_TAG)} column: packed rows (as pack_columns "
                "writes them), whose documents and padding this layout does not read; collate them with "
                "Collator(return_labels=True, return_cu_seqlens=True), or pack Hugging Face examples with "
                "trl.pack_dataset (seq_lengths)"
            )
        _check_examples([columns.example()], self.options.supervision)  # misspelled masks among them too
        tokens = columns.ragged(INPUT_IDS, "ids", _names)
        check_flat(tokens, INPUT_IDS, _names(0))
        check_ids(tokens, INPUT_IDS, _names)
        tokens = tokens.cast(torch.int64)
        fields: dict[str, Ragged] = {INPUT_IDS: tokens}
        for name, kind in _PER_TOKEN:
            if name not in columns:
                continue
            field = columns.ragged(name, kind, _names)
            if field.values.ndim != 1 or not np.array_equal(field.offsets, tokens.offsets):
                _check_shapes(_rows_of(field), tokens, name)  # names the first example that does not fit
            fields[name] = field
        segments = columns.ragged(SEQ_LENGTHS, "ids", _names) if SEQ_LENGTHS in columns else None
        if segments is not None and segments.values.ndim != 1:  # nested lengths: each example's, flattened
            segments = concat([np.reshape(row, -1) for row in _rows_of(segments)], SEQ_LENGTHS, _names)
        return fields, segments

    def _interpret(
        self,
        fields: dict[str, Ragged],
        segments: Ragged | None,
        per_sequence: Mapping[str, list[np.ndarray]] | None = None,
    ) -> Stacked:
        """The read fields to the chain's input: supervision, padding dropped, truncation, layout."""
        options = self.options
        per_token: dict[str, Ragged] = {INPUT_IDS: fields[INPUT_IDS], LOSS_MASK: self._supervision(fields)}
        if TOKEN_TYPE_IDS in fields:
            per_token[TOKEN_TYPE_IDS] = fields[TOKEN_TYPE_IDS]
        if options.float_fields:
            for name in options.token_floats:
                per_token[name] = fields[name]
        positions = self._positions(fields, segments)
        if positions is not None:
            per_token[POSITIONS] = positions
        if ATTENTION_MASK in fields:
            keep = self._attended(fields[ATTENTION_MASK])
            if not keep.all():
                per_token = {name: field.select(keep) for name, field in per_token.items()}
        if options.truncation_mode is not None:
            per_token = self._truncated(per_token)
        elif options.max_length is not None and options.padding != "max_length":
            self._check_max_length(per_token[INPUT_IDS].lengths, options.max_length)
        if positions is not None and not options.padding_free:
            self._check_one_document(per_token[POSITIONS])
        if POSITIONS not in per_token and (options.padding_free or options.positions_out):
            per_token[POSITIONS] = _restarting(per_token[INPUT_IDS].offsets)
        labelled = (
            [spec.name for spec in options.floats if spec.align == "label"] if options.float_fields else []
        )
        if labelled:  # moved to the token each prediction is scored against
            starts = _sequence_starts(per_token)
            for name in labelled:
                per_token[name] = to_label_positions(per_token[name], starts)
        if options.return_sequence_map:
            per_token.update(_sequence_map(per_token))
        stacked = self._flat(per_token) if options.padding_free else self._padded(per_token)
        if options.return_sequence_map:
            for name in (LOGITS_INDEX, SEQUENCE_INDEX):
                stacked.data[name] = stacked.data[name] - 1  # stored + 1: the padding reads -1
            stacked.data[NUM_SEQUENCES] = torch.tensor(int(_sequence_starts(per_token).sum()))
        if options.float_fields:
            for spec in options.floats:
                if not spec.per_token:
                    stacked.data[spec.name] = torch.from_numpy(np.stack((per_sequence or {})[spec.name]))
                stacked.data[spec.name] = stacked.data[spec.name].to(spec.dtype)
        return stacked

    def _supervision(self, fields: Mapping[str, Ragged]) -> Ragged:
        """The boolean ``[N]`` supervision: where ``labels`` are not -100 and every mask field is 1."""
        tokens = fields[INPUT_IDS]
        trained = np.ones(tokens.values.shape[0], dtype=bool)
        for name in _MASK_FIELDS:
            if name in fields:
                check_zero_one(fields[name], name, _names, "1 where the token is trained")
                trained &= fields[name].values != 0
        if LABELS in fields:
            labels = fields[LABELS].values
            given = labels != IGNORE_INDEX
            wrong = given & (labels != tokens.values)
            if ATTENTION_MASK in fields:
                wrong &= fields[ATTENTION_MASK].values != 0  # labels under the padding are dropped, unread
            flat = np.flatnonzero(wrong)
            if flat.size:
                index = int(flat[0])
                row = row_of(tokens.offsets, index)
                t = index - int(tokens.offsets[row])
                raise ValueError(
                    f"{_names(row)}: labels[{t}] is {int(labels[index])}, neither -100 nor the token there "
                    f"(input_ids[{t}] = {int(tokens.values[index])}); causal LMs take unshifted labels "
                    "(input_ids, -100 where no loss is taken) and shift them in forward: unshift labels "
                    "shifted already, or give a loss_mask; an encoder-decoder target needs "
                    "transformers.DataCollatorForSeq2Seq(tokenizer, model=model)"
                )
            trained &= given
        return Ragged(trained, tokens.offsets)

    def _attended(self, mask: Ragged) -> np.ndarray:
        """``[N]`` booleans: the tokens an ``attention_mask`` keeps (its 1s, with 0s on padding before them,
        left padding, or after them, right padding)."""
        check_zero_one(mask, ATTENTION_MASK, _names, "1 on tokens")
        keep = mask.values != 0
        rise = np.flatnonzero(keep[1:] & ~keep[:-1]) + 1  # a 1 after a 0 ...
        rise = rise[~np.isin(rise, mask.offsets)]  # ... inside one example
        if rise.size:
            fall = np.flatnonzero(~keep[1:] & keep[:-1]) + 1  # a 0 after a 1 inside one example
            fall = fall[~np.isin(fall, mask.offsets)]
            # a rise after a fall of the same example: 1s, 0s, then 1s again
            before = np.searchsorted(fall, rise) - 1
            hole = before >= 0
            rows = np.searchsorted(mask.offsets, rise[hole], side="right")
            hole[hole] = np.searchsorted(mask.offsets, fall[before[hole]], side="right") == rows
            if hole.any():
                row = row_of(mask.offsets, int(rise[np.flatnonzero(hole)[0]]))
                raise ValueError(
                    f"{_names(row)}: 'attention_mask' must be 1 on the tokens, with 0s only on padding "
                    "before or after them; it has 0s between 1s (a hole): give each example's tokens without "
                    "holes"
                )
        return np.asarray(keep)

    def _positions(self, fields: Mapping[str, Ragged], segments: Ragged | None) -> Ragged | None:
        """Segment-restarting positions from ``seq_lengths`` (each example's document lengths, end to
        end) or ``position_ids``, or ``None`` (one document per example)."""
        tokens = fields[INPUT_IDS]
        if segments is not None:
            sizes = np.asarray(segments.values).astype(np.int64, copy=False)
            totals = np.zeros(sizes.size + 1, dtype=np.int64)
            np.cumsum(sizes, out=totals[1:])
            negative = np.zeros(sizes.size + 1, dtype=np.int64)
            np.cumsum(sizes < 0, out=negative[1:])
            starts, ends = segments.offsets[:-1], segments.offsets[1:]
            bad = (totals[ends] - totals[starts] != tokens.lengths) | (negative[ends] > negative[starts])
            if bad.any():
                index = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"{_names(index)}: 'seq_lengths' {shown(sizes[starts[index] : ends[index]].tolist())} "
                    f"must be lengths >= 0 that add up to the example's {int(tokens.lengths[index])} tokens "
                    "(as TRL's packing writes them)"
                )
            documents = sizes[sizes > 0]
            bounds = np.zeros(documents.size + 1, dtype=np.int64)
            np.cumsum(documents, out=bounds[1:])
            return Ragged(_restarting(bounds).values, tokens.offsets)
        if POSITION_IDS not in fields:
            return None
        given = fields[POSITION_IDS]
        check_ids(given, POSITION_IDS, _names)
        nonempty = np.flatnonzero(given.lengths > 0)
        first = given.values[given.offsets[nonempty]]
        if (first != 0).any():
            index = int(nonempty[np.flatnonzero(first != 0)[0]])
            raise ValueError(
                f"{_names(index)}: 'position_ids' must start at 0 and restart at 0 at each packed "
                f"document (they start at {int(first[first != 0][0])}); give positions counted from 0"
            )
        return given.cast(torch.int64)

    def _check_one_document(self, positions: Ragged) -> None:
        """Padded rows must hold one document each: packed rows would attend across their documents."""
        inner = np.flatnonzero(_sequence_starts({INPUT_IDS: positions, POSITIONS: positions}))
        inner = inner[~np.isin(inner, positions.offsets)]  # a start that is not its example's first token
        if inner.size:
            row = row_of(positions.offsets, int(inner[0]))
            raise ValueError(
                f"{_names(row)}: holds several documents (from 'seq_lengths' or restarting 'position_ids'); "
                "padded, they would attend to each other: pass padding_free=True, which keeps them apart "
                "(as TRL's SFTTrainer does for packed data)"
            )

    def _truncated(self, per_token: dict[str, Ragged]) -> dict[str, Ragged]:
        """Each example cut to ``max_length`` tokens (keep its start or its end); see the options."""
        options = self.options
        limit = options.max_length
        assert limit is not None
        tokens = per_token[INPUT_IDS]
        lengths = tokens.lengths
        if not bool((lengths > limit).any()):
            return per_token
        place = places(tokens.offsets)
        if options.truncation_mode == "keep_start":
            keep = place < limit
        else:
            keep = place >= np.repeat(lengths - limit, lengths)
        cut = {name: field.select(keep) for name, field in per_token.items()}
        if options.keep_eos:
            cut = self._eos_kept(per_token, cut, lengths > limit)
        before, after = per_token[LOSS_MASK], cut[LOSS_MASK]
        lost = np.flatnonzero(
            row_any(before.host != 0, before.offsets) & ~row_any(after.host != 0, after.offsets)
        )
        if lost.size:
            raise ValueError(
                f"{_names(int(lost[0]))}: has no supervised token left after truncation to "
                f"max_length={limit} ({options.truncation_mode}); trained as is it would add nothing: drop "
                "or shorten such examples, raise max_length, or use the other truncation_mode"
            )
        return cut

    def _eos_kept(
        self, before: Mapping[str, Ragged], cut: dict[str, Ragged], truncated: np.ndarray
    ) -> dict[str, Ragged]:
        """``keep_eos``: a cut example that ended in EOS ends in EOS again, supervised as it was."""
        tokens = before[INPUT_IDS]
        ends = tokens.offsets[1:] - 1
        rows = np.flatnonzero(truncated & (tokens.values[ends] == self.options.eos_token_id))
        if not rows.size:
            return cut
        last = cut[INPUT_IDS].offsets[rows + 1] - 1
        new_tokens = cut[INPUT_IDS].host.copy()
        new_tokens[last] = self.options.eos_token_id
        new_mask = cut[LOSS_MASK].host.copy()
        new_mask[last] = before[LOSS_MASK].values[ends[rows]]
        offsets = cut[INPUT_IDS].offsets
        return {**cut, INPUT_IDS: Ragged(new_tokens, offsets), LOSS_MASK: Ragged(new_mask, offsets)}

    def _check_max_length(self, lengths: np.ndarray, limit: int) -> None:
        """Refuse an example longer than ``limit``: ``max_length`` without ``truncation_mode`` is a limit,
        never ignored (with ``padding='max_length'``, the padded row length: rounded up to
        ``pad_to_multiple_of``)."""
        longer = np.flatnonzero(lengths > limit)
        if longer.size:
            index = int(longer[0])
            given = self.options.max_length
            rounded = "" if limit == given else f" (rounded up to pad_to_multiple_of: {limit})"
            raise ValueError(
                f"{_names(index)}: has {int(lengths[index])} tokens, more than max_length={given}{rounded}; "
                "pass truncation_mode='keep_start' (TRL's default) or 'keep_end' to cut such examples, or "
                "raise max_length"
            )

    def _padded(self, per_token: Mapping[str, Ragged]) -> Stacked:
        padding = self.options.row_padding
        assert padding is not None
        lengths = per_token[INPUT_IDS].lengths
        width = padding.width(lengths)
        if self.options.padding == "max_length":
            self._check_max_length(lengths, width)
        if self.options.padding == "do_not_pad" and bool((lengths != width).any()):
            raise ValueError(
                f"{_OWNER}: padding=False (do_not_pad) needs examples of one length, got lengths "
                f"{shown(lengths.tolist())}; pad them (padding=True)"
            )
        data = {
            name: as_tensor(dense(field, width, padding.pad_token_id if name == INPUT_IDS else 0))
            for name, field in per_token.items()
        }
        data[PADDING_LENGTH] = torch.from_numpy(width - lengths)
        return Stacked(data)

    def _flat(self, per_token: Mapping[str, Ragged]) -> Stacked:
        total = int(per_token[INPUT_IDS].values.shape[0])
        if not total:
            raise ValueError(
                f"{self.owner}: every {self.item} of the batch is empty; padding_free needs a token (give "
                "non-empty ones, or pad them: padding_free=False)"
            )
        multiple = self.options.pad_to_multiple_of
        width = total if multiple is None else -(-total // multiple) * multiple
        one_row = np.array([0, total], dtype=np.int64)
        pad_id = self.options.pad_token_id or 0
        # Padding positions are 0 each, as TRL writes them: every pad token is a segment of its own.
        data = {
            name: as_tensor(dense(Ragged(field.values, one_row), width, pad_id if name == INPUT_IDS else 0))
            for name, field in per_token.items()
        }
        data[PADDING_LENGTH] = torch.tensor([width - total])
        return Stacked(data)

    # -- the chain -------------------------------------------------------------------------------

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The built-in transforms for a stacked batch holding ``keys``.

        Padded: ``PaddingMask -> AttentionMask -> UnshiftedLabels -> LossMask``
        (then ``LeftPadding`` for left padding). Padding-free: ``BoundaryMask ->
        UnshiftedLabels -> LossMask -> CuSeqlens -> SegmentIds``, each as asked for.
        """
        options = self.options
        label_pad = options.label_pad_token_id
        transforms: list[Transform] = []
        if options.padding_free and options.boundary_safe_labels:
            transforms.append(BoundaryMask())
        if not options.padding_free:
            transforms += [PaddingMask(), AttentionMask()]
        transforms.append(UnshiftedLabels())
        padded = not options.padding_free or options.pad_to_multiple_of is not None
        if label_pad == IGNORE_INDEX:
            counts = PADDING_LENGTH if padded else None
            transforms.append(LossMask(IGNORE_INDEX, padding_length_key=counts, out_key=None, count_key=None))
        else:  # the labels of padding get label_pad_token_id, ignored ones -100 (as HF pads them)
            transforms.append(LossMask(IGNORE_INDEX, padding_length_key=None, out_key=None, count_key=None))
            transforms.append(LossMask(label_pad, supervision_key=None, out_key=None, count_key=None))
        if options.padding_free:
            if options.return_flash_attn_kwargs:
                transforms.append(CuSeqlens(flatten=True, num_boundaries=self.num_boundaries))
            if options.return_seq_idx:
                transforms.append(SegmentIds(flatten=True))
            return transforms
        if self.padding_side == "left":
            moved = [k for k in (INPUT_IDS, POSITIONS, TOKEN_TYPE_IDS, *options.token_floats) if k in keys]
            moved += [ATTENTION_MASK, LABELS]
            transforms.append(LeftPadding(moved))
        return transforms

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`chain`'s output mapping computed by the fused host pass."""
        return _host.transformers(self.options, self.padding_side == "left", self.num_boundaries, data)

    def names(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """``(key, output name)`` of each output, in Hugging Face's names and order."""
        options = self.options
        if options.padding_free:
            pairs = [(INPUT_IDS, INPUT_IDS), (LABELS, LABELS)]
            pairs += [(POSITIONS, POSITION_IDS)] if options.positions_out else []
            if options.return_flash_attn_kwargs:
                pairs += [(CU_SEQLENS, CU_SEQ_LENS_Q), (CU_SEQLENS, CU_SEQ_LENS_K)]
                pairs += [(MAX_SEQLEN, MAX_LENGTH_Q), (MAX_SEQLEN, MAX_LENGTH_K)]
            pairs += [(SEGMENT_IDS, SEQ_IDX)] if options.return_seq_idx else []
        else:
            pairs = [(INPUT_IDS, INPUT_IDS)]
            pairs += [(TOKEN_TYPE_IDS, TOKEN_TYPE_IDS)] if TOKEN_TYPE_IDS in keys else []
            pairs += [(ATTENTION_MASK, ATTENTION_MASK), (LABELS, LABELS)]
            pairs += [(POSITIONS, POSITION_IDS)] if options.positions_out else []
        if options.padding_free and TOKEN_TYPE_IDS in keys:
            pairs.append((TOKEN_TYPE_IDS, TOKEN_TYPE_IDS))
        known = {key for key, _ in pairs} | {LOSS_MASK, PADDING_LENGTH, PADDING_MASK, POSITIONS}
        pairs = [(key, name) for key, name in pairs if key in keys]  # a chain of yours may make fewer
        pairs += [(key, key) for key in keys if key not in known]  # what transforms of yours add
        return pairs

    def assemble(
        self,
        per_record: Mapping[str, list[Any]],
        result: Mapping[str, Any],
        pairs: Sequence[tuple[str, str]],
        python_scalars: bool,
    ) -> dict[str, Any]:
        """The output dict: Hugging Face's keys, dtypes and shapes."""
        options = self.options
        kind = "numpy" if options.return_tensors == "np" else "torch"
        out: dict[str, Any] = {}
        seen: set[str] = set()
        for key, name in pairs:
            value = result[key]
            if key in seen and not isinstance(
                value, (int, float)
            ):  # cu_seq_lens_k: a copy of _q, never a view
                value = value.copy() if isinstance(value, np.ndarray) else value.clone()
            seen.add(key)
            if key in (MAX_SEQLEN, NUM_SEQUENCES):
                out[name] = (
                    int(value)
                    if python_scalars
                    else (convert(value, kind) if key == NUM_SEQUENCES else torch.as_tensor(value))
                )
                continue
            if key == SEGMENT_IDS:
                value = value.reshape(1, -1)
            if key == POSITIONS and options.position_ids_start:
                value = value + options.position_ids_start
            if key == LABELS and options.separator_id is not None and options.padding_free:
                value = _separated(value, result[POSITIONS], result[PADDING_LENGTH], options.separator_id)
            out[name] = convert(value, kind)
        return out

    def empty(self, chain: Callable[[list[str]], Chain] | None = None) -> dict[str, Any]:
        """An empty batch is refused, as the collators this layout stands in for refuse it: by
        :meth:`read` (each preset with its own words)."""
        self.read([])
        raise AssertionError("unreachable: read refuses an empty batch")  # pragma: no cover

    def stack(self, samples: object) -> Stacked:
        """:meth:`read` for ``Collator.stack`` and the one-step path: one batch, its static
        boundaries checked (a row with more documents than ``num_boundaries`` allows is named)."""
        batch = self.read(samples)[0]
        if self.num_boundaries is not None and self.options.return_flash_attn_kwargs:
            check_boundary_count(batch.data[POSITIONS], True, self.num_boundaries, _names)
        return batch

    def collate(self, samples: object, plan: Any, *, python_scalars: bool = True) -> dict[str, Any]:
        """The one-step path: read, stack, run ``plan(keys)``, assemble."""
        batch = self.stack(samples)
        chosen: Plan = plan(tuple(batch.data))
        return self.assemble(batch.per_record, chosen.run(batch.data), chosen.pairs, python_scalars)


def _sequence_starts(per_token: Mapping[str, Ragged]) -> np.ndarray:
    """``[N]`` booleans: each example's first token, and each packed document's (``positions == 0``):
    the segment rule (:func:`~zephon_collate.functional.segment_starts`) on ragged examples."""
    tokens = per_token[INPUT_IDS]
    starts = np.zeros(tokens.values.shape[0], dtype=bool)
    starts[tokens.offsets[:-1][tokens.lengths > 0]] = True
    if POSITIONS in per_token:
        starts |= np.asarray(per_token[POSITIONS].values) == 0
    return starts


def _sequence_map(per_token: Mapping[str, Ragged]) -> dict[str, Ragged]:
    """The sequence map of a padding-free row (what ``return_sequence_map`` emits), each value + 1 so that
    the row's padding, filled with 0, reads -1: ``logits_index``, the place of the token that predicts
    each one (none at a sequence's first token), and ``sequence_index``, each token's sequence (a packed
    document, or an example)."""
    starts = _sequence_starts(per_token)
    offsets = per_token[INPUT_IDS].offsets
    predictor = np.where(starts, 0, np.arange(starts.size, dtype=np.int64))  # place - 1, then + 1
    return {
        LOGITS_INDEX: Ragged(predictor, offsets),
        SEQUENCE_INDEX: Ragged(np.cumsum(starts, dtype=np.int64), offsets),
    }


def _rows_of(field: Ragged) -> list[Any]:
    """Each row of ``field`` (a view): for the row-wise checks that name the example at fault."""
    return [field.row(index) for index in range(field.rows)]


def _restarting(offsets: np.ndarray) -> Ragged:
    """Positions 0, 1, ... restarting at every offset: one segment per row."""
    return Ragged(places(offsets), offsets)


def _separated(labels: Any, positions: Any, padding: Any, separator: int) -> Any:
    """``labels`` with ``separator`` at each document's first token (``DataCollatorWithFlattening``'s
    ``separator_id``); the trailing ``padding`` tokens (``pad_to_multiple_of``, each a segment of
    its own) keep their label."""
    if isinstance(labels, np.ndarray):
        width = labels.shape[-1]
        real = np.arange(width) < width - np.asarray(padding).reshape(-1, 1)
        starts = _host.segment_starts(np.asarray(positions)) & real
        return np.where(starts, labels.dtype.type(separator), labels)
    width = labels.shape[-1]
    real = torch.arange(width, device=labels.device) < width - torch.as_tensor(
        padding, device=labels.device
    ).reshape(-1, 1)
    return labels.masked_fill(segment_starts(positions) & real, separator)


def _check_model(model: Any) -> None:
    """Refuse an encoder-decoder ``model`` (``DataCollatorForSeq2Seq(tokenizer, model=model)``'s)."""
    if model is None:
        return
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is True or hasattr(
        model, "prepare_decoder_input_ids_from_labels"
    ):
        raise ValueError(
            f"{_OWNER}: model {type(model).__name__} is an encoder-decoder model, which takes "
            "decoder_input_ids made from labels of their own length; this collator is for causal LMs, whose "
            "labels align with input_ids: use transformers.DataCollatorForSeq2Seq(tokenizer, model=model)"
        )


def _from_tokenizer(tokenizer: Any, name: str, given: Any) -> Any:
    """``given``, or the tokenizer's attribute ``name`` where ``given`` is ``None``."""
    if given is not None or tokenizer is None:
        return given
    return getattr(tokenizer, name, None)


class TransformersCollator(Collator):
    """The ``collate_fn`` of :meth:`Collator.for_transformers`: HF examples to a ``transformers`` batch.

    The swap is literal: ``DataCollatorForSeq2Seq(tokenizer, ...)`` becomes
    ``Collator.for_transformers(tokenizer, ...)``, ``DataCollatorWithFlattening(...)``
    becomes ``Collator.for_transformers(padding_free=True, ...)``, with the same
    option names (README: "Coming from Hugging Face" maps each one).

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``; it gives ``pad_token_id``,
            ``padding_side`` (padded layout) and ``eos_token_id`` where those are not passed.
        model: accepted for the literal swap of ``DataCollatorForSeq2Seq(tokenizer,
            model=model)`` and not kept: a causal LM changes nothing (as there); an
            encoder-decoder model is refused (this collator is for causal LMs).
        padding_free: put the batch in one row with ``position_ids``
            (``DataCollatorWithFlattening``'s layout) instead of padding it
            (``DataCollatorForSeq2Seq``'s).
        pad_token_id: the id padding gets; required for the padded layout.
        padding: ``True``/``"longest"`` (pad to the longest example),
            ``"max_length"`` (to ``max_length``: static shapes for XLA, Neuron, CUDA
            graphs) or ``False``/``"do_not_pad"`` (examples must be of one length).
        max_length: the length of ``padding="max_length"`` rows (rounded up to
            ``pad_to_multiple_of``), and the cut of ``truncation_mode``; without
            ``truncation_mode`` a longer example is refused, never passed on longer.
        truncation_mode: cut examples longer than ``max_length`` keeping their
            first (``"keep_start"``) or last (``"keep_end"``) tokens, as TRL does;
            ``None`` cuts nothing (a longer example is refused with
            ``padding="max_length"``, as ``DataCollatorForSeq2Seq`` refuses it). An
            example whose supervised tokens the cut removes entirely is refused,
            naming it: it would be trained as all -100, adding nothing.
        keep_eos: with ``"keep_start"``, an example that ended with
            ``eos_token_id`` and was cut ends with it again (its last kept token is
            replaced), supervised as the original EOS was: cut assistant turns
            still teach the model to stop.
        eos_token_id: the EOS id for ``keep_eos`` (default: the tokenizer's).
        pad_to_multiple_of: round the padded length (or, padding-free, the row's
            length) up to a multiple of this (at most 2**20).
        padding_side: ``"right"`` or ``"left"`` (default: the tokenizer's, else
            right); left padding puts each row's padding first, in every field
            (padded layout only: padding-free rows are padded at their end).
        label_pad_token_id: the label of padding (HF's ``label_pad_token_id``);
            unsupervised real tokens always get -100.
        return_tensors: ``"pt"`` (torch tensors) or ``"np"`` (NumPy arrays).
        boundary_safe_labels: padding-free, make each example's first label
            ``separator_id`` (-100), so no label predicts the next example's first
            token (as ``DataCollatorWithFlattening`` does).
        return_position_ids: emit ``position_ids`` (default: padding-free only).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free).
        return_seq_idx: emit ``seq_idx`` (padding-free).
        separator_id: the label of each example's first token padding-free
            (default -100).
        position_ids_start: the position of each example's first token (default 0).
        supervision: the field that says what is trained (``"labels"``,
            ``"loss_mask"``, ``"assistant_masks"``, ...), or ``None``; an example
            without it is refused, naming ``remove_unused_columns=False``
            (``Trainer`` drops dataset columns its model's ``forward`` does not name).
        float_fields: float example fields (names or :class:`~zephon_collate.fields.FloatField`
            specs): per token ``[B, L]`` (padding-free ``[1, N]``) beside the labels, 0.0 on
            padding, in their own dtype (float32 by default); one value per sequence ``[B]``.
        device, compile, num_boundaries, python_scalars, transforms, chain: as for
            :class:`Collator` (``python_scalars=False`` keeps ``max_length_q/k`` as tensors).

    Returns (from a call on a list of examples, a batched dict of lists, a list of
    token rows, read as examples of ``input_ids`` alone, or a columnar batch: an Arrow
    table, ``(values, offsets)`` pairs, see :mod:`zephon_collate._columns`):
        the dict of tensors (NumPy arrays with ``return_tensors="np"``) described in
        the module doc.

    Raises:
        TypeError, ValueError: for bad arguments, and for a bad example, naming it
            and the fix; ``ValueError`` for a padding-free batch whose examples are
            all empty, as ``DataCollatorWithFlattening`` does.

    Example:
        >>> from zephon_collate import Collator
        >>> collate = Collator.for_transformers(pad_token_id=0)
        >>> batch = collate([
        ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        ...     {"input_ids": [8, 9]},
        ... ])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, 7], [8, 9, -100]])
        >>> flatten = Collator.for_transformers(padding_free=True, return_flash_attn_kwargs=True)
        >>> flat = flatten([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> flat["labels"].tolist(), flat["position_ids"].tolist(), flat["cu_seq_lens_q"].tolist()
        ([[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5])
    """

    @suggest_options("Collator.for_transformers")
    def __init__(
        self,
        tokenizer: Any = None,
        model: Any = None,
        *,
        padding_free: bool = False,
        pad_token_id: int | None = None,
        padding: bool | Literal["longest", "max_length", "do_not_pad"] = True,
        max_length: int | None = None,
        truncation_mode: Literal["keep_start", "keep_end"] | None = None,
        keep_eos: bool = False,
        eos_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: Literal["right", "left"] | None = None,
        label_pad_token_id: int = IGNORE_INDEX,
        return_tensors: Literal["pt", "np"] = "pt",
        boundary_safe_labels: bool = True,
        return_position_ids: bool | None = None,
        return_flash_attn_kwargs: bool = False,
        return_seq_idx: bool = False,
        return_sequence_map: bool = False,
        separator_id: int | None = None,
        position_ids_start: int = 0,
        supervision: str | None = None,
        float_fields: Sequence[str | FloatField] = (),
        device: str | torch.device | None = None,
        compile: bool = False,
        num_boundaries: int | None = None,
        python_scalars: bool = True,
        transforms: Sequence[Transform] = (),
        chain: Sequence[Transform] | None = None,
    ) -> None:
        scope = locals()
        _check_model(model)
        arguments = TransformersOptions.arguments(scope)
        # Padding-free rows have no padding side: a left-padding tokenizer's does not apply to them.
        for name in ("pad_token_id", "eos_token_id") + (() if padding_free else ("padding_side",)):
            arguments[name] = _from_tokenizer(tokenizer, name, arguments[name])
        self.hf_options = TransformersOptions(**arguments)
        collator = {name: scope[name] for name in TRANSFORMERS_COLLATOR_OPTIONS}
        self.settings = CollatorOptions(**collator)
        if (self.settings.device is not None or self.settings.compile) and return_tensors != "pt":
            raise ValueError(f"{_OWNER}: device and compile need torch output; pass return_tensors='pt'")
        side = self.hf_options.padding_side or "right"
        self.layout = Transformers(self.hf_options, side, self.settings.num_boundaries)
        self._plans = Plans()

    def __repr__(self) -> str:
        return f"{_OWNER}({self.hf_options}, settings={self.settings})"


TRANSFORMERS_COLLATOR_OPTIONS = (
    "device",
    "compile",
    "num_boundaries",
    "python_scalars",
    "transforms",
    "chain",
)
"""The :class:`Collator` settings :class:`TransformersCollator` takes, after its layout options."""

Collator.for_transformers = TransformersCollator
