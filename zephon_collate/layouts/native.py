"""The reference page's layout: records in, ``to_training``'s (and the ``Collator``'s) outputs out."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import numpy as np
import torch

from zephon_collate.core.checks import check_bool, warn_user
from zephon_collate.core.keys import (
    CU_SEQLENS,
    IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    RESPONSE_MASK,
    TEXTS,
)
from zephon_collate.core.records import PADDING_LENGTH_TAG, SEGMENTS_TAG
from zephon_collate.core.text import shown
from zephon_collate.functional import host
from zephon_collate.layouts.base import Layout, Stacked, per_row_outputs
from zephon_collate.layouts.stack import RowPadding, dense, stack_rows
from zephon_collate.layouts.training import TrainingOptions
from zephon_collate.read.columns import (
    Batch,
    Names,
    Ragged,
    Row,
    Spread,
    as_numpy,
    concat,
    filled,
    numpy_dtype,
)
from zephon_collate.read.fields import TensorField, check_float_fields, read_floats, value_rows
from zephon_collate.read.rules import (
    FOREIGN_SUPERVISION,
    SUPERVISING_FIELDS,
    SUPERVISION_NAMES,
    check_fits,
    check_ids,
    check_zero_one,
    declared_padding,
    misaligned,
    misspelled,
    near_miss,
    positions_field,
    refuse_media,
    unread_documents,
    unread_message,
    unread_supervision,
    unstarted,
)
from zephon_collate.transforms import Chain, Transform

__all__ = ["CollatorOptions", "Native", "check_boundary_count"]

_WRITTEN = (INPUT_IDS, LABELS, POSITIONS, POSITION_IDS, LOSS_MASK, PADDING_LENGTH, PADDING_MASK)
"""Names a float field may not take: fields the collate path reads or writes itself."""


@dataclass(frozen=True, kw_only=True)
class CollatorOptions(TrainingOptions):
    """The :class:`~zephon_collate.Collator`'s layout options: ``to_training``'s, and these.

    Parameters:
        pad_token_id: pad ragged rows on the right to the longest with this id (counted as their padding).
        pad_to_multiple_of: round the padded length up to a multiple of this (at most 2**20).
        boundary_safe_labels: ignore every label whose target starts a new segment (on by default).
        float_fields: float payload fields (names or ``FloatField`` specs), in their dtype, 0.0 on padding.
    """

    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    boundary_safe_labels: bool = True
    float_fields: Sequence[str | TensorField] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        put = object.__setattr__
        safe = check_bool("boundary_safe_labels", self.boundary_safe_labels, owner="Collator")
        put(self, "boundary_safe_labels", safe)
        padding = RowPadding.create(self.pad_token_id, self.pad_to_multiple_of)
        if (
            padding is not None
            and self.output.kind != "list"
            and padding.pad_token_id > torch.iinfo(self.output.torch_dtype).max
        ):
            raise ValueError(
                f"Collator: pad_token_id {padding.pad_token_id} does not fit dtype "
                f"{self.output.torch_dtype}; pick a wider dtype"
            )
        reserved = (*self.generated_keys(), *self.extra_fields, *_WRITTEN)
        put(self, "float_fields", check_float_fields("Collator", self.float_fields, reserved))


class Native(Layout):
    """The page's layout over records: ``to_training`` (warns) or the ``Collator`` (refuses)."""

    OWNER: str = "Collator"
    READS: ClassVar[Literal["records", "examples"]] = "records"
    ROW_OUTPUTS: ClassVar[tuple[str, ...]] = (IDS, TEXTS)
    CHAIN_OPTIONS: ClassVar[Mapping[str, tuple[object, ...]]] = {
        "return_labels": (False,),
        "return_num_valid_tokens": (False,),
        "return_loss_mask": (False,),
        "return_cu_seqlens": (False,),
        "return_padding_mask": (False,),
        "eos_mask_loss": (False,),
        "position_mode": ("preserve",),
        "flatten": (False,),
        "ignore_index": (IGNORE_INDEX,),
    }
    ITEM: str = "record"
    TORCH_OUTPUT: ClassVar[str] = "dtype='auto' or a torch dtype"
    ORDER: tuple[str | None, ...] = (
        IDS,
        TEXTS,
        INPUT_IDS,
        LABELS,
        POSITIONS,
        None,
        NUM_VALID_TOKENS,
        LOSS_MASK,
        CU_SEQLENS,
        MAX_SEQLEN,
        PADDING_MASK,
    )
    SCALARS: frozenset[str] = frozenset({MAX_SEQLEN, NUM_VALID_TOKENS})

    options: TrainingOptions

    @functools.cached_property
    def collator(self) -> CollatorOptions | None:
        """The Collator's own options (``None`` for ``to_training``'s)."""
        return self.options if isinstance(self.options, CollatorOptions) else None

    @property
    def strict(self) -> bool:
        """Refuse what ``to_training`` would warn of (the Collator)."""
        return self.collator is not None

    @functools.cached_property
    def padding(self) -> RowPadding | None:
        found = self.collator
        return None if found is None else RowPadding.create(found.pad_token_id, found.pad_to_multiple_of)

    @functools.cached_property
    def floats(self) -> tuple[TensorField, ...]:
        return () if self.collator is None else tuple(cast(Sequence[TensorField], self.collator.float_fields))

    @property
    def boundary_safe(self) -> bool:
        return self.collator is not None and self.collator.boundary_safe_labels

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return tuple(self.options.extra_fields)

    @property
    def renames(self) -> dict[str, str]:
        return dict(self.options.rename_fields or ())

    @property
    def excluded(self) -> tuple[str, ...]:
        return tuple(self.options.exclude_fields)

    @property
    def tokens_field(self) -> str:
        return self.options.tokens_field

    @property
    def kind(self) -> Literal["torch", "numpy", "list"]:
        return self.options.kind

    # -- the chain -----------------------------------------------------------------------------------

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The page's chain (:meth:`TrainingOptions.chain`) for a stacked batch holding ``keys``."""
        like_labels = tuple(spec.name for spec in self.floats if spec.shifted_like_labels)
        unshifted = tuple(spec.name for spec in self.floats if not spec.per_token)
        return self.options.chain(
            keys,
            boundary_safe=self.boundary_safe,
            num_boundaries=self.settings.num_boundaries,
            like_labels=like_labels,
            unshifted=unshifted,
        )

    def empty(self) -> dict[str, Any]:
        """The page's outputs of an empty batch: each field the chain emits, empty."""
        options = self.options
        keys = [INPUT_IDS, PADDING_LENGTH, *options.extra_fields, *(spec.name for spec in self.floats)]
        if options.return_cu_seqlens and POSITIONS not in keys:
            keys.append(POSITIONS)  # CuSeqlens reads them
        builtin = self.chain(keys) if self.settings.chain is None else self.settings.chain
        chain = Chain(*builtin, *self.settings.transforms)
        final = chain.output_keys(keys)
        shown_keys = [
            key
            for key in final
            if key != POSITIONS or options.position_mode == "sequence" or POSITIONS in options.extra_fields
        ]
        values = chain.empty_outputs({NUM_VALID_TOKENS: 0})
        return {name: values.get(key, []) for key, name in self.output_names(shown_keys, empty=True)}

    # -- the layout ---------------------------------------------------------------------------------

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read, check and stack ``batch``: one :class:`Stacked`, or one per row (ragged list output)."""
        options = self.options
        names = batch.names
        refuse_media(batch, "the Collator")
        tokens_field = batch.tokens if batch.tokens is not None else batch.tokens_field(options.tokens_field)
        tokens = batch.get(tokens_field, "ids")
        assert tokens is not None
        lengths = tokens.lengths
        per_token: dict[str, Ragged] = {INPUT_IDS: tokens}
        per_record: dict[str, Sequence[Row] | np.ndarray] = {}
        for name, required, must_align in self._wanted():
            source = self._source(batch, name)
            if source not in batch:
                if required:
                    batch.require(source)
                continue
            kind: Literal["ids", "values"] = "ids" if name == POSITIONS else "values"
            field, rows = _read_field(batch, source, kind, tokens, must_align)
            if field is not None:
                per_token[name] = field
            else:
                per_record[name] = rows
        self._check_supervision(batch, tokens, {*per_token, *per_record})
        yours = [*(self.settings.chain or ()), *self.settings.transforms]
        if self.boundary_safe and (options.return_labels or self.labels_unbounded(yours) is not None):
            _check_documents_found(batch, self._source(batch, POSITIONS))
        self._check_values(per_token, names)
        for spec in self.floats:  # checked by read_floats: finite, in range, one value per token or sequence
            floats = read_floats(value_rows(batch, spec), lengths, spec, names)
            if isinstance(floats, Ragged):
                per_token[spec.name] = floats
            else:
                per_record[spec.name] = list(floats)
        needed = options.needs_padding_lengths or self.settings.chain is not None
        needed |= self.padding is not None and POSITIONS in per_token  # the padding's positions continue
        counts, declared = (
            declared_padding(batch, lengths) if needed else (np.zeros(batch.rows, np.int64), None)
        )
        if self.padding is not None and options.needs_padding_lengths and declared is not None:
            self._check_no_padding_given(tokens, ~declared, names)
        return self._stacked(batch, per_token, per_record, counts)

    def _source(self, batch: Batch, name: str) -> str:
        """The field ``name`` is read from (the Collator reads ``position_ids`` as the positions)."""
        if name != POSITIONS or not self.strict:
            return name
        return positions_field(batch) or POSITIONS

    def _wanted(self) -> list[tuple[str, bool, bool]]:
        """``(field, required, aligned)`` of each field read besides the tokens."""
        options = self.options
        labels = options.return_labels
        reads_positions = options.reads_positions or (self.boundary_safe and labels)
        must_align = labels or options.flatten
        wanted = [(LOSS_MASK, LOSS_MASK in options.extra_fields, True)]
        if reads_positions or POSITIONS in options.extra_fields or options.return_cu_seqlens:
            required = POSITIONS in options.extra_fields or options.return_cu_seqlens
            wanted.append((POSITIONS, required, True))
        wanted += [(name, True, must_align) for name in options.data_fields]
        return wanted

    def _check_supervision(self, batch: Batch, tokens: Ragged, read: set[str]) -> None:
        """A supervision field not read: refused by the Collator, warned of by ``to_training``."""
        if not (self.strict or self.options.return_labels):
            return
        # to_training never raises for a field it does not use: one it cannot read is warned of
        unreadable: list[str] | None = None if self.strict else []
        options = self.options
        given = (*read, *options.extra_fields, *(spec.name for spec in self.floats), options.tokens_field)
        near = misspelled(batch.fields, SUPERVISION_NAMES, (*given, POSITION_IDS))
        if near is not None:
            name, meant = near
            index = int(np.flatnonzero(batch.carried(name))[0])
            hint = {LOSS_MASK: "", RESPONSE_MASK: " (for rollouts, Collator.for_rollouts reads it)"}.get(
                meant, " (for Hugging Face examples, Collator.for_transformers reads it)"
            )
            self._refuse(
                near_miss(
                    batch.names(index), name, meant, f"{hint}, or list it in extra_fields to read it as data"
                )
            )
        for name in SUPERVISING_FIELDS:  # another stack's, one value per example: a class, not supervision
            if name in batch and name not in (*read, *FOREIGN_SUPERVISION) and not batch.is_list(name):
                raise TypeError(
                    f"field {shown(name)} is not a list column (one row of values per example) beside the "
                    "batch's columns, so what it supervises cannot be checked; give it as a list column or a "
                    "(values, offsets) pair, or drop it"
                )
        loss_mask = None
        if LOSS_MASK in read and LOSS_MASK in batch:
            loss_mask = batch.get(LOSS_MASK, "values")
        read = {*read, *(spec.name for spec in self.floats)}  # read as data: never supervision
        found = unread_supervision(batch, tokens, read, loss_mask, unreadable)
        if found is not None:
            self._refuse(unread_message(batch.names(found[0]), found[1], "collator"))
        needs_documents = options.return_labels or options.return_cu_seqlens  # the outputs they change
        fix = _PACKED_FIX if PADDING_LENGTH_TAG in batch else _DOCUMENTS_FIX  # pack_columns' rows
        problem = unread_documents(batch, read, fix, unreadable=unreadable) if needs_documents else None
        if problem is not None and (self.boundary_safe or not self.strict):
            self._refuse(problem)
        if unreadable:
            warn_user(
                f"to_training: {unreadable[0]}; the field is not read here, labels come from the tokens"
            )

    def _refuse(self, problem: str) -> None:
        if self.strict:
            raise ValueError(problem)
        warn_user(f"to_training: {problem}; the labels are made from the tokens, as the reference page says")

    def _check_values(self, per_token: Mapping[str, Ragged], names: Names) -> None:
        """The data checks that need values: ids >= 0, 0/1 supervision, values the dtype holds."""
        options = self.options
        dtype = options.output.torch_dtype
        tokens = per_token[INPUT_IDS]
        check_ids(tokens, INPUT_IDS, names)
        floats = {spec.name for spec in self.floats}
        for name, values in per_token.items():
            if name == LOSS_MASK and options.return_labels:
                check_zero_one(values, LOSS_MASK, names, "1 for supervised tokens, 0 for the rest")
            elif name not in floats:
                check_fits(values, dtype, name, names)
        mask = per_token.get(LOSS_MASK) if options.return_labels else None  # read only for the labels
        if mask is not None and mask.values.ndim > 1 and mask.values.shape[1:] != tokens.values.shape[1:]:
            first = int(np.argmax(mask.lengths > 0)) if mask.rows else 0
            raise ValueError(
                f"{names(first)}: field {shown(LOSS_MASK)} has shape {tuple(mask.values.shape[1:])} per "
                f"token, its tokens {tuple(tokens.values.shape[1:])}; give one 0/1 per token"
            )
        if tokens.values.ndim != 1 and tokens.rows:  # rows of [S, C] tokens
            option = "eos_mask_loss" if options.eos_mask_loss else None
            if options.return_padding_mask and options.output.kind != "list":
                option = option or "return_padding_mask"
            if option is not None:
                first = int(np.argmax(tokens.lengths > 0))
                raise ValueError(
                    f"{names(first)}: field {shown(INPUT_IDS)} has rows of shape "
                    f"{tuple(tokens.values.shape[1:])} per token, and {option} needs 2-D scalar token rows "
                    f"([B, S]): give one id per token, or turn {option} off"
                )

    def _check_no_padding_given(self, tokens: Ragged, undeclared: np.ndarray, names: Names) -> None:
        """Refuse a row that ends in ``pad_token_id`` without declaring its padding."""
        assert self.padding is not None
        pad = self.padding.pad_token_id
        values, offsets = tokens.host, tokens.offsets
        if values.ndim != 1 or not values.size:
            return
        nonempty = tokens.lengths > 0
        bad = np.zeros(tokens.rows, dtype=bool)
        bad[nonempty] = values[offsets[1:][nonempty] - 1] == pad
        found = np.flatnonzero(bad & undeclared)
        if found.size:
            raise ValueError(
                f"{names(int(found[0]))}: ends in pad_token_id {pad} and declares no padding "
                "(meta.padding_length): padding already in the row, which the labels would train as real "
                "tokens. Give the rows without their padding (the Collator pads them), or declare it "
                "(meta.padding_length, as pack_flat writes it), or collate Hugging Face examples with their "
                "attention_mask through Collator.for_transformers(...). If that id is a real token here "
                "(an EOS), pad with another id: padding's id is never trained"
            )

    # -- stacking -----------------------------------------------------------------------------------

    def _stacked(
        self,
        batch: Batch,
        per_token: dict[str, Ragged],
        per_record: dict[str, Sequence[Row] | np.ndarray],
        counts: np.ndarray,
    ) -> list[Stacked]:
        """The read and checked fields stacked: one :class:`Stacked`, or one per row (ragged lists)."""
        lengths = per_token[INPUT_IDS].lengths
        outputs = per_row_outputs(batch)
        width = self._width(lengths, batch.names)
        if width is None:  # ragged lists: each row a batch of its own, named by its place in the batch
            return [
                Stacked(
                    self._stack(
                        {name: f.take(index) for name, f in per_token.items()},
                        {name: rows[index : index + 1] for name, rows in per_record.items()},
                        counts[index : index + 1],
                        int(lengths[index]),
                        lambda _, index=index: batch.names(index),  # type: ignore[misc]
                    ),
                    {key: values[index : index + 1] for key, values in outputs.items()},
                    batch.metas[index : index + 1],
                )
                for index in range(len(lengths))
            ]
        if self.padding is not None:
            counts = counts + (width - lengths)
        return [Stacked(self._stack(per_token, per_record, counts, width, batch.names), outputs, batch.metas)]

    def _width(self, lengths: np.ndarray, names: Names) -> int | None:
        """The stacked row length; ``None`` for ragged list output. Unequal rows without padding raise."""
        if self.padding is not None:
            return self.padding.width(lengths)
        if bool((lengths == lengths[0]).all()):
            return int(lengths[0])
        if self.options.output.kind == "list":
            return None
        index = int(np.flatnonzero(lengths != lengths[0])[0])
        raise ValueError(
            f"cannot stack token rows of unequal shape into a tensor: {names(0)} has shape "
            f"({int(lengths[0])},), {names(index)} has ({int(lengths[index])},); pad them "
            "(Collator(pad_token_id=...)) or pack them (pack_flat), or pass dtype=None for lists"
        )

    def _stack(
        self,
        per_token: Mapping[str, Ragged],
        per_record: Mapping[str, Sequence[Row] | np.ndarray],
        counts: np.ndarray,
        width: int,
        names: Names,
    ) -> dict[str, Any]:
        """The chain's input: each field cast and laid out ``[B, width, ...]``, then the position checks."""
        options = self.options
        dtype = options.output.torch_dtype
        pad_id = 0 if self.padding is None else self.padding.pad_token_id
        lengths = per_token[INPUT_IDS].lengths
        data: dict[str, Any] = {}
        if options.position_mode == "sequence":  # 0 .. count - 1 in every row, after the shift
            _check_position_count(width - 1 if options.return_labels else width, dtype, "numbered")
        floats = {spec.name: spec for spec in self.floats}
        for name, values in per_token.items():
            spec = floats.get(name)
            if spec is not None:  # a value field: its own dtype, its fill on padding
                stacked = dense(values, width, spec.fill)
                if isinstance(spec.fill, Spread) and options.return_labels and spec.shifted_like_labels:
                    stacked = _shifted_spread(stacked, counts, spec.fill)
                data[name] = _in_dtype(stacked, spec.dtype)
                continue
            if name == LOSS_MASK and options.return_labels:
                # The supervision, checked to hold 0 and 1, as booleans: the masks that read it
                # (BoundaryMask, LossMask) then pass over a byte per token, not eight.
                cast_values = values.cast(torch.bool)
            else:
                cast_values = values.cast(dtype)
            if name == POSITIONS and self.padding is not None:
                _check_position_count(width, dtype, "padded to")
            fill = pad_id if name == INPUT_IDS else 0
            # The Collator's padding continues the row's own (a packed row's): one padding segment.
            ramp_from = width - counts if name == POSITIONS else None
            data[name] = dense(cast_values, width, fill, ramp_from=ramp_from)
        for name, rows in per_record.items():
            stacked = stack_rows(rows, name, names)
            if name in floats:
                data[name] = _in_dtype(stacked.numpy(), floats[name].dtype)
                continue
            check_fits(Ragged(stacked.reshape(-1), _flat_offsets(stacked)), dtype, name, names)
            data[name] = _in_dtype(stacked.numpy(), dtype) if stacked.is_cpu else stacked.to(dtype)
        device = _device(data)
        data[PADDING_LENGTH] = counts if device is None else torch.from_numpy(counts).to(device)
        if options.return_cu_seqlens:
            self._check_boundary_positions(data[POSITIONS], lengths, names)
            if self.settings.num_boundaries is not None:
                positions = data[POSITIONS][:, :-1] if options.return_labels else data[POSITIONS]
                check_boundary_count(
                    as_numpy(positions), options.flatten, self.settings.num_boundaries, names
                )
        return data

    def _check_boundary_positions(self, positions: Any, lengths: np.ndarray, names: Names) -> None:
        """``cu_seqlens`` needs ``[B, S]`` positions, starting at 0 in every row with a token."""
        if positions.ndim != 2:
            raise ValueError(
                "to_training: return_cu_seqlens needs one position per token ([B, S]), got positions of "
                f"shape {tuple(positions.shape)}"
            )
        labels = self.options.return_labels
        rows, width = positions.shape
        input_width = width - 1 if labels and width else width
        if (rows if self.options.flatten else 1) * input_width > INT32_MAX:  # per row, unflattened
            raise ValueError(
                f"to_training: {rows} x {input_width} input tokens overflow the int32 cu_seqlens; "
                "use smaller batches"
            )
        if not input_width:
            return
        firsts = Ragged(as_numpy(positions[:, 0]), np.arange(rows + 1, dtype=np.int64))
        found = unstarted(firsts, (lengths > 1) if labels else (lengths > 0))  # rows with an input token
        if found is not None:
            raise ValueError(
                f"{names(found[0])}: positions must start at zero in every row to derive cu_seqlens, but "
                f"this row starts at {found[1]}"
            )


