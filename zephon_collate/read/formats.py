"""Read adapters: each post-training format (docs/post_training.md, docs/trees.md) read into a ``Forest``."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch

from zephon_collate.core.checks import scalar
from zephon_collate.core.keys import (
    CHOSEN_ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INPUT_IDS,
    COMPLETION_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    KL_COMPLETION_IDS,
    LABEL,
    LABEL_IDS,
    LABELS,
    LOSS_MASK,
    MARGIN,
    POSITION_IDS,
    PROMPT_ATTENTION_MASK,
    PROMPT_IDS,
    PROMPT_INPUT_IDS,
    REF_CHOSEN_LOGPS,
    REF_KL_LOGPS,
    REF_LOGPS,
    REF_REJECTED_LOGPS,
    REJECTED_ATTENTION_MASK,
    REJECTED_IDS,
    REJECTED_INPUT_IDS,
    RESPONSE_MASK,
    SHIFT_LABELS,
    SUPERVISION_MASKS,
    TOKEN_TYPE_IDS,
)
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read.columns import (
    Batch,
    Names,
    Ragged,
    Spread,
    as_numpy,
    places,
    row_any,
    row_of,
    to_row,
)
from zephon_collate.read.examples import ExampleSpec, read_examples, supervision
from zephon_collate.read.fields import FloatField, read_floats, to_label_positions, value_rows
from zephon_collate.read.forest import Forest, rows_taker
from zephon_collate.read.rules import (
    FOREIGN_SUPERVISION,
    SUPERVISING_FIELDS,
    check_flat,
    check_ids,
    check_zero_one,
    group_id,
    kept_by_mask,
    misaligned,
    misspelled,
    near_miss,
    refuse_media,
    response_aligned,
    unread_message,
)

__all__ = [
    "NODE_ID",
    "PAIR_ROLES",
    "PARENT_ID",
    "Cut",
    "read_kto",
    "read_pairs",
    "read_reward_pairs",
    "read_rollouts",
    "read_trajectories",
    "read_trees",
]

PAIR_ROLES = ("chosen", "rejected")
_KTO_ROLES = ("completion", "KL")
_SIDES = (
    ("prompt", PROMPT_INPUT_IDS, PROMPT_IDS, PROMPT_ATTENTION_MASK),
    ("chosen", CHOSEN_INPUT_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK),
    ("rejected", REJECTED_INPUT_IDS, REJECTED_IDS, REJECTED_ATTENTION_MASK),
)
_FULL_LABELS = ("chosen_labels", "rejected_labels")
"""open-instruct's packed-DPO labels: whole sequences, -100 on the prompt."""
_UNPAIRED = (COMPLETION_IDS, LABEL, KL_COMPLETION_IDS)
"""The fields of TRL's unpaired (KTO) examples: any of them says the batch holds KTO examples."""
_OPENRLHF_REJECTED = "reject_ids"
"""OpenRLHF's rejected side (the prompt inside; ``extra``: the prompt's length, or a reward's margin)."""
_SIDE_MASKS = (
    PROMPT_ATTENTION_MASK,
    CHOSEN_ATTENTION_MASK,
    REJECTED_ATTENTION_MASK,
    "completion_attention_mask",
    "KL_attention_mask",
    "reject_attention_mask",
    "c_mask",  # OpenRLHF's
    "r_mask",
)
_PAIR_SUPERVISION = (*SUPERVISING_FIELDS, LOSS_MASK)
"""Fields that say what of one sequence is trained, which a pair's sides do not read (trained whole)."""
_SIDE_WORDS = frozenset({"prompt", "chosen", "rejected", "reject", "completion", "kl"})
"""The words of a side's name: a mask or labels named with one is a side's, read or refused."""
_NEAR_MISSES = (*_SIDE_MASKS, *_FULL_LABELS, *(n for n in _PAIR_SUPERVISION if n not in FOREIGN_SUPERVISION))
_DPO_ONLY = (REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS, *_FULL_LABELS)
"""Fields only DPO pairs carry: reference log-probs (TRL), per-token labels (open-instruct)."""
_ROLLOUT_SUPERVISION = (*SUPERVISION_MASKS, LABELS, RESPONSE_MASK)


@dataclass(frozen=True)
class Cut:
    """How a pair's sides are cut, as TRL's ``DataCollatorForPreference`` cuts them.

    The prompt keeps its last ``max_prompt_length`` tokens, each response its first ``max_completion_length``,
    each sequence ``max_length`` from its start or end (``truncation_mode``).
    """

    owner: str
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"


# -- pairs -------------------------------------------------------------------------------------------


def read_pairs(batch: Batch, cut: Cut) -> Forest:
    """DPO pairs (or KTO examples) as a forest: each side's prompt then response, every chosen one first."""
    names = batch.names
    refuse_media(batch, cut.owner)
    _check_pairs(batch, "prompt_input_ids, chosen_input_ids, rejected_input_ids")
    prompt_given = PROMPT_INPUT_IDS in batch or PROMPT_IDS in batch
    labelled = [name for name in _FULL_LABELS if name in batch]
    if labelled and prompt_given:
        raise ValueError(
            f"{names(int(np.flatnonzero(batch.carried(labelled[0]))[0]))}: carries {shown(labelled[0])} "
            "(open-instruct's packed DPO format: whole sequences with -100 on the prompt) beside prompt "
            "ids (TRL's format: each side without the prompt), so it is not clear what the sides hold; "
            f"give one format: drop {shown(labelled[0])}, or drop the prompt ids"
        )
    unpaired = [name for name in _UNPAIRED if name in batch]
    if unpaired:
        return read_kto(batch, cut, unpaired[0])
    if labelled:
        prompts, chosen, rejected = _labelled(batch)
    elif _OPENRLHF_REJECTED in batch:
        prompts, chosen, rejected = _openrlhf(batch, prompt_given)
    else:
        prompts, chosen, rejected = (_side(batch, *side) for side in _SIDES)
    sides = _cut_sides(prompts, {"chosen": chosen, "rejected": rejected}, cut, names)
    return _sequences(sides, PAIR_ROLES, _reference(batch, (REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS), cut.owner))


