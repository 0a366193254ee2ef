"""Token and sequence log-probs, :func:`unpack` and :func:`aggregate_loss`, exact in every layout.

They read the sequences from what the collator wrote (docs/post_training.md says how).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple, TypeAlias, get_args

import torch

from zephon_collate.core.checks import check_int, fits_dtype
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    BRANCH_IDS,
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOGITS_INDEX,
    NUM_SEQUENCES,
    PATH_INDEX,
    PATH_OFFSETS,
    POSITION_IDS,
    SEQUENCE_INDEX,
)
from zephon_collate.core.text import shown
from zephon_collate.parallel.distributed import data_parallel_size, global_num_valid_tokens, normalize_loss

__all__ = [
    "EMPTY",
    "MODES",
    "Empty",
    "Mode",
    "SequenceLogprobs",
    "aggregate_loss",
    "along_paths",
    "global_loss_count",
    "sequence_logprobs",
    "sequence_means",
    "token_logprobs",
    "unpack",
]

Mode: TypeAlias = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"
]
MODES: tuple[Mode, ...] = get_args(Mode)
"""verl's ``loss_agg_mode`` values, for :func:`aggregate_loss`."""
Empty: TypeAlias = Literal["skip", "count"]
EMPTY: tuple[Empty, ...] = get_args(Empty)
"""Whether a sequence without a supervised token counts in a ``"seq-mean-*"`` denominator."""
_Batch: TypeAlias = Mapping[str, Any]
_FIX = "pass the batch the collator returned"


class SequenceLogprobs(NamedTuple):
    """Per-sequence log-probs: ``sums`` ``[S]`` over supervised tokens, ``counts`` ``[S]`` int64 of them."""

    sums: torch.Tensor
    counts: torch.Tensor


class _Map(NamedTuple):
    """A batch's sequences and their *entries*: a tree batch's paths (``paths``), any other batch's tokens."""

    input_ids: torch.Tensor  # [R, L] int64
    logits_index: torch.Tensor  # [R, L] int64
    sequence_index: torch.Tensor  # [R, L] int64
    num_sequences: int
    paths: torch.Tensor | None = None  # [P] int64 flat places; None: the entries are the tokens
    path_sequence: torch.Tensor | None = None  # [P] int64

    @property
    def entry_sequence(self) -> torch.Tensor:
        """``[E]``: each entry's sequence (-1: none)."""
        return self.sequence_index.reshape(-1) if self.path_sequence is None else self.path_sequence

    def entries(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """``values`` per entry ``[E, ...]``, from token-aligned or entry-aligned values."""
        rows, length = self.logits_index.shape
        count = rows * length if self.paths is None else self.paths.numel()
        if values.dim() >= 2 and tuple(values.shape[:2]) == (rows, length):
            flat = values.reshape(rows * length, *values.shape[2:])
            return flat if self.paths is None else flat[self.paths.to(values.device)]
        if values.dim() >= 1 and values.shape[0] == count:
            return values
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}; give one value per token, aligned with input_ids "
            f"{(rows, length)}, or per entry ({count}, as along_paths(values, batch) returns them)"
        )


def _tensor(
    batch: _Batch, key: str, like: torch.Tensor | None = None, *, integers: bool = True
) -> torch.Tensor:
    """``batch[key]`` as a tensor (of integers unless ``integers=False``), of ``like``'s shape and device."""
    value = batch[key]
    kind = "a tensor [R, L] of integers" if integers else "a tensor [R, L]"
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError(f"batch[{shown(key)}] must be {kind}, got {shown(value)}; {_FIX}") from None
    if integers and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise TypeError(
            f"batch[{shown(key)}] holds {value.dtype}; it must be {kind} (token ids, labels or indices, as "
            f"the collator writes them); {_FIX}"
        )
    if like is not None and value.shape != like.shape:
        mrope = value.dim() == 3 and tuple(value.shape[1:]) == tuple(like.shape)  # [4, 1, N] positions
        fix = "the loss helpers read a padding-free mRoPE batch through its sequence map: collate it with "
        raise ValueError(
            f"batch[{shown(key)}] has shape {tuple(value.shape)}, but 'input_ids' has {tuple(like.shape)}; "
            + (fix + "return_sequence_map=True" if mrope else _FIX)
        )
    return value if like is None else value.to(like.device)


