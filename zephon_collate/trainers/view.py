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
    BRANCH_IDS,
    DOCUMENT_IDS,
    INPUT_IDS,
    LOGITS_INDEX,
    POSITION_IDS,
    SEQUENCE_INDEX,
)
from zephon_collate.core.text import shown
from zephon_collate.functional.attention import dense_branch_mask
from zephon_collate.packing._plan import best_fit_rows

__all__ = [
    "PACKED",
    "ROWS",
    "check_packing",
    "grid_rows",
    "pack_view",
    "packed_base",
    "packed_rows",
    "present",
    "wrap_forward",
]

PACKED = "packed"
"""The keyword (and batch key) of the packed sequences, a dict of tensors that the wrapped forward reads."""

ROWS = ("one", "fit")
"""The packed layouts: one row, or best-fit rows as wide as the longest sequence."""

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_PASSED = frozenset({"use_cache", "output_router_logits"})  # model keywords TRL adds that packing keeps
_PACK = Collator.for_rollouts(padding_free=True)
_SHARE = Collator.for_rollouts(padding_free=True, shared_prompt=True)


def pack_view(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    trained: torch.Tensor,
    rows: Literal["one", "fit"],
    owner: str,
    *,
    shared_prompt: bool = False,
    order: Sequence[int] | None = None,
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
        shared_prompt: consecutive sequences (in ``order``) with the same prompt (the tokens before the
            first trained one) share it: it is laid out once, each response after it in a branch of its
            own, opened by a copy of the prompt's last token (which predicts the response's first token
            there: one prediction per place). The rows then come with the 4-D ``attention_mask`` that
            keeps a branch from its siblings.
        order: the rows in the order they are laid out (default: as given), e.g. each DPO pair's chosen
            and rejected rows together, so that they share their prompt.

    Returns:
        ``input_ids``, ``position_ids`` and ``shift_labels`` (each place's next token where it is scored,
        else -100) ``[rows, width]`` (and, shared, ``attention_mask`` ``[rows, 1, width, width]``);
        ``source``, the flat packed place of each scored prediction, and ``target``, its flat place in the
        ``[R, T - 1]`` view.

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
        >>> pairs = torch.tensor([[4, 5, 6, 7], [4, 5, 8, 0]])  # prompt [4, 5]: responses [6, 7] and [8]
        >>> trained = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]])
        >>> shared = pack_view(pairs, pairs != 0, trained, "one", "example", shared_prompt=True)
        >>> shared["input_ids"].tolist(), shared["position_ids"].tolist()
        ([[4, 5, 6, 7, 5, 8]], [[0, 1, 2, 3, 1, 2]])
        >>> shared["shift_labels"].tolist()  # the copy of 5 predicts the rejected response's 8
        [[-100, 6, 7, -100, 8, -100]]
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
    order = range(len(lengths)) if order is None else order
    scored = trained != 0
    examples = []
    for i in order:
        span_of = slice(starts_at[i], starts_at[i] + lengths[i])
        supervised = scored[i, span_of].clone()
        if shared_prompt:  # the token before the response opens its branch: the prompt shared is one shorter
            supervised[:-1] |= supervised[1:].clone()
        examples.append({INPUT_IDS: input_ids[i, span_of], "completion_mask": supervised})
    flat = (_SHARE if shared_prompt else _PACK)(examples)
    # Each flat place in the [bins, width] grid: documents (a sequence, or a prompt and its branches) best
    # fit into rows, each document's tokens together.
    positions = flat[POSITION_IDS][0]
    tokens = flat[INPUT_IDS][0]
    grid = grid_rows(flat[DOCUMENT_IDS][0], tokens, positions, rows)
    place = grid.pop("place")
    bins, width = grid[INPUT_IDS].shape
    size = bins * width
    # The predicted tokens: their view row, and their place in it (positions count from the row's start).
    sequence = flat[SEQUENCE_INDEX][0]
    view_row = torch.tensor(list(order), dtype=torch.long)[sequence.clamp(min=0)]
    column_of = first[view_row] + positions
    hit = (sequence >= 0) & (positions > 0)
    hit &= scored[view_row, column_of.clamp(max=scored.shape[1] - 1)]
    hit = hit.nonzero()[:, 0]
    source = place[flat[LOGITS_INDEX][0, hit]]
    shift_labels = tokens.new_full((size,), -100).index_copy(0, source, tokens[hit])
    out = {**grid, "shift_labels": shift_labels.view(bins, width)}
    if shared_prompt:  # the attention: a branch sees its prompt and itself, never its sibling
        ids = {
            key: torch.full((size,), -1, dtype=flat[key].dtype).index_copy(0, place, flat[key][0])
            for key in (DOCUMENT_IDS, BRANCH_IDS)
        }
        out[ATTENTION_MASK] = dense_branch_mask(
            ids[DOCUMENT_IDS].view(bins, width), ids[BRANCH_IDS].view(bins, width)
        )
    out["source"] = source
    out["target"] = view_row[hit] * (input_ids.shape[1] - 1) + column_of[hit] - 1
    return out


