"""The ``transformers`` layout: Hugging Face examples to a causal LM's batch (``docs/hugging_face.md``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import numpy as np
import torch

from zephon_collate.core.checks import Keywords, check_bool, check_eos_token_id, check_ignore_index, check_int
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    CHOSEN_INDEX,
    COMPLETION_INDEX,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    DOCUMENT_IDS,
    EXAMPLE_LENGTHS,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    INT64_MAX,
    KL_INDEX,
    LABEL,
    LABELS,
    LOGITS_INDEX,
    LOSS_MASK,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MAX_PAD_MULTIPLE,
    NUM_SEQUENCES,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    REF_CHOSEN_LOGPS,
    REF_KL_LOGPS,
    REF_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_INDEX,
    SEQ_IDX,
    SEQUENCE_INDEX,
    SUPERVISION_MASKS,
    TOKEN_TYPE_IDS,
)
from zephon_collate.core.text import shown
from zephon_collate.functional import host
from zephon_collate.layouts.base import Layout, Stacked
from zephon_collate.layouts.native import check_boundary_count
from zephon_collate.layouts.stack import RowPadding, dense, row_places
from zephon_collate.layouts.vision import (
    COUNTS,
    CU_SEQLENS,
    MEDIA,
    MM_TOKEN_TYPE_IDS,
    MROPE_POSITIONS,
    Media,
    MRope,
    mrope_positions,
    read_media,
    with_dummy_image,
)
from zephon_collate.read.columns import Batch, Names, Ragged, Spread, places, restarted, row_any, row_of
from zephon_collate.read.examples import READ as _READ
from zephon_collate.read.examples import ExampleSpec, read_examples, supervision
from zephon_collate.read.fields import (
    TensorField,
    check_float_fields,
    spread_starts,
    to_label_positions,
)
from zephon_collate.read.rules import check_ids, kept_by_mask, unstarted
from zephon_collate.transforms import (
    AttentionMask,
    BoundaryMask,
    CopyKeys,
    CuSeqlens,
    LeftPadding,
    LossMask,
    MRopePositions,
    PaddingMask,
    PositionOffset,
    SegmentIds,
    SeparatorLabels,
    SequenceMap,
    Transform,
    UnshiftedLabels,
)

__all__ = ["Transformers", "TransformersOptions", "from_tokenizer", "in_float"]

_OWNER = "Collator.for_transformers"
_SUPERVISION = (LABELS, *SUPERVISION_MASKS)
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
    COMPLETION_INDEX,
    KL_INDEX,
    LABEL,
    REF_LOGPS,
    REF_KL_LOGPS,
)
"""Keys this layout and the post-training presets over it write, which a float field may not take."""
_PADDINGS: dict[object, str] = {
    True: "longest",
    "longest": "longest",
    "max_length": "max_length",
    False: "do_not_pad",
    "do_not_pad": "do_not_pad",
}


def from_tokenizer(tokenizer: Any, name: str, given: Any) -> Any:
    """``given``, or the tokenizer's attribute ``name`` where ``given`` is ``None``."""
    if given is not None or tokenizer is None:
        return given
    return getattr(tokenizer, name, None)


