"""Field names and limits: the one home for the names the package reads and writes."""

from __future__ import annotations

__all__ = [
    "ACTION_MASK",
    "ASSISTANT_MASK",
    "ASSISTANT_MASKS",
    "ATTENTION_MASK",
    "BRANCH_IDS",
    "CHOSEN_ATTENTION_MASK",
    "CHOSEN_IDS",
    "CHOSEN_INDEX",
    "CHOSEN_INPUT_IDS",
    "COMPLETION_IDS",
    "COMPLETION_INDEX",
    "COMPLETION_MASK",
    "CU_SEQLENS",
    "CU_SEQ_LENS_K",
    "CU_SEQ_LENS_Q",
    "DOCUMENT_IDS",
    "EXAMPLE_LENGTHS",
    "IDS",
    "IGNORE_INDEX",
    "INPUT_IDS",
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "KL_COMPLETION_IDS",
    "KL_INDEX",
    "LABEL",
    "LABELS",
    "LABEL_IDS",
    "LAST_TOKEN_INDEX",
    "LOGITS_INDEX",
    "LOSS_MASK",
    "MARGIN",
    "MAX_LENGTH_K",
    "MAX_LENGTH_Q",
    "MAX_PAD_MULTIPLE",
    "MAX_SEQLEN",
    "MEDIA",
    "MM_TOKEN_TYPE_IDS",
    "NUM_SEQUENCES",
    "NUM_VALID_TOKENS",
    "PADDING_LENGTH",
    "PADDING_MASK",
    "PATH_INDEX",
    "PATH_OFFSETS",
    "POSITIONS",
    "POSITION_IDS",
    "PROMPT_ATTENTION_MASK",
    "PROMPT_IDS",
    "PROMPT_INPUT_IDS",
    "PROMPT_MASK",
    "RAW_MEDIA",
    "REF_CHOSEN_LOGPS",
    "REF_KL_LOGPS",
    "REF_LOGPS",
    "REF_REJECTED_LOGPS",
    "REJECTED_ATTENTION_MASK",
    "REJECTED_IDS",
    "REJECTED_INDEX",
    "REJECTED_INPUT_IDS",
    "RESPONSE_MASK",
    "SEGMENT_IDS",
    "SEQUENCE_INDEX",
    "SEQ_IDX",
    "SEQ_LENGTHS",
    "SHIFT_LABELS",
    "SUBTREE_END",
    "SUPERVISION_MASKS",
    "TEXT",
    "TEXTS",
    "TOKEN_FIELD_CANDIDATES",
    "TOKEN_TYPE_IDS",
    "TOOL_MASKS",
]

INPUT_IDS = "input_ids"
"""The stacked token rows (the token field, whatever its payload name)."""
ATTENTION_MASK = "attention_mask"
LABELS = "labels"
POSITIONS = "positions"
LOSS_MASK = "loss_mask"
PADDING_MASK = "padding_mask"
PADDING_LENGTH = "padding_length"
"""``[B]`` trailing pad counts (each record's ``meta.padding_length``) in a stacked batch."""
NUM_VALID_TOKENS = "num_valid_tokens"
CU_SEQLENS = "cu_seqlens"
MAX_SEQLEN = "max_seqlen"
SEGMENT_IDS = "segment_ids"
IDS = "ids"
TEXTS = "texts"
TEXT = "text"

# Hugging Face ``transformers`` names (Collator.for_transformers reads and writes them).
POSITION_IDS = "position_ids"
ASSISTANT_MASKS = "assistant_masks"
ASSISTANT_MASK = "assistant_mask"
COMPLETION_MASK = "completion_mask"
RESPONSE_MASK = "response_mask"
"""verl's 1 on response tokens: response-aligned (the row's last ``len(response_mask)`` tokens)."""
CU_SEQ_LENS_Q, CU_SEQ_LENS_K = "cu_seq_lens_q", "cu_seq_lens_k"
MAX_LENGTH_Q, MAX_LENGTH_K = "max_length_q", "max_length_k"
SEQ_IDX = "seq_idx"
SEQ_LENGTHS = "seq_lengths"
TOKEN_TYPE_IDS = "token_type_ids"

