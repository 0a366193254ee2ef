"""A padded batch's sequences packed, and a fused forward that runs them packed but answers padded.

TRL's trainers reach the model through ``model(..., labels=labels, fused_lm_head=True)`` on a padded
batch ``[R, T]`` and read per-token outputs ``[R, T - 1]`` (the prediction of token ``t + 1`` at ``t``).
:func:`pack_view` packs the batch's sequences (each row's tokens one contiguous span, padding on either
side); :func:`wrap_forward` makes the model's fused forward run the packed rows when the call carries them
(``packed=...``) and lay each per-token output back out as the padded batch's::

    the view (left and right padding)       packed ("fit": rows as wide as the longest)
    . . p p c c                             p p c c p c
    . p c c c .                             p c c c . .     (padding: its own sequence)
    p c . . . .

The packed rows' ``position_ids`` restart at 0 at each sequence, which is how transformers keeps packed
sequences apart.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from trl.trainer.utils import FusedCausalLMOutput

from zephon_collate.collate.collator import Collator
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    LABELS,
    LOGITS_INDEX,
    POSITION_IDS,
    SEQUENCE_INDEX,
)
from zephon_collate.core.text import shown
from zephon_collate.packing._plan import best_fit_rows

__all__ = ["PACKED", "ROWS", "check_packing", "pack_view", "packed_rows", "present", "wrap_forward"]

PACKED = "packed"
"""The keyword (and batch key) of the packed sequences, a dict of tensors that the wrapped forward reads."""

ROWS = ("one", "fit")
"""The packed layouts: one row, or best-fit rows as wide as the longest sequence."""

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_PASSED = frozenset({"use_cache", "output_router_logits"})  # model keywords TRL adds that packing keeps
_PACK = Collator.for_transformers(padding_free=True, return_position_ids=True, return_sequence_map=True)


def pack_view(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    trained: torch.Tensor,
    rows: Literal["one", "fit"],
    owner: str,
) -> dict[str, torch.Tensor]:
    """The sequences of a padded batch, packed.

    Parameters:
        input_ids, attention_mask: ``[R, T]``; each row's tokens (``attention_mask`` 1) one contiguous span.
        trained: ``[R, T]``, nonzero at the tokens whose prediction is scored.
        rows: ``"one"``: every sequence in one row ``[1, N]`` (varlen attention kernels such as
            FlashAttention, whose cost grows with each sequence); ``"fit"``: the sequences best-fit into
            rows as wide as the longest (attention that masks a dense row, SDPA or eager, whose cost grows
            with the row's width squared). A row's padding is a sequence of its own, never scored.
        owner: who errors name.

    Returns:
        ``input_ids``, ``position_ids`` and ``shift_labels`` (each place's next token where it is scored,
        else -100) ``[rows, width]``; ``source``, the flat packed place of each scored prediction, and
        ``target``, its flat place in the ``[R, T - 1]`` view.

    Raises:
        ValueError: for a row whose tokens are not one span (holes in ``attention_mask``), naming it.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 7], [5, 9, 0, 0]])
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
        >>> packed = pack_view(ids, mask, torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]]), "one", "example")
        >>> packed["input_ids"].tolist(), packed["shift_labels"].tolist()
        ([[5, 6, 7, 5, 9]], [[6, 7, -100, 9, -100]])
        >>> packed["source"].tolist(), packed["target"].tolist()
        ([0, 1, 3], [1, 2, 3])
        >>> pack_view(ids, mask, mask, "fit", "example")["position_ids"].tolist()
        [[0, 1, 2], [0, 1, 0]]
    """
    present = attention_mask.bool()
    counts = present.sum(dim=1)
    first = present.int().argmax(dim=1) * (counts > 0)
    column = torch.arange(present.shape[1])
    span = (column >= first[:, None]) & (column < (first + counts)[:, None])
    holes = (present != span).any(dim=1).nonzero()
    if holes.numel():
        index = int(holes[0, 0])
        raise ValueError(
            f"{owner}: row {index}'s attention_mask has holes ({shown(attention_mask[index].tolist())}); "
            "each row's tokens must be one span, with padding on the left or the right only"
        )
    lengths, starts_at = counts.tolist(), first.tolist()
    width = max(lengths) if rows == "fit" else sum(lengths)
    bins = best_fit_rows(lengths, width) if rows == "fit" else [list(range(len(lengths)))]
    order = [index for members in bins for index in members]
    flat = _PACK(
        [
            {
                INPUT_IDS: input_ids[i, starts_at[i] : starts_at[i] + lengths[i]],
                "completion_mask": trained[i, starts_at[i] : starts_at[i] + lengths[i]] != 0,
            }
            for i in order
        ]
    )
    labels = flat[LABELS][0]  # -100 where not scored and on each sequence's first token
    # Each flat place in the [bins, width] grid: bin b's sequences fill row b from its start.
    used = torch.tensor([sum(lengths[i] for i in members) for members in bins])
    owner_row = torch.repeat_interleave(torch.arange(len(bins)), used)
    place = owner_row * width + torch.arange(labels.numel()) - (torch.cumsum(used, 0) - used)[owner_row]
    after = torch.arange(width) - used[:, None]  # each row's padding counts from 0: a sequence of its own
    size = len(bins) * width
    grid = {
        INPUT_IDS: flat[INPUT_IDS].new_zeros(size).index_copy(0, place, flat[INPUT_IDS][0]),
        POSITION_IDS: after.clamp(min=0).reshape(-1).index_copy(0, place, flat[POSITION_IDS][0]),
        "shift_labels": labels.new_full((size,), -100).index_copy(
            0, place, torch.cat([labels[1:], labels.new_full((1,), -100)])
        ),
    }
    scored = (labels != -100).nonzero()[:, 0]  # the predicted tokens, at their flat places
    sequence = torch.tensor(order, dtype=torch.long)[
        flat[SEQUENCE_INDEX][0, scored]
    ]  # the view's row of each
    out = {key: value.view(len(bins), width) for key, value in grid.items()}
    out["source"] = place[flat[LOGITS_INDEX][0, scored]]
    out["target"] = sequence * (input_ids.shape[1] - 1) + first[sequence] + flat[POSITION_IDS][0, scored] - 1
    return out


def _laid_out(values: torch.Tensor | None, packed: Mapping[str, torch.Tensor], shape: Sequence[int]) -> Any:
    """A packed per-token output ``[rows, width]`` as the padded view ``shape`` (zero where nothing is
    trained)."""
    if values is None:
        return None
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_copy(0, packed["target"], values.reshape(-1)[packed["source"]]).view(*shape)


def present(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a call gives: PEFT's wrappers pass every optional input, as ``None``."""
    return {key: value for key, value in kwargs.items() if value is not None}


