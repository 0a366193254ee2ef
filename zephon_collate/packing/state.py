"""The packer's saved state: pieces as plain data, checked on the way back (a ``ValueError`` naming the
corrupt key, never a raw NumPy error or a wrong row)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_collate.core.keys import LOSS_MASK
from zephon_collate.core.records import SampleMeta
from zephon_collate.core.text import shown
from zephon_collate.packing.reader import as_array, check_loss_mask
from zephon_collate.packing.rows import CONTINUES, OPENS_ROW, OPENS_UNIT, Base, Piece
from zephon_collate.read.columns import Ragged
from zephon_collate.read.rules import unstarted

__all__ = [
    "changed_options",
    "check_count",
    "check_saved",
    "corrupt",
    "piece_from_state",
    "piece_state",
    "pieces_from_state",
    "same_value",
]

_OWNER = "FlatPacker.load_state_dict"


def corrupt(where: str, problem: str, owner: str = _OWNER) -> ValueError:
    saver = owner.split(".")[0]
    return ValueError(
        f"{owner}: {where} {problem}; the state is corrupt: restore a state_dict() saved by {saver}"
    )


def check_saved(state: object, owner: str, keys: Sequence[str], version: int) -> None:
    """``owner.load_state_dict``'s first check: ``state`` a dict with ``keys``, saved by this ``version``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict: state must be a dict, got {type(state).__name__}")
    missing = [key for key in keys if key not in state]
    if missing or not same_value(state["version"], version):
        raise ValueError(
            f"{owner}.load_state_dict: not a version-{version} {owner} state "
            f"(missing keys {missing}, version {shown(state.get('version'))})"
        )


def same_value(saved: object, expected: object) -> bool:
    """``saved == expected`` for a saved plain value; anything else (an array, a tensor) is not the same."""
    if isinstance(saved, (np.ndarray, np.generic)) or type(saved).__module__.startswith("torch"):
        return False
    try:
        return bool(saved == expected)
    except (TypeError, ValueError):
        return False


def changed_options(saved: Mapping[Any, Any], mine: Mapping[str, Any]) -> str:
    """Each option a saved state and this run hold differently: ``key: saved ..., here ...`` ("" if none)."""
    keys = sorted(key for key in mine.keys() | saved.keys() if not same_value(saved.get(key), mine.get(key)))
    return ", ".join(f"{key}: saved {shown(saved.get(key))}, here {shown(mine.get(key))}" for key in keys)


def piece_state(piece: Piece) -> dict[str, Any]:
    """One piece as plain, picklable data (copies, not views)."""
    base = piece.base._asdict()
    base["counts"] = dict(base["counts"])
    fields = {name: values.copy() for name, values in piece.fields.items()}
    state = {"tokens": piece.tokens.copy(), "fields": fields, "base": base}
    positions = None if piece.positions is None else piece.positions.copy()
    extra = {"positions": positions, "side": piece.side, "opens": piece.opens}
    return {**state, "index": piece.part, "closes": piece.closes, **extra}


