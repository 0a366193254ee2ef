"""TrainingOptions: the one home of ``to_training``'s signature, its arguments checked once.

:func:`~zephon_collate.to_training`, :meth:`SampleBatch.to_training
<zephon_collate.SampleBatch.to_training>` and the :class:`~zephon_collate.Collator`
take these keyword arguments; their signatures are made from this class's fields.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from zephon_collate.checks import (
    OutputKind,
    check_bool,
    check_eos_fits,
    check_eos_token_id,
    check_field_names,
    check_ignore_index,
    check_position_mode,
    check_rename_fields,
    resolve_dtype,
    warn_user,
)
from zephon_collate.keys import (
    CU_SEQLENS,
    IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITIONS,
    TEXTS,
)
from zephon_collate.text import shown

__all__ = ["OPTION_NAMES", "TrainingOptions", "options_for", "signature_with_options"]

SPECIAL_FIELDS = (POSITIONS, LOSS_MASK)
EOS_WITHOUT_MASKING = (
    "to_training: eos_token_id was given but eos_mask_loss=False, so no EOS masking happens; "
    "pass eos_mask_loss=True to mask predictions made from EOS, or drop eos_token_id"
)
FLAGS = (
    "return_labels",
    "flatten",
    "return_num_valid_tokens",
    "return_loss_mask",
    "return_cu_seqlens",
    "return_padding_mask",
    "eos_mask_loss",
)


@dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    """The keyword arguments of :meth:`SampleBatch.to_training`, validated and normalised.

    Constructing one raises every error that the arguments alone decide (and
    the ``eos_token_id`` warning) before any payload is read. Instances are
    hashable values: the collate path caches its plan per option set. The
    parameters are the reference page's (see ``docs/to_training.md``).

    Raises:
        TypeError: for an argument of the wrong type, e.g. ``exclude_fields`` given as a str.
        ValueError: for the argument errors of the reference page.

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

    @classmethod
    def create(cls, **options: Any) -> TrainingOptions:
        """``TrainingOptions(**options)``."""
        return cls(**options)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.tokens_field, str) or not self.tokens_field:
            raise TypeError(
                f"to_training: tokens_field must be a field name or 'auto', got {shown(self.tokens_field)}"
            )
        for name in FLAGS:
            put(name, check_bool(name, getattr(self, name)))
        output = resolve_dtype(self.dtype)
        put("output", output)
        put("extra_fields", tuple(dict.fromkeys(check_field_names("extra_fields", self.extra_fields))))
        put("exclude_fields", check_field_names("exclude_fields", self.exclude_fields))
        put("ignore_index", check_ignore_index(self.ignore_index))
        put("rename_fields", tuple(check_rename_fields(self.rename_fields).items()))
        put("position_mode", check_position_mode(self.position_mode))
        if self.eos_token_id is not None:
            put("eos_token_id", check_eos_token_id(self.eos_token_id))
        self._check_combinations()
        if self.eos_token_id is not None and not self.eos_mask_loss:
            warn_user(EOS_WITHOUT_MASKING)

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
            check_eos_fits(self.eos_token_id, self.output.torch_dtype)
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

    def generated_keys(self) -> tuple[str, ...]:
        """Output fields this call generates, which an extra field may not overwrite."""
        keys = [IDS, TEXTS, INPUT_IDS]
        keys += [LABELS] if self.return_labels else []
        keys += [POSITIONS] if self.position_mode == "sequence" else []
        keys += [NUM_VALID_TOKENS] if self.return_num_valid_tokens else []
        keys += [LOSS_MASK] if self.return_loss_mask else []
        keys += [CU_SEQLENS, MAX_SEQLEN] if self.return_cu_seqlens else []
        keys += [PADDING_MASK] if self.return_padding_mask else []
        return tuple(keys)

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
    """``TrainingOptions(**options)``, cached when every value is hashable.

    A cached option set warns again on each call that gives ``eos_token_id``
    without ``eos_mask_loss``, as a fresh one would.
    """
    try:
        # The types belong to the key: 1 == True and 2.0 == 2, but only True and 2 are valid.
        checked = _cached(tuple((name, type(value), value) for name, value in options.items()))
    except TypeError:  # an unhashable value (a list of fields, a rename dict): check afresh
        return TrainingOptions(**options)
    if checked.eos_token_id is not None and not checked.eos_mask_loss:
        warn_user(EOS_WITHOUT_MASKING)
    return checked


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(TrainingOptions) if f.init)
"""The keyword arguments of ``to_training``, in the reference page's order."""


def signature_with_options(function: Any, leading: Sequence[inspect.Parameter]) -> inspect.Signature:
    """``function``'s signature: ``leading`` parameters, then ``to_training``'s keyword-only options."""
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(TrainingOptions)
        if f.init
    ]
    return inspect.Signature([*leading, *options], return_annotation="dict[str, Any]")