def wrap_forward(model: nn.Module) -> None:
    """Make ``model``'s fused forward (TRL's ``add_fused_lm_head``) run packed when the call carries
    ``packed=...``; every other call (generation, a batch without it, or one with inputs packing does not
    lay out: ``inputs_embeds``, vision inputs, token types) runs TRL's own forward, unchanged."""
    fused = model.forward
    if getattr(fused, "_zephon_packed", False):
        return

    @functools.wraps(fused.__func__)  # type: ignore[attr-defined]  # generate reads the signature
    def forward(self: nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        packed = kwargs.pop(PACKED, None)
        given = present(kwargs)
        others = set(given) - _PASSED - {INPUT_IDS, ATTENTION_MASK, "labels"}
        if packed is None or not fused_lm_head or args or others:
            return fused(*args, fused_lm_head=fused_lm_head, **kwargs)
        labels = given.pop("labels")
        given.pop(INPUT_IDS, None)
        given.pop(ATTENTION_MASK, None)
        out = fused(
            input_ids=packed[INPUT_IDS],
            position_ids=packed[POSITION_IDS],
            shift_labels=packed["shift_labels"],
            fused_lm_head=True,
            **given,
        )
        shape = (labels.shape[0], labels.shape[1] - 1)
        fields = {name: _laid_out(getattr(out, name), packed, shape) for name in _PER_TOKEN}
        return FusedCausalLMOutput(
            loss=out.loss, label_mask=labels[:, 1:] != -100, aux_loss=out.aux_loss, **fields
        )

    forward._zephon_packed = True  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)


def packed_rows(model: nn.Module) -> Literal["one", "fit"]:
    """The packed layout for ``model``: one row under FlashAttention (its varlen kernels split a row's
    sequences only in a batch of one) or when the model's MoE load-balancing loss is on (it counts every
    token of a row, padding too), else rows as wide as the longest sequence."""
    config: Any = model.config
    try:
        from transformers.utils.generic import is_flash_attention_requested

        flash = bool(is_flash_attention_requested(config))
    except ImportError:  # an older transformers
        flash = "flash" in str(getattr(config, "_attn_implementation", ""))
    moe = bool(getattr(config.get_text_config(), "output_router_logits", False))
    return "one" if flash or moe else "fit"


def check_packing(model: nn.Module, owner: str) -> None:
    """Refuse a model that does not keep packed sequences apart: two sequences laid end to end with
    ``position_ids`` restarting must score as they do alone. transformers does so from the positions for
    most decoders; some (OPT, BLOOM, MPT, BioGPT, convolutional layers) attend across the boundary.
    ``model`` is a causal LM (its logits are compared) or a bare decoder (its last hidden states).

    Raises:
        ValueError: naming the model's class, when a sequence's logits change once packed.
    """
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    first, second = torch.tensor([[3, 4, 5]], device=device), torch.tensor([[6, 7]], device=device)
    packed_ids = torch.cat([first, second], dim=1)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = _per_token(model(input_ids=second, use_cache=False))[0].float()
            together = _per_token(model(input_ids=packed_ids, position_ids=positions, use_cache=False))
            together = together[0, 3:].float()
    finally:
        model.train(training)
    scale = float(alone.abs().max()) + 1.0
    if not torch.allclose(together, alone, atol=1e-3 * scale, rtol=1e-3):
        raise ValueError(
            f"{owner}: {type(model).__name__} lets packed sequences attend to each other (a sequence scores "
            "otherwise once another is packed before it: its attention does not restart at position_ids "
            "0), so packing would change what is trained; train it with TRL's own trainer"
        )


def _per_token(out: Any) -> torch.Tensor:
    """A forward's per-token output: a causal LM's logits, a decoder's last hidden states."""
    logits = getattr(out, "logits", None)
    found: torch.Tensor = logits if logits is not None else out.last_hidden_state
    return found
