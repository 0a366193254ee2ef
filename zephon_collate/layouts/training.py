"""TrainingOptions: ``to_training``'s arguments, checked once, and the transform chain they build."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from zephon_collate.core.checks import (
    Keywords,
    OutputKind,
    check_bool,
    check_eos_token_id,
    check_field_names,
    check_fits_dtype,
    check_ignore_index,
    check_position_mode,
    check_rename_fields,
    renamed,
    resolve_dtype,
    warn_user,
)
from zephon_collate.core.keys import (
    CU_SEQLENS,
    IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITIONS,
    TEXTS,
)
from zephon_collate.core.text import shown
from zephon_collate.transforms import (
    BoundaryMask,
    Chain,
    CuSeqlens,
    EosMask,
    Flatten,
    LossMask,
    PaddingMask,
    Positions,
    TokenShift,
    Total,
    Transform,
)

__all__ = ["OPTION_NAMES", "SPECIAL_FIELDS", "TrainingOptions", "options_for"]

SPECIAL_FIELDS = (POSITIONS, LOSS_MASK)
_EOS_WITHOUT_MASKING = (
    "to_training: eos_token_id was given but eos_mask_loss=False, so no EOS masking happens; "
    "pass eos_mask_loss=True to mask predictions made from EOS, or drop eos_token_id"
)
_FLAGS = (
    "return_labels",
    "flatten",
    "return_num_valid_tokens",
    "return_loss_mask",
    "return_cu_seqlens",
    "return_padding_mask",
    "eos_mask_loss",
)


@dataclass(frozen=True, kw_only=True)
class TrainingOptions(Keywords):
    """The keyword arguments of :meth:`SampleBatch.to_training`, checked (``docs/to_training.md``), hashable.

    Warns:
        UserWarning: if ``eos_token_id`` is given with ``eos_mask_loss=False``.

    Example:
        >>> options = TrainingOptions(return_labels=True, extra_fields=["m"], rename_fields={"labels": "y"})
        >>> options.extra_fields, options.rename_fields, options.output.kind
        (('m',), (('labels', 'y'),), 'torch')
    """

    tokens_field: str = "auto"
    return_labels: bool = False
    dtype: Any = "auto"
    extra_fields: Sequence[str] = ()
    ignore_index: int = IGNORE_INDEX
    rename_fields: Mapping[str, str] | None = None
    flatten: bool = False
    exclude_fields: Sequence[str] = ()
    return_num_valid_tokens: bool = False
    return_loss_mask: bool = False
    return_cu_seqlens: bool = False
    return_padding_mask: bool = False
    eos_mask_loss: bool = False
    eos_token_id: int | None = None
    position_mode: Literal["preserve", "sequence"] = "preserve"
    output: OutputKind = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.tokens_field, str) or not self.tokens_field:
            raise TypeError(
                f"to_training: tokens_field must be a field name or 'auto', got {shown(self.tokens_field)}"
            )
        for name in _FLAGS:
            put(name, check_bool(name, getattr(self, name)))
        put("output", resolve_dtype(self.dtype))
        put("extra_fields", tuple(dict.fromkeys(check_field_names("extra_fields", self.extra_fields))))
        put("exclude_fields", check_field_names("exclude_fields", self.exclude_fields))
        put("ignore_index", check_ignore_index(self.ignore_index))
        put("rename_fields", tuple(check_rename_fields(self.rename_fields).items()))
        put("position_mode", check_position_mode(self.position_mode))
        if self.eos_token_id is not None:
            put("eos_token_id", check_eos_token_id(self.eos_token_id))
        self._check_combinations()
        values = tuple(getattr(self, f.name) for f in dataclasses.fields(TrainingOptions) if f.compare)
        put("_hash", hash(values))  # computed once: the collate path looks plans up by options
        if self.eos_token_id is not None and not self.eos_mask_loss:
            warn_user(_EOS_WITHOUT_MASKING)

    def __hash__(self) -> int:
        return cast(int, self.__dict__["_hash"])

    def _check_combinations(self) -> None:
        labels = self.return_labels
        for name in ("return_num_valid_tokens", "return_loss_mask", "eos_mask_loss"):
            if getattr(self, name) and not labels:
                raise ValueError(f"to_training: {name}=True requires return_labels=True")
        if self.eos_mask_loss and self.eos_token_id is None:
            raise ValueError("to_training: eos_mask_loss=True requires a known EOS id: pass eos_token_id")
        if labels and LOSS_MASK in self.extra_fields:
            raise ValueError(
                "to_training: 'loss_mask' cannot be an extra field with return_labels=True: extra fields are "
                "sliced input-aligned ([:, :-1]), the wrong alignment for a label mask. It is applied to the "
                "labels automatically; pass return_loss_mask=True to get the label-aligned mask"
            )
        if labels:
            check_ignore_index(self.ignore_index, fits=self.output.torch_dtype)
        if self.eos_token_id is not None:
            check_fits_dtype("to_training", "eos_token_id", self.eos_token_id, self.output.torch_dtype)
        generated = self.generated_keys()
        for name in self.extra_fields:
            if name in generated:
                raise ValueError(
                    f"to_training: extra field {shown(name)} would overwrite the generated output field "
                    f"{shown(name)}; rename it in the payloads, or drop it from extra_fields"
                )
            if name == PADDING_LENGTH:
                raise ValueError(
                    f"to_training: extra field {shown(name)} collides with the per-record pad counts that "
                    "to_training stacks under that name; rename it in the payloads"
                )
        always = list(dict.fromkeys((*generated, *self.extra_fields)))  # emitted whatever the payloads
        renamed(always, dict(self.rename_fields or {}))

    def generated_keys(self) -> tuple[str, ...]:
        """Output fields this call generates, which an extra field may not overwrite.

        Example:
            >>> TrainingOptions(return_labels=True, return_cu_seqlens=True).generated_keys()
            ('ids', 'texts', 'input_ids', 'labels', 'cu_seqlens', 'max_seqlen')
        """
        keys = (INPUT_IDS, PADDING_LENGTH, POSITIONS)
        return (IDS, TEXTS, INPUT_IDS, *Chain(*self.chain(keys)).created_keys())

    def chain(
        self,
        keys: Sequence[str],
        *,
        boundary_safe: bool = False,
        num_boundaries: int | None = None,
        like_labels: Sequence[str] = (),
        unshifted: Sequence[str] = (),
    ) -> list[Transform]:
        """The transforms these options run on a stacked batch holding ``keys``, in order, as asked for.

        Parameters:
            keys: the keys of the stacked batch.
            boundary_safe: add ``BoundaryMask`` when there are labels and positions.
            num_boundaries: give ``CuSeqlens`` a static shape.
            like_labels: token-aligned fields ``TokenShift`` cuts like the labels (``[:, 1:]``).
            unshifted: per-record fields ``TokenShift`` leaves alone.

        Example:
            >>> options = TrainingOptions(return_labels=True, return_padding_mask=True)
            >>> [type(t).__name__ for t in options.chain(("input_ids", "padding_length"))]
            ['PaddingMask', 'TokenShift', 'LossMask']
        """
        transforms: list[Transform] = []
        if self.return_padding_mask:
            transforms.append(PaddingMask())
        boundary = boundary_safe and self.return_labels and POSITIONS in keys
        if boundary:
            transforms.append(BoundaryMask())
        has_loss_mask = LOSS_MASK in keys or boundary
        if self.return_labels:
            skipped = (INPUT_IDS, LOSS_MASK, PADDING_LENGTH, *like_labels, *unshifted)
            aligned = [k for k in keys if k not in skipped]
            aligned += [PADDING_MASK] if self.return_padding_mask else []
            shifted = [LOSS_MASK] if has_loss_mask else []
            shifted += [k for k in like_labels if k in keys]
            transforms.append(TokenShift(input_keys=aligned, label_keys=shifted))
            if self.eos_mask_loss:
                assert self.eos_token_id is not None  # _check_combinations requires it
                transforms.append(EosMask(self.eos_token_id, self.ignore_index))
            transforms.append(
                LossMask(
                    self.ignore_index,
                    supervision_key=LOSS_MASK if has_loss_mask else None,
                    out_key=LOSS_MASK if self.return_loss_mask else None,
                    count_key=NUM_VALID_TOKENS if self.return_num_valid_tokens else None,
                )
            )
            if self.return_num_valid_tokens:  # the batch's count, made in the chain: yours see it
                transforms.append(Total(NUM_VALID_TOKENS))
        if self.return_cu_seqlens:
            transforms.append(CuSeqlens(flatten=self.flatten, num_boundaries=num_boundaries))
        if self.position_mode == "sequence":
            transforms.append(Positions("sequence"))
        if self.flatten:  # every per-token field [B, S, ...] to [B * S, ...]
            final = Chain(*transforms).output_keys(keys)
            kept = (PADDING_LENGTH, NUM_VALID_TOKENS, CU_SEQLENS, MAX_SEQLEN)
            transforms.append(Flatten([key for key in final if key not in kept]))
        return transforms

    @property
    def kind(self) -> Literal["torch", "numpy", "list"]:
        """The container of the outputs: torch tensors, NumPy arrays or Python lists."""
        return self.output.kind

    @property
    def data_fields(self) -> tuple[str, ...]:
        """Extra fields other than ``positions`` and ``loss_mask``, which have slots of their own."""
        return tuple(name for name in self.extra_fields if name not in SPECIAL_FIELDS)

    @property
    def reads_positions(self) -> bool:
        return self.position_mode == "preserve" or self.return_cu_seqlens

    @property
    def needs_padding_lengths(self) -> bool:
        return self.return_labels or self.return_padding_mask


@functools.lru_cache(maxsize=256)
def _cached(items: tuple[tuple[str, type, Any], ...]) -> TrainingOptions:
    return TrainingOptions(**{name: value for name, _, value in items})


def options_for(options: Mapping[str, Any]) -> TrainingOptions:
    """``TrainingOptions(**options)``, cached when every value is hashable (it still warns each call)."""
    misses = _cached.cache_info().misses
    try:
        # The types belong to the key: 1 == True and 2.0 == 2, but only True and 2 are valid.
        checked = _cached(tuple((name, type(value), value) for name, value in options.items()))
    except TypeError:  # an unhashable value (a list of fields, a rename dict): check afresh
        return TrainingOptions(**options)
    fresh = _cached.cache_info().misses != misses  # built just now: its __post_init__ warned already
    if not fresh and checked.eos_token_id is not None and not checked.eos_mask_loss:
        warn_user(_EOS_WITHOUT_MASKING)
    return checked


OPTION_NAMES = TrainingOptions.names()
"""The keyword arguments of ``to_training``, in the reference page's order."""
