"""The post-training layout: a forest of sequences to a ``transformers`` batch (docs/post_training.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from zephon_collate.core.checks import Keywords, check_bool, check_int
from zephon_collate.core.fit import best_fit_rows
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOGITS_INDEX,
    LOSS_MASK,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_SEQUENCES,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    PATH_INDEX,
    PATH_OFFSETS,
    POSITION_IDS,
    POSITIONS,
    SEQ_IDX,
    SEQUENCE_INDEX,
    SHIFT_LABELS,
    SUBTREE_END,
    TOKEN_TYPE_IDS,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.base import Layout, Settings, Stacked
from zephon_collate.layouts.forest import (
    Laid,
    as_paths,
    copy_openers,
    lay_out,
    merge_prefixes,
    share_prompts,
    split_trees,
)
from zephon_collate.layouts.stack import dense
from zephon_collate.layouts.transformers import TransformersOptions, in_float
from zephon_collate.read.columns import Batch, Names, Ragged, Spread, filled
from zephon_collate.read.fields import TensorField
from zephon_collate.read.forest import Forest
from zephon_collate.transforms import (
    AttentionMask,
    BoundaryMask,
    CopyKeys,
    CuSeqlens,
    LastTokenIndex,
    LossMask,
    PaddingMask,
    PredictedLabels,
    SegmentIds,
    SequenceRoles,
    Transform,
    UnshiftedLabels,
)

__all__ = ["ROLES", "Sharing", "TreeOptions", "Trees"]

ROLES = "sequence_roles:"
"""The stacked key of each sequence's role, then the role names (``sequence_roles:chosen,rejected``)."""
_MAP = (DOCUMENT_IDS, BRANCH_IDS, LOGITS_INDEX, SEQUENCE_INDEX)
Sharing = Literal["none", "prompt", "prefix"]