def check_count(value: object, where: str, owner: str = _OWNER) -> int:
    """A saved counter: an int >= 0 (not a bool)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 0:
        raise corrupt(where, f"must be an int >= 0, got {shown(value)}", owner)
    return int(value)


def piece_from_state(state: object, where: str, seq_len: int, fields: Sequence[str]) -> Piece:
    """A piece back from :func:`piece_state`, checked as strictly as a record."""
    if not isinstance(state, Mapping):
        raise corrupt(where, f"must be a dict, got {type(state).__name__}")
    missing = [key for key in ("tokens", "fields", "base", "index", "closes") if key not in state]
    if missing:
        raise corrupt(where, f"lacks {missing}")
    try:
        tokens = as_array(state["tokens"], f"{_OWNER}: {where}", "tokens", ids=True)
    except (TypeError, ValueError) as error:
        raise corrupt(f"{where}['tokens']", f"is not a row of token ids ({error})") from None
    if not 0 < tokens.size <= seq_len:
        raise corrupt(
            f"{where}['tokens']", f"holds {tokens.size} tokens; a piece holds 1 to seq_len={seq_len}"
        )
    saved = state["fields"]
    if not isinstance(saved, Mapping) or sorted(map(str, saved)) != sorted(fields):
        raise corrupt(f"{where}['fields']", f"must hold exactly the packed fields {list(fields)}")
    values = {}
    for name in fields:
        key = f"{where}['fields'][{shown(name)}]"
        try:
            values[name] = as_array(saved[name], f"{_OWNER}: {where}['fields']", name, ids=False, flat=False)
            if name == LOSS_MASK:
                check_loss_mask(values[name], f"{_OWNER}: {where}['fields']")
        except (TypeError, ValueError) as error:
            raise corrupt(key, f"is not a packed field ({error})") from None
        if values[name].shape[0] != tokens.size:
            raise corrupt(key, f"has {values[name].shape[0]} entries for {tokens.size} tokens")
    index = check_count(state["index"], f"{where}['index']")
    if not isinstance(state["closes"], (bool, np.bool_)):
        raise corrupt(f"{where}['closes']", f"must be a bool, got {shown(state['closes'])}")
    positions = state.get("positions")  # absent from states saved before segments were kept
    if positions is not None:
        try:
            positions = as_array(positions, f"{_OWNER}: {where}", "positions", ids=True)
        except (TypeError, ValueError) as error:
            raise corrupt(f"{where}['positions']", f"is not a row of positions ({error})") from None
        if positions.size != tokens.size or unstarted(Ragged.of_row(positions)) is not None:
            raise corrupt(f"{where}['positions']", f"must hold {tokens.size} positions starting at 0")
    side = check_count(state.get("side", 0), f"{where}['side']")
    opens = check_count(state.get("opens", OPENS_UNIT), f"{where}['opens']")
    if opens not in (OPENS_UNIT, OPENS_ROW, CONTINUES):
        raise corrupt(f"{where}['opens']", f"must be {CONTINUES}, {OPENS_ROW} or {OPENS_UNIT}, got {opens}")
    base = _base_from_state(state["base"], f"{where}['base']")
    return Piece(tokens, values, base, index, bool(state["closes"]), positions, side, opens)


def _base_from_state(state: object, where: str) -> Base:
    keys = set(Base._fields)
    if not isinstance(state, Mapping) or set(state) != keys:
        raise corrupt(where, f"must be a dict with the keys {sorted(keys)}")
    try:  # SampleMeta checks each value as it checks a record's metadata
        meta = SampleMeta(
            tuple(state["sample_id"]),
            state["lane_id"],
            state["chunk_id"],
            state["chunk_offset"],
            component_sample_counts=dict(state["counts"]),
            lineage=tuple(state["lineage"]),
        )
    except (TypeError, ValueError) as error:
        raise corrupt(where, f"is not record metadata ({error})") from None
    return Base.of(meta)


def pieces_from_state(
    pending: object, ready: object, seq_len: int, fields: Sequence[str], greedy: bool
) -> tuple[list[Piece], list[list[Piece]]]:
    """The open row (or best-fit buffer) and the closed rows of a state, each row within ``seq_len``."""
    for key, value in (("pending", pending), ("ready", ready)):
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise corrupt(f"state[{shown(key)}]", f"must be a list, got {type(value).__name__}")
    assert isinstance(pending, Sequence) and isinstance(ready, Sequence)  # checked just above
    open_row = [piece_from_state(p, f"state['pending'][{i}]", seq_len, fields) for i, p in enumerate(pending)]
    rows = []
    for r, row in enumerate(ready):
        if isinstance(row, (str, bytes, Mapping)) or not isinstance(row, Sequence) or not row:
            raise corrupt(f"state['ready'][{r}]", "must be a non-empty list of pieces")
        rows.append(
            [piece_from_state(p, f"state['ready'][{r}][{i}]", seq_len, fields) for i, p in enumerate(row)]
        )
    checked = [(f"state['ready'][{r}]", row) for r, row in enumerate(rows)]
    if greedy:
        checked.append(("state['pending']", open_row))
    for where, row in checked:
        if sum(piece.tokens.size for piece in row) > seq_len:
            raise corrupt(where, f"holds more than seq_len={seq_len} tokens")
    return open_row, rows
