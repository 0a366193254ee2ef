"""TrainingOptions: to_training's arguments, checked once, and the chain they build."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from zephon_collate.transforms import Chain, CuSeqlens, EosMask, LossMask, PaddingMask, Positions, TokenShift
from zephon_collate.validation import (
    OutputKind,
    check_bool,
    check_eos_token_id,
    check_field_names,
    check_ignore_index,
    check_position_mode,
    check_rename_fields,
    resolve_dtype,
)

__all__ = ["TrainingOptions"]

SPECIAL_FIELDS = ("positions", "loss_mask")
INTERNAL_KEYS = ("padding_length",)
DEFAULT_OUTPUT = OutputKind("torch", torch.long)


@dataclass(frozen=True)
class TrainingOptions:
    """The arguments of :func:`~zephon_collate.training.to_training`, validated.

    Build it with :meth:`create`, which raises every error that the arguments
    alone decide (and the ``eos_token_id`` warning) before any payload is read.
    The collator builds one and reuses it for every batch.
    """

    tokens_field: str = "auto"
    return_labels: bool = False
    output: OutputKind = DEFAULT_OUTPUT
    extra_fields: tuple[str, ...] = ()
    ignore_index: int = -100
    rename_fields: tuple[tuple[str, str], ...] = ()
    flatten: bool = False
    exclude_fields: tuple[str, ...] = ()
    return_num_valid_tokens: bool = False
    return_loss_mask: bool = False
    return_cu_seqlens: bool = False
    return_padding_mask: bool = False
    eos_mask_loss: bool = False
    eos_token_id: int | None = None
    position_mode: Literal["preserve", "sequence"] = "preserve"

    @classmethod
    def create(
        cls,
        *,
        tokens_field: str = "auto",
        return_labels: bool = False,
        dtype: Any = "auto",
        extra_fields: Sequence[str] = (),
        ignore_index: int = -100,
        rename_fields: Mapping[str, str] | None = None,
        flatten: bool = False,
        exclude_fields: Sequence[str] = (),
        return_num_valid_tokens: bool = False,
        return_loss_mask: bool = False,
        return_cu_seqlens: bool = False,
        return_padding_mask: bool = False,
        eos_mask_loss: bool = False,
        eos_token_id: int | None = None,
        position_mode: Literal["preserve", "sequence"] = "preserve",
    ) -> TrainingOptions:
        """Check to_training's arguments and return them normalised.

        Raises:
            TypeError: for an argument of the wrong type, e.g. ``exclude_fields``
                given as a str.
            ValueError: for the argument errors of the reference page.

        Warns:
            UserWarning: if ``eos_token_id`` is given with ``eos_mask_loss=False``.
        """
        if not isinstance(tokens_field, str) or not tokens_field:
            raise TypeError(f"to_training: tokens_field must be a field name or 'auto', got {tokens_field!r}")
        flags = {
            "return_labels": return_labels,
            "flatten": flatten,
            "return_num_valid_tokens": return_num_valid_tokens,
            "return_loss_mask": return_loss_mask,
            "return_cu_seqlens": return_cu_seqlens,
            "return_padding_mask": return_padding_mask,
            "eos_mask_loss": eos_mask_loss,
        }
        flags = {name: check_bool(name, value) for name, value in flags.items()}
        output = resolve_dtype(dtype)
        extras = check_field_names("extra_fields", extra_fields)
        excluded = check_field_names("exclude_fields", exclude_fields)
        ignore_index = check_ignore_index(ignore_index)
        renames = check_rename_fields(rename_fields)
        position_mode = check_position_mode(position_mode)
        if eos_token_id is not None:
            eos_token_id = check_eos_token_id(eos_token_id)
        labels = flags["return_labels"]
        for name in ("return_num_valid_tokens", "return_loss_mask"):
            if flags[name] and not labels:
                raise ValueError(f"to_training: {name}=True requires return_labels=True")
        if flags["eos_mask_loss"] and not labels:
            raise ValueError("to_training: eos_mask_loss=True requires return_labels=True")
        if flags["eos_mask_loss"] and eos_token_id is None:
            raise ValueError("to_training: eos_mask_loss=True requires a known EOS id: pass eos_token_id")
        if labels and "loss_mask" in extras:
            raise ValueError(
                "to_training: 'loss_mask' cannot be an extra field with return_labels=True: extra fields are "
                "sliced input-aligned ([:, :-1]), the wrong alignment for a label mask. It is applied to the "
                "labels automatically; pass return_loss_mask=True to get the label-aligned mask"
            )
        if labels:
            info = torch.iinfo(output.torch_dtype)
            if not info.min <= ignore_index <= info.max:
                raise ValueError(
                    f"to_training: ignore_index {ignore_index} does not fit dtype {output.torch_dtype}; "
                    "pick a wider dtype"
                )
        options = cls(
            tokens_field=tokens_field,
            return_labels=labels,
            output=output,
            extra_fields=tuple(dict.fromkeys(extras)),
            ignore_index=ignore_index,
            rename_fields=tuple(renames.items()),
            flatten=flags["flatten"],
            exclude_fields=excluded,
            return_num_valid_tokens=flags["return_num_valid_tokens"],
            return_loss_mask=flags["return_loss_mask"],
            return_cu_seqlens=flags["return_cu_seqlens"],
            return_padding_mask=flags["return_padding_mask"],
            eos_mask_loss=flags["eos_mask_loss"],
            eos_token_id=eos_token_id,
            position_mode=position_mode,
        )
        options._check_extra_fields()
        if eos_token_id is not None and not flags["eos_mask_loss"]:
            warnings.warn(
                "to_training: eos_token_id was given but eos_mask_loss=False, so no EOS masking happens; "
                "pass eos_mask_loss=True to mask predictions made from EOS, or drop eos_token_id",
                UserWarning,
                stacklevel=4,
            )
        return options

    def generated_keys(self) -> tuple[str, ...]:
        """Output fields this call generates, which an extra field may not overwrite."""
        keys = ["ids", "texts", "input_ids"]
        keys += ["labels"] if self.return_labels else []
        keys += ["positions"] if self.position_mode == "sequence" else []
        keys += ["num_valid_tokens"] if self.return_num_valid_tokens else []
        keys += ["loss_mask"] if self.return_loss_mask else []
        keys += ["cu_seqlens", "max_seqlen"] if self.return_cu_seqlens else []
        keys += ["padding_mask"] if self.return_padding_mask else []
        return tuple(keys)

    def _check_extra_fields(self) -> None:
        generated = self.generated_keys()
        for name in self.extra_fields:
            if name in generated:
                raise ValueError(
                    f"to_training: extra field {name!r} would overwrite the generated output field {name!r}; "
                    "rename it in the payloads, or drop it from extra_fields"
                )
            if name in INTERNAL_KEYS:
                raise ValueError(
                    f"to_training: extra field {name!r} collides with the per-record pad counts that "
                    "to_training stacks under that name; rename it in the payloads"
                )

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

    def build_chain(self, keys: Sequence[str], num_boundaries: int | None = None) -> Chain:
        """The transform chain for a stacked batch holding ``keys`` (cached: chains are stateless).

        ``PaddingMask -> TokenShift -> EosMask -> LossMask -> CuSeqlens -> Positions``,
        each only when asked for. ``num_boundaries`` gives ``CuSeqlens`` a static shape.
        ``Positions("sequence")`` comes after ``CuSeqlens`` because it overwrites the
        payload positions that ``CuSeqlens`` reads.
        """
        return _cached_chain(self, tuple(keys), num_boundaries)

    def _build_chain(self, keys: Sequence[str], num_boundaries: int | None) -> Chain:
        has_loss_mask = "loss_mask" in keys
        transforms: list[Any] = []
        if self.return_padding_mask:
            transforms.append(PaddingMask())
        if self.return_labels:
            aligned = [k for k in keys if k not in ("input_ids", "loss_mask", "padding_length")]
            aligned += ["padding_mask"] if self.return_padding_mask else []
            transforms.append(
                TokenShift(input_keys=aligned, label_keys=["loss_mask"] if has_loss_mask else [])
            )
            if self.eos_mask_loss:
                transforms.append(EosMask(self.eos_token_id, self.ignore_index))  # type: ignore[arg-type]
            transforms.append(
                LossMask(
                    self.ignore_index,
                    supervision_key="loss_mask" if has_loss_mask else None,
                    out_key="loss_mask" if self.return_loss_mask else None,
                    count_key="num_valid_tokens" if self.return_num_valid_tokens else None,
                )
            )
        if self.return_cu_seqlens:
            transforms.append(CuSeqlens(flatten=self.flatten, num_boundaries=num_boundaries))
        if self.position_mode == "sequence":
            transforms.append(Positions("sequence"))
        return Chain(*transforms, input_keys=keys)


@functools.lru_cache(maxsize=256)
def _cached_chain(options: TrainingOptions, keys: tuple[str, ...], num_boundaries: int | None) -> Chain:
    return options._build_chain(keys, num_boundaries)
