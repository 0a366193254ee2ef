"""A forest's prefixes shared (where ids, supervision and values are all equal), and the forest laid out."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from zephon_collate.core.fit import best_fit_rows
from zephon_collate.read.columns import Ragged, gather_spans
from zephon_collate.read.forest import Forest

__all__ = ["Laid", "as_paths", "copy_openers", "lay_out", "merge_prefixes", "share_prompts", "split_trees"]


@dataclass
class Laid:
    """A forest laid out, token by token (``N`` tokens, documents end to end, nodes depth-first).

    Parameters:
        order: each laid token's index in the forest's values.
        documents: ``[D + 1]`` token offsets of the documents (trees).
        node, position: each token's node and position.
        predictor: the laid index of the token before it on its path (-1 for a root's first).
        subtree_end: the laid index where its node's subtree ends.
        branch: 0 on a root that branches, else the root's child it descends from (from 1).
        sequence: the one sequence through it (-1: none, several, or a branching node).
        path_index, path_offsets: ``[P]``, ``[S + 1]``: sequence ``s``'s tokens, from ``path_offsets[s]``.
    """

    order: np.ndarray
    documents: np.ndarray
    node: np.ndarray
    position: np.ndarray
    predictor: np.ndarray
    subtree_end: np.ndarray
    branch: np.ndarray
    sequence: np.ndarray
    path_index: np.ndarray
    path_offsets: np.ndarray


def _keys(forest: Forest, skipped: Collection[str]) -> np.ndarray:
    """``[N]`` int64: one id per distinct (token, supervision, values) of the forest's tokens."""
    if not forest.tokens.values.shape[0]:
        return np.zeros(0, dtype=np.int64)
    columns = [np.asarray(forest.tokens.values, np.int64)[:, None].view(np.uint8)]
    columns.append(np.asarray(forest.trained.values, np.uint8)[:, None])
    for name, field in forest.values.items():
        if name not in skipped:
            values = np.ascontiguousarray(field.values).reshape(field.values.shape[0], -1)
            fill = forest.fills.get(name)
            if fill is not None:  # a fill is written at layout by its new place: never equal to a given value
                held = np.asarray(fill.values, bool).reshape(values.shape[0], -1).sum(axis=1) > 0
                values = np.where(held[:, None], np.zeros((), values.dtype), values)  # a copy: the input kept
                columns.append(held.astype(np.uint8)[:, None])
            columns.append(values.view(np.uint8))
    rows = np.ascontiguousarray(np.concatenate(columns, axis=1))
    return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _remap(index: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new[index]`` where ``index >= 0``, -1 elsewhere."""
    out = np.full(index.shape, -1, dtype=np.int64)
    valid = index >= 0
    out[valid] = new[index[valid]]
    return out


class _Builder:
    """Nodes as spans of a forest's values, with their parents; the forest they make."""

    def __init__(self, forest: Forest) -> None:
        self.forest = forest
        self.spans: list[tuple[int, int]] = []
        self.parents: list[int] = []
        self.children: list[list[int]] = []
        self.roots: list[int] = []

    def add(self, start: int, end: int, parent: int) -> int:
        node = len(self.spans)
        self.spans.append((start, end))
        self.parents.append(parent)
        self.children.append([])
        (self.roots if parent < 0 else self.children[parent]).append(node)
        return node

    def build(self, ends: np.ndarray) -> Forest:
        """The forest of the nodes added, depth-first; ``ends`` in the numbering of the nodes as added."""
        order: list[int] = []
        stack = list(reversed(self.roots))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children[node]))
        new = np.full(len(self.spans), -1, dtype=np.int64)
        new[order] = np.arange(len(order), dtype=np.int64)
        starts = np.array([self.spans[n][0] for n in order], dtype=np.int64)
        lengths = np.array([self.spans[n][1] - self.spans[n][0] for n in order], dtype=np.int64)
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        picked = gather_spans(starts, lengths)
        forest = self.forest

        def take(field: Ragged) -> Ragged:
            return Ragged(np.asarray(field.values)[picked], offsets)

        parents = np.array([self.parents[n] for n in order], dtype=np.int64)
        return Forest(
            take(forest.tokens),
            take(forest.trained),
            _remap(parents, new),
            _remap(ends, new),
            {name: take(field) for name, field in forest.values.items()},
            forest.per_sequence,
            forest.source,
            forest.roles,
            {name: take(field) for name, field in forest.fills.items()},
            forest.groups,
        )


