"""A padded batch's sequences packed (:func:`pack_view`), and a fused forward that runs them packed but
answers padded (:func:`wrap_forward`); docs/post_training.md.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from trl.trainer.utils import FusedCausalLMOutput

from zephon_collate.collate.collator import Collator
from zephon_collate.core.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS_INDEX,
    PATH_INDEX,
    PATH_OFFSETS,
    POSITION_IDS,
    SUBTREE_END,
)
from zephon_collate.core.text import shown
from zephon_collate.functional.trees import additive, dense_tree_mask, within_limits

__all__ = [
    "PACKED",
    "ROWS",
    "branch_attention",
    "check_packing",
    "layer_limits",
    "pack_view",
    "packed_base",
    "packed_rows",
    "padded_rope",
    "present",
    "wrap_forward",
]

PACKED = "packed"
"""The keyword (and batch key) of the packed sequences, a dict of tensors that the wrapped forward reads."""

ROWS = ("one", "fit")
"""The packed layouts: one row, or best-fit rows as wide as the longest sequence."""

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_PASSED = frozenset({"use_cache", "output_router_logits"})  # model keywords TRL adds that packing keeps


@functools.cache
def _collator(shared_prompt: bool, rows: Literal["one", "fit"]) -> Collator:
    """The tree collator of a packed view, one per layout (shared prefixes or not, one row or fit)."""
    return Collator.for_trees(
        share="batch" if shared_prompt else "none",
        copy_openers=shared_prompt,
        max_row_tokens="longest" if rows == "fit" else None,
    )


def pack_view(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    trained: torch.Tensor,
    rows: Literal["one", "fit"],
    owner: str,
    *,
    shared_prompt: bool = False,
) -> dict[str, torch.Tensor]:
    """The sequences of a padded batch, packed (as ``Collator.for_trees`` lays trajectories out).

    Parameters:
        input_ids, attention_mask: ``[R, T]``; each row's tokens (``attention_mask`` 1) one contiguous span.
        trained: ``[R, T]``, nonzero at the tokens whose prediction is scored.
        rows: ``"one"``: every document in one row; ``"fit"``: best-fit into rows as wide as the longest.
        owner: who errors name.
        shared_prompt: lay every shared prefix out once, each branch opening with its last token copied.

    Returns:
        ``input_ids``, ``position_ids``, ``shift_labels`` ``[rows, width]`` (shared: 4-D ``attention_mask``);
        ``source``, each scored prediction's flat packed place; ``target``, its flat place in ``[R, T - 1]``.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 7], [5, 9, 0, 0]])
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
        >>> packed = pack_view(ids, mask, torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]]), "one", "example")
        >>> packed["input_ids"].tolist(), packed["shift_labels"].tolist()
        ([[5, 6, 7, 5, 9]], [[6, 7, -100, 9, -100]])
        >>> packed["source"].tolist(), packed["target"].tolist()
        ([0, 1, 3], [1, 2, 3])
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
    scored = trained != 0
    lengths, starts_at = counts.tolist(), first.tolist()
    examples = [
        {
            INPUT_IDS: input_ids[i, start : start + length],
            "completion_mask": scored[i, start : start + length],
        }
        for i, (start, length) in enumerate(zip(starts_at, lengths, strict=True))
    ]
    tree = _collator(shared_prompt, rows)(examples)
    tokens = tree[INPUT_IDS]
    bins, width = tokens.shape
    # Every row's path: its k-th token is the view row's column first + k, predicted from logits_index.
    path, offsets = tree[PATH_INDEX], tree[PATH_OFFSETS]
    view_row = torch.repeat_interleave(torch.arange(len(lengths)), offsets[1:] - offsets[:-1])
    k = torch.arange(path.numel()) - offsets[:-1][view_row]
    column_of = first[view_row] + k
    hit = (k > 0) & scored[view_row, column_of.clamp(max=scored.shape[1] - 1)]
    places = path[hit]
    source = places // width * width + tree[LOGITS_INDEX].reshape(-1)[places]
    shift_labels = tokens.new_full((bins * width,), -100).index_copy(0, source, tokens.reshape(-1)[places])
    out = {
        INPUT_IDS: tokens,
        POSITION_IDS: tree[POSITION_IDS],
        "shift_labels": shift_labels.view(bins, width),
    }
    if shared_prompt:  # the attention: a token sees its ancestors and its node's earlier tokens
        out[ATTENTION_MASK] = dense_tree_mask(tree[SUBTREE_END])
    out["source"] = source
    out["target"] = view_row[hit] * (input_ids.shape[1] - 1) + column_of[hit] - 1
    return out


