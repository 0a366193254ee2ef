"""The transform contract and the chain that composes transforms."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from torch import nn

from zephon_collate.core.checks import check_keys
from zephon_collate.core.text import shown
from zephon_collate.transforms._shapes import check_present

__all__ = [
    "Chain",
    "Transform",
    "UndeclaredKeyError",
    "declared",
    "declared_keys",
    "flat_steps",
    "is_step",
    "join_rows",
    "returned",
]


class Transform(TensorDictModuleBase):
    """Base class: set ``in_keys`` / ``out_keys`` in ``__init__``, write :meth:`compute` (docs/transforms.md).

    Example:
        >>> from tensordict import TensorDict
        >>> class Halve(Transform):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.in_keys, self.out_keys = ["labels"], ["weights"]
        ...     def compute(self, data):
        ...         return {"weights": (data["labels"] != -100).float() / 2}
        >>> Halve()(TensorDict(labels=torch.tensor([[6, -100]]), batch_size=[1]))["weights"].tolist()
        [[0.5, 0.0]]
    """

    dropped_keys: tuple[str, ...] = ()
    optional_keys: tuple[str, ...] = ()
    data_dependent_shape: bool = False
    runs_before: tuple[str, ...] = ()
    """Built-in steps (class names) this one must precede where they share a key (one writes what the
    other reads): placed after one, it reads a key already cut or changed, or its output is ignored."""
    runs_last: bool = False
    """No built-in step may read what this one wrote (it reshapes it)."""
    shifted_as: Literal["inputs", "labels"] | None = None
    """How a later ``TokenShift`` must cut this step's outputs (``None``: no rule)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            td = args[0]
            if not isinstance(td, TensorDictBase):
                raise TypeError(
                    f"{_name(self)}: expects a TensorDict (e.g. batch.to_tensordict()), got "
                    f"{type(td).__name__}"
                )
            check_present(_name(self), self.in_keys, td)
        return super().__call__(*args, **kwargs)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        """``ValueError`` if the shapes in ``data`` do not fit; reads no values (default: no check)."""

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # pragma: no cover
        """The new entries computed from ``data``: pure, no Python branch on tensor values."""
        raise NotImplementedError

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:  # pragma: no cover
        """:meth:`compute` in NumPy over host arrays (optional): the same keys, values, dtypes and shapes."""
        raise NotImplementedError

    def empty_outputs(self, earlier: Mapping[str, Any]) -> dict[str, Any]:
        """The outputs of an empty batch that are not empty lists (the page's ``[0]`` / ``0``), given
        the earlier steps' (``earlier``)."""
        return {}

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        """The batch size of the output TensorDict (default: the input's)."""
        return batch_size

    def join(self, key: str, rows: list[Any]) -> Any:
        """One output of a batch run row by row, from the rows' Python values (:func:`join_rows`)."""
        return join_rows(rows)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        view = declared(self, cast(Mapping[str, torch.Tensor], td))
        self.check(view)
        updates = returned(self, _pure(self, view, self.compute))
        size = self.output_batch_size(td.batch_size)
        if size == td.batch_size:
            out = cast(Any, td).replace(updates) if updates else td.copy()
        else:  # e.g. flattened outputs: batch_size=[]
            out = td.copy()
            out.batch_size = size
            out = out.update(updates)
        return cast(TensorDictBase, out.exclude(*self.dropped_keys) if self.dropped_keys else out)

    def extra_repr(self) -> str:
        return f"in_keys={list(self.in_keys)}, out_keys={list(self.out_keys)}"


def join_rows(rows: list[Any]) -> Any:
    """Each row's output as one list: per-row and per-token entries joined by items, a 0-d one per row.

    Example:
        >>> join_rows([[[5, 6]], [[7]]]), join_rows([[5, 6], [7]]), join_rows([3, 1])
        ([[5, 6], [7]], [5, 6, 7], [3, 1])
    """
    if any(not isinstance(row, list) for row in rows):
        return rows
    return [item for row in rows for item in row]


def _name(module: object) -> str:
    return type(module).__qualname__


