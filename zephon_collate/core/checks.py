"""Argument checks shared by every entry point: each names the argument, the value and what is expected."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import sys
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Concatenate, Literal, ParamSpec, TypeGuard, TypeVar, cast

import numpy as np
import torch

from zephon_collate.core.keys import INT64_MAX, INT64_MIN
from zephon_collate.core.text import shown

__all__ = [
    "Keywords",
    "OutputKind",
    "check_bool",
    "check_device",
    "check_eos_token_id",
    "check_field_names",
    "check_fits_dtype",
    "check_ignore_index",
    "check_int",
    "check_key",
    "check_keys",
    "check_num_boundaries",
    "check_option_names",
    "check_position_mode",
    "check_rename_fields",
    "fits_dtype",
    "is_zero_d",
    "keywords",
    "renamed",
    "resolve_dtype",
    "scalar",
    "warn_user",
]

P = ParamSpec("P")
R = TypeVar("R")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_INTEGER_TORCH_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _is_int(value: object) -> TypeGuard[int]:
    """True for an integer that is not a bool (NumPy integers included)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class Keywords:
    """Base of the options dataclasses: one typed field per option (a signature, by :func:`keywords`)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The keywords, in the order of the fields (those ``__init__`` takes)."""
        return tuple(field.name for field in dataclasses.fields(cast(Any, cls)) if field.init)


def check_option_names(owner: str, names: Iterable[str], known: Sequence[str]) -> None:
    """``TypeError`` naming the first unknown option in ``names``, with the closest known one."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {shown(close[0])}?" if close else f"; known options: {', '.join(known)}"
            raise TypeError(f"{owner}: unknown option {shown(name)}{hint}")


def keywords(
    options: Callable[P, Any], owner: str, required: Mapping[str, str] | None = None
) -> Callable[[Callable[..., R]], Callable[Concatenate[Any, P], R]]:
    """Give ``function(first, **options)`` the signature of the dataclass ``options``; a misspelled keyword
    raises ``TypeError`` naming the closest option, a missing one of ``required`` (name: what it is) says it.

    Example:
        >>> @dataclasses.dataclass(frozen=True, kw_only=True)
        ... class Options(Keywords):
        ...     return_labels: bool = False
        >>> @keywords(Options, "f")
        ... def f(batch: list[int], **options: Any) -> Options:
        ...     return Options(**options)
        >>> f([], return_label=True)
        Traceback (most recent call last):
        ...
        TypeError: f: unknown option 'return_label'; did you mean 'return_labels'?
    """
    fields = [field for field in dataclasses.fields(cast(Any, options)) if field.init]
    known = [field.name for field in fields]

    def decorate(function: Callable[..., R]) -> Callable[Concatenate[Any, P], R]:
        given = inspect.signature(function)
        own = [p for p in given.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        try:
            hints = typing.get_type_hints(options)
        except NameError:  # a name imported for type checkers only: the annotations as written
            hints = {}
        derived = [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY if field.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=field.default
                if field.default is not dataclasses.MISSING
                else inspect.Parameter.empty,
                annotation=hints.get(field.name, field.type),
            )
            for field in fields
        ]
        positional = [p for p in derived if p.kind is p.POSITIONAL_OR_KEYWORD]
        signature = inspect.Signature(
            [*own, *positional, *(p for p in derived if p.kind is p.KEYWORD_ONLY)],
            return_annotation=given.return_annotation,
        )

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            check_option_names(owner, kwargs, known)
            missing = [name for name in required or {} if name not in kwargs]
            if missing and len(args) <= len(own) + len(positional):
                try:
                    signature.bind(*args, **kwargs)
                except TypeError:
                    raise TypeError(
                        f"{owner}: {missing[0]} is required: {(required or {})[missing[0]]}"
                    ) from None
            return function(*args, **kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper

    return decorate


def check_device(owner: str, device: object) -> torch.device | None:
    """``device`` (``None``, a str or a ``torch.device``) as a ``torch.device`` this process can use.

    ``ValueError`` for a name torch does not know, ``"meta"``, or a device this machine lacks.
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{owner}: device must be None, a str such as 'cuda' or a torch.device, got {shown(device)}"
        )
    try:
        checked = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"{owner}: device {shown(device)} is not a device name such as 'cpu' or 'cuda:0'"
        ) from None
    if checked.type == "meta":
        raise ValueError(f"{owner}: device 'meta' holds no data; pass 'cpu', an accelerator or None")
    if checked.type != "cpu":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != checked.type:
            raise ValueError(
                f"{owner}: device {shown(str(checked))} is not available here (accelerator: {accelerator})"
            )
        if checked.index is not None and checked.index >= torch.accelerator.device_count():
            raise ValueError(
                f"{owner}: device {shown(str(checked))} does not exist: this machine has "
                f"{torch.accelerator.device_count()} {checked.type} device(s)"
            )
    return checked