def check_boundary_count(positions: np.ndarray, flatten: bool, limit: int, names: Names) -> None:
    """``ValueError`` naming the first row whose segments do not fit a static ``num_boundaries``."""
    if not positions.size:
        return
    needed = host.segment_starts(positions).sum(axis=1) + 1  # each row's starts, then its end
    if flatten:
        total = int(needed.sum()) - len(needed) + 1
        if total > limit:
            raise ValueError(
                f"Collator: the batch has {total - 1} segments, more than num_boundaries - 1 = {limit - 1}; "
                "raise num_boundaries, or send fewer segments per batch"
            )
    elif bool((needed > limit).any()):
        index = int(np.flatnonzero(needed > limit)[0])
        raise ValueError(
            f"{names(index)}: has {int(needed[index]) - 1} segments, more than "
            f"num_boundaries - 1 = {limit - 1}; raise num_boundaries, or pack fewer documents per row"
        )


def _read_field(
    batch: Batch, name: str, kind: Literal["ids", "values"], tokens: Ragged, must_align: bool
) -> tuple[Ragged | None, Sequence[Row] | np.ndarray]:
    """Field ``name``, one entry per token (a :class:`Ragged`), or else one per record."""
    if batch.is_list(name):  # read once (cached), aligned as it is
        try:
            field = batch.get(name, kind)
        except ValueError:  # rows that do not join (one value each, say): read row by row below
            field = None
        if field is not None and np.array_equal(field.offsets, tokens.offsets):
            return field, ()
    rows = batch.per_row(name, kind)
    for index, (row, length) in enumerate(zip(rows, tokens.lengths.tolist(), strict=True)):
        if row.ndim == 0 or row.shape[0] != length:
            if not must_align:
                return None, rows
            raise misaligned(batch.names(index), name, None if row.ndim == 0 else row.shape[0], length)
    return concat(rows, name, batch.names), ()


