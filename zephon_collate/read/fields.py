"""Float fields: per-token (or per-sequence) float values beside the tokens, declared once.

Post-training carries float data with the tokens: the log-probs of a reference
or behaviour policy, advantages, rewards, per-token weights. A
:class:`FloatField` declares one such field: its name, what its values belong
to (``align``) and the float dtype it keeps, float32 by default, whatever the
dtype of the tokens. The :class:`~zephon_collate.Collator`
(``float_fields=[...]``), ``Collator.for_transformers``, the presets
``for_preference`` / ``for_rollouts`` and the packer (``pack_flat(float_fields=...)``)
all read a float field through :func:`read_floats` here, and place it with
the labels:

- ``align="token"``: one value per token, value ``t`` belongs to token ``t``
  (the log-prob of token ``t``, its advantage). Where a layout shifts the
  tokens (the Collator's ``return_labels``: labels are ``tokens[:, 1:]``), the
  field is shifted with them, ``[:, 1:]``, so that ``field[:, j]`` belongs to
  ``labels[:, j]``; in the unshifted ``transformers`` layout it stays as it is,
  beside the unshifted labels.
- ``align="label"``: one value per token, value ``t`` belongs to the prediction
  made at position ``t`` (of token ``t + 1``). Shifted layout: ``[:, :-1]``, like
  the inputs; unshifted layout: moved one token right inside each sequence (0 on
  a sequence's first token, which no position predicts).
- ``align="response"``: one value per token of the row's last ``len(values)``
  tokens, verl's response-aligned fields (``old_log_probs``, ``advantages``
  ``[batch, response_length]`` beside ``input_ids = cat(prompts, responses)``):
  value ``k`` belongs to token ``T - len(values) + k`` of a row of ``T`` tokens
  as given (padding included), the tokens before it get 0. Read, it is a
  token-aligned field.
- ``align="sequence"``: one value per sequence (a reward, a GRPO advantage, TRL's
  ``ref_chosen_logps``): a ``[num_sequences]`` output; with ``broadcast=True`` it
  is repeated over the sequence's tokens instead, a token-aligned field.

Either way ``out[field][..., j]`` goes with ``out["labels"][..., j]``: an
off-by-one cannot happen silently. Values must be finite (a NaN log-prob would
turn the loss into NaN several steps later): a NaN or an infinity is a
``ValueError`` naming the record, the field and the token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import torch

from zephon_collate.core.text import shown
from zephon_collate.read.columns import Names, Ragged, Row, as_numpy, concat, numpy_dtype, row_of
from zephon_collate.read.rules import response_aligned

__all__ = [
    "FLOAT_DTYPES",
    "Alignment",
    "FloatField",
    "FloatFields",
    "check_float_fields",
    "read_floats",
    "to_label_positions",
]

Alignment: TypeAlias = Literal["token", "label", "response", "sequence"]
"""What a float field's values belong to: a token, a prediction, a whole sequence (see the module doc)."""
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ALIGNMENTS = ("token", "label", "response", "sequence")


@dataclass(frozen=True)
class FloatField:
    """One float field beside the tokens: its name, alignment, dtype and broadcast (see the module doc).

    Parameters:
        name: the payload field (and output key).
        align: ``"token"`` (value ``t`` belongs to token ``t``, the default), ``"label"``
            (to the prediction made at ``t``), ``"response"`` (to the row's last ``len(values)`` tokens,
            as verl keeps them) or ``"sequence"`` (one value per sequence).
        dtype: the float dtype it keeps (float16, bfloat16, float32 or float64; default float32).
        broadcast: with ``align="sequence"``, repeat the value over the sequence's tokens.

    Raises:
        TypeError, ValueError: for a name that is not a non-empty str, an unknown alignment, a
            non-float dtype, or ``broadcast`` without ``align="sequence"``.

    Example:
        >>> FloatField("advantages", align="sequence", broadcast=True).per_token
        True
        >>> FloatField("old_logprobs").dtype
        torch.float32
    """

    name: str
    align: Alignment = "token"
    dtype: torch.dtype = torch.float32
    broadcast: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"FloatField: name must be a non-empty str, got {shown(self.name)}")
        if self.align not in _ALIGNMENTS:
            raise ValueError(
                f"FloatField {shown(self.name)}: align must be 'token', 'label', 'response' or "
                "'sequence', got "
                f"{shown(self.align)}"
            )
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"FloatField {shown(self.name)}: dtype must be a torch float dtype (float16, bfloat16, "
                f"float32, float64), got {shown(self.dtype)}"
            )
        if not isinstance(self.broadcast, bool):
            raise TypeError(
                f"FloatField {shown(self.name)}: broadcast must be a bool, got {shown(self.broadcast)}"
            )
        if self.broadcast and self.align != "sequence":
            raise ValueError(
                f"FloatField {shown(self.name)}: broadcast=True repeats one value per sequence over its "
                "tokens; it needs align='sequence'"
            )

    @property
    def per_token(self) -> bool:
        """True when the output holds one value per token (every alignment but an unbroadcast sequence)."""
        return self.align != "sequence" or self.broadcast

    @property
    def shifted_like_labels(self) -> bool:
        """True when a shift of the tokens cuts this field like the labels (``[:, 1:]``)."""
        return self.per_token and self.align != "label"

    @property
    def host_dtype(self) -> np.dtype:
        """The NumPy dtype the values are read in (float32 for bfloat16, which NumPy lacks)."""
        return np.dtype(np.float32) if self.dtype == torch.bfloat16 else numpy_dtype(self.dtype)