@dataclass(frozen=True, kw_only=True)
class TreeOptions(Keywords):
    """The layout options every post-training preset shares; a preset adds its own and its reader.

    Parameters:
        tokenizer: a ``transformers`` tokenizer, or ``None``; it gives ``pad_token_id`` where not passed.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of a padded row per document.
        pad_token_id: the id padding gets; required for the padded layout.
        pad_to_multiple_of: round the padded length (padding-free: the row's) up to a multiple of this.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared, where needed).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (padding-free, unshared).
        return_seq_idx: emit ``seq_idx`` (padding-free, unshared).
        max_row_tokens: best fit the documents into rows this wide (``"longest"``: the longest), or ``None``.
        oversized: a document wider than ``max_row_tokens``: ``"refuse"`` it or ``"split"`` it at its nodes.
    """

    OWNER: ClassVar[str] = "Collator.for_transformers"
    ITEM: ClassVar[str] = "example"
    KEY: ClassVar[tuple[str, ...]] = (INPUT_IDS,)
    OWN: ClassVar[tuple[str, ...]] = ("tokenizer",)
    """The options a preset reads itself (not the ``transformers`` layout's it is checked as)."""
    LABELLED: ClassVar[bool] = True
    """Emit labels (a reward batch has none)."""
    MAP: ClassVar[tuple[str, ...]] = _MAP
    """The sequence map's per-token keys the batch carries (output or internal)."""
    COUNT: ClassVar[bool] = True
    """Emit ``num_sequences`` and ``{role}_index`` (a pair's ``chosen_index``, ...)."""
    ROLE_VALUES: ClassVar[Mapping[str, Mapping[str, str]]] = {}
    """Per-sequence values split by role: ``{key: {role: output}}``."""
    ORDER: ClassVar[tuple[str | None, ...]] = (
        INPUT_IDS, TOKEN_TYPE_IDS, ATTENTION_MASK, LABELS, SHIFT_LABELS, POSITION_IDS, CU_SEQ_LENS_Q,
        CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, SEQ_IDX,
    )  # fmt: skip
    INTERNAL: ClassVar[frozenset[str]] = frozenset({PADDING_LENGTH, POSITIONS, LOSS_MASK, PADDING_MASK})

    tokenizer: Any = dataclasses.field(default=None, kw_only=False, compare=False, repr=False)
    padding_free: bool = False
    pad_token_id: int | None = None
    pad_to_multiple_of: int | None = None
    return_position_ids: bool | None = None
    return_flash_attn_kwargs: bool = False
    return_seq_idx: bool = False
    max_row_tokens: int | Literal["longest"] | None = None
    oversized: Literal["refuse", "split"] = "refuse"

    def __post_init__(self) -> None:
        if self.pad_token_id is None and self.tokenizer is not None:
            object.__setattr__(self, "pad_token_id", getattr(self.tokenizer, "pad_token_id", None))
        object.__setattr__(self, "tokenizer", None)  # read once: the options hold plain values only
        for name in ("padding_free", "return_flash_attn_kwargs", "return_seq_idx"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name), owner=self.OWNER))
        if self.max_row_tokens is not None:
            if self.max_row_tokens != "longest":
                width = check_int(self.OWNER, "max_row_tokens", self.max_row_tokens, 1, INT32_MAX)
                object.__setattr__(self, "max_row_tokens", width)  # a NumPy int as the int it is
            if not self.padding_free:
                raise ValueError(
                    f"{self.OWNER}: max_row_tokens packs the documents into rows of that width; a padded "
                    "batch (padding_free=False) gives each a row of its own: drop one of them"
                )
        if self.oversized not in ("refuse", "split"):
            raise ValueError(
                f"{self.OWNER}: oversized must be 'refuse' or 'split', got {shown(self.oversized)}"
            )
        self.transformers()  # checks the rest, naming the preset

    # -- what a preset sets -------------------------------------------------------------------------

    def read(self, batch: Batch) -> Forest:  # pragma: no cover
        """The examples as a forest: the preset's read adapter (:mod:`zephon_collate.read.formats`)."""
        raise NotImplementedError

    @property
    def sharing(self) -> Sharing:
        """How prefixes are shared: not at all, a prompt of consecutive sequences, or every prefix."""
        return "none"

    @property
    def shared_by(self) -> str:
        """The option that shares prefixes, as messages name it."""
        return "shared_prompt=True"

    @property
    def within_groups(self) -> bool:
        """Share prefixes within each group of sequences only, not across the batch."""
        return True

    @property
    def floats(self) -> tuple[TensorField, ...]:
        """The value fields read (their dtype, fill and alignment)."""
        return ()

    @property
    def score_skip_id(self) -> int | Literal[False] | None:
        """``False``: no score index; else ``LastTokenIndex``'s ``skip_id`` (a reward batch)."""
        return False

    @property
    def tree_outputs(self) -> bool:
        """Emit ``subtree_end`` and the paths (a tree batch)."""
        return False

    @property
    def copied_openers(self) -> bool:
        """Copy each branching node's last token into its branches (one prediction per place)."""
        return False

    # -- the underlying checks --------------------------------------------------------------------------

    def transformers(self) -> TransformersOptions:
        """The options as the ``transformers`` layout's (checked, errors naming the preset)."""
        owner = self.OWNER
        own = (*self.OWN, "max_row_tokens", "oversized")
        layout = {name: getattr(self, name) for name in self.names() if name not in own}
        if self.sharing != "none":
            if self.return_flash_attn_kwargs or self.return_seq_idx:
                fix = (
                    "build the attention from document_ids and branch_ids (attention.branch_block_mask or "
                    "dense_branch_mask), or pass shared_prompt=False"
                    if self.sharing == "prompt"
                    else "build the attention from subtree_end (trees.tree_block_mask, dense_tree_mask or "
                    "use_tree_attention), or pass share='none' to lay every path out whole"
                )
                raise ValueError(
                    f"{owner}: {self.shared_by} puts several responses after one prompt, which cu_seq_lens "
                    "and seq_idx cannot describe (a varlen kernel would let a response attend to its "
                    f"sibling); {fix}"
                )
            if self.return_position_ids is False:
                raise ValueError(
                    f"{owner}: {self.shared_by} needs position_ids (each response's positions continue "
                    "from the prompt); drop return_position_ids=False"
                )
            layout["return_position_ids"] = True
        try:
            return TransformersOptions(**layout)
        except (TypeError, ValueError) as error:
            raise type(error)(str(error).replace("Collator.for_transformers", owner)) from None