def read_kto(batch: Batch, cut: Cut, found: str = COMPLETION_IDS) -> Forest:
    """TRL's KTO examples: a prompt, a completion, ``label`` and the KL term's mismatched completion."""
    names = batch.names
    index = int(np.flatnonzero(batch.carried(found))[0])
    paired = [
        name for name in (CHOSEN_INPUT_IDS, CHOSEN_IDS, REJECTED_INPUT_IDS, REJECTED_IDS) if name in batch
    ]
    if paired or COMPLETION_IDS not in batch or LABEL not in batch:
        what = (
            f"beside {shown(paired[0])} (a pair's side)"
            if paired
            else f"without {shown(COMPLETION_IDS if COMPLETION_IDS not in batch else LABEL)}"
        )
        raise ValueError(
            f"{names(index)}: carries {shown(found)} (TRL's unpaired KTO format: prompt_ids, "
            f"completion_ids and a bool label per example) {what}; give one format: pairs (prompt, "
            "chosen and rejected ids) or KTO examples (prompt_ids, completion_ids, label)"
        )
    label = batch.objects(LABEL)
    for row, value in enumerate(label):
        if not isinstance(scalar(value), bool):
            raise ValueError(
                f"{names(row)}: 'label' is {shown(value)}, but KTO's label is one bool per example "
                "(True where the completion is desirable); give True or False (per-token labels belong "
                "in 'labels', which this collator writes)"
            )
    prompts = _side(batch, "prompt", PROMPT_INPUT_IDS, PROMPT_IDS, PROMPT_ATTENTION_MASK)
    responses = {
        "completion": _side(batch, "completion", COMPLETION_IDS, COMPLETION_IDS, "completion_attention_mask")
    }
    references: tuple[str, ...] = (REF_LOGPS,)
    if KL_COMPLETION_IDS in batch:
        responses["KL"] = _side(batch, "KL", KL_COMPLETION_IDS, KL_COMPLETION_IDS, "KL_attention_mask")
        references = (REF_LOGPS, REF_KL_LOGPS)
    elif REF_KL_LOGPS in batch:
        raise ValueError(
            f"{cut.owner}: the examples carry {shown(REF_KL_LOGPS)} but no {shown(KL_COMPLETION_IDS)}, "
            f"whose reference log-probs it holds; give both, or drop {shown(REF_KL_LOGPS)}"
        )
    roles = _KTO_ROLES[: len(responses)]
    desirable = np.array([bool(value) for value in label], dtype=bool)
    values = _reference(batch, references, cut.owner)
    values[LABEL] = np.tile(desirable, len(roles))
    return _sequences(_cut_sides(prompts, responses, cut, names), roles, values)


def _check_pairs(batch: Batch, fields: str) -> None:
    """Refuse the first example that is not a dict of token ids, or carries a field that would be lost."""
    for index, payload in enumerate(batch.payloads):
        if isinstance(payload, SampleRecord) or not hasattr(payload, "keys"):
            raise TypeError(
                f"{batch.names(index)}: must be a dict of a pair's token ids ({fields}), got "
                f"{type(payload).__name__}"
            )
    near = misspelled(batch.fields, _NEAR_MISSES, ("extra", _OPENRLHF_REJECTED))
    if near is not None:  # read under no name, a side's padding (or what it leaves out) would be trained
        name, meant = near
        raise ValueError(near_miss(batch.names(int(np.flatnonzero(batch.carried(name))[0])), name, meant))
    for name in (*_PAIR_SUPERVISION, *_side_supervision(batch.fields)):
        if name not in batch:
            continue
        values = batch.get(name, "values", partial=True)
        assert values is not None
        labels = name in (LABELS, SHIFT_LABELS, LABEL_IDS) or "labels" in _words(name)  # all would be lost
        untrained = np.ones(batch.rows, bool) if labels else row_any(values.host != 1, values.offsets)
        rows = np.flatnonzero(untrained & batch.carried(name))
        if rows.size:
            raise ValueError(unread_message(batch.names(int(rows[0])), name, "pairs"))


def _side_supervision(fields: Iterable[object]) -> list[str]:
    """The fields named as one side's mask or labels that no format reads (``chosen_loss_mask``,
    ``attention_mask_chosen``; TRL's ``prompt_mask`` is another stack's supervision), sorted.

    Example:
        >>> _side_supervision(["chosen_loss_mask", "chosen_ids", "attention_mask_chosen"])
        ['attention_mask_chosen', 'chosen_loss_mask']
    """
    read = {*_SIDE_MASKS, *_FULL_LABELS, *_PAIR_SUPERVISION}
    return sorted(
        name
        for name in fields
        if isinstance(name, str)
        and name not in read
        and _words(name) & _SIDE_WORDS
        and _words(name) & {"mask", "masks", "labels"}
    )


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower()))