def _count(value: object) -> int:
    """``batch["num_sequences"]``, checked: an int >= 0."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"batch['num_sequences'] must be an int (the number of sequences), got {shown(value)}; {_FIX}"
        ) from None
    if number < 0:
        raise ValueError(f"batch['num_sequences'] must be >= 0, got {number}; {_FIX}")
    return number


def _sequence_map(
    batch: _Batch,
    *,
    split: bool = False,
    ends: bool = False,
    logits_shape: tuple[int, ...] | None = None,
    labels: bool = False,
) -> _Map:
    """The batch's sequences, checked in one device sync at most.

    ``split`` or ``ends``: refuse a padding-free row ending in one-token sequences (``split`` also reads
    the map's indices); ``logits_shape``: check the logits fit and the token ids are in their vocabulary;
    ``labels``: check the labels are token-aligned (the helper reads what is trained from them).
    """
    if not isinstance(batch, Mapping) or INPUT_IDS not in batch:
        raise TypeError(
            "expected a batch dict from Collator.for_preference, for_rollouts or for_transformers"
        )
    ids = _tensor(batch, INPUT_IDS)
    if ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [R, L], got shape {tuple(ids.shape)}")
    ids = ids.long()
    rows, length = ids.shape
    if logits_shape is not None:
        if len(logits_shape) != 3 or tuple(logits_shape[:2]) != (rows, length):
            raise ValueError(
                f"logits have shape {tuple(logits_shape)}; they must be [R, L, V] for input_ids of shape "
                f"{(rows, length)} (the model's output for this batch, unshifted)"
            )
        if logits_shape[2] == 0:
            raise ValueError(
                f"logits have shape {tuple(logits_shape)}: no vocabulary to score the tokens over; give the "
                "model's logits over the whole vocabulary"
            )
    place = torch.arange(length, device=ids.device).expand_as(ids)
    read: dict[str, torch.Tensor] = {}  # the values to read, at once
    if logits_shape is not None and ids.numel():
        read["low"], read["high"] = ids.aminmax()
    count: int | None = None
    path_count = -1
    paths = path_sequence = None
    if PATH_INDEX in batch and PATH_OFFSETS in batch:  # a tree batch: its paths are its entries
        paths = _tensor(batch, PATH_INDEX).reshape(-1).long().to(ids.device)
        offsets = _tensor(batch, PATH_OFFSETS).reshape(-1).long().to(ids.device)
        if offsets.numel() < 1:
            raise ValueError(f"batch['path_offsets'] must hold [num_sequences + 1] offsets; {_FIX}")
        count = path_count = offsets.numel() - 1
        sizes = offsets[1:] - offsets[:-1]
        read["path_first"], read["path_last"] = offsets[0], offsets[-1]
        if count:
            read["path_size"] = sizes.min()
        if paths.numel():
            read["path_low"], read["path_high"] = paths.aminmax()
    if LOGITS_INDEX in batch and SEQUENCE_INDEX in batch:
        index, sequence = _tensor(batch, LOGITS_INDEX, ids).long(), _tensor(batch, SEQUENCE_INDEX, ids).long()
        given = batch.get(NUM_SEQUENCES)
        count = count if given is None else _count(given)
        checked = split or logits_shape is not None or ids.device.type == "cpu" or count is None
        if checked and ids.numel():
            read["index"], read["sequence"] = index.max(), sequence.max()
    elif ATTENTION_MASK in batch:  # padded: a sequence per row, on its mask
        mask = _tensor(batch, ATTENTION_MASK, ids, integers=False) != 0
        before = torch.zeros_like(mask)
        before[:, 1:] = mask[:, :-1]
        index = torch.where(mask & before, place - 1, -1)
        rows_of = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)
        sequence, count = torch.where(mask, rows_of, -1), rows
    elif POSITION_IDS in batch:  # padding-free: a sequence wherever the row's first position comes back
        positions = _tensor(batch, POSITION_IDS, ids)
        starts = positions == positions[:, :1]  # the row's first token included
        sequence = (starts.reshape(-1).cumsum(0) - 1).reshape(ids.shape)
        index = torch.where(starts, -1, place - 1)
        read["count"] = starts.sum()
        if (split or ends) and ids.numel():
            # Each row's closing run of one-token sequences. No label tells them from padding: padding
            # is labelled label_pad_token_id, whatever the user chose (its own id too, with the pad id).
            run = starts.flip(1).long().cumprod(1).flip(1).bool()
            read["trailing"] = run.sum(1).max()
    else:
        raise ValueError(
            "the batch has no sequence map ('logits_index', 'sequence_index'), 'attention_mask' or "
            "'position_ids'; collate it with Collator.for_preference, Collator.for_rollouts or "
            "Collator.for_transformers"
        )
    if labels and LABELS in batch and ids.numel():  # -100 or the token: shifted labels read one off
        label_ids = _tensor(batch, LABELS, ids).long()
        read["shifted"] = ((label_ids != IGNORE_INDEX) & (label_ids != ids) & (index >= 0)).any()
    values = dict(zip(read, torch.stack(list(read.values())).tolist(), strict=True)) if read else {}
    if values.get("trailing", 0) > 0:
        raise ValueError(
            "a row of the padding-free batch (position_ids, no attention_mask) ends with "
            f"{values['trailing']} one-token sequence(s): that is "
            "what pad_to_multiple_of padding looks like (whatever label_pad_token_id), and what one-token "
            "examples look like, so the loss helpers cannot tell padding from one-token sequences at the "
            "end of the row; collate with Collator.for_transformers(..., return_sequence_map=True), which "
            "writes where the sequences are (or, where the row ends in padding, leave out pad_to_multiple_of)"
        )
    if "count" in values:
        count = values["count"]
    if count is None:
        count = max(values.get("sequence", -1) + 1, 0)
    if values.get("index", -1) >= length:
        raise ValueError(
            f"batch['logits_index'] points at place {values['index']}, past the end of its row of {length} "
            f"tokens; {_FIX}"
        )
    if values.get("path_low", 0) < 0 or values.get("path_high", -1) >= rows * length:
        raise ValueError(f"batch['path_index'] points outside input_ids of shape {(rows, length)}; {_FIX}")
    if paths is not None:  # sequence s's path: path_index[path_offsets[s]:path_offsets[s + 1]]
        first, last, falling = values["path_first"], values["path_last"], values.get("path_size", 0) < 0
        if first != 0 or last != paths.numel() or falling:
            raise ValueError(
                f"batch['path_offsets'] must rise from 0 to the {paths.numel()} places of "
                f"batch['path_index'], got offsets from {first} to {last}"
                f"{', falling' if falling else ''}; {_FIX}"
            )
        path_sequence = torch.repeat_interleave(
            torch.arange(path_count, device=ids.device), sizes, output_size=paths.numel()
        )
    if paths is not None and count != path_count:
        raise ValueError(
            f"batch['path_offsets'] holds {path_count} sequences, batch['num_sequences'] {count}; {_FIX}"
        )
    if values.get("sequence", -1) >= count:
        raise ValueError(
            f"batch['sequence_index'] holds sequence {values['sequence']}, but batch['num_sequences'] is "
            f"{count}: the sequences are numbered 0 to num_sequences - 1; {_FIX}"
        )
    if logits_shape is not None and "high" in values:
        vocabulary = logits_shape[2]
        if values["high"] >= vocabulary:
            raise ValueError(
                f"logits have shape {tuple(logits_shape)}, but the largest token id in input_ids is "
                f"{values['high']}: {vocabulary} logits score ids 0 to {vocabulary - 1} only; give the "
                "logits over the whole vocabulary (the model's output, not a slice of it)"
            )
        if values["low"] < 0:
            raise ValueError(
                f"input_ids hold a negative token id {values['low']}; token ids index the logits' "
                f"vocabulary (0 to {vocabulary - 1}): {_FIX}"
            )
    if values.get("shifted"):
        raise ValueError(
            "batch['labels'] holds labels that are neither -100 nor the token at their place: labels "
            "shifted already (the native Collator's, whose labels[t] is input_ids[t + 1]) or another "
            "sequence's; the loss helpers read token-aligned labels: collate with Collator.for_transformers, "
            "for_rollouts, for_preference or for_trees"
        )
    return _Map(ids, index, sequence, count, paths, path_sequence)


def _supervised(batch: _Batch, view: _Map) -> torch.Tensor:
    """``[E]`` bool: entries whose label is not -100, that a position predicts, in a sequence."""
    if LABELS not in batch:
        raise ValueError(
            "the batch has no 'labels'; the loss helpers read what is supervised from them (-100 where no "
            f"loss is taken): {_FIX}, labels included"
        )
    labels = _tensor(batch, LABELS, view.logits_index)
    trained = view.entries((labels != IGNORE_INDEX) & (view.logits_index >= 0), "labels")
    return trained & (view.entry_sequence >= 0)


def _check_tensor(value: object, name: str, shape: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, aligned with input_ids; got {shown(value)}")
    return value


def _check_logits(value: object, owner: str) -> torch.Tensor:
    """The logits, a real tensor (complex ones would lose their imaginary part)."""
    logits = _check_tensor(value, f"{owner}: logits", "[R, L, V]")
    if logits.is_complex():
        raise TypeError(
            f"{owner}: logits hold {logits.dtype}; give the model's real-valued logits (logits.real if the "
            "imaginary part is meant to be 0)"
        )
    return logits


def _check_global_count(value: object) -> torch.Tensor | int:
    """``global_count``: an int >= 0 or a 0-d integer tensor (its sign read on the CPU only)."""
    if not isinstance(value, torch.Tensor):
        return check_int("aggregate_loss", "global_count", value, 0)
    fix = "pass global_loss_count(...) over the step's micro-batches, or None for this batch's own count"
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim():
        raise TypeError(
            f"aggregate_loss: global_count must be an int >= 0 or a 0-d integer tensor, got a tensor of "
            f"shape {tuple(value.shape)} and dtype {value.dtype}; {fix}"
        )
    if value.device.type == "cpu" and int(value) < 0:
        raise ValueError(f"aggregate_loss: global_count must be >= 0, got {int(value)}; {fix}")
    return value


def _padding_value(value: object, dtype: torch.dtype) -> float | int:
    """``unpack``'s ``padding_value``, checked: a real number that ``dtype`` holds."""
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"unpack: padding_value must be a real number, got {shown(value)}; pass the value that fills "
            "the padded rows' ends (0 by default)"
        )
    try:
        number, whole = float(value), None
    except OverflowError:  # an int past every float: no dtype holds it
        number, whole = math.nan, None
    if isinstance(value, numbers.Integral) and not math.isfinite(number):
        fits = False
    elif dtype.is_complex:
        fits = True
    elif dtype.is_floating_point:  # inf and NaN are floats too; a finite value past the range would be inf
        fits = not math.isfinite(number) or abs(number) <= torch.finfo(dtype).max
    else:
        whole = operator.index(value) if isinstance(value, numbers.Integral) else None
        if whole is None and math.isfinite(number) and number.is_integer():
            whole = int(number)
        fits = whole is not None and (whole in (0, 1) if dtype == torch.bool else fits_dtype(whole, dtype))
    if not fits:
        raise ValueError(
            f"unpack: padding_value {shown(value)} does not fit the tensor's dtype {dtype}; pass a value "
            "that it holds, or convert the tensor first (e.g. tensor.float())"
        )
    return number if whole is None else whole