# Post-training: preference pairs (TRL's names, both spellings) and the sequence map of a batch.
PROMPT_INPUT_IDS, CHOSEN_INPUT_IDS, REJECTED_INPUT_IDS = (
    "prompt_input_ids",
    "chosen_input_ids",
    "rejected_input_ids",
)
PROMPT_IDS, CHOSEN_IDS, REJECTED_IDS = "prompt_ids", "chosen_ids", "rejected_ids"
PROMPT_ATTENTION_MASK = "prompt_attention_mask"
CHOSEN_ATTENTION_MASK = "chosen_attention_mask"
REJECTED_ATTENTION_MASK = "rejected_attention_mask"
REF_CHOSEN_LOGPS, REF_REJECTED_LOGPS = "ref_chosen_logps", "ref_rejected_logps"
CHOSEN_INDEX, REJECTED_INDEX = "chosen_index", "rejected_index"
"""``[num_pairs]`` int64: the sequence index of each pair's chosen and rejected side."""
COMPLETION_IDS, KL_COMPLETION_IDS = "completion_ids", "KL_completion_ids"
"""An unpaired (KTO) example's completion, and its KL term's mismatched completion, as TRL tokenizes them."""
LABEL = "label"
"""TRL's KTO flag, one bool per example: True where the completion is desirable (not ``labels``)."""
REF_LOGPS, REF_KL_LOGPS = "ref_logps", "ref_KL_logps"
"""Precomputed reference log-probs of a KTO example's completion and of its KL completion (TRL's names)."""
COMPLETION_INDEX, KL_INDEX = "completion_index", "KL_index"
"""``[num_examples]`` int64: the sequence index of each KTO example's completion and of its KL completion."""
DOCUMENT_IDS = "document_ids"
"""``[B, S]`` int32: a token's document (a sequence, or a prompt and its responses), -1 on padding."""
BRANCH_IDS = "branch_ids"
"""``[B, S]`` int32: 0 on a document's shared prompt, ``k >= 1`` on its ``k``-th response, -1 on padding."""
LOGITS_INDEX = "logits_index"
"""``[B, S]`` int64: where in its row is the position whose logits predict the token (-1: nowhere)."""
SEQUENCE_INDEX = "sequence_index"
"""``[B, S]`` int64: the sequence a token belongs to, -1 on padding and on a prompt sequences share."""
NUM_SEQUENCES = "num_sequences"
"""The number of sequences in a batch (an int, like ``max_length_q``)."""
SHIFT_LABELS = "shift_labels"
"""``[B, S]``: the label each place's logits are scored against (-100: none), as ``transformers`` takes it."""
LABEL_IDS = "label_ids"
"""Another stack's labels: the name transformers' ``default_data_collator`` renames to ``labels``."""
ACTION_MASK = "action_mask"
"""Another stack's supervision: OpenRLHF's mask of the trained (response) tokens."""
TOOL_MASKS = ("tool_mask", "env_mask")
"""Another stack's supervision: TRL's masks of a completion's tool (environment) output, 0 on its tokens."""
PROMPT_MASK = "prompt_mask"
"""Another stack's padding: TRL's mask of a prompt's padding (0), beside its ``prompt_ids``."""
EXAMPLE_LENGTHS = "example_lengths"
"""``[1, E]`` int64, internal: each example's token count in a padding-free row (0: an empty example)."""
SUBTREE_END = "subtree_end"
"""``[B, S]`` int64, tree attention: token ``k`` is seen by the ``q`` with ``k <= q < subtree_end[k]``."""
PATH_INDEX, PATH_OFFSETS = "path_index", "path_offsets"
"""A tree batch's paths: every sequence's flat token places, sequence ``s``'s from ``path_offsets[s]``."""
MARGIN = "margin"
"""A reward pair's margin: one number per pair (TRL's ``RewardTrainer`` name)."""
LAST_TOKEN_INDEX = "last_token_index"
"""``[S]`` int64: the place of each sequence's last token in the flattened ``input_ids``."""
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"
"""A vision-language example's token types: 0 text, 1 image placeholder, 2 video placeholder."""
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""A vision-language example's media fields (Qwen-VL processors' names), fields of its document."""
RAW_MEDIA = ("images", "image", "multi_modal_inputs")
"""Media no processor has read yet (TRL's and datasets' names), or verl's dict of a processor's outputs."""

TOKEN_FIELD_CANDIDATES = (INPUT_IDS, "tokens", "token_ids", "ids")
"""The payload fields ``tokens_field="auto"`` tries, in order."""

IGNORE_INDEX = -100
"""The default loss-ignore sentinel (PyTorch's ``cross_entropy`` default)."""

INT32_MAX = 2**31 - 1
"""The largest ``cu_seqlens`` entry (int32, as varlen attention kernels take them)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PAD_MULTIPLE = 2**20
"""The largest ``pad_to_multiple_of`` accepted (a row padded to more than a million tokens is a typo)."""

SUPERVISION_MASKS = (LOSS_MASK, ASSISTANT_MASKS, ASSISTANT_MASK, COMPLETION_MASK)
"""The per-token 0/1 fields that say which tokens are trained (ours, ``transformers``' and TRL's names)."""