def _labelled(batch: Batch) -> tuple[Ragged, Ragged, Ragged]:
    """open-instruct's pairs: whole sequences, labels -100 on the prompt (each side's leading -100 run)."""
    names = batch.names
    split: list[tuple[Ragged, Ragged]] = []
    for side, name, labels_name in (
        ("chosen", CHOSEN_INPUT_IDS, "chosen_labels"),
        ("rejected", REJECTED_INPUT_IDS, "rejected_labels"),
    ):
        if labels_name not in batch or name not in batch:
            raise ValueError(
                f"{names(0)}: an open-instruct pair needs {shown(name)} and {shown(labels_name)} for both "
                f"sides (its fields: {shown_fields(dict.fromkeys(sorted(batch.fields)))})"
            )
        tokens = _side(batch, side, name, name, f"{side}_attention_mask")
        labels = batch.get(labels_name, "ids")
        assert labels is not None
        if f"{side}_attention_mask" in batch:
            mask = batch.get(f"{side}_attention_mask", "values")
            assert mask is not None
            bad = np.flatnonzero(labels.lengths != mask.lengths)  # the mask: one entry per token
            if bad.size:
                row = int(bad[0])
                raise misaligned(names(row), labels_name, int(labels.lengths[row]), int(mask.lengths[row]))
            labels = labels.select(
                kept_by_mask(Ragged(mask.host, mask.offsets), f"{side}_attention_mask", names)
            )
        bad = np.flatnonzero(labels.lengths != tokens.lengths)
        if bad.size:
            index = int(bad[0])
            raise ValueError(
                f"{names(index)}: {shown(labels_name)} has {int(labels.lengths[index])} labels for "
                f"{int(tokens.lengths[index])} tokens; give one label per token"
            )
        given = np.asarray(labels.host) != IGNORE_INDEX
        prompt = _prompt_lengths(Ragged(given, labels.offsets))
        after = places(tokens.offsets) >= np.repeat(prompt, tokens.lengths)
        wrong = after & ((~given) | (np.asarray(labels.host) != np.asarray(tokens.host)))
        if wrong.any():
            index = row_of(tokens.offsets, int(np.flatnonzero(wrong)[0]))
            raise ValueError(
                f"{names(index)}: {shown(labels_name)} is not -100 on a prompt, then the tokens: a later "
                "turn is -100 or a label differs from its token (open-instruct's multi-turn labels); this "
                "collator trains the whole response after one prompt: label only the last turn "
                "(open-instruct's preference_tulu_tokenize_and_truncate_v1_2)"
            )
        split.append((_kept(tokens, prompt, False), _kept(tokens, tokens.lengths - prompt, True)))
    (prompts, chosen), (other, rejected) = split
    if not np.array_equal(prompts.lengths, other.lengths) or not np.array_equal(prompts.host, other.host):
        same = (prompts.lengths == other.lengths) & np.array(
            [np.array_equal(prompts.row(i), other.row(i)) for i in range(prompts.rows)]
        )
        index = int(np.flatnonzero(~same)[0])
        raise ValueError(
            f"{names(index)}: its chosen and rejected sequences start with different prompts (the tokens "
            "before each side's first label); a pair's sides share one prompt"
        )
    return prompts, chosen, rejected


def _openrlhf(batch: Batch, prompt_given: bool) -> tuple[Ragged, Ragged, Ragged]:
    """OpenRLHF's pairs: ``chosen_ids`` and ``reject_ids`` hold the prompt, ``extra`` its length."""
    names = batch.names
    index = int(np.flatnonzero(batch.carried(_OPENRLHF_REJECTED))[0])
    trl = next((name for name in (REJECTED_IDS, REJECTED_INPUT_IDS) if name in batch), None)
    if trl is not None:
        raise ValueError(
            f"{names(index)}: carries {shown(_OPENRLHF_REJECTED)} (OpenRLHF's rejected side) beside "
            f"{shown(trl)} (TRL's), two rejected sides; give one format"
        )
    if prompt_given or "extra" not in batch:
        fix = (
            "beside prompt ids (TRL's format); give one format"
            if prompt_given
            else "without 'extra'; give each pair its prompt's length as 'extra'"
        )
        raise ValueError(
            f"{names(index)}: carries {shown(_OPENRLHF_REJECTED)} (OpenRLHF's pairs: chosen_ids and "
            f"reject_ids with the prompt inside, extra = the prompt's length) {fix}"
        )
    chosen = _side(batch, "chosen", CHOSEN_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK, "c_mask")
    rejected = _side(
        batch, "rejected", _OPENRLHF_REJECTED, _OPENRLHF_REJECTED, "reject_attention_mask", "r_mask"
    )
    extra = batch.objects("extra")
    lengths: list[int] = []
    for row, value in enumerate(extra):
        number = scalar(value)
        shortest = min(int(chosen.lengths[row]), int(rejected.lengths[row]))
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= shortest:
            raise ValueError(
                f"{names(row)}: 'extra' is {shown(value)}, but it must be the prompt's length: an int from 0 "
                "to the shorter side's length (OpenRLHF's DPO pairs; a reward model's margin is not read "
                "here)"
            )
        lengths.append(number)
    prompt = np.array(lengths, dtype=np.int64)
    prompts, other = _kept(chosen, prompt, False), _kept(rejected, prompt, False)
    if not np.array_equal(prompts.host, other.host):
        same = np.array([np.array_equal(prompts.row(i), other.row(i)) for i in range(prompts.rows)])
        row = int(np.flatnonzero(~same)[0])
        raise ValueError(
            f"{names(row)}: chosen_ids and reject_ids differ in their first {int(prompt[row])} tokens "
            "('extra', the prompt's length); both must start with the prompt"
        )
    return (
        prompts,
        _kept(chosen, chosen.lengths - prompt, True),
        _kept(rejected, rejected.lengths - prompt, True),
    )