def token_logprobs(logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Per-token log-probs ``[R, L]``, token-aligned: ``out[r, t] = log p(input_ids[r, t] | its context)``.

    Parameters:
        logits: ``[R, L, V]``, the model's output for ``batch["input_ids"]``, over the whole vocabulary.
        batch: a batch of ``Collator.for_preference`` / ``for_rollouts`` (or ``for_transformers``).

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...     {"input_ids": [1, 3], "completion_mask": [0, 1]},
        ... ])
        >>> logits = torch.zeros(1, 5, 4)  # uniform over 4 tokens: every log-prob is log(1/4)
        >>> token_logprobs(logits, batch).double().round(decimals=4).tolist()
        [[0.0, -1.3863, -1.3863, 0.0, -1.3863]]
    """
    logits = _check_logits(logits, "token_logprobs")
    return _token_logprobs(logits, _sequence_map(batch, logits_shape=tuple(logits.shape)))


def _token_logprobs(logits: torch.Tensor, view: _Map) -> torch.Tensor:
    index = view.logits_index.to(logits.device)
    ids = view.input_ids.to(logits.device)
    scores = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    safe = index.clamp(min=0)
    rows = torch.arange(scores.shape[0], device=scores.device)[:, None]
    normaliser = torch.logsumexp(scores, dim=-1).gather(1, safe)
    return (scores[rows, safe, ids] - normaliser).masked_fill(index < 0, 0)


def _per_sequence(values: torch.Tensor, supervised: torch.Tensor, view: _Map) -> torch.Tensor:
    """``[S]``: entry values summed over each sequence's supervised entries (no device sync)."""
    supervised = supervised.to(values.device)
    sequence = view.entry_sequence.to(values.device)
    slot = torch.where(supervised, sequence, view.num_sequences)
    picked = torch.where(supervised, values, torch.zeros((), dtype=values.dtype, device=values.device))
    total = torch.zeros(view.num_sequences + 1, dtype=values.dtype, device=values.device)
    return total.scatter_add(0, slot, picked)[: view.num_sequences]