class UndeclaredKeyError(KeyError):
    """A step read a key it does not declare in ``in_keys`` / ``optional_keys``."""

    def __str__(self) -> str:  # KeyError quotes its argument; this one is a sentence
        return str(self.args[0])


class _Declared(Mapping[str, Any]):
    """The keys of ``data`` that ``step`` declares, and nothing else."""

    __slots__ = ("_data", "_keys", "_step")

    def __init__(self, step: object, data: Mapping[str, Any], keys: frozenset[str]) -> None:
        self._step, self._data, self._keys = step, data, keys

    def _allow(self, key: object) -> None:
        if key not in self._keys:
            raise UndeclaredKeyError(
                f"{_name(self._step)} reads {shown(key)}, which it does not declare (in_keys "
                f"{_keys(self._step, 'in_keys')}, optional_keys {_keys(self._step, 'optional_keys')}); "
                "add it to in_keys (or optional_keys): a compiled graph is fed the declared keys only"
            )

    def __getitem__(self, key: str) -> Any:
        self._allow(key)
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._allow(key)
        return self._data[key] if key in self._data else default  # noqa: SIM401 (any Mapping, TensorDicts too)

    def __contains__(self, key: object) -> bool:
        self._allow(key)
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return (key for key in self._data.keys() if key in self._keys)  # noqa: SIM118 (a TensorDict iterates rows)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _as_tensors(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with each NumPy array as a tensor view of it (no copy)."""
    return {key: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for key, v in data.items()}


_OURS = "zephon_collate.transforms."
"""The built-in steps' modules: tested step by step, their returns need no check."""


_R = TypeVar("_R")


def _pure(step: object, given: Any, call: Callable[[Any], _R]) -> _R:
    """``call(given)``, refused if it wrote a tensor of ``given`` in place (eager: the tensors' version
    counters; a compiled graph cannot be watched). The batch's tensors are the caller's inputs."""
    if torch.compiler.is_compiling() or type(step).__module__.startswith(_OURS):
        return call(given)
    watched = [
        (key, value, value._version) for key, value in given.items() if isinstance(value, torch.Tensor)
    ]
    result = call(given)
    for key, tensor, version in watched:
        if tensor._version != version:
            raise ValueError(
                f"{_name(step)} wrote its input {key!r} in place; a step must not change the batch it "
                "reads (its tensors are the caller's inputs): compute a new tensor (e.g. "
                "data[key].clone()) and return it under an out_key"
            )
    return result


def declared_keys(step: object) -> frozenset[str]:
    """The keys ``step`` may read: its ``in_keys`` and ``optional_keys``."""
    return frozenset((*_keys(step, "in_keys"), *_keys(step, "optional_keys")))