@dataclass(frozen=True, kw_only=True)
class TransformersOptions(Keywords):
    """The options of :meth:`Collator.for_transformers <zephon_collate.Collator.for_transformers>`.

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``: the default pad id, padding side and EOS id.
        model: accepted for ``DataCollatorForSeq2Seq(tokenizer, model=model)``; an encoder-decoder is refused.
        padding_free: the batch in one row with ``position_ids`` instead of padded rows.
        pad_token_id: the id padding gets; required for the padded layout.
        padding: ``True``/``"longest"``, ``"max_length"`` (static shapes) or ``False``/``"do_not_pad"``.
        max_length: the rows of ``padding="max_length"``, the cut of ``truncation_mode``; else a limit.
        truncation_mode: cut longer examples keeping their start (``"keep_start"``) or end (``"keep_end"``).
        keep_eos: with ``"keep_start"``, a cut example that ended with ``eos_token_id`` ends with it again.
        eos_token_id: the EOS id for ``keep_eos`` (default: the tokenizer's).
        pad_to_multiple_of: round the padded length (padding-free: the row's) up to a multiple of this.
        padding_side: ``"right"`` or ``"left"`` (default: the tokenizer's, else right; padded layout).
        label_pad_token_id: the label of padding; unsupervised real tokens always get -100.
        return_tensors: ``"pt"`` (torch tensors) or ``"np"`` (NumPy arrays).
        boundary_safe_labels: padding-free, make each example's first label ``separator_id``; left-padded,
            each row's first label -100 (the model's shift would predict it from the padding).
        return_position_ids: emit ``position_ids`` (default: padding-free only; padding-free, ``False``
            needs ``return_flash_attn_kwargs``, which then marks the documents).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free).
        return_seq_idx: emit ``seq_idx`` (padding-free).
        return_sequence_map: emit ``logits_index``, ``sequence_index`` and ``num_sequences`` (padding-free).
        separator_id: the label of each example's first token padding-free (default -100).
        position_ids_start: the position of each example's first token (default 0).
        supervision: the field that says what is trained (an example without it is refused), or ``None``.
        float_fields: float example fields (names or :class:`~zephon_collate.FloatField` specs).
        mrope: a Qwen-VL model's position rule (:class:`~zephon_collate.layouts.vision.MRope`), for media.
    """

    OWNER: ClassVar[str] = _OWNER
    tokenizer: Any = dataclasses.field(default=None, kw_only=False, compare=False, repr=False)
    model: Any = dataclasses.field(default=None, kw_only=False, compare=False, repr=False)
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
    float_fields: Sequence[str | TensorField] = ()
    mrope: MRope | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        owner = self.OWNER
        self._check_model()
        for name in ("pad_token_id", "eos_token_id") + (() if self.padding_free else ("padding_side",)):
            put(self, name, from_tokenizer(self.tokenizer, name, getattr(self, name)))
        put(self, "tokenizer", None)  # read once: the options hold plain values only
        put(self, "model", None)
        flags = ("padding_free", "keep_eos", "boundary_safe_labels", "return_flash_attn_kwargs")
        for name in (*flags, "return_seq_idx", "return_sequence_map"):
            put(self, name, check_bool(name, getattr(self, name), owner=owner))
        if not isinstance(self.padding, (str, bool)) or self.padding not in _PADDINGS:  # 1 == True: refused
            raise ValueError(
                f"{owner}: padding must be True/'longest', 'max_length' or False/'do_not_pad', got "
                f"{shown(self.padding)}"
            )
        put(self, "padding", _PADDINGS[self.padding])
        choices = (
            ("truncation_mode", (None, "keep_start", "keep_end")),
            ("padding_side", (None, "right", "left")),
            ("return_tensors", ("pt", "np")),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{owner}: {name} must be one of {allowed}, got {shown(getattr(self, name))}"
                )
        if self.max_length is not None:
            put(self, "max_length", check_int(owner, "max_length", self.max_length, 1, INT32_MAX))
        if self.pad_to_multiple_of is not None:
            multiple = check_int(owner, "pad_to_multiple_of", self.pad_to_multiple_of, 1, MAX_PAD_MULTIPLE)
            put(self, "pad_to_multiple_of", multiple)
        if self.pad_token_id is not None:
            put(self, "pad_token_id", check_int(owner, "pad_token_id", self.pad_token_id, 0))
        if self.eos_token_id is not None:  # a token id: >= 0 (a negative one would match no token)
            put(self, "eos_token_id", check_eos_token_id(self.eos_token_id, owner=owner))
        if self.separator_id is not None:  # a label value: -100 and other negatives allowed
            put(self, "separator_id", check_ignore_index(self.separator_id, owner=owner, name="separator_id"))
        label_pad = check_ignore_index(self.label_pad_token_id, owner=owner, name="label_pad_token_id")
        put(self, "label_pad_token_id", label_pad)
        put(self, "position_ids_start", check_int(owner, "position_ids_start", self.position_ids_start, 0))
        if self.return_position_ids is not None:
            flag = check_bool("return_position_ids", self.return_position_ids, owner=owner)
            put(self, "return_position_ids", flag)
        if self.supervision is not None and self.supervision not in self.SUPERVISING:
            raise ValueError(
                f"{owner}: {self.SUPERVISION_MEANS} one of {self.SUPERVISING}, got {shown(self.supervision)}"
            )
        reserved = (*_READ, "label", POSITIONS, PADDING_LENGTH, EXAMPLE_LENGTHS, *_WRITTEN, MM_TOKEN_TYPE_IDS)
        reserved += (*MEDIA, *CU_SEQLENS.values(), *COUNTS.values())
        put(self, "float_fields", check_float_fields(owner, self.float_fields, reserved))
        if self.mrope is not None and not isinstance(self.mrope, MRope):
            raise TypeError(
                f"{owner}: mrope must be an MRope (MRope.from_config(model.config)), got {shown(self.mrope)}"
            )
        self._check_combinations()

    SUPERVISING: ClassVar[tuple[str, ...]] = _SUPERVISION
    SUPERVISION_MEANS: ClassVar[str] = "supervision must name a field that says what is trained,"

    def _check_model(self) -> None:
        """Refuse an encoder-decoder ``model``."""
        config = getattr(self.model, "config", None)
        if getattr(config, "is_encoder_decoder", False) is True or hasattr(
            self.model, "prepare_decoder_input_ids_from_labels"
        ):
            raise ValueError(
                f"{_OWNER}: model {type(self.model).__name__} is an encoder-decoder model, which takes "
                "decoder_input_ids made from labels of their own length; this collator is for causal LMs, "
                "whose labels align with input_ids: use transformers.DataCollatorForSeq2Seq(tokenizer, "
                "model=model)"
            )

    def _check_combinations(self) -> None:
        owner = self.OWNER
        refusals = [
            (
                self.padding_free and (self.padding == "max_length" or self.padding_side == "left"),
                "padding_free=True puts the batch in one row; padding='max_length' and padding_side='left' "
                "pad rows of a padded batch: drop them, or pass padding_free=False",
            ),
            (
                not self.padding_free and self.pad_token_id is None,
                "the padded layout needs pad_token_id (or a tokenizer with a pad token; for one without, "
                "tokenizer.pad_token = tokenizer.eos_token), or pass padding_free=True",
            ),
            (
                self.pad_to_multiple_of is not None and self.pad_token_id is None,
                "pad_to_multiple_of pads with pad_token_id: give it (or a tokenizer with a pad token)",
            ),
            (
                self.padding == "do_not_pad"
                and self.pad_to_multiple_of is not None
                and not self.padding_free,
                "padding=False pads nothing, so pad_to_multiple_of cannot apply: drop it, or pass "
                "padding=True",
            ),
            (
                self.padding == "max_length" and self.max_length is None,
                "padding='max_length' needs max_length, the padded row length",
            ),
            (
                self.mrope is not None and self.positions_out != self.padding_free,
                "mrope=...: padding-free, position_ids [4, 1, N] carry each document's mRoPE positions "
                "(return_position_ids=False would drop them); padded, the model computes them from "
                "mm_token_type_ids and the grids (1-D position_ids would replace them): leave "
                "return_position_ids at its default",
            ),
            (
                self.mrope is not None and self.position_ids_start != 0,
                "mrope=... positions start at 0 in every plane, as the model's get_rope_index; drop "
                "position_ids_start",
            ),
            (
                self.truncation_mode is not None and self.max_length is None,
                f"truncation_mode={self.truncation_mode!r} needs max_length, the cut length",
            ),
            (
                self.keep_eos and (self.truncation_mode != "keep_start" or self.eos_token_id is None),
                "keep_eos=True puts the EOS back at the end of an example cut by "
                "truncation_mode='keep_start'; "
                "it needs that mode and eos_token_id (or a tokenizer with one)",
            ),
            (
                self.separator_id is not None and not self.boundary_safe_labels,
                "separator_id is the label of each packed example's first token, which "
                "boundary_safe_labels=False keeps as given; drop one of them",
            ),
            (
                self.return_sequence_map and not self.padding_free,
                "return_sequence_map=True describes the sequences of a padding-free row; padded rows are one "
                "sequence each, which the loss helpers read from attention_mask: drop it, or pass "
                "padding_free=True",
            ),
            (
                self.padding_free and self.return_position_ids is False and not self.return_flash_attn_kwargs,
                "padding_free=True with return_position_ids=False leaves nothing in the row that separates "
                "its documents: the model would attend from each into the next; leave return_position_ids "
                "at its default (TRL's collator returns position_ids padding-free whatever it says), or "
                "pass return_flash_attn_kwargs=True for a varlen kernel",
            ),
            (
                not self.padding_free and (self.return_flash_attn_kwargs or self.return_seq_idx),
                "return_flash_attn_kwargs and return_seq_idx describe the padding-free row; pass "
                "padding_free=True",
            ),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{owner}: {why}")

    @property
    def positions_out(self) -> bool:
        """Whether ``position_ids`` is an output (padding-free: by default)."""
        return self.padding_free if self.return_position_ids is None else self.return_position_ids

    @functools.cached_property
    def floats(self) -> tuple[TensorField, ...]:
        return cast(tuple[TensorField, ...], self.float_fields)

    @property
    def kind(self) -> Literal["torch", "numpy", "list"]:
        return "numpy" if self.return_tensors == "np" else "torch"

    @functools.cached_property
    def row_padding(self) -> RowPadding | None:
        """How padded rows are padded (``None`` without ``pad_token_id``)."""
        if self.pad_token_id is None:
            return None
        length = self.max_length if self.padding == "max_length" else None
        return RowPadding.create(self.pad_token_id, self.pad_to_multiple_of, self.OWNER, length)


class Transformers(Layout):
    """The ``transformers`` layout: HF examples to a causal LM's batch."""

    OWNER: str = _OWNER
    ORDER: tuple[str | None, ...] = (
        INPUT_IDS,
        TOKEN_TYPE_IDS,
        ATTENTION_MASK,
        LABELS,
        POSITION_IDS,
        CU_SEQ_LENS_Q,
        CU_SEQ_LENS_K,
        MAX_LENGTH_Q,
        MAX_LENGTH_K,
        SEQ_IDX,
    )
    INTERNAL: frozenset[str] = frozenset(
        {PADDING_LENGTH, POSITIONS, LOSS_MASK, PADDING_MASK, EXAMPLE_LENGTHS}
    )
    SCALARS: frozenset[str] = frozenset({MAX_LENGTH_Q, MAX_LENGTH_K, NUM_SEQUENCES, NUM_VALID_TOKENS})
    # return_flash_attn_kwargs and return_sequence_map shape the stacked batch too: not listed
    CHAIN_OPTIONS: ClassVar[Mapping[str, tuple[object, ...]]] = {
        "label_pad_token_id": (IGNORE_INDEX,),
        "padding_side": (None, "right"),
        "position_ids_start": (0,),
        "return_seq_idx": (False,),
        "separator_id": (None,),
    }
    UNIFORM_SUPERVISION: ClassVar[bool] = False
    """Refuse an example without a supervising field that another example carries (rollouts)."""
    READS_RESPONSE_MASK: ClassVar[bool] = False
    """Read verl's response-aligned ``response_mask`` (rollouts); elsewhere it is refused, never dropped."""

    options: TransformersOptions

    @property
    def kind(self) -> Literal["torch", "numpy", "list"]:
        return self.options.kind

    @property
    def floats(self) -> tuple[TensorField, ...]:
        return self.options.floats

    @property
    def positions_key(self) -> str:
        """Where the stacked positions live: ``position_ids`` when an output, else internal."""
        return POSITION_IDS if self.options.positions_out else POSITIONS

    # -- the chain ---------------------------------------------------------------------------------

    @property
    def boundary_safe(self) -> bool:
        # Left-padded, a row's first token sits after padding: the model's shift would train it as a
        # prediction from a padding place (right-padded, the shift drops it).
        options = self.options
        return options.boundary_safe_labels and (options.padding_free or options.padding_side == "left")

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The built-in transforms for a stacked batch holding ``keys``, each as the options ask."""
        options = self.options
        positions = self.positions_key
        steps: list[Transform] = []
        if self.boundary_safe:  # padded (left), each row is one document: its first token starts it
            steps.append(BoundaryMask(positions_key=positions if options.padding_free else None))
        if not options.padding_free:
            steps += [PaddingMask(), AttentionMask()]
        steps.append(UnshiftedLabels())
        padded = not options.padding_free or options.pad_to_multiple_of is not None
        if options.label_pad_token_id == IGNORE_INDEX:
            counts = PADDING_LENGTH if padded else None
            steps.append(LossMask(IGNORE_INDEX, padding_length_key=counts, out_key=None, count_key=None))
        else:  # the labels of padding get label_pad_token_id, ignored ones -100 (as HF pads them)
            steps.append(LossMask(IGNORE_INDEX, padding_length_key=None, out_key=None, count_key=None))
            steps.append(
                LossMask(options.label_pad_token_id, supervision_key=None, out_key=None, count_key=None)
            )
        if not options.padding_free:
            if options.padding_side == "left":
                moved = (INPUT_IDS, positions, TOKEN_TYPE_IDS, MM_TOKEN_TYPE_IDS, *self._token_floats)
                steps.append(LeftPadding([*(k for k in moved if k in keys), ATTENTION_MASK, LABELS]))
            if options.position_ids_start and positions in keys:
                steps.append(PositionOffset(options.position_ids_start, positions))
            return steps
        if options.separator_id is not None and options.boundary_safe_labels:
            steps.append(SeparatorLabels(options.separator_id, positions))
        if options.return_flash_attn_kwargs:
            cu = CuSeqlens(positions, True, self.settings.num_boundaries, CU_SEQ_LENS_Q, MAX_LENGTH_Q)
            steps += [cu, CopyKeys({CU_SEQ_LENS_Q: CU_SEQ_LENS_K, MAX_LENGTH_Q: MAX_LENGTH_K})]
        if options.return_seq_idx:
            steps.append(SegmentIds(positions, out_key=SEQ_IDX))
        if options.return_sequence_map:
            steps.append(SequenceMap(positions))
        if options.position_ids_start:
            steps.append(PositionOffset(options.position_ids_start, positions))
        if MROPE_POSITIONS in keys:
            steps.append(MRopePositions(positions, MROPE_POSITIONS))
        return steps

    @property
    def _token_floats(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.options.floats if spec.per_token)

    def _fills(self, pad_token_id: int) -> dict[str, int | float | Spread]:
        """What padding holds, field by field (0 where not named)."""
        return {INPUT_IDS: pad_token_id, **{spec.name: spec.fill for spec in self.options.floats}}

    # -- reading -------------------------------------------------------------------------------------

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read, check and lay the examples out (every error naming the example, the field and the fix)."""
        read = read_examples(batch, self.examples)
        fields, segments, per_sequence = read.fields, read.segments, read.per_sequence
        mrope = self.options.mrope
        media = None if mrope is None else read_media(batch, batch.names, mrope)
        if media is not None and mrope is not None and mrope.dummy_image and media.empty:
            if segments is not None or per_sequence or not self.options.padding_free:
                raise ValueError(
                    f"{self.OWNER}: MRope(dummy_image=...) adds its image as one more document of a "
                    "padding-free batch (padding_free=True), without seq_lengths or per-sequence float fields"
                )
            fills = {LABELS: IGNORE_INDEX, ATTENTION_MASK: 1, **{s.name: s.fill for s in self.options.floats}}
            fields, media = with_dummy_image(fields, fills, media, mrope)
            return [self.layout(fields, segments, per_sequence, batch.names, media, dummy=True)]
        return [self.layout(fields, segments, per_sequence, batch.names, media)]

    @functools.cached_property
    def examples(self) -> ExampleSpec:
        """What this layout reads of its examples."""
        options = self.options
        return ExampleSpec(
            self.OWNER,
            options.floats,
            options.supervision,
            vision=options.mrope is not None,
            media_fix=(
                "pass mrope=MRope.from_config(model.config) (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or "
                "MRope(rule=...) for another model's positions"
                if self.OWNER == _OWNER
                else None
            ),
            response_mask=self.READS_RESPONSE_MASK,
            uniform=self.UNIFORM_SUPERVISION,
        )

    # -- the layout ----------------------------------------------------------------------------------

    def layout(
        self,
        fields: dict[str, Ragged],
        segments: Ragged | None,
        per_sequence: dict[str, list[np.ndarray]],
        names: Names,
        media: Media | None = None,
        *,
        dummy: bool = False,
    ) -> Stacked:
        """The read fields to the chain's input: supervision, padding dropped, truncation, rows, media
        (``dummy``: the last example is ``MRope.dummy_image``'s document, no sequence)."""
        options = self.options
        per_token: dict[str, Ragged] = {INPUT_IDS: fields[INPUT_IDS], LOSS_MASK: supervision(fields, names)}
        per_token.update(
            (name, fields[name]) for name in (TOKEN_TYPE_IDS, MM_TOKEN_TYPE_IDS) if name in fields
        )
        per_token.update((name, fields[name]) for name in self._token_floats)
        positions = _positions(fields, segments, names)
        if positions is not None:
            per_token[POSITIONS] = positions
        if ATTENTION_MASK in fields:
            keep = kept_by_mask(fields[ATTENTION_MASK], ATTENTION_MASK, names)
            if not keep.all():
                per_token = {name: field.select(keep) for name, field in per_token.items()}
        if positions is not None:
            _check_started(positions, per_token[POSITIONS], segments is None, options.padding_free, names)
        if options.truncation_mode is not None:
            per_token = self._truncated(per_token, names)
        elif options.max_length is not None and options.padding != "max_length":
            self._check_max_length(per_token[INPUT_IDS].lengths, options.max_length, names)
        if positions is not None and not options.padding_free:
            _check_one_document(per_token[POSITIONS], names)
        if POSITIONS not in per_token and (options.padding_free or options.positions_out):
            offsets = per_token[INPUT_IDS].offsets
            per_token[POSITIONS] = Ragged(places(offsets), offsets, per_token[INPUT_IDS].lengths)
        if options.position_ids_start and POSITIONS in per_token:
            self._check_offset(per_token, names)
        if media is not None and options.mrope is not None:  # checked on what is kept: no run cut
            kept = per_token[INPUT_IDS]
            documents = _starts(per_token)  # an example packed of several: each document from 0
            types = per_token[MM_TOKEN_TYPE_IDS]
            planes = mrope_positions(kept, types, media, options.mrope, names, documents)
            if options.padding_free:  # padded, the model computes them from the types and grids
                per_token[MROPE_POSITIONS] = Ragged(planes, kept.offsets, kept.lengths)
        starts = None
        for spec in options.floats:
            if spec.align == "label":  # moved to the token each prediction is scored against
                starts = _starts(per_token) if starts is None else starts
                per_token[spec.name] = to_label_positions(per_token[spec.name], starts, spec.fill)
        if POSITIONS in per_token and self.positions_key != POSITIONS:
            per_token[self.positions_key] = per_token.pop(POSITIONS)
        stacked = self.flat(per_token) if options.padding_free else self.padded(per_token, names)
        data = stacked.data
        if options.return_sequence_map:  # the map itself is the chain's (SequenceMap)
            lengths = per_token[INPUT_IDS].lengths[: -1 if dummy else None]  # sequences: the examples'
            data[EXAMPLE_LENGTHS] = lengths.astype(np.int64)[None]
        for spec in options.floats:
            value = np.stack(per_sequence[spec.name]) if not spec.per_token else data[spec.name]
            data[spec.name] = in_float(value, spec)
        if media is not None and options.mrope is not None:
            data.update(media.joined(options.mrope.vision_cu_seqlens))
        limit = self.settings.num_boundaries
        if options.padding_free and limit is not None and options.return_flash_attn_kwargs:
            check_boundary_count(data[self.positions_key], True, limit, names)
        return stacked

    def _truncated(self, per_token: dict[str, Ragged], names: Names) -> dict[str, Ragged]:
        """Each example cut to ``max_length`` tokens (keep its start or its end)."""
        options = self.options
        limit = options.max_length
        assert limit is not None
        tokens = per_token[INPUT_IDS]
        lengths = tokens.lengths
        if not bool((lengths > limit).any()):
            return per_token
        place = places(tokens.offsets)
        keep = (
            place < limit
            if options.truncation_mode == "keep_start"
            else place >= np.repeat(lengths - limit, lengths)
        )
        if MM_TOKEN_TYPE_IDS in per_token:  # vision placeholders stand for an image: never cut
            kept = keep.copy()
            if options.keep_eos:  # the EOS put back takes the last kept token's place
                rows = _ending_in_eos(tokens, limit, options.eos_token_id)[1]
                kept[tokens.offsets[rows] + limit - 1] = False
            self._check_no_image_cut(per_token[MM_TOKEN_TYPE_IDS], kept, names)
        cut = {name: field.select(keep) for name, field in per_token.items()}
        if options.keep_eos:
            self._put_back_eos(per_token, cut)
        if POSITIONS in cut and options.truncation_mode == "keep_end":
            cut[POSITIONS] = restarted(cut[POSITIONS], lengths > limit)
        before, after = per_token[LOSS_MASK], cut[LOSS_MASK]
        lost = np.flatnonzero(
            row_any(before.host != 0, before.offsets) & ~row_any(after.host != 0, after.offsets)
        )
        if lost.size:
            raise ValueError(
                f"{names(int(lost[0]))}: has no supervised token left after truncation to "
                f"max_length={limit} ({options.truncation_mode}); trained as is it would add nothing: drop "
                "or shorten such examples, raise max_length, or use the other truncation_mode"
            )
        return cut

    def _check_no_image_cut(self, types: Ragged, keep: np.ndarray, names: Names) -> None:
        """Refuse a ``max_length`` cut that removes vision placeholder tokens."""
        lost = ~keep & (types.host != 0)
        if not lost.any():
            return
        row = row_of(types.offsets, int(np.flatnonzero(lost)[0]))
        start, end = int(types.offsets[row]), int(types.offsets[row + 1])
        gone = types.host[start:end][lost[start:end]]
        counts = [(int((gone == kind).sum()), name) for kind, name in ((1, "image"), (2, "video"))]
        what = " and ".join(f"{count} of its {name} placeholder tokens" for count, name in counts if count)
        options = self.options
        raise ValueError(
            f"{names(row)}: max_length={options.max_length} with truncation_mode={options.truncation_mode!r} "
            f"would cut {what} ({shown(MM_TOKEN_TYPE_IDS)} != 0) away"
            f"{' (keep_eos=True puts the EOS on the last kept token)' if options.keep_eos else ''}, and a "
            "truncation must never cut an image or a video; cut the example's text before its images and "
            "videos, or raise max_length"
        )

    def _put_back_eos(self, per_token: dict[str, Ragged], cut: dict[str, Ragged]) -> None:
        """A cut example that ended in EOS ends in EOS again, with the EOS's own values."""
        tokens, limit = per_token[INPUT_IDS], self.options.max_length
        ends, rows = _ending_in_eos(tokens, limit, self.options.eos_token_id)
        if not rows.size:
            return
        last = cut[INPUT_IDS].offsets[rows + 1] - 1
        by_label = {spec.name for spec in self.options.floats if spec.align == "label"}
        for name, field in cut.items():
            if name == POSITIONS:
                continue
            values = field.host.copy()
            values[last] = per_token[name].host[ends[rows]]
            if name in by_label and limit is not None and limit > 1:
                values[last - 1] = per_token[name].host[ends[rows] - 1]
            cut[name] = Ragged(values, field.offsets)

    def _check_offset(self, per_token: dict[str, Ragged], names: Names) -> None:
        """Refuse a ``position_ids_start`` that would carry a position past int64."""
        options, positions = self.options, per_token[POSITIONS]
        highest = int(positions.host.max()) if positions.host.size else 0  # padding's positions are 0
        if highest > INT64_MAX - options.position_ids_start:
            row = row_of(positions.offsets, int(np.argmax(positions.host))) if positions.host.size else 0
            raise ValueError(
                f"{names(row)}: positions up to {highest} plus position_ids_start="
                f"{options.position_ids_start} pass int64's largest value; give a smaller position_ids_start"
            )

    def _check_max_length(self, lengths: np.ndarray, limit: int, names: Names) -> None:
        """Refuse an example longer than ``limit`` (``max_length`` is never ignored)."""
        longer = np.flatnonzero(lengths > limit)
        if longer.size:
            index = int(longer[0])
            given = self.options.max_length
            rounded = "" if limit == given else f" (rounded up to pad_to_multiple_of: {limit})"
            raise ValueError(
                f"{names(index)}: has {int(lengths[index])} tokens, more than max_length={given}{rounded}; "
                "pass truncation_mode='keep_start' (TRL's default) or 'keep_end' to cut such examples, or "
                "raise max_length"
            )

    def padded(self, per_token: dict[str, Ragged], names: Names) -> Stacked:
        """``[B, L]`` rows padded on the right (``LeftPadding`` moves the padding left, in the chain)."""
        padding = self.options.row_padding
        assert padding is not None
        lengths = per_token[INPUT_IDS].lengths
        width = padding.width(lengths)
        if self.options.padding == "max_length":
            self._check_max_length(lengths, width, names)
        if self.options.padding == "do_not_pad" and bool((lengths != width).any()):
            raise ValueError(
                f"{self.OWNER}: padding=False (do_not_pad) needs examples of one length, got lengths "
                f"{shown(lengths.tolist())}; pad them (padding=True)"
            )
        fills = self._fills(padding.pad_token_id)
        left = self.options.padding_side == "left"  # a Spread fill: numbered where LeftPadding puts it
        at = functools.partial(row_places, lengths, width, left=left)
        per_token = spread_starts(per_token, self.options.floats, functools.partial(_starts, per_token), at)
        data: dict[str, Any] = {
            name: dense(field, width, fills.get(name, 0), left=left) for name, field in per_token.items()
        }
        data[PADDING_LENGTH] = np.subtract(width, lengths, dtype=np.int64)  # one op: no astype copy
        return Stacked(data)

    def flat(self, per_token: dict[str, Ragged]) -> Stacked:
        """One row ``[1, N]``, padded to ``pad_to_multiple_of`` (each pad token a segment of its own)."""
        total = int(per_token[INPUT_IDS].values.shape[0])
        if not total:
            raise ValueError(
                f"{self.OWNER}: every {self.ITEM} of the batch is empty; padding_free needs a token (give "
                "non-empty ones, or pad them: padding_free=False)"
            )
        multiple = self.options.pad_to_multiple_of
        width = total if multiple is None else -(-total // multiple) * multiple
        one_row, length = np.array([0, total], dtype=np.int64), np.array([total], dtype=np.int64)
        fills = self._fills(self.options.pad_token_id or 0)
        at = functools.partial(np.arange, total, dtype=np.int64)  # a Spread fill: its place in this row
        per_token = spread_starts(per_token, self.options.floats, functools.partial(_starts, per_token), at)
        data: dict[str, Any] = {
            name: dense(Ragged(field.values, one_row, length), width, fills.get(name, 0))
            for name, field in per_token.items()
        }
        data[PADDING_LENGTH] = np.array([width - total], dtype=np.int64)
        return Stacked(data)


def _positions(fields: dict[str, Ragged], segments: Ragged | None, names: Names) -> Ragged | None:
    """Segment-restarting positions from ``seq_lengths`` or ``position_ids``, or ``None``."""
    tokens = fields[INPUT_IDS]
    if segments is not None:
        sizes = np.asarray(segments.values).astype(np.int64, copy=False)
        starts, ends = segments.offsets[:-1], segments.offsets[1:]
        limit = np.repeat(tokens.lengths, ends - starts)  # each size within its example: no sum wraps
        totals = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(np.clip(sizes, 0, limit), out=totals[1:])
        negative = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum((sizes < 0) | (sizes > limit), out=negative[1:])
        bad = (totals[ends] - totals[starts] != tokens.lengths) | (negative[ends] > negative[starts])
        if bad.any():
            index = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{names(index)}: 'seq_lengths' {shown(sizes[starts[index] : ends[index]].tolist())} "
                f"must be lengths >= 0 that add up to the example's {int(tokens.lengths[index])} tokens "
                "(as TRL's packing writes them)"
            )
        documents = sizes[sizes > 0]
        bounds = np.zeros(documents.size + 1, dtype=np.int64)
        np.cumsum(documents, out=bounds[1:])
        return Ragged(places(bounds), tokens.offsets, tokens.lengths)
    if POSITION_IDS not in fields:
        return None
    given = fields[POSITION_IDS]
    check_ids(given, POSITION_IDS, names)
    return given.cast(torch.int64)


def _check_started(given: Ragged, kept: Ragged, ids: bool, padding_free: bool, names: Names) -> None:
    """Positions start at 0 on each example's first token, or on its first token the attention mask
    keeps: Hugging Face gives left padding any position (``[1, 0, 1, 2]`` for the mask ``[0, 1, 1, 1]``).
    Padding-free, the kept tokens must start at 0, or the example would continue the one before it."""
    has = kept.lengths > 0
    firsts = np.zeros(kept.rows, dtype=np.int64)
    firsts[has] = kept.host[kept.offsets[:-1][has]]
    found = unstarted(given, ~has | (firsts != 0)) if ids else None
    if found is not None:
        raise ValueError(
            f"{names(found[0])}: 'position_ids' must start at 0 and restart at 0 at each packed "
            f"document (they start at {found[1]}); give positions counted from 0"
        )
    found = unstarted(kept) if padding_free else None
    if found is not None:
        raise ValueError(
            f"{names(found[0])}: its attention_mask drops its first tokens, and the positions "
            f"of the tokens it keeps start at {found[1]} ('position_ids' or 'seq_lengths' count "
            "the dropped ones); give positions counted from 0 over the kept tokens "
            "(attention_mask.cumsum(-1) - 1), or drop them"
        )


def _ending_in_eos(tokens: Ragged, limit: int | None, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each example's last token, and the examples longer than ``limit`` that end in ``eos``."""
    ends = tokens.offsets[1:] - 1
    return ends, np.flatnonzero((tokens.lengths > limit) & (tokens.host[np.maximum(ends, 0)] == eos))


def _starts(per_token: dict[str, Ragged]) -> np.ndarray:
    """``[N]`` booleans: each example's first token and each packed document's."""
    offsets = per_token[INPUT_IDS].offsets
    positions = per_token.get(POSITIONS, per_token.get(POSITION_IDS))
    return host.ragged_starts(offsets, None if positions is None else positions.host)


def _check_one_document(positions: Ragged, names: Names) -> None:
    """Padded rows must hold one document each (packed rows would attend across them)."""
    inner = np.flatnonzero(host.ragged_starts(positions.offsets, positions.host))
    inner = inner[~np.isin(inner, positions.offsets)]  # a start that is not its example's first token
    if inner.size:
        raise ValueError(
            f"{names(row_of(positions.offsets, int(inner[0])))}: holds several documents (from "
            "'seq_lengths' or "
            "restarting 'position_ids'); padded, they would attend to each other: pass padding_free=True, "
            "which keeps them apart (as TRL's SFTTrainer does for packed data)"
        )


def in_float(value: Any, spec: TensorField) -> Any:
    """A float field's stacked values in its dtype (bfloat16, which NumPy lacks: a tensor)."""
    if spec.dtype == torch.bfloat16:
        return torch.from_numpy(np.asarray(value)).to(torch.bfloat16)
    return np.asarray(value).astype(spec.host_dtype, copy=False)
