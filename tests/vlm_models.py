"""Tiny Qwen vision-language models and synthetic examples, for testing vision-language packing.

No tests here, only helpers. For each family in ``FAMILIES`` (``"qwen2_vl"``, ``"qwen2_5_vl"``,
``"qwen3_vl"``; transformers' ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``):

* :func:`tiny_model` builds a 2-layer model from a config (no download), with its own deterministic
  initialisation (weights large enough that a wrong position or a leaked token moves the logits by O(1)).
* :func:`sample` makes one example as the Qwen processors would, without a processor.
* :func:`alone` runs one example alone (batch of 1, no mask, the model computing its own mRoPE positions).
* :func:`rope_alone` is the model's own ``get_rope_index`` for one example, ``[3, n]``.
* :func:`packed` runs several examples packed in one row under given ``[4, 1, N]`` positions;
  :func:`reference_positions` builds those positions from :func:`rope_alone` per example.

What transformers (5.24) needs for a packed row to equal each example alone
----------------------------------------------------------------------------
* ``position_ids`` of shape ``[4, 1, N]``: row 0 is the plain text position (``0..n_i-1`` per document),
  rows 1..3 the mRoPE t/h/w positions. The text models split row 0 off
  (``position_ids.shape[0] == 4``) and hand it to ``create_causal_mask``, which finds the document
  boundaries from it (``find_packed_sequence_indices``: a new document wherever row 0 does not step by
  exactly 1) and builds a block-diagonal causal mask. A ``[3, 1, N]`` tensor (no text row) gives NO
  packing mask: the documents would attend to each other.
* ``attention_mask=None`` and ``use_cache=False``: ``_preprocess_mask_arguments`` looks at the position
  ids for packed documents only when the 2D mask is None AND there is no cache; with the config default
  ``use_cache=True`` the text model builds a ``DynamicCache`` first and the packing is silently ignored.
* ``mm_token_type_ids`` is needed only when the model computes positions itself (:func:`alone`); with
  given ``position_ids`` it is not read, but we pass it anyway.
* The vision towers need nothing: each image / video frame is its own attention segment
  (``cu_seqlens`` from ``grid_thw``, one segment per frame; Qwen2.5-VL windows lie inside one image),
  so concatenating ``pixel_values`` and ``*_grid_thw`` in document order gives each image the same
  features as alone. Placeholders are filled in order (``masked_scatter``), which is document order.
* Attention "sdpa" (text and vision; set here via ``attn_implementation="sdpa"``). With it the packed
  row equals the examples alone to ~2.5e-6 in float32 and ~2e-15 in float64 (logits of size ~5; 3-4
  examples of 0-2 images and 0-1 video each, all three families). The float32 residue is rounding, not
  a wrong position or a leak: the vision tower's matmuls over more rows round differently (image
  features of a concatenation vs alone already differ by ~8e-7), and one example through
  :func:`packed` is bitwise equal to :func:`alone`. Sensitivity, for scale: ``use_cache=True``, a
  ``[3, 1, N]`` tensor without the text row, or text positions on rows 1..3 each move the logits by 1-4.

mRoPE rule of ``get_rope_index`` (all three families, transformers 5.24)
-----------------------------------------------------------------------
The token types (``mm_token_type_ids``: 0 text, 1 image, 2 video) are grouped with
``itertools.groupby`` into runs of equal type, ``current_pos = 0``:

* a text run of length L gets ``current_pos .. current_pos+L-1`` on all three rows;
  ``current_pos += L``;
* a vision run takes the NEXT grid of its modality (``t, h, w``; ``gh, gw = h // merge, w // merge``),
  and gets, for tokens in (t, h, w) raster order, ``T = current_pos + floor(t_idx * interval)``,
  ``H = current_pos + h_idx``, ``W = current_pos + w_idx``; then ``current_pos += max(gh, gw)``.
  The temporal extent is NOT counted in the advance (so a video with more frames than ``max(gh, gw)``
  has T positions past the next text token's position; older transformers used ``max + 1`` of the
  run instead). The interval is 1 for Qwen2-VL and Qwen3-VL and for Qwen2.5-VL images; for Qwen2.5-VL
  videos it is ``vision_config.tokens_per_second * second_per_grid_ts[k]`` and the product
  ``arange(gt) * interval`` is truncated with ``.long()`` element-wise (0.75 s at 2 tokens/s gives
  T offsets 0, 1, 3, 4, ...). ``second_per_grid_ts`` defaults to 1 per video when absent.
* Qwen3-VL splits each video grid ``[t, h, w]`` into ``t`` grids ``[1, h, w]``
  (``repeat_interleave``) before the loop: each frame is its own vision run (the processor writes
  ``<x.x seconds>`` text, vision_start, ``h*w/merge**2`` video pads, vision_end per frame), so every
  frame has T = its own ``current_pos`` and the timestamp text between frames advances the positions.
  The model's forward still passes the UNSPLIT ``video_grid_thw`` to the vision tower (one features
  block of ``t*h*w/merge**2`` rows per video, scattered into the frames' placeholders in order).
* Consecutive placeholder runs of the same modality with no text between them ARE merged by
  ``groupby`` into one run, which then consumes only one grid: its positions are too few and
  ``get_rope_index`` raises a ``RuntimeError`` (shape mismatch); the vision_start / vision_end tokens
  (type 0) always separate them in processor output. An image directly followed by a video (types 1
  then 2) stays two runs.
* Examples (merge 2): Qwen2-VL, text ``a s`` + video grid ``[4, 2, 2]`` (4 tokens) + ``e b``: T rows
  ``0 1 | 2 3 4 5 | 3 4``, H = W = ``0 1 | 2 2 2 2 | 3 4``: the text after the video reuses T positions
  3 and 4. Qwen2.5-VL, same with 0.75 s per grid at 2 tokens/s: T = ``0 1 | 2 3 5 6 | 3 4``.
* The deltas returned (``max + 1 - n``) are only for generation; training positions ignore them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

VOCAB = 128
TEXT_VOCAB = 110  # ordinary text tokens are 0..TEXT_VOCAB-1
IMAGE_TOKEN_ID = 120
VIDEO_TOKEN_ID = 121
VISION_START_ID = 122
VISION_END_ID = 123
IGNORE_INDEX = -100

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16: 8 rotary frequencies, split t/h/w as MROPE_SECTION
MROPE_SECTION = [2, 3, 3]
VISION_HIDDEN = 32
VISION_HEADS = 2
CHANNELS = 3
PATCH = 2
MERGE = 2
TEMPORAL_PATCH = 2
PATCH_DIM = CHANNELS * TEMPORAL_PATCH * PATCH * PATCH  # what the vision tower's Conv3d patch embed takes
TOKENS_PER_SECOND = 2  # Qwen2.5-VL
WINDOW_SIZE = 8  # Qwen2.5-VL: windows of WINDOW_SIZE // MERGE // PATCH = 2 merged cells a side
IMAGE_SIDES = (2, 4, 6)  # grid h / w in patches (multiples of MERGE)
VIDEO_SIDES = (2, 4)
VIDEO_FRAMES = (2, 3)  # grid t (temporal patches) of a video
SECONDS_PER_GRID = (0.5, 0.75, 1.0)  # Qwen2.5-VL; 0.75 * 2 = 1.5 exercises the .long() truncation


def _family(model: torch.nn.Module) -> str:
    family = model.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"not a tiny Qwen VL model: {family!r}")
    return family


def tiny_config(family: str) -> Any:
    """The config of :func:`tiny_model` (a transformers ``PreTrainedConfig``)."""
    text = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": False,
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "num_heads": VISION_HEADS,
        "in_channels": CHANNELS,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }
    ids = {
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
    }
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision.update(embed_dim=VISION_HIDDEN, hidden_size=HIDDEN, mlp_ratio=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision.update(
            hidden_size=VISION_HIDDEN,
            intermediate_size=2 * VISION_HIDDEN,
            out_hidden_size=HIDDEN,
            tokens_per_second=TOKENS_PER_SECOND,
            window_size=WINDOW_SIZE,
            fullatt_block_indexes=[1],  # block 0 windowed, block 1 full
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text.update(head_dim=HEAD_DIM)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision.update(
            hidden_size=VISION_HIDDEN,
            intermediate_size=2 * VISION_HIDDEN,
            out_hidden_size=HIDDEN,
            num_position_embeddings=16,  # a 4 x 4 learned grid, interpolated per image
            deepstack_visual_indexes=[0],  # block 0's features are added after text layer 0
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A tiny ``*ForConditionalGeneration`` of ``family`` in eval mode, "sdpa" attention, deterministic in ``seed``.

    Weights are drawn in float32 from ``seed`` (matrices N(0, 1/fan_in), embeddings N(0, 1), biases
    N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)) and then cast to ``dtype``, so the float32 and float64
    models of one seed hold the same values.
    """
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    classes = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
    }
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = classes[family]._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim >= 2:
                fan_in = 1 if "embed_tokens" in name or "pos_embed" in name else param[0].numel()
                value = torch.randn(param.shape, generator=generator) / fan_in**0.5
            elif leaf == "bias":
                value = 0.1 * torch.randn(param.shape, generator=generator)
            else:  # norm weights
                value = 1 + 0.1 * torch.randn(param.shape, generator=generator)
            param.copy_(value)
    return model.to(dtype).eval()