def _entry_view(
    values: torch.Tensor, batch: _Batch, name: str, *, ends: bool = False
) -> tuple[_Map, torch.Tensor, torch.Tensor]:
    """The batch's sequence map, ``values`` per entry (one number each) and the supervised entries."""
    view = _sequence_map(batch, ends=ends, labels=True)
    given = view.entries(values, name)
    if given.dim() != 1:  # [R, L, 1] would broadcast against the [E] mask into [E, E]
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}: give one number per token, aligned with input_ids "
            f"{tuple(view.logits_index.shape)} (squeeze a trailing dimension of 1, e.g. a value head's)"
        )
    return view, given, _supervised(batch, view)


def sequence_means(values: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """``[R, L]``: at every token, the mean of ``values`` over its sequence's supervised tokens.

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
        ...     {"input_ids": [1, 4], "completion_mask": [0, 1]},
        ... ])
        >>> sequence_means(torch.tensor([[9.0, 1.0, 2.0, 9.0, 5.0]]), batch).tolist()
        [[1.5, 1.5, 1.5, 5.0, 5.0]]
    """
    values = _check_tensor(values, "sequence_means: values", "[R, L]")
    view, given, supervised = _entry_view(values, batch, "sequence_means: values")
    counts = _per_sequence(torch.ones_like(given), supervised, view).clamp(min=1)
    means = _per_sequence(given, supervised, view) / counts
    sequence = view.entry_sequence.to(values.device)
    spread = means[sequence.clamp(min=0)] if view.num_sequences else torch.zeros_like(given)
    out = torch.where(sequence >= 0, spread, torch.zeros_like(spread))
    if given is values:  # entry-aligned in, entry-aligned out
        return out
    if view.paths is not None:
        raise ValueError(
            "sequence_means: a tree batch's tokens belong to several sequences, so one mean per token is not "
            "defined; give the values per entry (along_paths(values, batch)) and get one mean per entry"
        )
    return out.reshape(values.shape)


def along_paths(values: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """``values`` per *entry* (every token of every sequence): what the loss helpers take on a tree batch.

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_trees()([
        ...     {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
        ...     {"input_ids": [1, 2, 3, 5], "completion_mask": [0, 0, 1, 1]},
        ... ])
        >>> batch["input_ids"].tolist()  # 1 2 3 once, then each path's last token
        [[1, 2, 3, 4, 5]]
        >>> along_paths(batch["input_ids"], batch).tolist()
        [1, 2, 3, 4, 1, 2, 3, 5]
    """
    values = _check_tensor(values, "along_paths: values", "[R, L, ...] or [S, ...]")
    view = _sequence_map(batch)
    if (
        values.dim() >= 1
        and values.shape[0] == view.num_sequences
        and not (values.dim() >= 2 and tuple(values.shape[:2]) == tuple(view.logits_index.shape))
    ):
        sequence = view.entry_sequence.to(values.device)
        picked = values[sequence.clamp(min=0)] if view.num_sequences else values.new_zeros(sequence.shape)
        mask = (sequence >= 0).reshape(-1, *([1] * (values.dim() - 1)))
        return torch.where(mask, picked, torch.zeros((), dtype=values.dtype, device=values.device))
    return view.entries(values, "along_paths: values")


def sequence_logprobs(logits: torch.Tensor, batch: _Batch) -> SequenceLogprobs:
    """Per-sequence log-probs over supervised tokens: ``SequenceLogprobs(sums [S], counts [S] int64)``.

    Example:
        >>> from zephon_collate import Collator
        >>> pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [2, 3]}]
        >>> batch = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
        >>> out = sequence_logprobs(torch.zeros(1, 5, 4), batch)  # uniform: log(1/4) per supervised token
        >>> out.sums.double().round(decimals=4).tolist(), out.counts.tolist()
        ([-1.3863, -2.7726], [1, 2])
    """
    logits = _check_logits(logits, "sequence_logprobs")
    view = _sequence_map(batch, split=True, logits_shape=tuple(logits.shape), labels=True)
    scores = view.entries(_token_logprobs(logits, view), "logits")
    supervised = _supervised(batch, view)
    counts = _per_sequence(torch.ones_like(scores, dtype=torch.int64), supervised, view)
    return SequenceLogprobs(_per_sequence(scores, supervised, view), counts)


def unpack(
    tensor: torch.Tensor, batch: _Batch, *, padded: bool = False, padding_value: float = 0
) -> list[torch.Tensor] | torch.Tensor:
    """A per-token tensor ``[R, L, ...]`` back to its sequences: each one's tokens (shared prompt included).

    Parameters:
        tensor: ``[R, L, ...]``, aligned with ``batch["input_ids"]``.
        batch: a batch of ``Collator.for_preference`` / ``for_rollouts`` (or ``for_transformers``).
        padded: return ``[S, max_len, ...]`` padded with ``padding_value`` instead of a list.
        padding_value: the padding of ``padded``, a number the tensor's dtype holds.

    Example:
        >>> from zephon_collate import Collator
        >>> pairs = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}]
        >>> batch = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
        >>> batch["input_ids"].tolist()
        [[1, 2, 3, 4, 5]]
        >>> [row.tolist() for row in unpack(batch["input_ids"], batch)]
        [[1, 2, 3], [1, 2, 4, 5]]
    """
    tensor = _check_tensor(tensor, "unpack: tensor", "[R, L, ...]")
    fill = _padding_value(padding_value, tensor.dtype) if padded else 0
    view = _sequence_map(batch, split=True)
    rows, length = view.sequence_index.shape
    device = tensor.device
    count = view.num_sequences
    if view.path_sequence is not None:  # a tree batch: each sequence's path
        values = view.entries(tensor, "unpack: tensor")
        total = torch.bincount(view.path_sequence.to(device), minlength=count)
        return _split(values, total, count, padded, fill)
    if tuple(tensor.shape[:2]) != (rows, length):
        raise ValueError(
            f"unpack: tensor has shape {tuple(tensor.shape)}; it must be [R, L, ...] for input_ids of shape "
            f"{(rows, length)}"
        )
    if rows * length == 0:  # no tokens: every sequence is empty
        empty = tensor.new_empty((count, 0, *tensor.shape[2:]))
        return empty if padded else list(empty)
    sequence = view.sequence_index.reshape(-1).to(device)
    flat = torch.arange(sequence.numel(), device=device)
    own = sequence >= 0
    slot = torch.where(own, sequence, count)
    zeros = torch.zeros(count + 1, dtype=torch.int64, device=device)
    own_length = zeros.scatter_add(0, slot, own.long())[:count]
    far = torch.full((count + 1,), sequence.numel(), dtype=torch.int64, device=device)
    own_start = far.scatter_reduce(0, slot, flat, reduce="amin")[:count]
    trunk_start = torch.zeros(count, dtype=torch.int64, device=device)
    trunk_length = torch.zeros(count, dtype=torch.int64, device=device)
    if DOCUMENT_IDS in batch and BRANCH_IDS in batch:  # a shared prompt: the document's branch-0 tokens
        document = _tensor(batch, DOCUMENT_IDS, view.sequence_index).reshape(-1).to(device).long()
        branch = _tensor(batch, BRANCH_IDS, view.sequence_index).reshape(-1).to(device)
        trunk = (branch == 0) & (document >= 0)
        documents = int(document.max()) + 1
        key = torch.where(trunk, document, documents)
        lengths = torch.zeros(documents + 1, dtype=torch.int64, device=device).scatter_add(
            0, key, trunk.long()
        )
        starts = torch.full((documents + 1,), 0, dtype=torch.int64, device=device)
        starts = starts.scatter_reduce(0, key, flat, reduce="amin", include_self=False)
        mine = document[own_start.clamp(max=sequence.numel() - 1)]
        trunk_start = starts[mine]
        trunk_length = torch.where(own_length > 0, lengths[mine], 0)  # an empty sequence has no prompt here
    total = trunk_length + own_length
    spans_start = torch.stack([trunk_start, own_start], dim=1).reshape(-1)
    spans_length = torch.stack([trunk_length, own_length], dim=1).reshape(-1)
    ends = spans_length.cumsum(0)
    size = int(ends[-1]) if ends.numel() else 0
    index = torch.arange(size, device=device)
    index = index + torch.repeat_interleave(
        spans_start - (ends - spans_length), spans_length, output_size=size
    )
    return _split(tensor.reshape(rows * length, *tensor.shape[2:])[index], total, count, padded, fill)


def _split(
    values: torch.Tensor, total: torch.Tensor, count: int, padded: bool, fill: float | int
) -> list[torch.Tensor] | torch.Tensor:
    """``values`` (each sequence's, end to end; ``total`` their sizes) as a list, or padded."""
    sizes = total.tolist()  # the one read of the sizes
    if not padded:
        return list(torch.split(values, sizes))
    size, device = sum(sizes), values.device
    out = values.new_full((count, max(sizes, default=0), *values.shape[1:]), fill)
    place = torch.arange(size, device=device) - torch.repeat_interleave(
        total.cumsum(0) - total, total, output_size=size
    )
    out[torch.repeat_interleave(torch.arange(count, device=device), total, output_size=size), place] = values
    return out


def _counts_sequences(mode: Mode, empty: Empty) -> bool:
    """Whether ``mode``'s count is every sequence (padding must then be told from sequences)."""
    return empty == "count" and mode.startswith("seq-mean")


def _local_count(supervised: torch.Tensor, view: _Map, mode: Mode, empty: Empty) -> torch.Tensor:
    """This batch's units of ``mode``: supervised tokens, or (``"seq-mean-*"``) sequences."""
    if mode == "token-mean":
        return supervised.sum()
    if empty == "count":
        return torch.tensor(view.num_sequences, dtype=torch.int64, device=supervised.device)
    per_sequence = _per_sequence(supervised.long(), supervised, view)
    return (per_sequence > 0).sum()


def _check_mode(mode: object) -> Mode:
    if mode not in MODES:
        raise ValueError(f"aggregate_loss: mode must be one of {MODES}, got {shown(mode)}")
    return mode


def _check_empty(owner: str, empty: object) -> Empty:
    if empty not in EMPTY:
        raise ValueError(
            f"{owner}: empty must be 'skip' or 'count' (whether a sequence without a supervised token counts "
            f"in a 'seq-mean-*' mode's denominator), got {shown(empty)}"
        )
    return empty


def global_loss_count(
    batches: _Batch | Iterable[_Batch],
    *,
    mode: Mode = "token-mean",
    empty: Empty = "skip",
    group: Any = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """The denominator of ``mode`` over one optimizer step: every micro-batch of every rank.

    Parameters:
        batches: this rank's micro-batches of the step (or one batch).
        mode: one of :data:`MODES` except ``"token-sum"``.
        empty: ``"skip"`` or ``"count"`` the sequences without a supervised token.
        group: the data-parallel group (``None``: the default group).
        device: where the count lives (default: as ``global_num_valid_tokens``).

    Example:
        >>> from zephon_collate import Collator
        >>> collate = Collator.for_rollouts(padding_free=True)
        >>> micro = [collate([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}]),
        ...          collate([{"input_ids": [4, 5], "completion_mask": [0, 1]},
        ...                   {"input_ids": [4, 6], "completion_mask": [0, 0]}])]  # all masked
        >>> int(global_loss_count(micro)), int(global_loss_count(micro, mode="seq-mean-token-mean"))
        (3, 2)
    """
    checked = _check_mode(mode)
    how = _check_empty("global_loss_count", empty)
    if checked == "token-sum":
        raise ValueError("global_loss_count: 'token-sum' divides by nothing; call aggregate_loss without it")
    if isinstance(batches, Mapping):
        items: list[Any] = [batches]
    elif isinstance(batches, Iterable) and not isinstance(batches, (str, bytes, torch.Tensor)):
        items = list(batches)
    else:
        raise TypeError(
            "global_loss_count: batches must be a batch dict or an iterable of them (the step's "
            f"micro-batches on this rank), got {shown(batches)}"
        )
    counts = []
    for batch in items:
        view = _sequence_map(batch, ends=_counts_sequences(checked, how), labels=True)
        counts.append(_local_count(_supervised(batch, view), view, checked, how))
    return global_num_valid_tokens(counts, group=group, device=device)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    batch: _Batch,
    *,
    mode: Mode = "token-mean",
    empty: Empty = "skip",
    global_count: torch.Tensor | int | None = None,
    accumulation_steps: int | None = None,
    normalizer: float | None = None,
    group: Any = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """The 0-d loss to call ``backward`` on: ``per_token_loss`` over supervised tokens, by ``mode``.

    Parameters:
        per_token_loss: ``[R, L]``, aligned with ``input_ids`` (or per entry, :func:`along_paths`).
        batch: the micro-batch (``Collator.for_preference`` / ``for_rollouts`` / ``for_transformers``).
        mode: one of :data:`MODES`.
        empty: ``"skip"`` (default) or ``"count"`` the sequences without a supervised token.
        global_count: the step's denominator (:func:`global_loss_count`); ``None``: this batch's, all-reduced.
        accumulation_steps: the micro-batches of a step on each rank, for TRL's per-micro-batch denominator
            (then neither ``global_count`` nor ``world_size``).
        normalizer: the constant response length of ``"seq-mean-token-sum-norm"`` (required there).
        group: the data-parallel group (``None``: the default group).
        world_size: the ranks gradients are averaged over (default: ``group``'s size, 1 alone).

    Example:
        >>> from zephon_collate import Collator
        >>> batch = Collator.for_rollouts(padding_free=True)([
        ...     {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1]},
        ...     {"input_ids": [1, 5], "completion_mask": [0, 1]},
        ...     {"input_ids": [1, 6, 7], "completion_mask": [0, 0, 0]},  # all masked (truncated)
        ... ])
        >>> loss = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 6.0, 0.0, 9.0, 9.0]])  # sequence sums 6, 6, 0
        >>> [round(float(aggregate_loss(loss, batch, mode=m, normalizer=8.0)), 4) for m in MODES]
        [3.0, 6.0, 4.0, 0.75, 12.0]
        >>> counted = [aggregate_loss(loss, batch, mode=m, empty="count", normalizer=8.0) for m in MODES]
        >>> [round(float(value), 4) for value in counted]
        [3.0, 4.0, 2.6667, 0.5, 12.0]
    """
    per_token_loss = _check_tensor(per_token_loss, "aggregate_loss: per_token_loss", "[R, L]")
    checked = _check_mode(mode)
    how = _check_empty("aggregate_loss", empty)
    norm = checked == "seq-mean-token-sum-norm"
    if norm and (
        isinstance(normalizer, bool)
        or not isinstance(normalizer, numbers.Real)
        or not 0 < normalizer < math.inf
    ):
        raise ValueError(
            f"aggregate_loss: mode 'seq-mean-token-sum-norm' needs normalizer=, a finite constant > 0 (e.g. "
            f"the largest response length), got {shown(normalizer)}"
        )
    count = None if global_count is None else _check_global_count(global_count)
    steps = None
    if accumulation_steps is not None:
        steps = check_int("aggregate_loss", "accumulation_steps", accumulation_steps, 1)
        for name, value in (("global_count", global_count), ("world_size", world_size)):
            if value is not None:
                raise ValueError(
                    f"aggregate_loss: {name}= and accumulation_steps= are two ways to scale the loss: "
                    "accumulation_steps= divides each micro-batch by its own count (TRL's per-micro-batch "
                    "denominator, ranks averaged as DDP averages them), global_count= and world_size= by the "
                    "step's (verl's); pass one of them"
                )
    view, per_token_loss, supervised = _entry_view(
        per_token_loss, batch, "aggregate_loss: per_token_loss", ends=_counts_sequences(checked, how)
    )
    on_device = supervised.to(per_token_loss.device)
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    if checked == "token-sum":
        total = torch.where(on_device, per_token_loss, zero).sum()
        if steps is not None:
            return total / steps
        return total * (data_parallel_size(group) if world_size is None else world_size)
    if checked in ("token-mean", "seq-mean-token-sum-norm"):
        numerator = torch.where(on_device, per_token_loss, zero).sum()
    else:
        sums = _per_sequence(per_token_loss, supervised, view)
        if checked == "seq-mean-token-mean":
            counts = _per_sequence(torch.ones_like(per_token_loss, dtype=torch.int64), supervised, view)
            sums = sums / counts.clamp(min=1).to(sums.dtype)
        numerator = sums.sum()
    if steps is not None:
        own = _local_count(supervised, view, checked, how)
        loss = normalize_loss(numerator, own, world_size=1) / steps
    else:
        if count is None:
            count = global_num_valid_tokens(_local_count(supervised, view, checked, how), group=group)
        loss = normalize_loss(numerator, count, group=group, world_size=world_size)
    return loss / float(normalizer) if norm else loss