def _cut_sides(
    prompts: Ragged, responses: dict[str, Ragged], cut: Cut, names: Names
) -> list[tuple[Ragged, Ragged]]:
    """Each side's ``(prompt, response)``, cut as ``cut`` asks (each side its own prompt)."""
    keep_end = cut.truncation_mode == "keep_end"
    if cut.max_prompt_length is not None:  # a prompt keeps its end, next to its response
        prompts = _kept(prompts, np.minimum(prompts.lengths, cut.max_prompt_length), True)
    if cut.max_completion_length is not None:
        responses = {
            side: _kept(response, np.minimum(response.lengths, cut.max_completion_length), False)
            for side, response in responses.items()
        }
    limit = cut.max_length
    if limit is None:
        return [(prompts, response) for response in responses.values()]
    out: list[tuple[Ragged, Ragged]] = []
    for side, response in responses.items():
        total = prompts.lengths + response.lengths
        if keep_end:  # the sequence's last max_length tokens: the prompt gives up its start first
            over = np.maximum(total - limit, 0)
            from_prompt = np.minimum(over, prompts.lengths)
            out.append(
                (
                    _kept(prompts, prompts.lengths - from_prompt, True),
                    _kept(response, response.lengths - (over - from_prompt), True),
                )
            )
            continue
        full = np.flatnonzero(prompts.lengths >= limit)  # TRL drops these pairs, empty responses too
        if full.size:
            index = int(full[0])
            raise ValueError(
                f"{names(index)}: its prompt of {int(prompts.lengths[index])} tokens "
                f"fills max_length={limit}, so none of the {side} response would be "
                "trained (truncation_mode='keep_start'); drop such pairs (TRL does when it prepares the "
                "dataset), raise max_length, or cut prompts with max_prompt_length"
            )
        kept = np.minimum(response.lengths, np.maximum(limit - prompts.lengths, 0))
        out.append((prompts, _kept(response, kept, False)))
    return out


def _side(batch: Batch, side: str, new: str, old: str, *mask_names: str) -> Ragged:
    """One side's tokens (either spelling; both given must agree), its padding (any one of ``mask_names``)
    dropped."""
    names = batch.names
    masks = [name for name in mask_names if name in batch]
    if len(masks) > 1:
        index = int(np.flatnonzero(batch.carried(masks[0]) & batch.carried(masks[1]))[0])
        raise ValueError(
            f"{names(index)}: carries both {shown(masks[0])} and {shown(masks[1])}, two masks of the {side} "
            "side's padding; keep one of them"
        )
    if new not in batch and old not in batch:
        raise ValueError(
            f"{names(0)}: has no {side} tokens: neither {shown(new)} nor {shown(old)} (its fields: "
            f"{shown_fields(dict.fromkeys(sorted(batch.fields)))}); tokenize the pairs first (prompt, "
            "chosen and rejected token ids)"
        )
    name = new if new in batch else old
    if new in batch and old in batch:
        given, other = batch.get(new, "ids", partial=True), batch.get(old, "ids", partial=True)
        assert given is not None and other is not None
        for index in np.flatnonzero(batch.carried(new) & batch.carried(old)).tolist():
            if not np.array_equal(as_numpy(given.row(index)), as_numpy(other.row(index))):
                raise ValueError(
                    f"{names(index)}: carries both {shown(new)} and {shown(old)} (two spellings of one "
                    "side) with different tokens, so it is not clear which to train; keep one of them"
                )
    tokens = batch.get(name, "ids")
    assert tokens is not None
    check_flat(tokens, name, names)
    tokens = Ragged(tokens.host, tokens.offsets)
    check_ids(tokens, name, names)
    tokens = tokens.cast(torch.int64)
    if masks:
        mask_name = masks[0]
        mask = batch.get(mask_name, "values")
        assert mask is not None
        bad = np.flatnonzero((mask.lengths != tokens.lengths) | (mask.values.ndim != 1))
        if bad.size:
            index = int(bad[0])
            raise ValueError(
                f"{names(index)}: {shown(mask_name)} has shape {tuple(mask.row(index).shape)}, but "
                f"{shown(name)} has {int(tokens.lengths[index])} tokens; give one value per token"
            )
        tokens = tokens.select(kept_by_mask(Ragged(mask.host, mask.offsets), mask_name, names))
    return tokens


