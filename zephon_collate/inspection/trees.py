"""Read a tree batch: its nodes, the paths through each token, what each token sees (``docs/demo.md``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_collate.core.keys import (
    BRANCH_IDS,
    DOCUMENT_IDS,
    INPUT_IDS,
    LABELS,
    LOGITS_INDEX,
    NUM_SEQUENCES,
    PATH_INDEX,
    PATH_OFFSETS,
    POSITION_IDS,
    POSITIONS,
    SEQUENCE_INDEX,
    SUBTREE_END,
)
from zephon_collate.inspection.values import as_lists, as_rows, percent, plural

__all__ = ["TreeNode", "TreeRow", "TreeToken", "TreeView", "batch_tree", "is_tree_batch", "tree_warnings"]

_PER_TOKEN = (
    LABELS,
    POSITION_IDS,
    POSITIONS,
    DOCUMENT_IDS,
    BRANCH_IDS,
    LOGITS_INDEX,
    SEQUENCE_INDEX,
    SUBTREE_END,
)
_PADDING_WARN_FRACTION = 0.5


@dataclass(frozen=True)
class TreeNode:
    """A node: tokens ``start:end`` of a row that the same paths go through (``parent`` -1 for a root)."""

    index: int
    row: int
    document: int
    start: int
    end: int
    parent: int
    depth: int
    sequences: tuple[int, ...]

    @property
    def shared(self) -> int:
        """How many paths go through the node."""
        return len(self.sequences)


@dataclass(frozen=True)
class TreeToken:
    """One token of a tree batch: its node (-1 on padding), depth, paths and whether it is trained."""

    row: int
    place: int
    token: int
    node: int
    depth: int
    position: int | None
    sequences: tuple[int, ...]
    trained: bool | None

    @property
    def trained_for(self) -> tuple[int, ...]:
        """The sequences whose loss the token counts in: every path through it, when it is trained."""
        return self.sequences if self.trained else ()


@dataclass(frozen=True)
class TreeRow:
    """One row of a tree batch as plain lists (-1 on padding; ``sequences``: the paths through each token)."""

    index: int
    input_ids: list[int]
    trained: list[bool] | None
    positions: list[int] | None
    documents: list[int]
    branches: list[int] | None
    predictor: list[int]
    node: list[int]
    sequences: list[tuple[int, ...]]
    sequence_index: list[int] | None
    subtree_end: list[int] | None
    padding: list[bool]


@dataclass(frozen=True)
class TreeView:
    """A tree batch read: its rows, nodes (numbered through the batch in row order) and paths.

    ``paths[s]``: sequence ``s``'s ``(row, place)`` tokens in order; ``paths_from`` / ``attention_from``: the
    fields they were read from; ``notes``: the problems met while reading.
    """

    rows: list[TreeRow]
    nodes: list[TreeNode]
    paths: list[list[tuple[int, int]]]
    paths_from: str
    attention_from: str
    num_sequences: int | None
    notes: list[str]

    def token(self, row: int, place: int) -> TreeToken:
        """The token at ``place`` of ``row``."""
        line = self.rows[row]
        node = line.node[place]
        return TreeToken(
            row,
            place,
            line.input_ids[place],
            node,
            self.nodes[node].depth if node >= 0 else -1,
            None if line.positions is None else line.positions[place],
            line.sequences[place],
            None if line.trained is None else line.trained[place],
        )

    def sees(self, row: int, place: int) -> list[int]:
        """The places of ``row`` the token at ``place`` attends to (itself included)."""
        return [int(k) for k in np.flatnonzero(_keys_seen(self.rows[row], self.attention_from, place, place))]

    def node_sees(self, node: int) -> tuple[int, ...]:
        """The nodes any token of ``node`` attends to (its ancestors and itself; -1: padding)."""
        found = self.nodes[node]
        line = self.rows[found.row]
        keys = np.flatnonzero(_keys_seen(line, self.attention_from, found.start, found.end - 1))
        return tuple(sorted({line.node[int(k)] for k in keys}))

    def mask(self, row: int) -> np.ndarray:
        """``[S, S]`` bool, True where query ``q`` (first index) attends key ``k``, as :meth:`sees`."""
        line = self.rows[row]
        size = len(line.input_ids)
        if self.attention_from == SUBTREE_END and line.subtree_end is not None:
            place = np.arange(size)
            ends = np.asarray(line.subtree_end)
            return (place[None, :] <= place[:, None]) & (place[:, None] < ends[None, :])
        out = np.zeros((size, size), dtype=bool)
        for q in range(size):
            out[q] = _keys_seen(line, self.attention_from, q, q)
        return out


def is_tree_batch(batch: Mapping[str, Any]) -> bool:
    """True for a batch to draw as a tree (``subtree_end``, ``path_offsets``, or a shared prompt's branches).

    Example:
        >>> is_tree_batch({"input_ids": [[5, 6]], "logits_index": [[-1, 0]], "branch_ids": [[1, 1]]})
        False
    """
    if batch.get(SUBTREE_END) is not None or batch.get(PATH_OFFSETS) is not None:
        return True
    if batch.get(LOGITS_INDEX) is None or batch.get(BRANCH_IDS) is None:
        return False
    return any(value == 0 for row in as_rows(batch[BRANCH_IDS], BRANCH_IDS) for value in row)


def _fields(batch: Mapping[str, Any], tokens: list[list[Any]]) -> dict[str, list[list[int]]]:
    """The per-token fields present, as int rows of ``input_ids``' shape."""
    return {
        name: [[int(value) for value in row] for row in as_rows(batch[name], name, tokens)]
        for name in _PER_TOKEN
        if batch.get(name) is not None
    }


def _flat(value: Any) -> list[int]:
    data = as_lists(value)
    return [int(v) for v in (data if isinstance(data, list) else [data])]


def _indexed_paths(
    batch: Mapping[str, Any], rows: int, width: int, notes: list[str]
) -> list[list[tuple[int, int]]]:
    """Each sequence's ``(row, place)`` tokens from ``path_index`` / ``path_offsets`` (flat places)."""
    flat, offsets = _flat(batch[PATH_INDEX]), _flat(batch[PATH_OFFSETS])
    paths, outside = [], []
    for sequence in range(len(offsets) - 1):
        path = []
        for place in flat[offsets[sequence] : offsets[sequence + 1]]:
            if 0 <= place < rows * width:
                path.append(divmod(place, width))
            else:
                outside.append((sequence, place))
        paths.append(path)
    if outside:
        sequence, place = outside[0]
        notes.append(
            f"batch: path_index holds {plural(len(outside), 'place')} outside input_ids of shape "
            f"({rows}, {width}) (first: sequence {sequence}, place {place}); they are left out of the paths"
        )
    return paths


def _traced_paths(
    sequence_rows: list[list[int]], predictor_rows: list[list[int]], count: int | None, notes: list[str]
) -> list[list[tuple[int, int]]]:
    """Each sequence's tokens traced back through the predictors from its last token in ``sequence_index``."""
    last: dict[int, tuple[int, int]] = {}
    for row, values in enumerate(sequence_rows):
        for place, sequence in enumerate(values):
            if sequence >= 0:
                last[sequence] = (row, place)
    total = max(count or 0, max(last, default=-1) + 1)
    paths: list[list[tuple[int, int]]] = []
    for sequence in range(total):
        chain: list[tuple[int, int]] = []
        row, place = last.get(sequence, (0, -1))
        while 0 <= place < len(predictor_rows[row]) and len(chain) <= len(predictor_rows[row]):
            chain.append((row, place))
            place = predictor_rows[row][place]
        paths.append(chain[::-1])
    missing = [sequence for sequence in range(total) if sequence not in last]
    if missing:
        notes.append(
            f"batch: sequences {missing[:8]} have no token of their own in sequence_index (they end inside "
            "another sequence's path), so their paths cannot be traced without path_index"
        )
    return paths


def _predictors(
    fields: dict[str, list[list[int]]], tokens: list[list[Any]], paths: list[list[tuple[int, int]]]
) -> list[list[int]]:
    """``logits_index``, or where the batch has none, each path's previous token."""
    if LOGITS_INDEX in fields:
        return fields[LOGITS_INDEX]
    predictor = [[-1] * len(row) for row in tokens]
    for path in paths:
        for (row, place), (before_row, before) in zip(path[1:], path, strict=False):
            if row == before_row:
                predictor[row][place] = before
    return predictor


def _through(tokens: list[list[Any]], paths: list[list[tuple[int, int]]]) -> list[list[tuple[int, ...]]]:
    """The sequences whose paths go through each token."""
    sets: list[list[set[int]]] = [[set() for _ in row] for row in tokens]
    for sequence, path in enumerate(paths):
        for row, place in path:
            sets[row][place].add(sequence)
    return [[tuple(sorted(found)) for found in row] for row in sets]


def _row_nodes(
    row: int,
    documents: list[int],
    predictor: list[int],
    sequences: list[tuple[int, ...]],
    nodes: list[TreeNode],
) -> list[int]:
    """Cut one row into nodes (appended to ``nodes``); each token's node, -1 on padding."""
    children = np.bincount([p for p in predictor if 0 <= p < len(predictor)], minlength=len(predictor))
    node = [-1] * len(predictor)
    spans: list[list[int]] = []  # [node, start, end] of this row's nodes, ends growing
    for place, document in enumerate(documents):
        if document < 0:
            continue
        before = place - 1
        starts = (
            place == 0
            or node[before] < 0
            or documents[before] != document
            or predictor[place] != before
            or children[before] > 1
            or sequences[before] != sequences[place]
        )
        if starts:
            spans.append([len(nodes) + len(spans), place, place + 1])
        else:
            spans[-1][2] = place + 1
        node[place] = spans[-1][0]
    for index, start, end in spans:
        up = predictor[start]
        parent = node[up] if 0 <= up < start else -1
        depth = nodes[parent].depth + 1 if parent >= 0 else 0
        nodes.append(TreeNode(index, row, documents[start], start, end, parent, depth, sequences[start]))
    return node


def batch_tree(batch: Mapping[str, Any], *, ignore_index: int = -100) -> TreeView:
    """Read a tree batch (``Collator.for_trees``, or a shared-prompt batch) as a :class:`TreeView`.

    Example:
        >>> from zephon_collate import Collator
        >>> view = batch_tree(Collator.for_trees()([
        ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...     {"input_ids": [1, 2, 4], "completion_mask": [0, 1, 1]}]))
        >>> [(n.start, n.end, n.depth, n.sequences) for n in view.nodes], view.sees(0, 3)
        ([(0, 2, 0, (0, 1)), (2, 3, 1, (0,)), (3, 4, 1, (1,))], [0, 1, 3])
    """
    if INPUT_IDS not in batch:
        raise KeyError(f"inspect_batch: the batch has no 'input_ids' (its keys: {sorted(batch)})")
    if batch.get(LOGITS_INDEX) is None and batch.get(PATH_INDEX) is None:
        raise KeyError("inspect_batch: a tree batch needs 'logits_index' or 'path_index' to read its tree")
    tokens = as_rows(batch[INPUT_IDS], INPUT_IDS)
    fields = _fields(batch, tokens)
    count = None if batch.get(NUM_SEQUENCES) is None else int(_flat(batch[NUM_SEQUENCES])[0])
    notes: list[str] = []
    indexed = batch.get(PATH_INDEX) is not None and batch.get(PATH_OFFSETS) is not None
    if indexed:
        width = len(tokens[0]) if tokens else 0
        paths = _indexed_paths(batch, len(tokens), width, notes)
        if count is not None and count != len(paths):
            notes.append(f"batch: num_sequences is {count}, but path_offsets holds {len(paths)} paths")
    else:
        sequence_rows = fields.get(SEQUENCE_INDEX, [[-1] * len(row) for row in tokens])
        paths = _traced_paths(sequence_rows, fields[LOGITS_INDEX], count, notes)
    predictor = _predictors(fields, tokens, paths)
    through = _through(tokens, paths)
    nodes: list[TreeNode] = []
    rows = []
    for index, row in enumerate(tokens):
        documents = fields[DOCUMENT_IDS][index] if DOCUMENT_IDS in fields else [0] * len(row)
        labels = fields[LABELS][index] if LABELS in fields else None
        node = _row_nodes(index, documents, predictor[index], through[index], nodes)
        rows.append(
            TreeRow(
                index,
                [int(t) for t in row],
                None if labels is None else _trained(labels, predictor[index], documents, ignore_index),
                _field_row(fields, (POSITION_IDS, POSITIONS), index),
                documents,
                _field_row(fields, (BRANCH_IDS,), index),
                predictor[index],
                node,
                through[index],
                _field_row(fields, (SEQUENCE_INDEX,), index),
                _field_row(fields, (SUBTREE_END,), index),
                [document < 0 for document in documents],
            )
        )
    attention = SUBTREE_END if SUBTREE_END in fields else BRANCH_IDS if BRANCH_IDS in fields else LOGITS_INDEX
    return TreeView(rows, nodes, paths, PATH_INDEX if indexed else SEQUENCE_INDEX, attention, count, notes)


def _trained(labels: list[int], predictor: list[int], documents: list[int], ignore_index: int) -> list[bool]:
    """A token is trained where its label is kept and some place predicts it (a padded row's first label,
    kept as transformers keeps it, is never predicted), or where padding keeps one (a model's own
    shifted loss trains it)."""
    return [
        label != ignore_index and (by >= 0 or document < 0)
        for label, by, document in zip(labels, predictor, documents, strict=True)
    ]


def _field_row(fields: dict[str, list[list[int]]], names: tuple[str, ...], index: int) -> list[int] | None:
    """Row ``index`` of the first of ``names`` present."""
    return next((fields[name][index] for name in names if name in fields), None)


def _keys_seen(row: TreeRow, attention: str, first: int, last: int) -> np.ndarray:
    """``[S]`` bool: the keys that some query ``first..last`` of ``row`` attends to."""
    size = len(row.input_ids)
    place = np.arange(size)
    if attention == SUBTREE_END and row.subtree_end is not None:  # k <= q < subtree_end[k] for some q
        later = np.maximum(place, first)
        return (later <= last) & (np.asarray(row.subtree_end) > later)
    seen = np.zeros(size, dtype=bool)
    seen[first : last + 1] = True  # every token sees itself
    if attention == BRANCH_IDS and row.branches is not None:  # dense_branch_mask's rule
        documents, branches = np.asarray(row.documents), np.asarray(row.branches)
        groups = {
            (row.documents[q], row.branches[q]): q for q in range(first, last + 1) if row.documents[q] >= 0
        }
        for (document, branch), q in groups.items():  # q: the group's last query sees the most
            seen |= (place <= q) & (documents == document) & ((branches == 0) | (branches == branch))
        return seen
    for q in range(last, first - 1, -1):  # the ancestors along logits_index
        key = row.predictor[q]
        while 0 <= key < size and not seen[key]:
            seen[key] = True
            key = row.predictor[key]
    return seen


def tree_warnings(
    batch: Mapping[str, Any] | TreeView,
    *,
    ignore_index: int = -100,
    padding_fraction: float = _PADDING_WARN_FRACTION,
) -> list[str]:
    """What looks wrong in a tree batch, in words (an empty list when nothing does).

    Example:
        >>> batch = {"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]], "position_ids": [[0, 1, 1]],
        ...          "logits_index": [[-1, 0, 1]], "document_ids": [[0, 0, 0]],
        ...          "subtree_end": [[3, 3, 3]], "path_index": [0, 1, 2], "path_offsets": [0, 3]}
        >>> tree_warnings(batch)  # doctest: +NORMALIZE_WHITESPACE
        ['sequence 0: positions along its path do not count 0..2 (first: its token 2, row 0 place 2,
          has position 1); 1 sequence in all']
    """
    view = batch if isinstance(batch, TreeView) else batch_tree(batch, ignore_index=ignore_index)
    found = list(view.notes)
    found += _supervision_warnings(view, padding_fraction)
    found += _path_warnings(view)
    for row in view.rows:
        subtree = view.attention_from == SUBTREE_END and row.subtree_end is not None
        found += (_attention_warnings(row) if subtree else []) or _seen_warnings(row, view.attention_from)
    return found


def _seen_warnings(row: TreeRow, attention: str) -> list[str]:
    """Tokens whose keys (per ``subtree_end`` or ``document_ids`` / ``branch_ids``) are not exactly their
    ancestors along ``logits_index`` and themselves: a sibling, another document, a missing ancestor."""
    if attention == LOGITS_INDEX:  # attention read from the paths themselves: nothing to compare
        return []
    extra, missing = [], []
    for query in range(len(row.input_ids)):
        if row.padding[query]:
            continue
        seen = _keys_seen(row, attention, query, query)
        own = _keys_seen(row, LOGITS_INDEX, query, query)
        if (seen & ~own).any():
            extra.append((query, int(np.flatnonzero(seen & ~own)[0])))
        if (own & ~seen).any():
            missing.append((query, int(np.flatnonzero(own & ~seen)[0])))
    found = []
    if extra:
        query, key = extra[0]
        found.append(
            f"row {row.index}: {plural(len(extra), 'token')} see tokens off their paths (first: token "
            f"{query}, {_document_name(row, query)}, sees token {key}, {_document_name(row, key)}, which is "
            f"not its ancestor; check {attention})"
        )
    if missing:
        query, key = missing[0]
        found.append(
            f"row {row.index}: {plural(len(missing), 'token')} miss an ancestor (first: token {query} does "
            f"not see token {key}; check {attention})"
        )
    return found


def _supervision_warnings(view: TreeView, padding_fraction: float) -> list[str]:
    found = []
    if view.rows and all(row.trained is not None and not any(row.trained) for row in view.rows):
        found.append("batch: no trained token in any row: the loss is empty (NaN or 0); check the loss mask")
    for row in view.rows:
        length, padding = len(row.input_ids), sum(row.padding)
        if length and padding / length > padding_fraction:
            found.append(
                f"row {row.index}: {padding} of {length} tokens ({percent(padding, length)}) are padding: "
                "put more trees in a row (padding_free=True), or group the sequences differently"
            )
        if row.trained is not None:
            padded = sum(t and p for t, p in zip(row.trained, row.padding, strict=True))
            if padded:
                found.append(
                    f"row {row.index}: labels train on {plural(padded, 'padding token')} (in no tree; "
                    "check the padding's labels)"
                )
    lost = [
        (row.index, place)
        for row in view.rows
        if row.trained is not None
        for place, trained in enumerate(row.trained)
        if trained and not row.padding[place] and not row.sequences[place]
    ]
    if lost:
        first, place = lost[0]
        found.append(
            f"batch: no path holds {plural(len(lost), 'trained token')} (first: row {first} place {place}): "
            "the loss helpers score each path's tokens, so these count in no sequence's loss; check "
            "path_index"
        )
    return found


def _path_warnings(view: TreeView) -> list[str]:
    """Paths whose positions, predictors, documents or ``sequence_index`` disagree with the tree."""
    counted: dict[str, list[str]] = {"positions": [], "predictor": [], "documents": []}
    for sequence, path in enumerate(view.paths):
        for kind, problem in _path_problems(view, sequence, path).items():
            counted[kind].append(problem)
    found = []
    for problems in counted.values():
        if problems:
            found.append(f"{problems[0]}; {plural(len(problems), 'sequence')} in all")
    found += _sequence_index_warnings(view)
    return found


def _path_problems(view: TreeView, sequence: int, path: list[tuple[int, int]]) -> dict[str, str]:
    """The first problem of each kind on one path (positions, predictor, documents)."""
    problems: dict[str, str] = {}
    where = f"sequence {sequence}"
    for step, (row, place) in enumerate(path):
        line = view.rows[row]
        at = f"its token {step}, row {row} place {place}"
        if line.positions is not None and line.positions[place] != step and "positions" not in problems:
            problems["positions"] = (
                f"{where}: positions along its path do not count 0..{len(path) - 1} "
                f"(first: {at}, has position {line.positions[place]})"
            )
        expected = -1 if step == 0 else path[step - 1][1] if path[step - 1][0] == row else None
        if line.predictor[place] != expected and "predictor" not in problems:
            problems["predictor"] = (
                f"{where}: its path does not follow logits_index (first: {at} is predicted by place "
                f"{line.predictor[place]}, not by the path's {'start' if step == 0 else 'previous token'}): "
                "its loss would read other tokens' logits"
            )
        first_row, first_place = path[0]
        home = view.rows[first_row].documents[first_place]
        if (row != first_row or line.documents[place] != home) and "documents" not in problems:
            problems["documents"] = (
                f"{where}: its path leaves its tree (first: {at} is in document {line.documents[place]}, "
                f"the path starts in document {home} of row {first_row})"
            )
    return problems


def _sequence_index_warnings(view: TreeView) -> list[str]:
    """Tokens whose ``sequence_index`` names one sequence while the paths say otherwise."""
    if view.paths_from != PATH_INDEX:
        return []  # the paths were traced from sequence_index: they agree by construction
    wrong = []
    for line in view.rows:
        for place, sequence in enumerate(line.sequence_index or []):
            if sequence >= 0 and line.sequences[place] != (sequence,):
                wrong.append((line.index, place, sequence, line.sequences[place]))
    if not wrong:
        return []
    row, place, sequence, paths = wrong[0]
    return [
        f"batch: sequence_index disagrees with the paths at {plural(len(wrong), 'token')} (first: row {row} "
        f"place {place} says sequence {sequence}, the paths through it are {list(paths)})"
    ]


def _descendant_ends(row: TreeRow) -> np.ndarray:
    """``[S]``: one past the last token that descends from each token along ``logits_index`` (itself too)."""
    ends = np.arange(1, len(row.input_ids) + 1)
    for place in range(len(row.input_ids) - 1, -1, -1):
        up = row.predictor[place]
        if 0 <= up < place and not row.padding[place]:
            ends[up] = max(ends[up], ends[place])
    return ends


def _document_ends(row: TreeRow) -> np.ndarray:
    """``[S]``: one past the last token of each token's document (padding: itself)."""
    ends = np.arange(1, len(row.input_ids) + 1)
    for place in range(len(row.input_ids) - 2, -1, -1):
        if row.documents[place] >= 0 and row.documents[place + 1] == row.documents[place]:
            ends[place] = ends[place + 1]
    return ends


def _count_covered(starts: np.ndarray, stops: np.ndarray, size: int) -> int:
    """How many places lie in at least one of the ranges ``starts[i]:stops[i]``."""
    marks = np.zeros(size + 1, dtype=np.int64)
    np.add.at(marks, starts, 1)
    np.add.at(marks, stops, -1)
    return int((np.cumsum(marks)[:size] > 0).sum())


def _document_name(row: TreeRow, place: int) -> str:
    document = row.documents[place] if place < len(row.documents) else -1
    return f"document {document}" if document >= 0 else "padding"


def _attention_warnings(row: TreeRow) -> list[str]:
    """Per ``subtree_end``: tokens that see across documents, off their paths, or miss an ancestor."""
    assert row.subtree_end is not None
    size = len(row.input_ids)
    ends = row.subtree_end
    given = np.clip(np.asarray(ends, dtype=np.int64), 0, size)
    documents, descendants = _document_ends(row), _descendant_ends(row)
    found = []
    crossing = np.flatnonzero(given > documents)
    if crossing.size:
        key = int(crossing[0])
        query = int(documents[key])  # the first token past the key's document
        count = _count_covered(documents[crossing], given[crossing], size)
        found.append(
            f"row {row.index}: subtree_end lets {plural(count, 'token')} attend across documents (first: "
            f"token {query}, {_document_name(row, query)}, sees token {key}, {_document_name(row, key)}; "
            f"subtree_end[{key}] is {ends[key]})"
        )
    reach = np.minimum(given, documents)
    off = np.flatnonzero(reach > descendants)
    if off.size:
        key = int(off[0])
        count = _count_covered(descendants[off], reach[off], size)
        found.append(
            f"row {row.index}: subtree_end lets {plural(count, 'token')} see tokens off their paths (first: "
            f"token {int(descendants[key])} sees token {key}, which is not its ancestor; subtree_end[{key}] "
            f"is {ends[key]}, its subtree ends at {int(descendants[key])})"
        )
    hidden = np.flatnonzero((given < descendants) & ~np.asarray(row.padding, dtype=bool))
    if hidden.size:
        key = int(hidden[0])
        missing = _count_covered(np.maximum(given[hidden], hidden), descendants[hidden], size)
        found.append(
            f"row {row.index}: subtree_end hides an ancestor from {plural(missing, 'token')} (first: token "
            f"{max(int(given[key]), key)} does not see token {key}; subtree_end[{key}] is {ends[key]}, its "
            f"subtree ends at {int(descendants[key])})"
        )
    return found
