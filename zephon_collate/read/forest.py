"""Forest: post-training data as trees of token spans, what every post-training format is read into.

A node is a span of tokens, a sequence a path from a root to a node (a DPO pair: the prompt, two children).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from zephon_collate.read.columns import Ragged, gather_spans

__all__ = ["Forest", "rows_taker"]


def rows_taker(tokens: Ragged, kept: np.ndarray) -> Callable[[Ragged], Ragged]:
    """A function giving the rows ``kept`` of a field with the offsets of ``tokens``, end to end."""
    offsets = np.zeros(kept.size + 1, dtype=np.int64)
    np.cumsum(tokens.lengths[kept], out=offsets[1:])
    picked = gather_spans(tokens.offsets[kept], tokens.lengths[kept])
    return lambda field: Ragged(np.asarray(field.values)[picked], offsets)


@dataclass
class Forest:
    """A batch's trees: nodes (token spans) and sequences (root-to-node paths).

    Parameters:
        tokens: each node's token ids (int64), one row per node.
        trained: each node's supervision (bool), the offsets of ``tokens``.
        parent: ``[M]`` int64, each node's parent (-1 for a root), a parent before its children.
        ends: ``[S]`` int64, the node each sequence ends at (-1: a sequence without tokens).
        values: per-token value fields, the offsets of ``tokens``.
        per_sequence: ``[S, ...]`` values, one per sequence.
        source: ``[S]`` the example each sequence was read from (errors name it).
        groups: ``[S]`` each sequence's group (its prefixes shared within it), or ``None``: one group.
        fills: per value field, the places (bool) that hold its fill.
        roles: the roles the sequences come in, role-major (pairs: ``("chosen", "rejected")``); ``()``: one.

    Example:
        >>> pair = Forest.chains(Ragged(np.array([1, 2, 3, 1, 2, 4]), np.array([0, 3, 6])),
        ...                      Ragged(np.array([0, 0, 1, 0, 0, 1], bool), np.array([0, 3, 6])))
        >>> pair.nodes, pair.sequences, pair.ends.tolist()
        (2, 2, [0, 1])
    """

    tokens: Ragged
    trained: Ragged
    parent: np.ndarray
    ends: np.ndarray
    values: dict[str, Ragged] = field(default_factory=dict)
    per_sequence: dict[str, np.ndarray] = field(default_factory=dict)
    source: np.ndarray | None = None
    roles: tuple[str, ...] = ()
    fills: dict[str, Ragged] = field(default_factory=dict)
    groups: np.ndarray | None = None

    @property
    def nodes(self) -> int:
        return len(self.parent)

    @property
    def sequences(self) -> int:
        return len(self.ends)

    @property
    def role_of(self) -> np.ndarray:
        """``[S]`` int64: each sequence's role number (role-major: the first ``S / roles`` are role 0)."""
        count = max(len(self.roles), 1)
        return np.repeat(np.arange(count, dtype=np.int64), self.sequences // count)

    def by_example(self) -> Forest:
        """Sequences given whole, laid out example by example (a pair's sides can share their prompt)."""
        source = np.arange(self.sequences) if self.source is None else self.source
        order = np.argsort(source, kind="stable")
        kept = self.ends[order]
        take = rows_taker(self.tokens, kept)
        renumbered = np.full(self.nodes, -1, dtype=np.int64)
        renumbered[kept] = np.arange(kept.size, dtype=np.int64)
        ends = np.full(self.sequences, -1, dtype=np.int64)
        ends[self.ends >= 0] = renumbered[self.ends[self.ends >= 0]]
        return Forest(
            take(self.tokens),
            take(self.trained),
            np.full(kept.size, -1, dtype=np.int64),
            ends,
            {name: take(field) for name, field in self.values.items()},
            self.per_sequence,
            self.source,
            self.roles,
            {name: take(field) for name, field in self.fills.items()},
            self.groups,
        )

    @classmethod
    def chains(
        cls,
        tokens: Ragged,
        trained: Ragged,
        values: dict[str, Ragged] | None = None,
        per_sequence: dict[str, np.ndarray] | None = None,
        *,
        order: np.ndarray | None = None,
        source: np.ndarray | None = None,
        roles: tuple[str, ...] = (),
        fills: dict[str, Ragged] | None = None,
        groups: np.ndarray | None = None,
    ) -> Forest:
        """Sequences given whole (a row each), each a tree of one node.

        Parameters:
            tokens, trained, values: one row per sequence, in the sequences' numbering.
            per_sequence: ``[S, ...]`` values.
            order: the sequences in layout order (default: their numbering).
            source, roles, fills, groups: as the class's.
        """
        count = tokens.rows
        kept = np.arange(count, dtype=np.int64) if order is None else np.asarray(order, np.int64)
        node_of = np.full(count, -1, dtype=np.int64)
        node_of[kept] = np.arange(kept.size, dtype=np.int64)
        take = rows_taker(tokens, kept)
        return cls(
            take(tokens),
            take(trained),
            np.full(kept.size, -1, dtype=np.int64),
            node_of,
            {name: take(value) for name, value in (values or {}).items()},
            dict(per_sequence or {}),
            np.arange(count, dtype=np.int64) if source is None else source,
            roles,
            {name: take(value) for name, value in (fills or {}).items()},
            groups,
        )
