"""Engine state as JSON: a packer's saved arrays and tuples in a form any checkpointer writes (Grain's
write ``get_state()`` as JSON); :func:`from_json` restores what :func:`to_json` tags, bit for bit.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["from_json", "to_json"]

_ARRAY, _TUPLE, _ITEMS = "__array__", "__tuple__", "__items__"


def to_json(value: Any) -> Any:
    """``value`` with arrays, NumPy scalars, tuples and non-string keys in JSON-safe tagged form.

    Example:
        >>> import json
        >>> state = {"tokens": np.arange(3, dtype=np.int32), "key": (0, 1), "counts": {7: 2}}
        >>> restored = from_json(json.loads(json.dumps(to_json(state))))
        >>> restored["tokens"].dtype, restored["tokens"].tolist(), restored["key"], restored["counts"]
        (dtype('int32'), [0, 1, 2], (0, 1), {7: 2})
    """
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)  # a 0-d array comes back 1-d: its shape is the given one's
        return {
            _ARRAY: data.dtype.str,
            "shape": list(value.shape),
            "data": base64.b64encode(data.tobytes()).decode(),
        }
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {_TUPLE: [to_json(item) for item in value]}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    if isinstance(value, Mapping):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: to_json(item) for key, item in value.items()}
        return {_ITEMS: [[to_json(key), to_json(item)] for key, item in value.items()]}
    return value


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json`: tagged values back to arrays, tuples and dicts."""
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if not isinstance(value, Mapping):
        return value
    if _ARRAY in value:
        raw = base64.b64decode(value["data"])
        return np.frombuffer(raw, dtype=np.dtype(value[_ARRAY])).reshape(value["shape"]).copy()
    if _TUPLE in value:
        return tuple(from_json(item) for item in value[_TUPLE])
    if _ITEMS in value:
        return {_hashable(from_json(key)): from_json(item) for key, item in value[_ITEMS]}
    return {key: from_json(item) for key, item in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(item) for item in key) if isinstance(key, list) else key
