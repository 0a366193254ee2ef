"""The transform contract and the chain that composes transforms."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

__all__ = ["Chain", "Transform"]


class Transform(TensorDictModuleBase):
    """Base class: read ``in_keys`` from a TensorDict, return a new one with ``out_keys`` written.

    A transform never writes into its input TensorDict or its tensors; it
    returns a shallow copy (``td.replace(...)``) holding the new entries.
    Subclasses set ``in_keys`` / ``out_keys`` (and ``dropped_keys``, for inputs
    they consume) in ``__init__``, validate their configuration there, and
    implement :meth:`forward`. They hold no Python branch on tensor values, so
    the same transform runs on any device and under ``torch.compile``.
    Being a :class:`tensordict.nn.TensorDictModuleBase`, a transform also fits
    in a :class:`tensordict.nn.TensorDictSequential`.

    Calling a transform checks its input first: anything but a TensorDict
    raises ``TypeError``, a TensorDict lacking one of ``in_keys`` raises
    ``ValueError`` naming it. Built-in transforms also check the shapes they
    rely on (``ValueError``); they never read values (that would synchronise
    with the device): :func:`~zephon_collate.training.to_training` checks those.
    """

    dropped_keys: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            td = args[0]
            if not isinstance(td, TensorDictBase):
                raise TypeError(
                    f"{type(self).__name__}: expects a TensorDict (e.g. batch.to_tensordict()), got "
                    f"{type(td).__name__}"
                )
            missing = [key for key in self.in_keys if key not in td]
            if missing:
                raise ValueError(
                    f"{type(self).__name__} needs {missing[0]!r}, which the TensorDict lacks "
                    f"(it holds {sorted(td.keys())})"
                )
        return super().__call__(*args, **kwargs)

    def forward(self, td: TensorDictBase) -> TensorDictBase:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_keys={list(self.in_keys)}, out_keys={list(self.out_keys)}"


def _check_key(owner: str, name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{owner}: {name} must be a non-empty str, got {value!r}")
    return value


def _check_keys(owner: str, name: str, value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"{owner}: {name} must be a sequence of keys, not the str {value!r}")
    if not isinstance(value, Iterable):
        raise TypeError(f"{owner}: {name} must be a sequence of keys, got {value!r}")
    return tuple(_check_key(owner, name, key) for key in value)


def _check_rank(
    owner: str, key: str, tensor: torch.Tensor, layout: str, min_dim: int, max_dim: int = 64
) -> None:
    """``ValueError`` unless ``tensor`` has ``min_dim`` to ``max_dim`` dimensions (``layout`` names them)."""
    if not min_dim <= tensor.dim() <= max_dim:
        raise ValueError(f"{owner}: {key!r} must be {layout}, got shape {tuple(tensor.shape)}")


def _check_ignore_fits(owner: str, ignore_index: int, key: str, labels: torch.Tensor) -> None:
    """``ValueError`` if integer ``labels`` cannot hold ``ignore_index`` (it would wrap around)."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return
    info = torch.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(f"{owner}: ignore_index {ignore_index} does not fit {key!r} of dtype {labels.dtype}")


def _check_leading(
    owner: str, key: str, tensor: torch.Tensor, like_key: str, like: torch.Tensor, dims: int
) -> None:
    """``ValueError`` unless the first ``dims`` sizes of ``tensor`` equal those of ``like``."""
    if tensor.shape[:dims] != like.shape[:dims]:
        raise ValueError(
            f"{owner}: {key!r} has shape {tuple(tensor.shape)}, which does not match {like_key!r} "
            f"{tuple(like.shape)} in its first {dims} dims; per-token fields must align one to one"
        )


class Chain(Transform):
    """Run transforms in order, each on the previous one's output.

    The wiring is checked when the chain is built: each transform's
    ``in_keys`` must be written by an earlier transform or be among the
    chain's ``input_keys``. Without ``input_keys`` the chain's own ``in_keys``
    are the keys it needs from outside, and a call fails naming the first one
    missing from its input.

    Parameters:
        *transforms: the transforms (any :class:`Transform`, or any
            ``TensorDictModuleBase`` with ``in_keys``/``out_keys``).
        input_keys: the keys the input TensorDict will hold, or ``None``.

    Raises:
        TypeError: if an item is not a transform.
        ValueError: if ``input_keys`` is given and a transform reads a key that
            nothing provides; when called, if the input lacks a key it needs.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from zephon_collate.transforms import Chain, LossMask, TokenShift
        >>> chain = Chain(TokenShift(), LossMask(supervision_key=None, padding_length_key=None))
        >>> chain.in_keys
        ['input_ids']
        >>> out = chain(TensorDict(input_ids=torch.tensor([[1, 2, 3]]), batch_size=[1]))
        >>> out["labels"].tolist(), out["loss_mask"].tolist()
        ([[2, 3]], [[1.0, 1.0]])
    """

    def __init__(self, *transforms: TensorDictModuleBase, input_keys: Sequence[str] | None = None) -> None:
        super().__init__()
        for index, transform in enumerate(transforms):
            if not isinstance(transform, nn.Module) or not self.is_tdmodule_compatible(transform):
                raise TypeError(
                    f"Chain: item {index} ({transform!r}) is not a transform with in_keys and out_keys"
                )
        self.transforms = nn.ModuleList(transforms)
        provided = set(_check_keys("Chain", "input_keys", input_keys or ()))
        needed: list[str] = []
        for transform in self.transforms:
            for key in transform.in_keys:
                if key in provided:
                    continue
                if input_keys is not None:
                    raise ValueError(
                        f"Chain: {type(transform).__name__} reads {key!r}, which neither the input "
                        f"(keys {sorted(input_keys)}) nor an earlier transform provides"
                    )
                needed.append(key)
                provided.add(key)
            provided.update(transform.out_keys)
            provided.difference_update(getattr(transform, "dropped_keys", ()))
        self.in_keys = needed
        self.out_keys = sorted({key for t in self.transforms for key in t.out_keys})

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        for transform in self.transforms:
            # A Transform checks its own input when called; other modules are checked here.
            checked = isinstance(transform, Transform)
            missing = [] if checked else [key for key in transform.in_keys if key not in td]
            if missing:
                raise ValueError(
                    f"{type(transform).__name__} needs {missing[0]!r}, which the TensorDict lacks "
                    f"(it holds {sorted(td.keys())})"
                )
            td = transform(td)
        return td

    def __len__(self) -> int:
        return len(self.transforms)

    def __getitem__(self, index: int) -> TensorDictModuleBase:
        return self.transforms[index]  # type: ignore[return-value]