def sample(
    family: str,
    model: torch.nn.Module | None,
    rng: np.random.Generator,
    images: int,
    videos: int,
    text: int,
) -> dict[str, Any]:
    """One synthetic example laid out as the ``family`` processor would produce it.

    ``text`` (>= 1) ordinary text tokens come first; then the ``images`` images and ``videos`` videos in a
    random order, each followed by 1..``text`` text tokens. An image is ``vision_start``,
    ``t*h*w / MERGE**2`` image pads, ``vision_end``; a video likewise with video pads, except for
    ``qwen3_vl`` where each of its ``t`` frames is 2 timestamp text tokens, ``vision_start``,
    ``h*w / MERGE**2`` video pads, ``vision_end``.

    Returns ``input_ids``, ``labels`` (``IGNORE_INDEX`` on the pads), ``mm_token_type_ids`` (lists of
    int), ``pixel_values`` (float32 ``[sum t*h*w, PATCH_DIM]``), ``image_grid_thw`` (int64 ``[images, 3]``,
    t = 1), and, with videos, ``pixel_values_videos``, ``video_grid_thw`` (t >= 2) and for
    ``qwen2_5_vl`` ``second_per_grid_ts`` (list of float). ``model`` is not used (the layout depends
    only on the family); it is accepted so that a caller can pass the model it will run.
    """
    del model
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if text < 1:
        raise ValueError("text must be >= 1")
    unit = MERGE * MERGE

    def words(count: int) -> list[int]:
        return [int(x) for x in rng.integers(0, TEXT_VOCAB, size=count)]

    ids: list[int] = words(text)
    image_grids: list[list[int]] = []
    video_grids: list[list[int]] = []
    seconds: list[float] = []
    kinds = ["image"] * images + ["video"] * videos
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "image":
            grid = [1, int(rng.choice(IMAGE_SIDES)), int(rng.choice(IMAGE_SIDES))]
            image_grids.append(grid)
            ids += [VISION_START_ID] + [IMAGE_TOKEN_ID] * (grid[1] * grid[2] // unit) + [VISION_END_ID]
        else:
            grid = [int(rng.choice(VIDEO_FRAMES)), int(rng.choice(VIDEO_SIDES)), int(rng.choice(VIDEO_SIDES))]
            video_grids.append(grid)
            frame = [VISION_START_ID] + [VIDEO_TOKEN_ID] * (grid[1] * grid[2] // unit) + [VISION_END_ID]
            if family == "qwen3_vl":
                for _ in range(grid[0]):
                    ids += words(2) + frame  # "<x.x seconds>" stands for 2 text tokens
            else:
                ids += [VISION_START_ID] + [VIDEO_TOKEN_ID] * (grid[0] * grid[1] * grid[2] // unit)
                ids += [VISION_END_ID]
            if family == "qwen2_5_vl":
                seconds.append(float(rng.choice(SECONDS_PER_GRID)))
        ids += words(int(rng.integers(1, text + 1)))

    types = [1 if i == IMAGE_TOKEN_ID else 2 if i == VIDEO_TOKEN_ID else 0 for i in ids]
    example: dict[str, Any] = {
        "input_ids": ids,
        "labels": [IGNORE_INDEX if t else i for i, t in zip(ids, types, strict=True)],
        "mm_token_type_ids": types,
        "pixel_values": _pixels(rng, image_grids),
        "image_grid_thw": np.asarray(image_grids, dtype=np.int64).reshape(-1, 3),
    }
    if videos:
        example["pixel_values_videos"] = _pixels(rng, video_grids)
        example["video_grid_thw"] = np.asarray(video_grids, dtype=np.int64).reshape(-1, 3)
        if family == "qwen2_5_vl":
            example["second_per_grid_ts"] = seconds
    return example


def _pixels(rng: np.random.Generator, grids: list[list[int]]) -> np.ndarray:
    rows = sum(t * h * w for t, h, w in grids)
    return rng.standard_normal((rows, PATCH_DIM)).astype(np.float32)


def _inputs(model: torch.nn.Module, examples: list[dict[str, Any]], pixels: bool = True) -> dict[str, Any]:
    """The model's keyword arguments for ``examples`` concatenated in one row, in document order.

    Without ``pixels``, only the ids, token types, grids and ``second_per_grid_ts`` (what ``get_rope_index``
    reads)."""
    family = _family(model)
    dtype = next(model.parameters()).dtype
    out: dict[str, Any] = {
        "input_ids": torch.tensor([[i for e in examples for i in e["input_ids"]]], dtype=torch.long),
        "mm_token_type_ids": torch.tensor([[t for e in examples for t in e["mm_token_type_ids"]]]),
    }
    images = [e for e in examples if len(e["image_grid_thw"])]
    if images:
        if pixels:
            pixel_values = np.concatenate([e["pixel_values"] for e in images])
            out["pixel_values"] = torch.from_numpy(pixel_values).to(dtype)
        out["image_grid_thw"] = torch.from_numpy(np.concatenate([e["image_grid_thw"] for e in images]))
    videos = [e for e in examples if "video_grid_thw" in e and len(e["video_grid_thw"])]
    if videos:
        if pixels:
            pixel_values = np.concatenate([e["pixel_values_videos"] for e in videos])
            out["pixel_values_videos"] = torch.from_numpy(pixel_values).to(dtype)
        out["video_grid_thw"] = torch.from_numpy(np.concatenate([e["video_grid_thw"] for e in videos]))
        if family == "qwen2_5_vl":
            seconds = [float(s) for e in videos for s in e["second_per_grid_ts"]]
            out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
    return out


def alone(model: torch.nn.Module, example: dict[str, Any]) -> torch.Tensor:
    """Logits ``[n, V]`` of ``example`` alone: batch of 1, no mask, the model's own mRoPE positions."""
    with torch.no_grad():
        return model(**_inputs(model, [example]), use_cache=False).logits[0]


def rope_alone(model: torch.nn.Module, example: dict[str, Any]) -> torch.Tensor:
    """The model's own ``get_rope_index`` positions ``[3, n]`` (t, h, w) of ``example``."""
    inputs = _inputs(model, [example], pixels=False)
    kwargs = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], **kwargs
    )
    return positions[:, 0]


def reference_positions(model: torch.nn.Module, examples: list[dict[str, Any]]) -> torch.Tensor:
    """``[4, 1, N]`` packed positions: row 0 ``0..n_i-1`` per example, rows 1..3 :func:`rope_alone` per example."""
    rows = []
    for example in examples:
        rope = rope_alone(model, example)
        rows.append(torch.cat([torch.arange(rope.shape[1])[None], rope]))
    return torch.cat(rows, dim=1)[:, None]


def packed(model: torch.nn.Module, examples: list[dict[str, Any]], positions: torch.Tensor) -> torch.Tensor:
    """Logits ``[N, V]`` of ``examples`` packed in one row, no mask, ``position_ids=positions`` (``[4, 1, N]``)."""
    inputs = _inputs(model, examples)
    if positions.shape != (4, 1, inputs["input_ids"].shape[1]):
        raise ValueError(
            f"positions must be [4, 1, {inputs['input_ids'].shape[1]}], got {list(positions.shape)}"
        )
    with torch.no_grad():
        return model(**inputs, position_ids=positions, use_cache=False).logits[0]