def _reference(batch: Batch, expected: tuple[str, ...], owner: str) -> dict[str, np.ndarray]:
    """The sides' reference log-probs (all of ``expected`` or none) as float32 ``ref_logps``."""
    found: dict[str, np.ndarray] = {}
    ones = np.ones(batch.rows, dtype=np.int64)
    for name in expected:
        if name in batch:
            spec = FloatField(name, align="sequence")
            values = read_floats(batch.per_row(name, "values"), ones, spec, batch.names)
            found[name] = np.stack(cast(list[np.ndarray], values)).astype(np.float32).reshape(-1)
    if found and len(found) < len(expected):
        given = next(iter(found))
        other = next(name for name in expected if name not in found)
        raise ValueError(
            f"{owner}: the examples carry {shown(given)} but not {shown(other)}; give both, or neither"
        )
    return {REF_LOGPS: np.concatenate([found[name] for name in expected])} if found else {}


def _sequences(
    sides: list[tuple[Ragged, Ragged]], roles: tuple[str, ...], values: dict[str, np.ndarray]
) -> Forest:
    """The sequences ``prompt + response`` of every side, role-major, with the per-sequence ``values``."""
    tokens, trained = [], []
    for prompts, responses in sides:
        for example in range(prompts.rows):
            prompt, response = np.asarray(prompts.row(example)), np.asarray(responses.row(example))
            tokens.append(np.concatenate([prompt, response]))
            trained.append(np.repeat([False, True], [prompt.size, response.size]))
    lengths = np.array([row.size for row in tokens], dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    examples = sides[0][0].rows
    return Forest.chains(
        Ragged(np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64), offsets),
        Ragged(np.concatenate(trained).astype(bool) if trained else np.zeros(0, bool), offsets),
        per_sequence=values,
        source=np.tile(np.arange(examples, dtype=np.int64), len(sides)),
        roles=roles,
    )


def _kept(field: Ragged, counts: np.ndarray, from_end: bool) -> Ragged:
    """Each row's first (or, ``from_end``, last) ``counts[row]`` values."""
    if bool((counts >= field.lengths).all()):
        return field
    place = places(field.offsets)
    if from_end:
        return field.select(place >= np.repeat(field.lengths - counts, field.lengths))
    return field.select(place < np.repeat(counts, field.lengths))


def _prompt_lengths(supervised: Ragged) -> np.ndarray:
    """``[S]``: each sequence's tokens before its first supervised one (all where none is)."""
    offsets = supervised.offsets
    prompt = np.diff(offsets).astype(np.int64)
    trained = np.flatnonzero(np.asarray(supervised.values))
    if trained.size:
        rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))[trained]
        np.minimum.at(prompt, rows, places(offsets)[trained])
    return prompt


# -- reward pairs ------------------------------------------------------------------------------------


def read_reward_pairs(batch: Batch, owner: str, max_length: int | None) -> Forest:
    """A reward model's pairs as a forest: each side's whole sequence, every chosen one first."""
    names = batch.names
    refuse_media(batch, owner)
    _check_pairs(batch, "chosen_ids, rejected_ids")
    for name in _DPO_ONLY:
        if name in batch:
            index = int(np.flatnonzero(batch.carried(name))[0])
            raise ValueError(
                f"{names(index)}: carries {shown(name)}, a field of DPO pairs; a reward pair is "
                "chosen_ids and rejected_ids (each the whole sequence, prompt inside) and an optional "
                f"margin: drop {shown(name)}, or collate DPO pairs with Collator.for_preference"
            )
    prompt_given = PROMPT_IDS in batch or PROMPT_INPUT_IDS in batch
    if _OPENRLHF_REJECTED in batch:
        index = int(np.flatnonzero(batch.carried(_OPENRLHF_REJECTED))[0])
        trl = (PROMPT_IDS, PROMPT_INPUT_IDS, MARGIN, REJECTED_IDS, REJECTED_INPUT_IDS)
        other = next((name for name in trl if name in batch), None)
        if prompt_given or other is not None:
            raise ValueError(
                f"{names(index)}: carries {shown(_OPENRLHF_REJECTED)} (OpenRLHF's reward pairs: chosen_ids "
                f"and reject_ids, whole sequences, extra = the margin) beside {shown(other)} (TRL's format); "
                "give one format"
            )
        chosen = _side(batch, "chosen", CHOSEN_IDS, CHOSEN_IDS, CHOSEN_ATTENTION_MASK, "c_mask")
        rejected = _side(
            batch, "rejected", _OPENRLHF_REJECTED, _OPENRLHF_REJECTED, "reject_attention_mask", "r_mask"
        )
        margin = _margins(batch, "extra") if "extra" in batch else None
    else:
        chosen = _side(batch, "chosen", CHOSEN_IDS, CHOSEN_INPUT_IDS, CHOSEN_ATTENTION_MASK)
        rejected = _side(batch, "rejected", REJECTED_IDS, REJECTED_INPUT_IDS, REJECTED_ATTENTION_MASK)
        margin = _margins(batch, MARGIN) if MARGIN in batch else None
    sides = (
        ("chosen", (CHOSEN_IDS, CHOSEN_INPUT_IDS), chosen),
        ("rejected", (REJECTED_IDS, REJECTED_INPUT_IDS, _OPENRLHF_REJECTED), rejected),
    )
    for side, spellings, tokens in sides:
        name = next((spelling for spelling in spellings if spelling in batch), spellings[0])  # as given
        empty = np.flatnonzero(tokens.lengths == 0)
        if empty.size:
            raise ValueError(
                f"{names(int(empty[0]))}: its {side} side ({shown(name)}) holds no tokens (once its padding "
                "is dropped), so the reward model has no token to score; drop such pairs"
            )
    if prompt_given:
        prompts = _side(batch, "prompt", PROMPT_IDS, PROMPT_INPUT_IDS, PROMPT_ATTENTION_MASK)
    else:
        prompts = Ragged(np.zeros(0, dtype=np.int64), np.zeros(batch.rows + 1, dtype=np.int64))
    if max_length is not None:
        for side, tokens in (("chosen", chosen), ("rejected", rejected)):
            total = prompts.lengths + tokens.lengths
            over = np.flatnonzero(total > max_length)
            if over.size:
                index = int(over[0])
                raise ValueError(
                    f"{names(index)}: its {side} sequence has {int(total[index])} tokens, more "
                    f"than max_length={max_length}; cut, a sequence would be scored at another token: drop "
                    "such pairs (RewardTrainer does when it prepares the dataset) or raise max_length"
                )
    values = {} if margin is None else {MARGIN: np.tile(margin, 2)}
    return _sequences([(prompts, chosen), (prompts, rejected)], PAIR_ROLES, values)