def declared(step: object, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """What ``step`` sees of ``data``: its declared keys (every key with ``reads_every_key``)."""
    if getattr(step, "reads_every_key", False):
        return data
    keys = declared_keys(step)
    if torch.compiler.is_compiling():
        return {key: data[key] for key in keys if key in data}
    return _Declared(step, data, keys)


def returned(step: object, result: Any) -> Any:
    """``result``, checked: a dict of arrays or tensors, each under a key of ``step``'s ``out_keys``."""
    if not isinstance(result, Mapping):
        raise TypeError(f"{_name(step)}.compute must return a dict of its new entries, got {shown(result)}")
    out_keys = _keys(step, "out_keys")
    for key, value in result.items():
        if key not in out_keys:
            raise ValueError(
                f"{_name(step)} returns {shown(key)}, which is not in its out_keys {out_keys}: add it to "
                "out_keys (only declared keys are outputs), or do not return it"
            )
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise TypeError(
                f"{_name(step)} returns {shown(key)} as {type(value).__name__}, not a tensor: return a "
                "torch tensor (torch.as_tensor(value))"
            )
    return result


_PLAIN, _EVERY, _MODULE = 0, 1, 2


def _has_host(step: object) -> bool:
    """Does ``step`` run its own ``host`` on the host path? Only where ``host`` is defined by the class that
    defines ``compute``, or below it: a subclass overriding ``compute`` alone runs its ``compute``."""
    if not isinstance(step, Transform):
        return False
    mro = type(step).__mro__
    host_at = next(k for k, cls in enumerate(mro) if "host" in vars(cls))
    compute_at = next(k for k, cls in enumerate(mro) if "compute" in vars(cls))
    return mro[host_at] is not Transform and host_at <= compute_at


def _kind(step: object) -> int:
    """How a chain runs ``step``: a transform's core over a view, the whole batch, or as a module."""
    if isinstance(step, Transform) and type(step).forward is Transform.forward:
        return _PLAIN
    return _EVERY if getattr(step, "reads_every_key", False) else _MODULE


def _keys(step: Any, name: str) -> list[str]:
    """A step's ``in_keys``, ``out_keys`` or ``dropped_keys``, as a list of str."""
    return list(getattr(step, name, ()))


class Chain(Transform):
    """Run transforms in order, each on the previous one's output (``ValueError`` if the wiring breaks).

    Parameters:
        *transforms: the transforms (any ``TensorDictModuleBase`` with ``in_keys`` / ``out_keys``).
        input_keys: the keys the input will hold (checked against each step's ``in_keys``), or ``None``.

    Example:
        >>> from zephon_collate.transforms import Chain, LossMask, TokenShift
        >>> chain = Chain(TokenShift(), LossMask(supervision_key=None, padding_length_key=None))
        >>> out = chain(TensorDict(input_ids=torch.tensor([[1, 2, 3]]), batch_size=[1]))
        >>> out["labels"].tolist(), out["loss_mask"].tolist()
        ([[2, 3]], [[1.0, 1.0]])
    """

    def __init__(self, *transforms: TensorDictModuleBase, input_keys: Sequence[str] | None = None) -> None:
        super().__init__()
        for index, transform in enumerate(transforms):
            if not isinstance(transform, nn.Module) or not cast(Any, self).is_tdmodule_compatible(transform):
                raise TypeError(
                    f"Chain: item {index} ({shown(transform)}) is not a transform with in_keys and out_keys"
                )
        self.transforms = nn.ModuleList(transforms)
        self.steps: tuple[Any, ...] = tuple(transforms)
        provided = set(check_keys("Chain", "input_keys", input_keys or ()))
        needed: list[str] = []
        for step in self.steps:
            for key in _keys(step, "in_keys"):
                if key in provided:
                    continue
                if input_keys is not None:
                    raise ValueError(
                        f"Chain: {_name(step)} reads {shown(key)}, which neither the input "
                        f"(keys {sorted(input_keys)}) nor an earlier transform provides"
                    )
                needed.append(key)
                provided.add(key)
            provided.update(_keys(step, "out_keys"))
            provided.difference_update(_keys(step, "dropped_keys"))
        _check_order(self.steps)  # after the wiring, whose message is the more precise
        self.in_keys = cast(Any, needed)  # tensordict types keys as NestedKey; these are str
        # Read when present, and written by no earlier step: the chain's own optional inputs.
        self.optional_keys = tuple(dict.fromkeys(key for key in self._optional() if key not in needed))
        self.reads_every_key = any(getattr(step, "reads_every_key", False) for step in self.steps)
        dropped = {key for step in self.steps for key in _keys(step, "dropped_keys")}
        self.dropped_keys = tuple(sorted(dropped - provided))
        self.out_keys = sorted({key for step in self.steps for key in _keys(step, "out_keys")})
        self.data_dependent_shape = any(getattr(step, "data_dependent_shape", False) for step in self.steps)
        # What each call needs to know of a step, found once: its kind, declared keys, host variant and
        # the inputs it consumes.
        self._runs = tuple(
            (
                step,
                _kind(step),
                None if getattr(step, "reads_every_key", False) else declared_keys(step),
                _has_host(step),
                tuple(key for key in _keys(step, "dropped_keys") if key not in _keys(step, "out_keys")),
                type(step).__module__.startswith(_OURS),
            )
            for step in self.steps
        )

    def _optional(self) -> list[str]:
        """Each step's optional keys that no earlier step writes, in order."""
        found: list[str] = []
        written: set[str] = set()
        for step in self.steps:
            found += [key for key in _keys(step, "optional_keys") if key not in written]
            written.update(_keys(step, "out_keys"))
        return found

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_present("Chain", self.in_keys, data)

    def empty_outputs(self, earlier: Mapping[str, Any]) -> dict[str, Any]:
        outputs = dict(earlier)
        for step in self.steps:  # a module of tensordict's has no empty_outputs: its outputs are empty
            outputs.update(step.empty_outputs(outputs) if isinstance(step, Transform) else {})
        return outputs

    def run(self, data: Mapping[str, Any], *, host: bool = False) -> dict[str, Any]:
        """Every step's core over a copy of ``data``, unchecked (``host``: the NumPy variants where given)."""
        return self._run(dict(data), checked=False, host=host)[0]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        given = dict(data)
        out = self.run(given)
        return {key: value for key, value in out.items() if given.get(key) is not value}

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        data, batch_size = self._run(dict(td.items()), checked=True, batch_size=td.batch_size)
        return TensorDict(data, batch_size=batch_size, device=td.device)

    def _run(
        self, data: dict[str, Any], *, checked: bool, batch_size: torch.Size | None = None, host: bool = False
    ) -> tuple[dict[str, Any], torch.Size | None]:
        compiling = torch.compiler.is_compiling()
        # Every value a NumPy array: checked once, then true until a step returns tensors.
        arrays = host and all(type(value) is np.ndarray for value in data.values())
        for step, kind, keys, has_host, consumed, ours in self._runs:
            if checked:
                check_present(_name(step), _keys(step, "in_keys"), data)
            if kind == _PLAIN:
                # What the step sees: its declared keys (a plain dict of them while compiling).
                view: Mapping[str, Any] = (
                    data
                    if keys is None
                    else {key: data[key] for key in keys if key in data}
                    if compiling
                    else _Declared(step, data, keys)
                )
                if checked:
                    step.check(view)
                if (
                    host
                    and has_host
                    and (arrays or all(type(data[key]) is np.ndarray for key in keys or data if key in data))
                ):
                    result = step.host(view)
                    arrays = arrays and ours  # a host variant of yours may return tensors
                else:
                    given = declared(step, _as_tensors(view)) if host else view
                    result = step.compute(given) if ours else _pure(step, given, step.compute)
                    arrays = False
                data.update(result if ours else returned(step, result))
                for key in consumed:
                    data.pop(key, None)
                batch_size = None if batch_size is None else step.output_batch_size(batch_size)
            else:
                arrays = False
                size = batch_size if batch_size is not None else []
                if kind == _EVERY:  # it reshapes the whole batch: its output is all
                    result = _pure(
                        step, TensorDict(_as_tensors(data) if host else data, batch_size=size), step
                    )
                    data = dict(result.items())
                else:  # any other TensorDict module: wrap its declared keys, call, merge what it returns
                    given = _as_tensors(declared(step, data))
                    result = _pure(step, TensorDict(given, batch_size=size), step)
                    data.update((key, value) for key, value in result.items() if given.get(key) is not value)
                    for key in consumed:  # a nested Chain's consumed inputs leave the batch after it too
                        data.pop(key, None)
                batch_size = result.batch_size
        return data, batch_size

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        for step in self.steps:
            if isinstance(step, Transform):
                batch_size = step.output_batch_size(batch_size)
        return batch_size

    def join(self, key: str, rows: list[Any]) -> Any:
        """Output ``key`` of a batch run row by row, joined by the last step that writes it (or by items)."""
        for step in reversed(self.steps):
            if key in _keys(step, "out_keys"):
                return step.join(key, rows) if isinstance(step, Transform) else join_rows(rows)
        return join_rows(rows)

    def output_keys(self, input_keys: Sequence[str]) -> list[str]:
        """The keys a mapping holds after the chain, given those it starts with (consumed keys gone).

        Example:
            >>> from zephon_collate.transforms import LossMask, TokenShift
            >>> Chain(TokenShift(label_keys=["loss_mask"]), LossMask()).output_keys(
            ...     ["input_ids", "loss_mask", "padding_length"]
            ... )
            ['input_ids', 'loss_mask', 'padding_length', 'labels', 'num_valid_tokens']
        """
        keys = dict.fromkeys(input_keys)
        for step in self.steps:
            written = _keys(step, "out_keys")
            keys.update(dict.fromkeys(written))
            for key in _keys(step, "dropped_keys"):
                if key not in written:
                    keys.pop(key, None)
        return list(keys)

    def created_keys(self) -> list[str]:
        """The keys some step writes without reading them (``labels``, ``cu_seqlens``, ...), in order."""
        created = [
            key for step in self.steps for key in _keys(step, "out_keys") if key not in _keys(step, "in_keys")
        ]
        return list(dict.fromkeys(created))

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> Any:
        return self.steps[index]


def is_step(step: object, name: str) -> bool:
    """Whether ``step`` is the built-in step ``name`` (a subclass of it too; never a class of yours)."""
    return any(cls.__name__ == name and cls.__module__.startswith(_OURS) for cls in type(step).__mro__)


def flat_steps(steps: Sequence[Any]) -> list[Any]:
    """``steps`` with every nested ``Chain`` or ``TensorDictSequential`` replaced by its own steps."""
    found: list[Any] = []
    for step in steps:
        if isinstance(step, Chain):
            found += flat_steps(step.steps)
        elif isinstance(step, TensorDictSequential):
            found += flat_steps(list(step.module))
        else:
            found.append(step)
    return found


def _check_order(steps: Sequence[Any]) -> None:
    """Refuse built-in steps in an order that gives a wrong batch (docs/transforms.md, "where each goes"):
    a step after one its ``runs_before`` names, where they share a key; a built-in step reading what a
    ``runs_last`` one wrote; a mask ``TokenShift`` would cut the wrong way."""
    flat = flat_steps(steps)
    aligned: dict[str, str] = {}  # key -> "inputs" / "labels": how a TokenShift must cut it
    for index, step in enumerate(flat):
        reads = {*_keys(step, "in_keys"), *_keys(step, "optional_keys")}
        writes = set(_keys(step, "out_keys"))
        for before, earlier in enumerate(flat[:index]):
            shared = (set(_keys(earlier, "out_keys")) & reads) | (writes & set(_keys(earlier, "in_keys")))
            misplaced = any(is_step(earlier, name) for name in getattr(step, "runs_before", ()))
            if misplaced and shared:
                raise ValueError(
                    f"Chain: {_name(step)} (step {index}) must run before {_name(earlier)} (step {before}): "
                    f"they share {shown(sorted(shared)[0])}, which one writes and the other reads; swap them "
                    "(docs/transforms.md lists where each step goes)"
                )
            flattened = set(_keys(earlier, "out_keys")) & reads
            if getattr(earlier, "runs_last", False) and flattened and _ours(step):
                raise ValueError(
                    f"Chain: {_name(step)} (step {index}) reads {shown(sorted(flattened)[0])}, which "
                    f"{_name(earlier)} (step {before}) reshaped; move {_name(earlier)} after it"
                )
        if is_step(step, "TokenShift"):
            for role, keys in (("labels", step.input_keys), ("inputs", step.label_keys)):
                wrong = [key for key in keys if aligned.get(key) == role]
                if wrong:
                    where = "label_keys" if role == "labels" else "input_keys"
                    raise ValueError(
                        f"Chain: {_name(step)} (step {index}) cuts {shown(wrong[0])} the other way: it is "
                        f"aligned with the {role}; put it in {where}"
                    )
        if getattr(step, "shifted_as", None) is not None:
            aligned.update(dict.fromkeys(writes, step.shifted_as))


def _ours(step: object) -> bool:
    """A built-in step, or a subclass of one (not a transform of yours, whose base lives here)."""
    return any(cls.__module__.startswith(_OURS) and cls.__module__ != __name__ for cls in type(step).__mro__)