def share_prompts(forest: Forest, skipped: Collection[str] = ()) -> Forest:
    """Consecutive sequences with one prompt laid out as the prompt once, then a branch per sequence.

    Parameters:
        forest: sequences given whole (:meth:`Forest.chains`).
        skipped: value fields not compared (one value per sequence, written on its tokens).

    Example:
        >>> chains = Forest.chains(Ragged(np.array([1, 2, 3, 1, 2, 4, 4]), np.array([0, 3, 7])),
        ...                        Ragged(np.array([0, 0, 1, 0, 0, 1, 1], bool), np.array([0, 3, 7])))
        >>> shared = share_prompts(chains)
        >>> shared.tokens.offsets.tolist(), shared.parent.tolist(), shared.ends.tolist()
        ([0, 2, 3, 5], [-1, 0, 0], [1, 2])
    """
    offsets = forest.tokens.offsets
    flags = np.asarray(forest.trained.values)
    keys = _keys(forest, skipped)
    first_trained = [
        int(np.argmax(flags[offsets[n] : offsets[n + 1]])) if flags[offsets[n] : offsets[n + 1]].any() else -1
        for n in range(forest.nodes)
    ]
    builder = _Builder(forest)
    mapped = np.full(forest.nodes, -1, dtype=np.int64)
    group: list[int] = []

    def close() -> None:
        if not group:
            return
        head = group[0]
        prompt = first_trained[head]
        root = builder.add(int(offsets[head]), int(offsets[head]) + prompt, -1)
        for member in group:
            mapped[member] = builder.add(int(offsets[member]) + prompt, int(offsets[member + 1]), root)
        group.clear()

    for node in range(forest.nodes):
        prompt = first_trained[node]
        eligible = prompt > 0 and forest.parent[node] < 0
        if eligible and group:
            head = group[0]
            start, other = int(offsets[node]), int(offsets[head])
            same = first_trained[head] == prompt and bool(
                (keys[start : start + prompt] == keys[other : other + prompt]).all()
            )
            if not same:
                close()
        elif group:
            close()
        if eligible:
            group.append(node)
        else:
            mapped[node] = builder.add(int(offsets[node]), int(offsets[node + 1]), -1)
    close()
    return builder.build(_remap(forest.ends, mapped))