def grid_rows(
    document: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, rows: Literal["one", "fit"]
) -> dict[str, torch.Tensor]:
    """A packed row's documents (``document``: each token's, ``[N]``, numbered from 0 in order) laid out
    in rows: ``"one"``, as they are; ``"fit"``, best-fit into rows as wide as the longest document.

    Returns:
        ``input_ids`` and ``position_ids`` ``[rows, width]`` (each row's padding counts from 0, a
        sequence of its own, never read), and ``place``: each token's flat place in them.

    Example:
        >>> tokens, positions = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 1, 2, 0, 1])
        >>> grid = grid_rows(torch.tensor([0, 0, 0, 1, 1]), tokens, positions, "fit")
        >>> grid["input_ids"].tolist(), grid["position_ids"].tolist(), grid["place"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[0, 1, 2], [0, 1, 0]], [0, 1, 2, 3, 4])
    """
    document = document.long()
    total = document.numel()
    sizes = torch.bincount(document)
    width = int(sizes.max()) if rows == "fit" else total
    bins = best_fit_rows(sizes.tolist(), width) if rows == "fit" else [list(range(len(sizes)))]
    row_of_doc, start_of_doc = torch.zeros_like(sizes), torch.zeros_like(sizes)
    used = torch.zeros(len(bins), dtype=torch.long)
    for row, members in enumerate(bins):
        for member in members:
            row_of_doc[member], start_of_doc[member] = row, used[row]
            used[row] += sizes[member]
    into = torch.arange(total) - (torch.cumsum(sizes, 0) - sizes)[document]  # each token's place in its doc
    place = row_of_doc[document] * width + start_of_doc[document] + into
    after = torch.arange(width) - used[:, None]  # each row's padding counts from 0: a sequence of its own
    size = len(bins) * width
    return {
        INPUT_IDS: tokens.new_zeros(size).index_copy(0, place, tokens).view(len(bins), width),
        POSITION_IDS: after.clamp(min=0).reshape(-1).index_copy(0, place, positions).view(len(bins), width),
        "place": place,
    }


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
        if ATTENTION_MASK in packed:  # a shared prompt's branches: the 4-D mask keeps them apart
            given[ATTENTION_MASK] = packed[ATTENTION_MASK]
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


def packed_rows(model: nn.Module, *, shared_prompt: bool = False) -> Literal["one", "fit"]:
    """The packed layout for ``model``: one row under FlashAttention (its varlen kernels split a row's
    sequences only in a batch of one) or when the model's MoE load-balancing loss is on (it counts every
    token of a row, padding too), else rows as wide as the longest sequence.

    Raises:
        ValueError: for ``shared_prompt`` under FlashAttention, whose varlen kernels cannot keep a response
            from its sibling.
    """
    config: Any = model.config
    try:
        from transformers.utils.generic import is_flash_attention_requested

        flash = bool(is_flash_attention_requested(config))
    except ImportError:  # an older transformers
        flash = "flash" in str(getattr(config, "_attn_implementation", ""))
    moe = bool(getattr(config.get_text_config(), "output_router_logits", False))
    if flash and shared_prompt:
        raise ValueError(
            "shared_prompt=True lays responses out as branches after one prompt, which FlashAttention's "
            f"varlen kernels cannot keep apart ({type(model).__name__} runs "
            f"{getattr(config, '_attn_implementation', 'flash')}); load the model with "
            "attn_implementation='sdpa' (or 'eager'), or pass shared_prompt=False"
        )
    return "one" if flash or moe else "fit"


def packed_base(trainer: Any, owner: str, shared_prompt: bool) -> tuple[nn.Module, Literal["one", "fit"]]:
    """A built TRL trainer's model (under PEFT, its base model), checked to keep packed sequences apart
    (:func:`check_packing`), and the packed rows its attention wants (:func:`packed_rows`)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    base: nn.Module = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_packing(base, owner, shared_prompt=shared_prompt)
    return base, packed_rows(base, shared_prompt=shared_prompt)


def check_packing(model: nn.Module, owner: str, *, shared_prompt: bool = False) -> None:
    """Refuse a model that does not keep packed sequences apart: two sequences laid end to end with
    ``position_ids`` restarting must score as they do alone. transformers does so from the positions for
    most decoders; some (OPT, BLOOM, MPT, BioGPT, convolutional layers) attend across the boundary.
    ``shared_prompt``: a response after its sibling, behind a 4-D branch mask, must score as it does
    after the prompt alone (the model must take the mask as given). ``model`` is a causal LM (its logits
    are compared) or a bare decoder (its last hidden states).

    Raises:
        ValueError: naming the model's class, when a sequence's logits change once packed.
    """
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    first, second = torch.tensor([[3, 4, 5]], device=device), torch.tensor([[6, 7]], device=device)
    packed_ids = torch.cat([first, second], dim=1)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
    extra: dict[str, torch.Tensor] = {}
    if shared_prompt:  # prompt [3, 4], then the branches [5] and [6, 7]: the second alone is [3, 4, 6, 7]
        second = torch.tensor([[3, 4, 6, 7]], device=device)
        positions = torch.tensor([[0, 1, 2, 2, 3]], device=device)
        branches = torch.tensor([[0, 0, 1, 2, 2]], device=device)
        extra[ATTENTION_MASK] = dense_branch_mask(torch.zeros_like(branches), branches)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = _per_token(model(input_ids=second, use_cache=False))[0, -2:].float()
            together = _per_token(
                model(input_ids=packed_ids, position_ids=positions, use_cache=False, **extra)
            )
            together = together[0, 3:].float()
    finally:
        model.train(training)
    scale = float(alone.abs().max()) + 1.0
    if not torch.allclose(together, alone, atol=1e-3 * scale, rtol=1e-3):
        if shared_prompt:
            raise ValueError(
                f"{owner}: {type(model).__name__} does not keep a shared prompt's responses apart under a "
                "4-D attention mask (a response scores otherwise once its sibling is laid out before it), so "
                "shared_prompt=True would change what is trained; pass shared_prompt=False"
            )
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