def _check_position_count(count: int, dtype: torch.dtype, how: str) -> None:
    """``ValueError`` unless positions ``0 .. count - 1`` fit ``dtype``."""
    if count - 1 > torch.iinfo(dtype).max:
        raise ValueError(
            f"to_training: positions {how} {count} tokens do not fit dtype {dtype} (at most "
            f"{torch.iinfo(dtype).max + 1}); pick a wider dtype"
        )


def _shifted_spread(stacked: Any, counts: np.ndarray, fill: Spread) -> Any:
    """A token-aligned field's padding, numbered for the column it holds once cut like the labels."""
    rows, width = stacked.shape[:2]
    place = np.arange(width, dtype=np.int64)
    padding = place[None] >= (width - counts)[:, None]
    at = np.broadcast_to(np.maximum(place - 1, 0), (rows, width))[padding]
    spread = filled((int(at.size), *stacked.shape[2:]), fill, np.dtype(np.int64), at=at)
    if isinstance(stacked, np.ndarray):
        out = stacked.copy()
        out[padding] = spread.astype(out.dtype)
        return out
    out = stacked.clone()
    out[torch.from_numpy(padding).to(out.device)] = torch.from_numpy(spread).to(out.device, out.dtype)
    return out


def _flat_offsets(stacked: torch.Tensor) -> np.ndarray:
    """Offsets of a ``[B, ...]`` stacked field read as ``B`` rows of equal size."""
    per_row = int(np.prod(stacked.shape[1:]))
    return np.arange(stacked.shape[0] + 1, dtype=np.int64) * per_row