def merge_prefixes(forest: Forest, groups: np.ndarray | None = None, skipped: Collection[str] = ()) -> Forest:
    """Every common prefix shared: the sequences of each group as a trie.

    Parameters:
        forest: sequences given whole (:meth:`Forest.chains`).
        groups: ``[S]``, the group of each sequence (groups never share), or ``None``: one group.
        skipped: value fields not compared (one value per sequence).

    Example:
        >>> values, offsets = np.array([7, 1, 2, 7, 1, 3, 4, 7, 5]), np.array([0, 3, 7, 9])
        >>> tree = merge_prefixes(Forest.chains(Ragged(values, offsets), Ragged(np.ones(9, bool), offsets)))
        >>> tree.tokens.values.tolist(), tree.tokens.offsets.tolist(), tree.parent.tolist()
        ([7, 1, 2, 3, 4, 5], [0, 1, 2, 3, 5, 6], [-1, 0, 1, 1, 0])
    """
    keys = _keys(forest, skipped)
    offsets = forest.tokens.offsets
    builder = _Builder(forest)
    ends = np.full(forest.sequences, -1, dtype=np.int64)
    node_sequence = np.full(forest.nodes, -1, dtype=np.int64)
    valid = forest.ends >= 0
    node_sequence[forest.ends[valid]] = np.flatnonzero(valid)
    group_of = np.zeros(forest.sequences, dtype=np.int64) if groups is None else np.asarray(groups)
    tops: dict[object, dict[int, int]] = {}  # per group: first key -> top node
    below: list[dict[int, int]] = []  # per trie node: first key -> child
    for chain in range(forest.nodes):
        sequence = int(node_sequence[chain])
        start, stop = int(offsets[chain]), int(offsets[chain + 1])
        key = group_of[sequence].item() if sequence >= 0 else ("chain", chain)
        children = tops.setdefault(key, {})
        current, place = -1, start
        while place < stop:
            child = children.get(int(keys[place]))
            if child is None:
                current = builder.add(place, stop, current)
                below.append({})
                children[int(keys[place])] = current
                break
            first, last = builder.spans[child]
            size = min(last - first, stop - place)
            equal = keys[first : first + size] == keys[place : place + size]
            common = size if equal.all() else int(np.argmin(equal))
            if common < last - first:  # split the child: its first ``common`` tokens become a node
                middle = builder.add(first, first + common, current)
                below.append({int(keys[first + common]): child})
                siblings = builder.roots if current < 0 else builder.children[current]
                siblings.remove(middle)
                siblings[siblings.index(child)] = middle
                builder.spans[child] = (first + common, last)
                builder.parents[child] = middle
                builder.children[middle].append(child)
                children[int(keys[place])] = middle
                child = middle
            current, place = child, place + common
            children = below[current]
        if sequence >= 0:
            ends[sequence] = current
    return builder.build(ends)