FloatFields: TypeAlias = "Sequence[str | FloatField]"
"""How callers name float fields: names (token-aligned float32) or :class:`FloatField` specs."""


def check_float_fields(owner: str, value: object, reserved: Sequence[str] = ()) -> tuple[FloatField, ...]:
    """The float fields ``value`` names, as specs: a str is ``FloatField(name)``.

    Raises:
        TypeError: if ``value`` is a str or not a sequence, or an item is neither a str nor a FloatField.
        ValueError: if a name is given twice or is one of ``reserved`` (a name the caller writes).

    Example:
        >>> [f.name for f in check_float_fields("Collator", ["old_logprobs", FloatField("adv", "sequence")])]
        ['old_logprobs', 'adv']
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{owner}: float_fields must be a list of field names or FloatField specs, got {shown(value)}"
        )
    specs: list[FloatField] = []
    for item in value:
        if isinstance(item, str):
            specs.append(FloatField(item))
        elif isinstance(item, FloatField):
            specs.append(item)
        else:
            raise TypeError(
                f"{owner}: float_fields items must be names or FloatField specs, got {shown(item)}"
            )
    names = [spec.name for spec in specs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{owner}: float_fields names {shown(name)} twice")
        if name in reserved:
            raise ValueError(
                f"{owner}: float field {shown(name)} collides with a field this collator reads or writes "
                "under that name; rename it in the payloads"
            )
    return tuple(specs)


def _first_bad(field: Ragged, bad: np.ndarray, names: Names, name: str) -> tuple[str, int]:
    """``(where, flat index)`` of the first True of ``bad``: ``record 3 ... at name[t]``."""
    flat = int(np.flatnonzero(bad)[0])
    row = row_of(field.offsets, flat)
    return f"{names(row)}: float field {shown(name)}", flat - int(field.offsets[row])


def _checked(source: Ragged, spec: FloatField, names: Names) -> Ragged:
    """``source`` in ``spec.host_dtype``: its values finite, and each one within ``spec.dtype``'s range.

    A NaN or an infinity given is named as such; a finite value beyond the dtype (1e39 for float32,
    70000 for float16, 3.5e38 for bfloat16), which the cast would turn into an infinity, is named as an
    overflow of that dtype.
    """
    values, name = np.asarray(source.values), spec.name
    if values.size and values.dtype.kind == "f" and not np.isfinite(values).all():
        where, token = _first_bad(source, ~np.isfinite(values), names, spec.name)
        raise ValueError(
            f"{where} holds {values[np.flatnonzero(~np.isfinite(values))[0]]} at {name}[{token}]; give "
            "finite values (a NaN or an infinity would make the loss NaN)"
        )
    with np.errstate(over="ignore"):
        cast = values.astype(spec.host_dtype, copy=False)
    kept = cast if spec.dtype != torch.bfloat16 else torch.from_numpy(cast).to(torch.bfloat16).float().numpy()
    if values.size and not np.isfinite(kept).all():
        where, token = _first_bad(source, ~np.isfinite(kept), names, spec.name)
        largest = torch.finfo(spec.dtype).max
        raise ValueError(
            f"{where} holds {values[np.flatnonzero(~np.isfinite(kept))[0]]} at {name}[{token}], beyond "
            f"{spec.dtype} (largest {largest:.6g}): it would overflow to an infinity; rescale it, or declare "
            f"a wider dtype (FloatField({shown(name)}, dtype=torch.float32 or torch.float64))"
        )
    return Ragged(cast, source.offsets)


def read_floats(
    rows: Sequence[Row], lengths: np.ndarray, spec: FloatField, names: Names
) -> Ragged | list[np.ndarray]:
    """A float field's checked rows (from :meth:`~zephon_collate.read.columns.Batch.per_row`) in the
    spec's layout.

    Per token (``spec.per_token``): a host :class:`~zephon_collate.read.columns.Ragged`
    in ``spec.host_dtype`` with one value per token (a broadcast sequence value
    repeated ``lengths[b]`` times). Per sequence: one 0-d array per payload.

    Raises:
        ValueError: for a row whose shape does not fit the alignment (one value per token, or one
            number per sequence), or a value that is not finite; naming the record and the field.

    Example:
        >>> lengths = np.array([2, 1])
        >>> read_floats([np.array([0.5, -1.0]), np.array([2.0])], lengths, FloatField("lp"), str).values
        array([ 0.5, -1. ,  2. ], dtype=float32)
        >>> spec = FloatField("adv", align="sequence", broadcast=True)
        >>> read_floats([np.array(1.5), np.array(-2.0)], lengths, spec, str).values.tolist()
        [1.5, 1.5, -2.0]
    """
    name = spec.name
    arrays = [as_numpy(row) for row in rows]
    if spec.align == "sequence":
        for index, array in enumerate(arrays):
            if array.ndim != 0:
                raise ValueError(
                    f"{names(index)}: float field {shown(name)} holds shape {tuple(array.shape)}, but it is "
                    "declared one value per sequence (align='sequence'); give one number, or declare it "
                    "FloatField(name) for one value per token"
                )
        offsets = np.arange(len(arrays) + 1, dtype=np.int64)
        given = np.array([array.item() for array in arrays], dtype=np.float64)
        values = np.asarray(_checked(Ragged(given, offsets), spec, names).values)
        if not spec.broadcast:
            return [values[index] for index in range(len(arrays))]
        repeated = np.repeat(values, lengths)
        return Ragged(repeated, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    if spec.align == "response":  # checked as given (errors name its own index), then placed
        for index, array in enumerate(arrays):
            if array.ndim != 1:
                raise ValueError(
                    f"{names(index)}: float field {shown(name)} holds shape {tuple(array.shape)}, but it is "
                    "declared one value per response token (align='response'); give a 1-D row"
                )
        return response_aligned(_checked(concat(arrays, name, names), spec, names), lengths, name, names)
    for index, (array, length) in enumerate(zip(arrays, lengths.tolist(), strict=True)):
        if array.ndim != 1 or array.shape[0] != length:
            got = "one number" if array.ndim == 0 else f"shape {tuple(array.shape)}"
            hint = (
                "; declare FloatField(name, align='sequence') for one value per sequence"
                if array.ndim == 0
                else "; a field of the response's tokens only (verl's old_log_probs, advantages) is "
                "FloatField(name, align='response')"
                if array.ndim == 1 and array.shape[0] < length
                else ""
            )
            raise ValueError(
                f"{names(index)}: float field {shown(name)} holds {got}, but the token row has {length} "
                f"tokens; give one value per token{hint}"
            )
    return _checked(concat(arrays, name, names), spec, names)


def to_label_positions(field: Ragged, starts: np.ndarray) -> Ragged:
    """A label-aligned field for the unshifted layout: each value moved one token right.

    Value ``t`` (of the prediction made at ``t``) goes to token ``t + 1``, the
    token that prediction is scored against; ``starts`` (``[N]`` booleans) marks
    each sequence's first token, which no position predicts: it gets 0.

    Example:
        >>> field = Ragged(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.array([0, 3, 5]))
        >>> to_label_positions(field, np.array([True, False, False, True, False])).values.tolist()
        [0.0, 1.0, 2.0, 0.0, 4.0]
    """
    values = np.asarray(field.values)
    moved = np.zeros_like(values)
    moved[1:] = values[:-1]
    moved[starts] = 0
    return Ragged(moved, field.offsets)