def _laid_out(values: torch.Tensor | None, packed: Mapping[str, torch.Tensor], shape: Sequence[int]) -> Any:
    """A packed per-token output ``[rows, width]`` as the padded view ``shape`` (zero where not trained)."""
    if values is None:
        return None
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_copy(0, packed["target"], values.reshape(-1)[packed["source"]]).view(*shape)


def present(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a call gives: PEFT's wrappers pass every optional input, as ``None``."""
    return {key: value for key, value in kwargs.items() if value is not None}


def wrap_forward(model: nn.Module) -> None:
    """Make ``model``'s fused forward run packed when the call carries ``packed=...``, else TRL's own."""
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
            given[ATTENTION_MASK] = branch_attention(self, packed)
            if _has_router(self):  # no load-balancing loss from a 4-D mask (the trainer refuses one here)
                given.setdefault("output_router_logits", False)
        with padded_rope(self, labels.shape[1]):
            out = fused(
                input_ids=packed[INPUT_IDS],
                position_ids=_model_positions(self, packed[POSITION_IDS]),
                shift_labels=packed["shift_labels"],
                fused_lm_head=True,
                **given,
            )
        shape = (labels.shape[0], labels.shape[1] - 1)
        fields = {name: _laid_out(getattr(out, name), packed, shape) for name in _PER_TOKEN}
        mask, loss = labels[:, 1:] != -100, out.loss
        if ATTENTION_MASK in packed:  # a token the branches share is scored once: count it per row, as TRL
            count = given.get("num_items_in_batch")
            loss = -fields["log_probs"].sum() / (mask.sum().clamp(min=1) if count is None else count)
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=out.aux_loss, **fields)

    forward._zephon_packed = True  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)


@contextlib.contextmanager
def padded_rope(model: nn.Module, width: int | None) -> Iterator[None]:
    """Run ``model``'s length-dependent RoPE on packed rows as on the padded batch ``width`` tokens wide.

    transformers' ``dynamic`` and ``longrope`` rotary embeddings (and PhiMoE's scale) follow the call's
    largest position: on the padded batch, its width (``position_ids`` count 0 to ``width - 1``); packed,
    the longest sequence. Within this context each such module runs as on the padded batch, on positions
    0 to ``width - 1`` (a ``dynamic`` RoPE's cache updated as that call updates it), and its cos and sin
    are read at the packed positions. Other modules and multimodal positions, and ``width=None``, are
    left as they are.

    Example:
        >>> with padded_rope(nn.Linear(1, 1), 24):  # no rotary embedding: nothing to do
        ...     pass
    """
    if width is None:
        yield
        return
    rotaries = [module for module in model.modules() if _length_dependent(module)]
    saved = [vars(rotary).get("forward") for rotary in rotaries]  # a forward set on the instance, kept
    for rotary in rotaries:

        def forward(x: Any, position_ids: torch.Tensor, *args: Any, _own: Any = rotary.forward,
                    _name: str = type(rotary).__name__, **kwargs: Any) -> Any:  # fmt: skip
            if position_ids.dim() != 2:  # multimodal planes
                return _own(x, position_ids, *args, **kwargs)
            padded = torch.arange(width, device=position_ids.device)[None]  # the padded call's positions
            tables = _own(x, padded, *args, **kwargs)
            if any(table.shape[:2] != (1, width) for table in tables):
                raise ValueError(
                    f"{_name} returned tables of shapes {[tuple(table.shape) for table in tables]} for "
                    f"positions [1, {width}], which the packed forward cannot read at the packed positions; "
                    "train this model with TRL's own trainer"
                )
            return tuple(table[0][position_ids] for table in tables)

        rotary.forward = forward
    try:
        yield
    finally:
        for rotary, own in zip(rotaries, saved, strict=True):
            del rotary.forward
            if own is not None:
                rotary.forward = own


def _length_dependent(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose tables follow the call's largest position."""
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, Mapping) else [kinds]
    follows = any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in kinds)
    return follows and any(name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False))