def _margins(batch: Batch, name: str) -> np.ndarray:
    """float32 ``[P]``: each pair's margin, one finite real number, in every pair."""
    names = batch.names
    lacking = batch.lacking(name)
    if lacking is not None:
        raise ValueError(
            f"{names(lacking)}: lacks {shown(name)}, which other pairs of the batch carry; give every pair a "
            "margin (0.0 for none), or none"
        )
    values = []
    for row, value in enumerate(batch.objects(name)):
        array = as_numpy(value) if isinstance(value, torch.Tensor) else None
        number = scalar(value)
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            kind = "a tensor of shape " + str(tuple(array.shape)) if array is not None else shown(value)
            sized = isinstance(value, (list, tuple, np.ndarray))
            raise (ValueError if array is not None or sized else TypeError)(
                f"{names(row)}: {shown(name)} is {kind}, but a pair's margin is one real number (how "
                "much the chosen side should outscore the rejected one); give a float"
            )
        if not np.isfinite(float(number)):
            raise ValueError(
                f"{names(row)}: {shown(name)} is {float(number)}, but a margin must be finite (it shifts the "
                "loss: NaN or inf would make it NaN or constant); fix or drop the pair"
            )
        if abs(float(number)) > float(np.finfo(np.float32).max):
            raise ValueError(
                f"{names(row)}: {shown(name)} is {float(number)}, beyond float32 (the margins' dtype: it "
                "would be inf, making the loss constant); give a margin within +-3.4e38"
            )
        values.append(float(number))
    return np.array(values, dtype=np.float32)


# -- rollouts ----------------------------------------------------------------------------------------


def read_rollouts(batch: Batch, spec: ExampleSpec) -> Forest:
    """One rollout per example as a forest of one-node trees: its tokens, what is trained, its values."""
    read = read_examples(batch, spec)
    fields, names = read.fields, batch.names
    tokens = fields[INPUT_IDS]
    if TOKEN_TYPE_IDS in fields:
        where = names(int(np.flatnonzero(batch.carried(TOKEN_TYPE_IDS))[0]))
        raise ValueError(
            f"{spec.owner}: {where} carries 'token_type_ids'; a rollout is one sequence (prompt and "
            "completion) for a causal LM: drop the field"
        )
    if read.segments is not None:
        raise ValueError(
            f"{spec.owner}: the examples carry 'seq_lengths' (several documents packed in one example); give "
            "one rollout per example, which this collator packs itself (padding_free=True)"
        )
    if not any(name in fields or name in batch for name in _ROLLOUT_SUPERVISION):
        raise ValueError(
            f"{spec.owner}: the examples carry none of {', '.join(_ROLLOUT_SUPERVISION)}, so nothing says "
            "which tokens are the completion; give a completion_mask (1 on completion tokens)"
        )
    supervised = supervision(fields, names)
    if RESPONSE_MASK in batch:  # verl's: the row's last tokens, with every other supervision given
        response = batch.get(RESPONSE_MASK, "values")
        assert response is not None
        check_zero_one(response, RESPONSE_MASK, names, "1 on the response tokens that are trained")
        placed = response_aligned(response, tokens.lengths, RESPONSE_MASK, names)
        supervised = Ragged(np.asarray(supervised.values) & (placed.host != 0), tokens.offsets)
    floats = {field.name: fields[field.name] for field in spec.floats if field.per_token}
    fills = {  # a response-aligned field's fill before the response, numbered where it is laid out
        field.name: Ragged(
            places(tokens.offsets)
            < np.repeat(tokens.lengths - [row.shape[0] for row in value_rows(batch, field)], tokens.lengths),
            tokens.offsets,
        )
        for field in spec.floats
        if field.align == "response" and isinstance(field.fill, Spread)
    }
    positions = fields.get(POSITION_IDS)
    if "attention_mask" in fields:
        keep = kept_by_mask(fields["attention_mask"], "attention_mask", names)
        if not keep.all():
            tokens, supervised = tokens.select(keep), supervised.select(keep)
            floats = {name: values.select(keep) for name, values in floats.items()}
            fills = {name: values.select(keep) for name, values in fills.items()}
            positions = None if positions is None else positions.select(keep)
    if positions is not None:  # one sequence each (verl writes them so): they say nothing more
        wrong = np.flatnonzero(row_any(positions.host != places(positions.offsets), positions.offsets))
        if wrong.size:
            raise ValueError(
                f"{names(int(wrong[0]))}: its positions ('position_ids' or 'positions') do not count its "
                "tokens from 0 (padding dropped): several documents packed in one example; a rollout is one "
                "sequence (prompt and completion): give one rollout per example, which this collator packs "
                "itself (padding_free=True), or drop the field"
            )
    starts = places(tokens.offsets) == 0
    for field in spec.floats:
        if field.align == "label":  # moved to the token each prediction is scored against
            floats[field.name] = to_label_positions(floats[field.name], starts, field.fill)
            if isinstance(field.fill, Spread):
                fills[field.name] = Ragged(starts, tokens.offsets)
    return Forest.chains(
        tokens,
        Ragged(np.asarray(supervised.values, dtype=bool), tokens.offsets),
        floats,
        {name: np.stack(values) for name, values in read.per_sequence.items()},
        fills=fills,
    )