class Trees(Layout):
    """The post-training layout: a preset's forest laid out.

    Parameters:
        options: a preset's :class:`TreeOptions`: its reader, its outputs.
        settings: the collator's settings.
    """

    options: TreeOptions

    def __init__(self, options: TreeOptions, settings: Settings | None = None) -> None:
        super().__init__(options, settings)
        self.OWNER, self.ITEM, self.KEY = options.OWNER, options.ITEM, options.KEY
        self.ORDER, self.INTERNAL = options.ORDER, options.INTERNAL
        self.SCALARS = frozenset({MAX_LENGTH_Q, MAX_LENGTH_K, NUM_SEQUENCES, NUM_VALID_TOKENS})

    CHAIN_OPTIONS: ClassVar[Mapping[str, tuple[object, ...]]] = {"return_seq_idx": (False,)}

    def internal(self, key: str) -> bool:
        return key in self.INTERNAL or key.startswith(ROLES)  # the roles, read by SequenceRoles alone

    @functools.cached_property
    def rows(self) -> TransformersOptions:
        """The row options: padding, positions, the varlen keys."""
        return self.options.transformers()

    @property
    def positions_key(self) -> str:
        return POSITION_IDS if self.rows.positions_out else POSITIONS

    # -- the chain ---------------------------------------------------------------------------------

    @property
    def boundary_safe(self) -> bool:
        rows = self.rows
        return self.options.LABELLED and rows.padding_free and rows.boundary_safe_labels

    def chain(self, keys: Sequence[str]) -> list[Transform]:
        """The built-in transforms for a stacked batch holding ``keys``, each as the options ask."""
        options, rows = self.options, self.rows
        shared = options.sharing != "none"
        steps: list[Transform] = []
        if self.boundary_safe:
            steps.append(BoundaryMask(positions_key=self.positions_key))
        if not rows.padding_free and not shared:  # shared: a 2-D mask would let branches see each other
            steps += [PaddingMask(), AttentionMask()]
        if options.LABELLED:
            padded = (
                not rows.padding_free
                or rows.pad_to_multiple_of is not None
                or options.max_row_tokens is not None
            )
            counts = PADDING_LENGTH if padded else None
            steps += [
                UnshiftedLabels(),
                LossMask(IGNORE_INDEX, padding_length_key=counts, out_key=None, count_key=None),
            ]
            if options.copied_openers:  # each place predicts one token: its target, for a shifted loss
                steps.append(PredictedLabels())
        if rows.return_flash_attn_kwargs:
            cu = CuSeqlens(
                self.positions_key, True, self.settings.num_boundaries, CU_SEQ_LENS_Q, MAX_LENGTH_Q
            )
            steps += [cu, CopyKeys({CU_SEQ_LENS_Q: CU_SEQ_LENS_K, MAX_LENGTH_Q: MAX_LENGTH_K})]
        if rows.return_seq_idx:
            steps.append(SegmentIds(self.positions_key, out_key=SEQ_IDX))
        role_key = next((key for key in keys if key.startswith(ROLES)), None)
        if role_key is not None:
            names = tuple(name for name in role_key[len(ROLES) :].split(",") if name)
            values = {
                key: {role: out for role, out in targets.items() if role in names}
                for key, targets in options.ROLE_VALUES.items()
                if key in keys
            }
            count = NUM_SEQUENCES if options.COUNT else None
            steps.append(SequenceRoles(role_key, names, values, count, index=options.COUNT))
        skip = options.score_skip_id
        if skip is not False:
            steps.append(LastTokenIndex(skip))
        return steps

    # -- the layout --------------------------------------------------------------------------------

    def lay_out(self, batch: Batch) -> list[Stacked]:
        """Read the examples into a forest (the preset's adapter), share its prefixes, lay it out."""
        forest = self.fitted(self.shared(self.options.read(batch)), batch.names)
        return [self.stacked(forest, lay_out(forest), batch.names)]

    def shared(self, forest: Forest) -> Forest:
        """``forest`` with its prefixes shared as the options ask."""
        options = self.options
        skipped = [spec.name for spec in options.floats if spec.broadcast]
        if skipped:  # one value per sequence, on its tokens: kept per sequence, written back where they agree
            forest = _per_sequence(forest, skipped)
        whole = bool((forest.parent < 0).all())  # sequences given whole (not explicit trees)
        if options.sharing == "prompt":
            forest = share_prompts(forest.by_example(), skipped)
        elif options.sharing == "prefix" and whole:
            forest = merge_prefixes(forest, forest.groups if options.within_groups else None, skipped)
        elif options.sharing == "none" and not whole:
            forest = as_paths(forest)
        return copy_openers(forest) if options.copied_openers else forest

    def fitted(self, forest: Forest, names: Names) -> Forest:
        """``forest`` with every tree within ``max_row_tokens``: split at its nodes, or refused by name."""
        width = self.options.max_row_tokens
        if not isinstance(width, int):
            return forest
        failed: int | None = None
        if self.options.oversized == "split":
            forest, failed = split_trees(forest, width)
            if failed is None:
                return forest
        laid = lay_out(forest)
        sizes = np.diff(laid.documents)
        if failed is None and bool((sizes <= width).all()):
            return forest
        wide = int(np.flatnonzero(sizes > width)[0]) if failed is None else -1  # the first tree too wide
        if failed is None:  # its first sequence
            starts = laid.path_offsets[:-1]
            nonempty = np.diff(laid.path_offsets) > 0
            tree = np.full(forest.sequences, -1, dtype=np.int64)
            tree[nonempty] = np.searchsorted(laid.documents, laid.path_index[starts[nonempty]], "right") - 1
            entry = int(np.flatnonzero(tree == wide)[0])
        else:  # the first sequence through the node
            entry = next(
                s for s in range(forest.sequences) if failed in _ancestors(forest, int(forest.ends[s]))
            )
        source = int(forest.source[entry]) if forest.source is not None else entry
        if failed is not None:
            reach = int(forest.tokens.lengths[_ancestors(forest, failed)].sum())
            what = f"a path of its tree reaches {reach} tokens by a node's end (trees split between nodes)"
            fix = "raise max_row_tokens"
        else:
            what = f"its tree holds {int(sizes[wide])} tokens"
            fix = "pass oversized='split' or raise max_row_tokens"
        raise ValueError(f"{names(source)}: {what}, more than max_row_tokens={width}; {fix}")

    def stacked(self, forest: Forest, laid: Laid, names: Names) -> Stacked:
        """The laid-out forest as the chain's input: its documents in rows, per-token and per-sequence."""
        options = self.options
        documents = laid.documents
        lengths = np.diff(documents)
        doc = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        rows, starts, width = self._placed(lengths)
        place = starts[doc] + np.arange(doc.size, dtype=np.int64) - documents[:-1][doc]  # in its row
        order = np.lexsort((place, rows[doc]))  # the tokens row by row
        row_offsets = np.zeros(int(rows.max(initial=-1)) + 2, dtype=np.int64)
        np.cumsum(np.bincount(rows[doc], minlength=row_offsets.size - 1), out=row_offsets[1:])
        by_row = {
            INPUT_IDS: np.asarray(forest.tokens.values)[laid.order].astype(np.int64),
            LOSS_MASK: np.asarray(forest.trained.values)[laid.order].astype(bool),
        }
        if self.rows.padding_free or self.rows.positions_out:
            by_row[self.positions_key] = laid.position
        specs = {spec.name: spec for spec in options.floats}
        for name, field in forest.values.items():
            values = np.asarray(field.values)[laid.order]
            fill = specs[name].fill if name in specs else 0
            if name in forest.fills and isinstance(fill, Spread):  # numbered by the place laid out
                where = np.asarray(forest.fills[name].values)[laid.order]
                values = np.array(values)
                values[where] = filled(
                    (int(where.sum()), *values.shape[1:]), fill, values.dtype, at=place[where]
                )
            by_row[name] = values
        per_sequence = dict(forest.per_sequence)
        for spec in options.floats:
            if spec.broadcast:  # one value per sequence on its tokens: where its sequences agree
                by_row[spec.name] = _broadcast(per_sequence.pop(spec.name), laid, spec.fill)
        structure = {
            DOCUMENT_IDS: doc.astype(np.int32),
            BRANCH_IDS: laid.branch.astype(np.int32),
            LOGITS_INDEX: np.where(laid.predictor >= 0, place[np.maximum(laid.predictor, 0)], -1),
            SEQUENCE_INDEX: laid.sequence,
            SUBTREE_END: place[np.maximum(laid.subtree_end - 1, 0)] + 1 if doc.size else laid.subtree_end,
        }
        kept = [*options.MAP, *((SUBTREE_END,) if options.tree_outputs else ())]
        for name in kept:  # each + 1: padding, filled with 0, reads -1 once stacked
            by_row[name] = (structure[name] + 1).astype(structure[name].dtype)
        per_token = {name: Ragged(values[order], row_offsets) for name, values in by_row.items()}
        stacked = self._rows(per_token, specs, width)
        data = stacked.data
        for name in kept:
            data[name] = data[name] - 1
        if options.tree_outputs:
            width = data[INPUT_IDS].shape[1]
            data[PATH_INDEX] = rows[doc[laid.path_index]] * width + place[laid.path_index]
            data[PATH_OFFSETS] = laid.path_offsets
            padding = data[SUBTREE_END] < 0  # padding sees itself only
            data[SUBTREE_END] = np.where(padding, np.arange(width, dtype=np.int64) + 1, data[SUBTREE_END])
        for name, values in per_sequence.items():
            data[name] = in_float(values, specs[name]) if name in specs else np.asarray(values)
        if options.COUNT or options.ROLE_VALUES:
            data[ROLES + ",".join(forest.roles)] = forest.role_of
        return stacked

    def _placed(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int | None]:
        """Each document's row and its start there, and the rows' width (``None``: the longest's)."""
        count = lengths.size
        fixed = self.options.max_row_tokens
        multiple = self.rows.pad_to_multiple_of
        if fixed == "longest":
            fixed = int(lengths.max(initial=0))
            fixed = fixed if multiple is None else -(-fixed // multiple) * multiple
        if fixed is not None:
            rows = np.zeros(count, dtype=np.int64)
            starts = np.zeros(count, dtype=np.int64)
            for row, members in enumerate(best_fit_rows(lengths.tolist(), fixed)):
                rows[members] = row
                starts[members] = np.concatenate([[0], np.cumsum(lengths[members])[:-1]])
            return rows, starts, fixed if multiple is None else -(-fixed // multiple) * multiple
        if self.rows.padding_free:
            return np.zeros(count, dtype=np.int64), np.concatenate([[0], np.cumsum(lengths)[:-1]]), None
        return np.arange(count, dtype=np.int64), np.zeros(count, dtype=np.int64), None

    def _rows(
        self, per_token: dict[str, Ragged], specs: Mapping[str, TensorField], width: int | None
    ) -> Stacked:
        """The rows stacked ``[rows, width]``, rounded up to ``pad_to_multiple_of``."""
        rows = self.rows
        fills: dict[str, int | float | Spread] = {INPUT_IDS: rows.pad_token_id or 0}
        fills.update((name, spec.fill) for name, spec in specs.items())
        tokens = per_token[INPUT_IDS]
        if rows.padding_free and not int(tokens.values.shape[0]):
            raise ValueError(
                f"{self.OWNER}: every {self.ITEM} of the batch is empty; padding_free needs a token "
                "(give non-empty ones, or pad them: padding_free=False)"
            )
        if width is None and rows.padding_free:
            multiple = rows.pad_to_multiple_of
            total = int(tokens.values.shape[0])
            width = total if multiple is None else -(-total // multiple) * multiple
        elif width is None:
            assert rows.row_padding is not None
            width = rows.row_padding.width(tokens.lengths)
        data: dict[str, Any] = {}
        for name, field in per_token.items():
            values = dense(field, width, fills.get(name, 0))
            data[name] = in_float(values, specs[name]) if name in specs else values
        data[PADDING_LENGTH] = np.subtract(width, tokens.lengths, dtype=np.int64)
        return Stacked(data)


def _ancestors(forest: Forest, node: int) -> list[int]:
    """``node`` and the nodes above it (none for -1)."""
    found = []
    while node >= 0:
        found.append(node)
        node = int(forest.parent[node])
    return found


def _per_sequence(forest: Forest, names: Sequence[str]) -> Forest:
    """``forest`` with the value fields ``names`` moved to ``per_sequence`` (read on each first token)."""
    values = dict(forest.values)
    per_sequence = dict(forest.per_sequence)
    first = forest.tokens.offsets[np.maximum(forest.ends, 0)]
    for name in (name for name in names if name in values):  # explicit trees: read on the leaves already
        field = values.pop(name)
        given = np.asarray(field.values)
        taken = (
            given[np.minimum(first, max(given.shape[0] - 1, 0))] if given.shape[0] else np.zeros(len(first))
        )
        per_sequence[name] = np.where(forest.ends >= 0, taken, 0).astype(given.dtype)
    return dataclasses.replace(forest, values=values, per_sequence=per_sequence)


def _broadcast(values: np.ndarray, laid: Laid, fill: int | float | Spread) -> np.ndarray:
    """``[N]``: each token's sequences' value, where they agree; else ``fill``."""
    count = laid.position.size
    entry_sequence = np.repeat(np.arange(laid.path_offsets.size - 1), np.diff(laid.path_offsets))
    low = np.full(count, np.inf)
    high = np.full(count, -np.inf)
    given = values.astype(np.float64)[entry_sequence]
    np.minimum.at(low, laid.path_index, given)
    np.maximum.at(high, laid.path_index, given)
    number = 0 if isinstance(fill, Spread) else fill
    return np.where((low == high) & np.isfinite(low), low, number).astype(values.dtype)