def check_eos_token_id(value: object, *, owner: str = "to_training") -> int:
    """Return ``value`` as an int if it is an int (not a bool) in ``[0, 2**63)``; else ``ValueError``."""
    if not _is_int(value) or not 0 <= value <= INT64_MAX:
        raise ValueError(f"{owner}: eos_token_id must be a nonnegative int below 2**63, got {shown(value)}")
    return int(value)


def fits_dtype(value: int, dtype: torch.dtype) -> bool:
    """True if ``dtype`` holds the int ``value`` exactly (always for float, complex and bool dtypes).

    Example:
        >>> fits_dtype(300, torch.int8), fits_dtype(-100, torch.int16), fits_dtype(-1, torch.uint8)
        (False, True, False)
    """
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


def check_fits_dtype(owner: str, name: str, value: int, dtype: torch.dtype) -> None:
    """``ValueError`` naming ``name`` unless ``dtype`` holds ``value`` (:func:`fits_dtype`)."""
    if not fits_dtype(value, dtype):
        raise ValueError(f"{owner}: {name} {value} does not fit dtype {dtype}; pick a wider dtype")


def check_ignore_index(
    value: object, *, owner: str = "to_training", fits: torch.dtype | None = None, name: str = "ignore_index"
) -> int:
    """``value`` (a label value, the option ``name``) as an int within int64 (and ``fits``, when given);
    else ``TypeError`` / ``ValueError``."""
    if not _is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {shown(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{owner}: {name} must fit in int64, got {shown(value)}")
    if fits is not None:
        check_fits_dtype(owner, name, int(value), fits)
    return int(value)


def check_key(owner: str, name: str, value: object) -> str:
    """Return ``value`` if it is a non-empty str (a TensorDict key), else raise ``TypeError``."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{owner}: {name} must be a non-empty str, got {shown(value)}")
    return value


def check_keys(owner: str, name: str, value: Iterable[str]) -> tuple[str, ...]:
    """Return a sequence of keys as a tuple; a bare str or a non-str item raises ``TypeError``."""
    if isinstance(value, str):
        raise TypeError(f"{owner}: {name} must be a sequence of keys, not the str {shown(value)}")
    if not isinstance(value, Iterable):
        raise TypeError(f"{owner}: {name} must be a sequence of keys, got {shown(value)}")
    return tuple(check_key(owner, name, key) for key in value)


def warn_user(message: str) -> None:
    """A ``UserWarning`` attributed to the first caller outside this package."""
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def check_position_mode(value: object) -> Literal["preserve", "sequence"]:
    """Return ``value`` if it is ``"preserve"`` or ``"sequence"``, else raise ``ValueError``."""
    if value == "preserve" or value == "sequence":
        return value
    raise ValueError(f"position_mode must be 'preserve' or 'sequence', got {shown(value)}")


def check_bool(name: str, value: object, *, owner: str = "to_training") -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}: {name} must be a bool, got {shown(value)}")
    return bool(value)


def check_field_names(name: str, value: object, *, owner: str = "to_training") -> tuple[str, ...]:
    """Return a sequence of field names as a tuple; a bare str or a non-str item raises ``TypeError``."""
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"{owner}: {name} must be a sequence of field names, not the string {shown(value)}; "
            f"write ({shown(value)},)"
        )
    if not isinstance(value, (Sequence, set, frozenset)):
        raise TypeError(f"{owner}: {name} must be a sequence of field names, got {shown(value)}")
    names = tuple(value)
    for item in names:
        if not isinstance(item, str):
            raise TypeError(f"{owner}: {name} must hold str field names, got {shown(item)}")
    return names


def check_rename_fields(value: object) -> dict[str, str]:
    """Return ``rename_fields`` as a dict of str to str (``None`` gives ``{}``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"to_training: rename_fields must be a mapping {{emitted_key: new_key}}, got {shown(value)}"
        )
    for source, target in value.items():
        if not isinstance(source, str) or not isinstance(target, str):
            raise TypeError(
                f"to_training: rename_fields must map str to str, got {shown(source)}: {shown(target)}"
            )
    return dict(value)


def renamed(keys: Iterable[str], renames: Mapping[str, str]) -> dict[str, str]:
    """``{final name: key}`` of ``keys`` under ``rename_fields``; ``ValueError`` where two names meet.

    Example:
        >>> renamed(["input_ids", "labels"], {"labels": "y"})
        {'input_ids': 'input_ids', 'y': 'labels'}
    """
    named: dict[str, str] = {}
    for key in keys:
        name = renames.get(key, key)
        if name in named:
            raise ValueError(
                f"to_training: rename_fields gives {shown(named[name])} and {shown(key)} the same name "
                f"{shown(name)}; final names must be unique"
            )
        named[name] = key
    return named


@dataclass(frozen=True)
class OutputKind:
    """The container kind to_training returns (``"torch"``, ``"numpy"``, ``"list"``) and its torch dtype."""

    kind: Literal["torch", "numpy", "list"]
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype | None = None


def resolve_dtype(dtype: Any) -> OutputKind:
    """``dtype`` as an :class:`OutputKind`: ``"auto"`` (torch.long), ``None`` (lists), a torch or NumPy dtype.

    ``ValueError`` unless it is a signed integer dtype (8 to 64 bits, native byte order).
    """
    if isinstance(dtype, str) and dtype == "auto":
        return OutputKind("torch", torch.long)
    if dtype is None:
        return OutputKind("list", torch.long)
    if isinstance(dtype, torch.dtype):
        if dtype not in _INTEGER_TORCH_DTYPES:
            raise ValueError(
                f"to_training: dtype must be a signed integer dtype such as torch.long, got {dtype}"
            )
        return OutputKind("torch", dtype)
    try:
        numpy_dtype = np.dtype(dtype)
    except (TypeError, ValueError):  # NumPy's ValueError: an object with a .dtype (a tensor) is no dtype
        raise TypeError(
            f"to_training: dtype must be 'auto', None, a torch dtype or a NumPy dtype, got {shown(dtype)}"
        ) from None
    if numpy_dtype.kind != "i":
        raise ValueError(
            f"to_training: dtype must be a signed integer dtype such as np.int64, got {numpy_dtype}"
        )
    if not numpy_dtype.isnative:
        raise ValueError(
            f"to_training: dtype {shown(numpy_dtype.str)} is not in this machine's byte order; pass "
            f"np.dtype({shown(numpy_dtype.newbyteorder('=').name)})"
        )
    return OutputKind("numpy", torch.from_numpy(np.empty(0, numpy_dtype)).dtype, numpy_dtype)


def is_zero_d(value: object) -> bool:
    """A 0-d array or tensor: iterable by its type, but holding no items."""
    return getattr(value, "ndim", 1) == 0


def scalar(value: object) -> object:
    """A per-example value as the Python scalar it holds where it is a 0-d array or tensor or a NumPy
    scalar (``datasets``' NumPy rows hand a bool column over as ``array(True)``); else ``value``.

    Example:
        >>> scalar(np.array(True)), scalar(torch.tensor(3)), scalar([1])
        (True, 3, [1])
    """
    if isinstance(value, (np.ndarray, np.generic, torch.Tensor)) and is_zero_d(value):
        return value.item()
    return value


def check_int(owner: str, name: str, value: object, minimum: int, maximum: int = INT64_MAX) -> int:
    """``value`` as an int from ``minimum`` to ``maximum`` (``TypeError`` for a non-int or a bool)."""
    if not _is_int(value):
        raise TypeError(
            f"{owner}: {name} must be an int >= {minimum}, got {shown(value)} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {shown(value)}")
    if value > maximum:
        raise ValueError(f"{owner}: {name} must be an int <= {maximum}, got {shown(value)}")
    return int(value)


def check_num_boundaries(owner: str, value: object) -> int | None:
    """``None``, or ``value`` as an int >= 1 (``cu_seqlens``'s static boundary count)."""
    if value is None:
        return None
    message = f"{owner}: num_boundaries must be an int >= 1 or None, got {shown(value)}"
    if not _is_int(value):
        raise TypeError(message)
    if value < 1:
        raise ValueError(message)
    return int(value)