# -- trajectories and trees --------------------------------------------------------------------------

NODE_ID, PARENT_ID = "node_id", "parent_id"
"""An explicit tree's fields: each example is a node, ``parent_id`` its parent's ``node_id`` (or -1)."""


def read_trajectories(batch: Batch, spec: ExampleSpec, group_key: str) -> Forest:
    """Trajectories (``input_ids`` flat or a list of turns) as whole sequences, grouped by ``group_key``."""
    not_per_token = {RESPONSE_MASK, *(field.name for field in spec.floats if field.align == "response")}
    batch = _turns_joined(batch, spec.owner, not_per_token)
    forest = read_rollouts(batch, spec)
    if group_key not in batch:
        return forest
    lacking = batch.lacking(group_key)
    if lacking is not None:
        carrier = int(np.flatnonzero(batch.carried(group_key))[0])
        raise ValueError(
            f"{batch.names(lacking)}: lacks {shown(group_key)}, which {batch.names(carrier)} carries: give "
            f"every trajectory its group (the trajectories whose prefixes are shared), or none (one group)"
        )
    keys: dict[int | str, int] = {}
    groups = []
    for row, value in enumerate(batch.objects(group_key)):
        groups.append(keys.setdefault(group_id(value, batch.names(row), group_key), len(keys)))
    forest.groups = np.array(groups, dtype=np.int64)
    return forest


def _turns_joined(batch: Batch, owner: str, not_per_token: set[str]) -> Batch:
    """``batch`` with every trajectory given as turns joined, field by field (``not_per_token``: the fields
    of the row's last tokens, verl's, never one value per turn)."""
    payloads = batch.payloads
    if not payloads:
        return batch
    joined: list[Any] = []
    changed = False
    for index, payload in enumerate(payloads):
        turns = payload.get(INPUT_IDS) if hasattr(payload, "get") else None
        if not isinstance(turns, (list, tuple)) or not turns or not _sized(turns[0]):
            joined.append(payload)
            continue
        changed = True
        where = batch.names(index)
        rows = []
        for place, turn in enumerate(turns):  # each turn a row of ids, checked as a flat row is
            if not _sized(turn):
                raise TypeError(
                    f"{where}: 'input_ids' given as turns holds {type(turn).__name__} at turn {place}; give "
                    "every turn as a list of token ids, or the trajectory as one flat list"
                )
            row = as_numpy(to_row(turn, f"{where}, turn {place}", INPUT_IDS, "ids"))
            if row.ndim != 1:
                raise ValueError(
                    f"{where}, turn {place}: field 'input_ids' must be 1-D (one id per token), got shape "
                    f"{tuple(row.shape)}"
                )
            rows.append(row)
        sizes = [row.size for row in rows]
        out = dict(payload)
        for name, value in payload.items():
            if not isinstance(value, (list, tuple)) or len(value) != len(sizes) or name == INPUT_IDS:
                continue
            if all(_sized(part) for part in value):
                if [len(part) for part in value] != sizes:
                    raise ValueError(
                        f"{batch.names(index)}: {shown(name)} holds turns of {[len(part) for part in value]} "
                        f"values for turns of {sizes} tokens; give one value per token, turn by turn (or one "
                        "value per turn)"
                    )
                try:
                    out[name] = [item for part in value for item in np.asarray(part).tolist()]
                except ValueError:  # a ragged turn: NumPy cannot make it one row of values
                    raise ValueError(
                        f"{batch.names(index)}: {shown(name)} holds a turn that is not a flat row of "
                        "values; give one value per token, turn by turn"
                    ) from None
            elif name not in not_per_token and all(
                isinstance(part, (numbers.Number, np.generic)) for part in value
            ):
                if sum(sizes) == len(sizes) and sizes != [1] * len(sizes):  # as many tokens as turns
                    raise ValueError(
                        f"{batch.names(index)}: {shown(name)} holds {len(sizes)} values for turns of {sizes} "
                        "tokens, as many as the turns and as the tokens: one per turn or one per token? Give "
                        "them turn by turn (a list per turn), or drop the empty turns"
                    )
                out[name] = [part for part, size in zip(value, sizes, strict=True) for _ in range(size)]
        out[INPUT_IDS] = np.concatenate(rows)
        joined.append(out)
    if not changed:
        return batch
    from zephon_collate.read.rows import examples_of

    return examples_of(joined, owner)