def _in_dtype(values: Any, dtype: torch.dtype) -> Any:
    """``values`` in ``dtype``: a NumPy array where NumPy has the dtype (bfloat16: a tensor)."""
    if isinstance(values, np.ndarray) and dtype != torch.bfloat16:
        return values.astype(numpy_dtype(dtype), copy=False)
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    return tensor.to(dtype)


def _device(data: Mapping[str, Any]) -> torch.device | None:
    """The device of the first tensor in ``data`` not on the CPU, or ``None``."""
    found = (value.device for value in data.values() if isinstance(value, torch.Tensor) and not value.is_cpu)
    return next(found, None)


_PACKED_FIX = (
    "pack with emit_positions=True (the default) or give the row's positions, or pass "
    "boundary_safe_labels=False to train across the documents"
)
_DOCUMENTS_FIX = (
    "give each row's positions, restarting at 0 at each document (position_ids), or collate the rows "
    "with Collator.for_transformers(padding_free=True), which reads seq_lengths"
)


def _check_documents_found(batch: Batch, positions: str) -> None:
    """Refuse a packed record (its meta lists several documents) without positions: boundary-safe labels
    find the documents by their positions, so its labels would cross from one document into the next."""
    if not batch.metas:
        return
    unmarked = ~batch.carried(positions) if positions in batch else np.ones(batch.rows, dtype=bool)
    for index in np.flatnonzero(unmarked).tolist():
        documents = len((batch.metas[index].tags or {}).get(SEGMENTS_TAG, ()))
        if documents > 1:
            raise ValueError(
                f"{batch.names(index)}: a packed row of {documents} documents (its meta's "
                f"{SEGMENTS_TAG!r}) given without positions, so its labels would cross from each document "
                f"into the next; {_PACKED_FIX}"
            )