def packed_rows(
    model: nn.Module, *, shared_prompt: bool = False, aux_loss: bool = False
) -> Literal["one", "fit"]:
    """The packed layout: ``"one"`` under FlashAttention or an MoE load-balancing loss, else ``"fit"``."""
    config: Any = model.config
    try:
        from transformers.utils.generic import is_flash_attention_requested

        flash = bool(is_flash_attention_requested(config))
    except ImportError:  # an older transformers
        flash = "flash" in str(getattr(config, "_attn_implementation", ""))
    moe = aux_loss or bool(getattr(config.get_text_config(), "output_router_logits", False))
    if flash and shared_prompt:
        raise ValueError(
            "shared_prompt=True lays responses out as branches after one prompt, which FlashAttention's "
            f"varlen kernels cannot keep apart ({type(model).__name__} runs "
            f"{getattr(config, '_attn_implementation', 'flash')}); load the model with "
            "attn_implementation='sdpa' (or 'eager'), or pass shared_prompt=False"
        )
    return "one" if flash or moe else "fit"


def packed_base(trainer: Any, owner: str, shared_prompt: bool) -> tuple[nn.Module, Literal["one", "fit"]]:
    """A built TRL trainer's (base) model and its :func:`packed_rows`, it and its reference model checked."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    base: nn.Module = model.get_base_model() if hasattr(model, "get_base_model") else model
    aux_loss = bool(getattr(trainer, "aux_loss_enabled", False))
    if shared_prompt and aux_loss:
        coefficient = getattr(trainer, "router_aux_loss_coef", "?")
        raise ValueError(
            f"{owner}: {type(base).__name__} trains with its MoE load-balancing loss (router_aux_loss_coef="
            f"{coefficient}), which over a shared prompt counts the prompt's tokens once where stock TRL "
            "counts them once per sequence, so shared_prompt=True would change what is trained; pass "
            "router_aux_loss_coef=0.0 in the trainer's config to train without that loss, or "
            "shared_prompt=False"
        )
    check_packing(base, owner, shared_prompt=shared_prompt)
    reference = getattr(trainer, "ref_model", None)
    if reference is not None:  # it runs the same packed rows
        unwrapped = trainer.accelerator.unwrap_model(reference)
        check_packing(unwrapped, owner, shared_prompt=shared_prompt, role="the reference model ")
    return base, packed_rows(base, shared_prompt=shared_prompt, aux_loss=aux_loss)


def check_packing(model: nn.Module, owner: str, *, shared_prompt: bool = False, role: str = "") -> None:
    """Refuse (``ValueError``) a model that does not train on packed rows as on the padded batch.

    Parameters:
        model: a causal LM (its logits are compared) or a bare decoder (its last hidden states).
        owner: who errors name; ``role``: what the model is to the owner (``"the reference model "``).
        shared_prompt: check the shared-prompt layout too.
    """
    name = f"{role}{type(model).__name__}"
    kinds = getattr(_text_config(model), "layer_types", None) or ()
    stateful = next((kind for kind in kinds if kind != _FULL and kind not in _SIZED), None)
    if stateful is not None:  # a leak of a tiny model's weights can hide under the probe's tolerance
        raise ValueError(
            f"{owner}: {name} has {stateful} layers (config.layer_types), which carry state from one packed "
            "sequence into the next (only attention layers restart at position_ids 0), so packing would "
            "change what is trained; train it with TRL's own trainer"
        )
    span = _probe_span(model)
    past = min(span, 16)  # tokens past the window: enough of the keys for a wrong window to show
    draw = _token_draw(model)
    plain = [draw(3), draw(span + past)]
    if not _probe_agrees(model, plain, [[1] * len(plain[0]), [1] * len(plain[1])], owner, name, shared=False):
        raise ValueError(
            f"{owner}: {name} lets packed sequences attend to each other (a sequence scores otherwise once "
            "another is packed before it: its attention does not restart at position_ids 0), so packing "
            "would change what is trained; train it with TRL's own trainer"
        )
    if not shared_prompt:
        return
    limits = layer_limits(model, owner, role)
    prompt = draw(span)  # as long as the window: the responses reach past it
    pair = [prompt + draw(past + 1), prompt + draw(past)]
    trained = [[0] * len(prompt) + [1] * (len(sequence) - len(prompt)) for sequence in pair]
    if not _probe_agrees(model, pair, trained, owner, name, shared=True):
        folded = {kind: size for kind, size in limits.items() if size}
        detail = f" (each layer kind's window or chunk, {folded}, folded in by position)" if folded else ""
        raise ValueError(
            f"{owner}: {name} does not keep a shared prompt's responses apart under a 4-D attention mask"
            f"{detail}: a response scores otherwise once its sibling is laid out before it, so "
            "shared_prompt=True would change what is trained; pass shared_prompt=False"
        )


def layer_limits(model: nn.Module, owner: str = "layer_limits", role: str = "") -> dict[str, int]:
    """Each kind of attention layer ``model`` has and how far it sees: 0 (full), a window or a chunk size.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> config = Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
        ...                      num_attention_heads=2, use_sliding_window=True, sliding_window=4,
        ...                      max_window_layers=1)  # layer 0 full, layer 1 a window of 4
        >>> layer_limits(Qwen2ForCausalLM(config))
        {'full_attention': 0, 'sliding_attention': 4}
    """
    config = _text_config(model)
    kinds = getattr(config, "layer_types", None)
    if not kinds:  # one kind for every layer: a window wherever the config gives one (Mistral, Phi-3)
        window = getattr(config, "sliding_window", None)
        return {"sliding_attention": window} if isinstance(window, int) and window > 0 else {_FULL: 0}
    limits = {}
    for kind in dict.fromkeys(kinds):
        size = 0 if kind == _FULL else getattr(config, _SIZED.get(kind, ""), None)
        if not isinstance(size, int) or size < 0 or (kind != _FULL and size == 0):
            raise ValueError(
                f"{owner}: {role}{type(model).__name__} has {kind} layers (config.layer_types), which a "
                "shared prompt's branch mask cannot keep from a sibling response (only full, sliding-window "
                "and chunked attention layers take it); pass shared_prompt=False"
            )
        limits[str(kind)] = size
    return limits


def branch_attention(
    model: nn.Module, packed: Mapping[str, torch.Tensor]
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` for a shared prompt's packed rows, each layer kind's window folded in.

    Example:
        >>> from transformers import MistralConfig, MistralForCausalLM
        >>> config = MistralConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        ...                        num_attention_heads=2, num_key_value_heads=1, sliding_window=2)
        >>> config._attn_implementation = "sdpa"
        >>> seen = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
        >>> mask = branch_attention(MistralForCausalLM(config), {"attention_mask": seen,
        ...                                                      "position_ids": torch.tensor([[0, 1, 2]])})
        >>> mask[0, 0].int().tolist()  # each token sees itself and the one before it
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    seen, positions = packed[ATTENTION_MASK], packed[POSITION_IDS]
    query, key = positions[:, None, :, None], positions[:, None, None, :]
    masks = {}
    for kind, size in layer_limits(model).items():  # a window or a chunk by position, as transformers
        limits = within_limits(
            query, key, window=size if kind == "sliding_attention" else None,
            chunk=size if kind == "chunked_attention" else None,
        )  # fmt: skip
        masks[kind] = seen if limits is None else seen & limits
    config = _text_config(model)
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation != "sdpa":  # eager and flex add the mask to the scores
        dtype = _float_dtype(model)
        masks = {kind: additive(mask, dtype) for kind, mask in masks.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


_FULL = "full_attention"
_SIZED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def _probe_agrees(
    model: nn.Module,
    sequences: list[list[int]],
    trained: list[list[int]],
    owner: str,
    name: str,
    *,
    shared: bool,
) -> bool:
    """Whether ``model`` scores ``sequences`` packed as each alone; ``ValueError`` if the model raises."""
    width = max(map(len, sequences))
    ids, mask, marks = (torch.zeros(len(sequences), width, dtype=torch.long) for _ in range(3))
    for row, (sequence, scored) in enumerate(zip(sequences, trained, strict=True)):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = torch.tensor(sequence), 1
        marks[row, : len(scored)] = torch.tensor(scored)
    packed = pack_view(ids, mask, marks, "one", owner, shared_prompt=shared)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    packed = {key: value.to(device) for key, value in packed.items()}
    extra = {"use_cache": False, **({"output_router_logits": False} if _has_router(model) else {})}
    given = {POSITION_IDS: _model_positions(model, packed[POSITION_IDS]), **extra}
    if shared:
        given[ATTENTION_MASK] = branch_attention(model, packed)
    training = model.training
    model.eval()
    try:  # every call at the padded width's RoPE, as the trainers run them (padded_rope)
        with torch.no_grad(), padded_rope(model, width):
            together = _per_token(model(input_ids=packed[INPUT_IDS], **given)).flatten(0, 1)
            alone = [_per_token(model(input_ids=ids[row : row + 1, : len(sequence)].to(device), **extra))[0]
                     for row, sequence in enumerate(sequences)]  # fmt: skip
    except Exception as error:  # the model's own: it cannot run this layout, which is a refusal
        fix = "pass shared_prompt=False" if shared else "train it with TRL's own trainer"
        layout = "a shared prompt's packed rows (a 4-D attention mask)" if shared else "packed sequences"
        raise ValueError(
            f"{owner}: {name} cannot run {layout}: its forward raised {type(error).__name__}: "
            f"{_first_line(error)}; {fix}"
        ) from error
    finally:
        model.train(training)
    grid = torch.zeros(len(sequences), width - 1, together.shape[-1], dtype=together.dtype, device=device)
    for row, out in enumerate(alone):
        grid[row, : out.shape[0] - 1] = out[:-1]
    got, want = together[packed["source"]].float(), grid.flatten(0, 1)[packed["target"]].float()
    # Other shapes round otherwise: a tolerance of the output's scale, wider in bfloat16 and float16.
    tolerance = max(1e-3, 2 * torch.finfo(together.dtype).eps) * (float(want.abs().max()) + 1.0)
    return bool(torch.allclose(got, want, atol=tolerance, rtol=0))


def _model_positions(model: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """Packed ``[R, N]`` positions as ``model`` reads them: ``[4, R, N]`` for multimodal RoPE.

    A model whose text config has ``mrope_section`` (Qwen-VL, GLM-4V) builds the packed mask from a text
    row of 4-row positions, then the temporal, height and width planes, which for text are the text's.
    Given ``[R, N]``, Qwen2-VL and Qwen2.5-VL make three planes and no text row, so mask nothing.

    Example:
        >>> _model_positions(nn.Linear(1, 1), torch.tensor([[0, 1, 0]])).tolist()
        [[0, 1, 0]]
    """
    config = _text_config(model)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not (isinstance(rope, Mapping) and "mrope_section" in rope):
        return positions
    return positions[None].expand(4, *positions.shape)


def _first_line(error: Exception) -> str:
    """An exception's message for another one: its first line, cut to 160 characters."""
    line = (str(error).strip().splitlines() or [""])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def _text_config(model: nn.Module) -> Any:
    """The model's (text) config, or None for a module without one."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def _has_router(model: nn.Module) -> bool:
    """Whether the model takes ``output_router_logits`` (an MoE with a load-balancing loss)."""
    return hasattr(_text_config(model), "output_router_logits")


def _probe_span(model: nn.Module) -> int:
    """How long the probe's prompt must be to see every window and chunk the config declares."""
    config = _text_config(model)
    sizes = [getattr(config, name, None) for name in _SIZED.values()]
    span = max([size for size in sizes if isinstance(size, int) and size > 0], default=2)
    top = getattr(config, "max_position_embeddings", None)  # the longest probe is span + 17 tokens
    return max(2, min(span, top - 17)) if isinstance(top, int) else span


def _token_draw(model: nn.Module) -> Callable[[int], list[int]]:
    """Draws of probe tokens (ids from 3 on, within the model's vocabulary), seeded."""
    generator, top = torch.Generator().manual_seed(0), max(_vocab_size(model), 4)
    return lambda count: torch.randint(3, top, (count,), generator=generator).tolist()


def _vocab_size(model: nn.Module) -> int:
    """The token ids the model embeds (8 for a module that says nothing)."""
    try:
        embeddings = model.get_input_embeddings()  # type: ignore[operator]
        return int(embeddings.num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        size = getattr(_text_config(model), "vocab_size", None)
        return size if isinstance(size, int) else 8


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating weights (float32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _per_token(out: Any) -> torch.Tensor:
    """A forward's per-token output: a causal LM's logits, a decoder's last hidden states."""
    logits = getattr(out, "logits", None)
    found: torch.Tensor = logits if logits is not None else out.last_hidden_state
    return found