def _sized(value: object) -> bool:
    """A list, tuple or array of at least one dimension (a 0-d tensor is one value)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.ndim >= 1
    return isinstance(value, (list, tuple))


def read_trees(batch: Batch, spec: ExampleSpec) -> Forest:
    """Explicit trees, one node per example (``node_id``, ``parent_id``), each leaf a sequence."""
    names = batch.names
    for field in spec.floats:
        if field.align in ("label", "response"):
            raise ValueError(
                f"{spec.owner}: float field {shown(field.name)} is {field.align}-aligned; in a tree a node's "
                "last token predicts one token per child, so give its values per token (align='token': the "
                "token a prediction scores) or per sequence (align='sequence', on the leaves)"
            )
    for name in (NODE_ID, PARENT_ID):
        lacking = batch.lacking(name)
        if lacking is not None:
            raise ValueError(
                f"{names(lacking)}: lacks {shown(name)}; a tree is given node by node, each with its "
                f"{NODE_ID} and its {PARENT_ID} (-1 for a root)"
            )
    # a value per sequence (broadcast or not) is given on the leaves, where the sequences end
    per_node = dataclasses.replace(
        spec, floats=tuple(field for field in spec.floats if field.align != "sequence")
    )
    chains = read_rollouts(batch, per_node)
    ids = [_node_id(value, row, NODE_ID, names) for row, value in enumerate(batch.objects(NODE_ID))]
    row_of_id: dict[int, int] = {}
    for row, node in enumerate(ids):
        if node == -1:  # the parent of a root: as a node's own id, its children would be roots
            raise ValueError(
                f"{names(row)}: {NODE_ID} is -1, which marks a root's {PARENT_ID}; give each node another id"
            )
        if node in row_of_id:
            raise ValueError(
                f"{names(row)}: {NODE_ID} {node} is {names(row_of_id[node])}'s too; give each node its own"
            )
        row_of_id[node] = row
    parents = []
    for row, value in enumerate(batch.objects(PARENT_ID)):
        parent = -1 if value is None else _node_id(value, row, PARENT_ID, names)
        if parent != -1 and parent not in row_of_id:
            raise ValueError(
                f"{names(row)}: {PARENT_ID} {parent} is no node of the batch; give each node's parent in the "
                "same batch (-1 for a root)"
            )
        parents.append(-1 if parent == -1 else row_of_id[parent])
    empty = np.flatnonzero(chains.tokens.lengths == 0)
    if empty.size:
        raise ValueError(f"{names(int(empty[0]))}: is a node without tokens; give each node its tokens")
    children: list[list[int]] = [[] for _ in ids]
    roots: list[int] = []
    for row, parent in enumerate(parents):
        (roots if parent < 0 else children[parent]).append(row)
    order: list[int] = []
    stack = list(reversed(roots))
    while stack:
        row = stack.pop()
        order.append(row)
        stack.extend(reversed(children[row]))
    if len(order) != len(ids):
        row = min(set(range(len(ids))) - set(order))
        raise ValueError(
            f"{names(row)}: its {PARENT_ID}s go round in a cycle; a tree's parents end at a root"
        )
    rank = np.empty(len(order), dtype=np.int64)
    rank[np.array(order, dtype=np.int64)] = np.arange(len(order))
    leaves = [row for row in range(len(ids)) if not children[row]]
    sequence_of = np.array(leaves, dtype=np.int64)
    take = rows_taker(chains.tokens, np.array(order, dtype=np.int64))
    parent_rank = np.array([rank[parents[row]] if parents[row] >= 0 else -1 for row in order], dtype=np.int64)
    per_sequence = {}
    for field in [f for f in spec.floats if f.align == "sequence"]:  # one value per sequence: on the leaves
        values = batch.objects(field.name) if field.name in batch else [None] * batch.rows
        inner = next((row for row in range(len(ids)) if children[row] and _given(values[row])), None)
        if inner is not None:  # a value nothing would read: refused, never dropped
            raise ValueError(
                f"{names(inner)}: gives {shown(field.name)}, one value per sequence, on a node with "
                "children; a sequence ends at a leaf: give it on the leaves only"
            )
        rows = []
        for leaf in leaves:
            if values[leaf] is None:
                raise ValueError(
                    f"{names(leaf)}: a leaf (a sequence's end) lacks {shown(field.name)}, one value per "
                    "sequence; give it on every leaf"
                )
            rows.append(to_row(values[leaf], names(leaf), field.name, "values"))
        one = dataclasses.replace(field, broadcast=False)  # one value each; the layout broadcasts it
        read = read_floats(rows, np.ones(len(rows), np.int64), one, lambda i: names(leaves[i]))
        per_sequence[field.name] = np.stack(cast(list[np.ndarray], read)) if rows else np.zeros(0)
    return Forest(
        take(chains.tokens),
        take(chains.trained),
        parent_rank,
        rank[sequence_of] if leaves else np.zeros(0, dtype=np.int64),
        {name: take(field) for name, field in chains.values.items()},
        per_sequence,
        sequence_of,
    )


def _given(value: object) -> bool:
    """A value given (not ``None``, nor the NaN a table writes for a missing one)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _node_id(value: object, row: int, name: str, names: Names) -> int:
    """A node id: an int (a NumPy or 0-d tensor integer too)."""
    number = scalar(value)
    if isinstance(number, bool) or not isinstance(number, int):
        raise TypeError(f"{names(row)}: {shown(name)} is {shown(value)}; a node id is an int")
    return number