def as_paths(forest: Forest) -> Forest:
    """Every sequence its own one-node tree of its path's tokens: the sharing undone.

    Example:
        >>> values, offsets = np.array([7, 1, 2, 7, 1, 3]), np.array([0, 3, 6])
        >>> tree = merge_prefixes(Forest.chains(Ragged(values, offsets), Ragged(np.ones(6, bool), offsets)))
        >>> as_paths(tree).tokens.values.tolist()
        [7, 1, 2, 7, 1, 3]
    """
    laid = lay_out(forest)
    lengths = np.diff(laid.path_offsets)
    picked = laid.order[laid.path_index]
    offsets = np.zeros(forest.sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    paths = Ragged(np.asarray(forest.tokens.values)[picked], offsets)
    return Forest.chains(
        paths,
        Ragged(np.asarray(forest.trained.values)[picked], offsets),
        {name: Ragged(np.asarray(field.values)[picked], offsets) for name, field in forest.values.items()},
        forest.per_sequence,
        source=forest.source,
        roles=forest.roles,
        fills={
            name: Ragged(np.asarray(field.values)[picked], offsets) for name, field in forest.fills.items()
        },
        groups=forest.groups,
    )


def copy_openers(forest: Forest) -> Forest:
    """Each node with several branches gives its last token to every branch: each place predicts one token.

    Example:
        >>> values, offsets = np.array([7, 1, 2, 7, 1, 3]), np.array([0, 3, 6])
        >>> tree = merge_prefixes(Forest.chains(Ragged(values, offsets), Ragged(np.ones(6, bool), offsets)))
        >>> copied = copy_openers(tree)
        >>> copied.tokens.values.tolist(), copied.tokens.offsets.tolist(), copied.parent.tolist()
        ([7, 1, 2, 1, 3], [0, 1, 2, 3, 4, 5], [-1, 0, 1, 0, 3])
    """
    counts = np.bincount(forest.parent[forest.parent >= 0], minlength=forest.nodes)
    ending = np.zeros(forest.nodes, dtype=bool)
    ending[forest.ends[forest.ends >= 0]] = True
    offsets = forest.tokens.offsets
    builder = _Builder(forest)
    tail = np.full(forest.nodes, -1, dtype=np.int64)  # the node a node's own kept tokens end on
    ends_on = np.full(forest.nodes, -1, dtype=np.int64)  # where a sequence ending on a node ends now
    for node in range(forest.nodes):  # parents come first
        start, stop = int(offsets[node]), int(offsets[node + 1])
        up = int(forest.parent[node])
        home = int(tail[up]) if up >= 0 else -1
        if up >= 0 and counts[up] > 1:  # the parent's last token, copied
            last = int(offsets[up + 1]) - 1
            home = builder.add(last, last + 1, home)
        kept = stop - 1 if counts[node] > 1 else stop
        tail[node] = builder.add(start, kept, home) if kept > start else home
        ends_on[node] = tail[node]
        if counts[node] > 1 and ending[node]:
            ends_on[node] = builder.add(stop - 1, stop, int(tail[node]))
    return builder.build(_remap(forest.ends, ends_on))


def lay_out(forest: Forest) -> Laid:
    """The forest laid out: each tree a document, its nodes depth-first (``docs/trees.md`` draws it)."""
    count = forest.nodes
    lengths = forest.tokens.lengths
    parent = forest.parent
    children: list[list[int]] = [[] for _ in range(count)]
    roots: list[int] = []
    for node in range(count):
        (roots if parent[node] < 0 else children[int(parent[node])]).append(node)
    order: list[int] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    preorder = np.array(order, dtype=np.int64)
    start = np.zeros(count, dtype=np.int64)
    start[preorder] = np.concatenate([[0], np.cumsum(lengths[preorder])[:-1]]) if count else []
    depth = np.zeros(count, dtype=np.int64)
    subtree = lengths.astype(np.int64).copy()
    through = np.zeros(count, dtype=np.int64)
    valid = forest.ends >= 0
    np.add.at(through, forest.ends[valid], 1)
    some = np.full(count, -1, dtype=np.int64)
    some[forest.ends[valid]] = np.flatnonzero(valid)
    top = np.arange(count, dtype=np.int64)
    for node in order:  # parents first
        up = int(parent[node])
        if up >= 0:
            depth[node] = depth[up] + lengths[up]
            top[node] = node if parent[up] < 0 else top[up]
    for node in reversed(order):  # children first
        up = int(parent[node])
        if up >= 0:
            subtree[up] += subtree[node]
            through[up] += through[node]
            some[up] = max(some[up], some[node])
    rank = np.zeros(count, dtype=np.int64)
    for root in roots:
        for index, child in enumerate(children[root]):
            rank[child] = index + 1
    total = int(lengths.sum())
    node_of = np.repeat(preorder, lengths[preorder])
    place = np.arange(total, dtype=np.int64)
    offset = place - start[node_of]
    above = parent[node_of]
    parent_last = np.where(above >= 0, start[np.maximum(above, 0)] + lengths[np.maximum(above, 0)] - 1, -1)
    is_root = above < 0
    has_children = np.array([len(children[n]) > 0 for n in range(count)], dtype=bool)
    branch = np.where(is_root, np.where(has_children[node_of], 0, 1), rank[top[node_of]])
    documents = np.zeros(len(roots) + 1, dtype=np.int64)
    np.cumsum(subtree[np.array(roots, dtype=np.int64)] if roots else np.zeros(0, np.int64), out=documents[1:])
    path_parts: list[np.ndarray] = []
    path_lengths = np.zeros(forest.sequences, dtype=np.int64)
    for sequence, end in enumerate(forest.ends.tolist()):
        chain = []
        while end >= 0:
            chain.append(end)
            end = int(parent[end])
        spans = [np.arange(start[n], start[n] + lengths[n], dtype=np.int64) for n in reversed(chain)]
        path = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        path_parts.append(path)
        path_lengths[sequence] = path.size
    path_offsets = np.zeros(forest.sequences + 1, dtype=np.int64)
    np.cumsum(path_lengths, out=path_offsets[1:])
    filled = preorder[lengths[preorder] > 0]
    return Laid(
        order=gather_spans(forest.tokens.offsets[filled], lengths[filled]),
        documents=documents,
        node=node_of,
        position=depth[node_of] + offset,
        predictor=np.where(offset > 0, place - 1, parent_last),
        subtree_end=start[node_of] + subtree[node_of],
        branch=branch,
        sequence=np.where((through[node_of] == 1) & ~has_children[node_of], some[node_of], -1),
        path_index=np.concatenate(path_parts) if path_parts else np.zeros(0, dtype=np.int64),
        path_offsets=path_offsets,
    )


def split_trees(forest: Forest, width: int) -> tuple[Forest, int | None]:
    """Trees wider than ``width`` tokens split at node boundaries, each part behind a copy of the path above.

    Returns ``(forest, None)``, or, where a path's prefix alone is wider, ``(unchanged forest, that node)``.

    Example:
        >>> values, offsets = np.array([7, 8, 1, 2, 7, 8, 3, 4, 7, 8, 5]), np.array([0, 4, 8, 11])
        >>> tree = merge_prefixes(Forest.chains(Ragged(values, offsets), Ragged(np.ones(11, bool), offsets)))
        >>> fitted, _ = split_trees(tree, 6)
        >>> lay_out(fitted).documents.tolist(), as_paths(fitted).tokens.values.tolist() == values.tolist()
        ([0, 6, 9], True)
    """
    count = forest.nodes
    lengths = forest.tokens.lengths.astype(np.int64)
    offsets = forest.tokens.offsets
    children: list[list[int]] = [[] for _ in range(count)]
    roots: list[int] = []
    for node in range(count):
        (roots if forest.parent[node] < 0 else children[int(forest.parent[node])]).append(node)
    size = lengths.copy()
    for node in reversed(range(count)):  # parents come first: children are summed into them
        if forest.parent[node] >= 0:
            size[forest.parent[node]] += size[node]
    ending: list[list[int]] = [[] for _ in range(count)]
    for sequence, end in enumerate(forest.ends.tolist()):
        if end >= 0:
            ending[end].append(sequence)
    builder = _Builder(forest)
    ends = np.full(forest.sequences, -1, dtype=np.int64)

    def copy(node: int, parent: int) -> None:  # a whole subtree, under ``parent``
        made = builder.add(int(offsets[node]), int(offsets[node + 1]), parent)
        for sequence in ending[node]:
            ends[sequence] = made
        for child in children[node]:
            copy(child, made)

    def fit(node: int, prefix: list[int]) -> int | None:  # the subtree of ``node`` behind ``prefix``
        above = int(lengths[prefix].sum()) if prefix else 0
        if above + size[node] <= width:
            parent = -1
            for step in prefix:
                parent = builder.add(int(offsets[step]), int(offsets[step + 1]), parent)
            copy(node, parent)
            return None
        room = width - above - int(lengths[node])
        if room < 0:
            return node
        whole = [child for child in children[node] if size[child] <= room]
        bins = best_fit_rows([int(size[child]) for child in whole], room) if whole else []
        if not bins and ending[node]:
            bins = [[]]  # the sequences ending here need a tree of their own
        for index, members in enumerate(bins):
            parent = -1
            for step in prefix:
                parent = builder.add(int(offsets[step]), int(offsets[step + 1]), parent)
            made = builder.add(int(offsets[node]), int(offsets[node + 1]), parent)
            if index == 0:
                for sequence in ending[node]:
                    ends[sequence] = made
            for member in members:
                copy(whole[member], made)
        for child in children[node]:
            if size[child] > room:
                failed = fit(child, [*prefix, node])
                if failed is not None:
                    return failed
        return None

    for root in roots:
        failed = fit(root, [])
        if failed is not None:
            return forest, failed
    return builder.build(ends), None
