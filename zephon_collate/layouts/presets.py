"""The post-training presets' options, each a ``TreeOptions`` with its read adapter and its outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from zephon_collate.core.checks import check_bool, check_int
from zephon_collate.core.keys import (
    ASSISTANT_MASK,
    ASSISTANT_MASKS,
    ATTENTION_MASK,
    CHOSEN_IDS,
    CHOSEN_INPUT_IDS,
    COMPLETION_IDS,
    COMPLETION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    INPUT_IDS,
    INT32_MAX,
    LABEL,
    LABELS,
    LAST_TOKEN_INDEX,
    LOSS_MASK,
    MARGIN,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
    REF_CHOSEN_LOGPS,
    REF_KL_LOGPS,
    REF_LOGPS,
    REF_REJECTED_LOGPS,
    RESPONSE_MASK,
    SEQ_IDX,
    SEQUENCE_INDEX,
)
from zephon_collate.core.text import shown
from zephon_collate.layouts.trees import Sharing, TreeOptions
from zephon_collate.read.columns import Batch
from zephon_collate.read.examples import ExampleSpec
from zephon_collate.read.fields import TensorField
from zephon_collate.read.forest import Forest
from zephon_collate.read.formats import (
    PARENT_ID,
    Cut,
    read_pairs,
    read_reward_pairs,
    read_rollouts,
    read_trajectories,
    read_trees,
)

__all__ = ["PreferenceOptions", "RewardOptions", "RolloutOptions", "TrajectoryOptions"]

_ROLLOUT_SUPERVISION = (COMPLETION_MASK, LOSS_MASK, ASSISTANT_MASKS, ASSISTANT_MASK, LABELS, RESPONSE_MASK)


@dataclass(frozen=True, kw_only=True)
class PreferenceOptions(TreeOptions):
    """The options of :meth:`Collator.for_preference <zephon_collate.Collator.for_preference>`.

    Parameters:
        tokenizer, pad_token_id, pad_to_multiple_of, return_flash_attn_kwargs, return_seq_idx: as TreeOptions.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        shared_prompt: lay each pair out as its prompt once, then both responses.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared prompt).
        max_prompt_length: cut each prompt to its last this many tokens.
        max_completion_length: cut each response to its first this many tokens.
        max_length: cut each sequence (prompt + response) to this many tokens, as TRL's collator does.
        truncation_mode: ``"keep_start"`` (TRL's default) or ``"keep_end"``.
    """

    OWNER: ClassVar[str] = "Collator.for_preference"
    ITEM: ClassVar[str] = "pair"
    KEY: ClassVar[tuple[str, ...]] = (CHOSEN_INPUT_IDS, CHOSEN_IDS, COMPLETION_IDS)
    OWN: ClassVar[tuple[str, ...]] = (
        "shared_prompt", "tokenizer", "max_prompt_length", "max_completion_length", "max_length",
        "truncation_mode",
    )  # fmt: skip
    ROLE_VALUES: ClassVar[Mapping[str, Mapping[str, str]]] = {
        REF_LOGPS: {
            "chosen": REF_CHOSEN_LOGPS, "rejected": REF_REJECTED_LOGPS,
            "completion": REF_LOGPS, "KL": REF_KL_LOGPS,
        },
        LABEL: {"completion": LABEL},
    }  # fmt: skip
    shared_prompt: bool = False
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    max_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def __post_init__(self) -> None:
        shared = check_bool("shared_prompt", self.shared_prompt, owner=self.OWNER)
        object.__setattr__(self, "shared_prompt", shared)
        for name in ("max_prompt_length", "max_completion_length", "max_length"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(self.OWNER, name, value, 1, INT32_MAX))
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(
                f"{self.OWNER}: truncation_mode must be 'keep_start' or 'keep_end', got "
                f"{shown(self.truncation_mode)}"
            )
        if self.shared_prompt and self.max_length is not None and self.truncation_mode == "keep_end":
            raise ValueError(
                f"{self.OWNER}: shared_prompt=True with max_length and truncation_mode='keep_end' would keep "
                "a different part of the prompt for each response (the longer one keeps less), so the prompt "
                "could not be shared; use truncation_mode='keep_start', max_prompt_length, or "
                "shared_prompt=False"
            )
        super().__post_init__()

    @property
    def sharing(self) -> Sharing:
        return "prompt" if self.shared_prompt else "none"

    def read(self, batch: Batch) -> Forest:
        lengths = (self.max_prompt_length, self.max_completion_length, self.max_length)
        return read_pairs(batch, Cut(self.OWNER, *lengths, self.truncation_mode))


@dataclass(frozen=True, kw_only=True)
class RewardOptions(TreeOptions):
    """The options of :meth:`Collator.for_rewards <zephon_collate.Collator.for_rewards>`.

    Parameters:
        tokenizer, pad_token_id, pad_to_multiple_of, return_flash_attn_kwargs, return_seq_idx: as TreeOptions.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        return_position_ids: emit ``position_ids`` (default: padding-free only).
        max_length: refuse a pair with a sequence longer than this (``RewardTrainer`` drops such pairs).
        last_token_skip_id: score each sequence's last token whose id is not this (``config.pad_token_id``).
    """

    OWNER: ClassVar[str] = "Collator.for_rewards"
    ITEM: ClassVar[str] = "pair"
    KEY: ClassVar[tuple[str, ...]] = (CHOSEN_IDS, CHOSEN_INPUT_IDS)
    OWN: ClassVar[tuple[str, ...]] = ("shared_prompt", "tokenizer", "max_length", "last_token_skip_id")
    LABELLED: ClassVar[bool] = False
    MAP: ClassVar[tuple[str, ...]] = (SEQUENCE_INDEX,)
    COUNT: ClassVar[bool] = False
    ROLE_VALUES: ClassVar[Mapping[str, Mapping[str, str]]] = {MARGIN: {"chosen": MARGIN}}
    ORDER: ClassVar[tuple[str | None, ...]] = (
        INPUT_IDS, ATTENTION_MASK, POSITION_IDS, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K,
        SEQ_IDX, MARGIN, LAST_TOKEN_INDEX,
    )  # fmt: skip
    INTERNAL: ClassVar[frozenset[str]] = frozenset(
        {PADDING_LENGTH, POSITIONS, LOSS_MASK, PADDING_MASK, SEQUENCE_INDEX}
    )
    shared_prompt: bool = False
    max_length: int | None = None
    last_token_skip_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_length is not None:
            length = check_int(self.OWNER, "max_length", self.max_length, 1, INT32_MAX)
            object.__setattr__(self, "max_length", length)
        if self.last_token_skip_id is not None:
            skip = check_int(self.OWNER, "last_token_skip_id", self.last_token_skip_id, 0)
            object.__setattr__(self, "last_token_skip_id", skip)
        if self.shared_prompt is not False:
            raise ValueError(
                f"{self.OWNER}: shared_prompt is not offered for reward pairs: a reward model scores each "
                "sequence whole (TRL's RewardTrainer calls model(**batch)); drop shared_prompt, or use "
                "Collator.for_preference(shared_prompt=True) for DPO pairs"
            )
        super().__post_init__()

    def read(self, batch: Batch) -> Forest:
        return read_reward_pairs(batch, self.OWNER, self.max_length)

    @property
    def score_skip_id(self) -> int | Literal[False] | None:
        return self.last_token_skip_id


@dataclass(frozen=True, kw_only=True)
class RolloutOptions(TreeOptions):
    """The options of :meth:`Collator.for_rollouts <zephon_collate.Collator.for_rollouts>`.

    Parameters:
        tokenizer, pad_token_id, pad_to_multiple_of, return_flash_attn_kwargs, return_seq_idx: as TreeOptions.
        padding_free: one row ``[1, N]`` with ``position_ids`` instead of padded rows.
        shared_prompt: lay consecutive rollouts of one prompt out as the prompt once, then each completion.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared prompt).
        supervision: the field marking the completion, required in every example (``None``: any such field).
        float_fields: float example fields (names or :class:`~zephon_collate.FloatField` specs).
    """

    OWNER: ClassVar[str] = "Collator.for_rollouts"
    ITEM: ClassVar[str] = "rollout"
    OWN: ClassVar[tuple[str, ...]] = ("shared_prompt", "tokenizer")
    shared_prompt: bool = False
    supervision: str | None = None
    float_fields: Sequence[str | TensorField] = ()

    def __post_init__(self) -> None:
        shared = check_bool("shared_prompt", self.shared_prompt, owner=self.OWNER)
        object.__setattr__(self, "shared_prompt", shared)
        if self.supervision is not None and self.supervision not in _ROLLOUT_SUPERVISION:
            raise ValueError(
                f"{self.OWNER}: supervision must name the field that marks the completion, one of "
                f"{_ROLLOUT_SUPERVISION}, got {shown(self.supervision)}"
            )
        super().__post_init__()
        object.__setattr__(self, "float_fields", self.transformers().floats)

    @property
    def sharing(self) -> Sharing:
        return "prompt" if self.shared_prompt else "none"

    @property
    def floats(self) -> tuple[TensorField, ...]:
        return tuple(field for field in self.float_fields if isinstance(field, TensorField))

    def read(self, batch: Batch) -> Forest:
        spec = ExampleSpec(self.OWNER, self.floats, self.supervision, response_mask=True, uniform=True)
        return read_rollouts(batch, spec)


@dataclass(frozen=True, kw_only=True)
class TrajectoryOptions(TreeOptions):
    """The options of :meth:`Collator.for_trees <zephon_collate.Collator.for_trees>`.

    Parameters:
        tokenizer, pad_token_id, pad_to_multiple_of: as :class:`TreeOptions`.
        padding_free: the trees end to end in one row ``[1, N]`` (the default), or a padded row each.
        return_position_ids: emit ``position_ids`` (default: padding-free or shared; padded paths apart: no).
        return_flash_attn_kwargs, return_seq_idx: emit the varlen keys (``share="none"`` only).
        share: share prefixes within each group (``"group"``), across the batch (``"batch"``), or not.
        group_key: the example field naming each trajectory's group.
        copy_openers: give each branch a copy of its parent's last token (each place predicts one token).
        max_row_tokens, oversized: as :class:`TreeOptions`.
        supervision: the field that marks the trained tokens, or ``None``: every such field given applies.
        float_fields: value fields (names or ``FloatField`` specs), per token or per sequence.
    """

    OWNER: ClassVar[str] = "Collator.for_trees"
    ITEM: ClassVar[str] = "trajectory"
    OWN: ClassVar[tuple[str, ...]] = ("tokenizer", "share", "group_key", "copy_openers")
    padding_free: bool = True
    share: Literal["group", "batch", "none"] = "group"
    group_key: str = "group"
    copy_openers: bool = False
    supervision: str | None = None
    float_fields: Sequence[str | TensorField] = ()

    def __post_init__(self) -> None:
        if self.share not in ("group", "batch", "none"):
            raise ValueError(
                f"{self.OWNER}: share must be 'group', 'batch' or 'none', got {shown(self.share)}"
            )
        if not isinstance(self.group_key, str) or not self.group_key:
            raise TypeError(f"{self.OWNER}: group_key must be a field name, got {shown(self.group_key)}")
        copied = check_bool("copy_openers", self.copy_openers, owner=self.OWNER)
        object.__setattr__(self, "copy_openers", copied)
        if self.supervision is not None and self.supervision not in _ROLLOUT_SUPERVISION:
            raise ValueError(
                f"{self.OWNER}: supervision must name the field that marks the trained tokens, one of "
                f"{_ROLLOUT_SUPERVISION}, got {shown(self.supervision)}"
            )
        super().__post_init__()
        object.__setattr__(self, "float_fields", self.transformers().floats)
        broadcast = next((field.name for field in self.floats if field.broadcast), None)
        if broadcast is not None and self.share != "none":
            raise ValueError(
                f"{self.OWNER}: float field {shown(broadcast)} is broadcast to its sequence's tokens, but a "
                "tree's tokens (trained ones too) belong to several sequences, which one value per token "
                f"cannot hold: declare FloatField({broadcast!r}, 'sequence') and spread it over every path's "
                "tokens with along_paths(batch[name], batch)"
            )

    @property
    def sharing(self) -> Sharing:
        return "none" if self.share == "none" else "prefix"

    @property
    def shared_by(self) -> str:
        return f"share={self.share!r}"

    @property
    def within_groups(self) -> bool:
        return self.share == "group"

    @property
    def tree_outputs(self) -> bool:
        return True

    @property
    def copied_openers(self) -> bool:
        return self.copy_openers

    @property
    def floats(self) -> tuple[TensorField, ...]:
        return tuple(field for field in self.float_fields if isinstance(field, TensorField))

    def read(self, batch: Batch) -> Forest:
        spec = ExampleSpec(self.OWNER, self.floats, self.supervision, response_mask=True, uniform=True)
        if PARENT_ID in batch:
            return read_trees(batch, spec)
        return read_trajectories(batch, spec, self.group_key)
