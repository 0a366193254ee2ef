"""Vision-language media, read as fields of their document, and mRoPE positions (docs/vision_language.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from zephon_collate.core.keys import ATTENTION_MASK, MEDIA, MM_TOKEN_TYPE_IDS
from zephon_collate.core.text import shown
from zephon_collate.read.columns import Batch, Names, Ragged, Spread, as_numpy, filled

__all__ = [
    "COUNTS",
    "CU_SEQLENS",
    "GRIDS",
    "MEDIA",
    "MM_TOKEN_TYPE_IDS",
    "MROPE_POSITIONS",
    "PIXELS",
    "SECONDS",
    "MRope",
    "Media",
    "Rule",
    "VideoTime",
    "mrope_positions",
    "read_media",
    "with_dummy_image",
]

MROPE_POSITIONS = "mrope_positions"
"""The chain's internal ``[B, S, 3]`` planes, joined into ``position_ids`` by ``MRopePositions``."""
PIXELS = {1: "pixel_values", 2: "pixel_values_videos"}
GRIDS = {1: "image_grid_thw", 2: "video_grid_thw"}
CU_SEQLENS = {1: "image_cu_seqlens", 2: "video_cu_seqlens"}
COUNTS = {1: "image_counts", 2: "video_counts"}
SECONDS = "second_per_grid_ts"
VideoTime: TypeAlias = Literal["index", "seconds", "frames"]
"""How a video's frames are numbered: Qwen2-VL's ``"index"``, Qwen2.5-VL's ``"seconds"``, Qwen3-VL's
``"frames"`` (each frame its own run)."""
Rule: TypeAlias = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
"""A model's own rule, one example at a time: ``(input_ids [n], mm_token_type_ids [n], image_grid_thw
[images, 3], video_grid_thw [videos, 3], second_per_grid_ts [videos]) -> positions [3, n]``."""
_FAMILIES: dict[str, VideoTime] = {
    "qwen2_vl": "index",
    "qwen2_5_vl": "seconds",
    "qwen3_vl": "frames",
    "qwen3_vl_moe": "frames",
}


@dataclass(frozen=True)
class MRope:
    """The mRoPE rule of a Qwen-VL model, or a hook for another model's.

    Parameters:
        spatial_merge_size: patches merged per side into one token (``vision_config.spatial_merge_size``).
        video_time: ``"index"`` (Qwen2-VL), ``"seconds"`` (Qwen2.5-VL) or ``"frames"`` (Qwen3-VL).
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second`` (``"seconds"`` only).
        rule: another model's rule, run on each example (:data:`Rule`); ``None``: the built-in one.
        dummy_image: ``(image_token_id, pixel_width)``: a one-token image for batches without media (FSDP).
        vision_cu_seqlens: also emit ``image_cu_seqlens`` / ``video_cu_seqlens`` (each frame a segment).

    Example:
        >>> MRope(spatial_merge_size=2, video_time="seconds", tokens_per_second=2.0).video_time
        'seconds'
    """

    spatial_merge_size: int = 2
    video_time: VideoTime = "seconds"
    tokens_per_second: float = 2.0
    rule: Rule | None = None
    dummy_image: tuple[int, int] | None = None
    vision_cu_seqlens: bool = False

    def __post_init__(self) -> None:
        merge = self.spatial_merge_size
        if type(merge) is not int or merge < 1:
            raise TypeError(f"MRope: spatial_merge_size must be an int >= 1, got {shown(merge)}")
        if self.video_time not in ("index", "seconds", "frames"):
            raise ValueError(
                f"MRope: video_time must be 'index', 'seconds' or 'frames', got {shown(self.video_time)}"
            )
        rate = self.tokens_per_second
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"MRope: tokens_per_second must be a number > 0, got {shown(rate)}")
        if self.rule is not None and not callable(self.rule):
            raise TypeError(f"MRope: rule must be a function, got {shown(self.rule)}")
        if not isinstance(self.vision_cu_seqlens, bool):
            raise TypeError(f"MRope: vision_cu_seqlens must be a bool, got {shown(self.vision_cu_seqlens)}")
        dummy = self.dummy_image
        if dummy is not None and (
            not isinstance(dummy, tuple) or len(dummy) != 2 or any(type(v) is not int or v < 1 for v in dummy)
        ):
            raise TypeError(
                f"MRope: dummy_image must be (image_token_id, pixel_width), two ints >= 1, got {shown(dummy)}"
            )

    @classmethod
    def from_config(cls, config: Any, *, dummy_image: bool = False) -> MRope:
        """The rule of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL ``model.config`` (and its ``dummy_image``); for
        another ``model_type``, ``ValueError`` (give ``MRope(rule=...)``)."""
        kind = getattr(config, "model_type", None)
        if kind not in _FAMILIES:
            raise ValueError(
                f"MRope.from_config: model_type {shown(kind)} is not one of {sorted(_FAMILIES)}; give "
                "MRope(rule=...) with that model's rule"
            )
        vision = config.vision_config
        rate = float(getattr(vision, "tokens_per_second", 2.0) or 2.0)
        dummy = None
        if dummy_image:
            width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
            dummy = (int(config.image_token_id), width)
        return cls(int(vision.spatial_merge_size), _FAMILIES[kind], rate, dummy_image=dummy)


@dataclass(frozen=True)
class Media:
    """A batch's media per example, by modality (1 image, 2 video): pixels, grids and seconds."""

    pixels: Mapping[int, list[np.ndarray]]
    grids: Mapping[int, list[np.ndarray]]
    seconds: list[np.ndarray]

    @property
    def empty(self) -> bool:
        """True when no example holds an image or a video."""
        return not any(grid.shape[0] for modality in (1, 2) for grid in self.grids[modality])

    def joined(self, cu_seqlens: bool = False) -> dict[str, np.ndarray]:
        """The media fields, each example's end to end in document order, with each example's count. With
        ``cu_seqlens``, each modality's vision attention boundaries too (one segment per frame)."""
        out: dict[str, np.ndarray] = {}
        for modality in (1, 2):
            if any(grid.shape[0] for grid in self.grids[modality]):
                out[PIXELS[modality]] = np.concatenate([p for p in self.pixels[modality] if p.shape[0]])
                grid = out[GRIDS[modality]] = np.concatenate(self.grids[modality]).astype(np.int64)
                out[COUNTS[modality]] = np.array([g.shape[0] for g in self.grids[modality]], dtype=np.int64)
                if cu_seqlens:
                    frames = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
                    bounds = np.zeros(frames.size + 1, dtype=np.int32)
                    np.cumsum(frames, out=bounds[1:])
                    out[CU_SEQLENS[modality]] = bounds
        if any(seconds.size for seconds in self.seconds):  # float32, as the processors give it: the
            out[SECONDS] = np.concatenate(self.seconds).astype(np.float32)  # model rounds times in it
        return out


def with_dummy_image(
    fields: dict[str, Ragged], fills: Mapping[str, int | float | Spread], media: Media, mrope: MRope
) -> tuple[dict[str, Ragged], Media]:
    """``fields`` and ``media`` with one more document: a single-token image of zeros (``MRope.dummy_image``).

    Example:
        >>> from zephon_collate.read.columns import concat
        >>> fields = {"input_ids": concat([np.array([5, 6])], "input_ids", str),
        ...           "mm_token_type_ids": concat([np.array([0, 0])], "mm_token_type_ids", str)}
        >>> media = Media({1: [np.zeros((0, 0))], 2: [np.zeros((0, 0))]},
        ...               {1: [np.zeros((0, 3), np.int64)], 2: [np.zeros((0, 3), np.int64)]}, [np.zeros(0)])
        >>> more, media = with_dummy_image(fields, {}, media, MRope(dummy_image=(99, 12)))
        >>> more["input_ids"].values.tolist(), media.joined()["image_grid_thw"].tolist()
        ([5, 6, 99], [[1, 2, 2]])
    """
    assert mrope.dummy_image is not None
    token, width = mrope.dummy_image
    merge = mrope.spatial_merge_size
    given = {"input_ids": token, MM_TOKEN_TYPE_IDS: 1, **fills}
    mask = fields.get(ATTENTION_MASK)
    place = int(fields["input_ids"].offsets[-1]) if mask is None else int(np.count_nonzero(mask.host))
    out = {}
    for name, field in fields.items():
        values = np.asarray(field.values)
        one = filled((1, *values.shape[1:]), given.get(name, 0), values.dtype, at=np.array([place]))
        out[name] = Ragged(np.concatenate([values, one]), np.append(field.offsets, field.offsets[-1] + 1))
    # The dummy document's media: one image of merge x merge patches, no video.
    image, video = np.zeros((merge * merge, width), np.float32), np.zeros((0, width), np.float32)
    pixels = {1: [*media.pixels[1], image], 2: [*media.pixels[2], video]}
    no_video = np.zeros((0, 3), np.int64)
    grids = {1: [*media.grids[1], np.array([[1, merge, merge]], np.int64)], 2: [*media.grids[2], no_video]}
    return out, Media(pixels, grids, [*media.seconds, np.zeros(0)])


def read_media(batch: Batch, names: Names, mrope: MRope) -> Media:
    """Each example's media, checked (grids, pixels per patch, one width across the batch)."""
    rows = batch.rows
    pixels: dict[int, list[np.ndarray]] = {}
    grids: dict[int, list[np.ndarray]] = {}
    for modality in (1, 2):
        grid_name, pixel_name = GRIDS[modality], PIXELS[modality]
        given_grids = batch.objects(grid_name) if grid_name in batch else [None] * rows
        given_pixels = batch.objects(pixel_name) if pixel_name in batch else [None] * rows
        stored = batch.stored_dtype(pixel_name) if pixel_name in batch else None
        grids[modality], pixels[modality] = [], []
        width: tuple[int, ...] | None = None
        for index, (grid_value, pixel_value) in enumerate(zip(given_grids, given_pixels, strict=True)):
            grid = _grid(grid_value, index, grid_name, names, mrope.spatial_merge_size)
            patches = int(grid.prod(axis=1).sum()) if grid.size else 0
            pixel = None if pixel_value is None else _array(pixel_value, index, pixel_name, names)
            if pixel is not None and isinstance(pixel_value, (list, tuple)) and pixel.dtype.kind == "f":
                pixel = pixel.astype(np.float32 if stored is None else stored)  # the column's, or torch's
            if pixel is not None and pixel.size == 0 and not patches:
                pixel = None  # an empty list: a table's row without images holds no pixels
            if pixel is None:
                if patches:
                    raise ValueError(
                        f"{names(index)}: has {shown(grid_name)} of {grid.shape[0]} grids but no "
                        f"{shown(pixel_name)}; give the pixels of each, as the processor returns them"
                    )
                pixel = np.zeros((0, *(width or (0,))), np.float32)
            else:
                if pixel.ndim < 2 or pixel.shape[0] != patches:
                    raise ValueError(
                        f"{names(index)}: {shown(pixel_name)} has shape {tuple(pixel.shape)}, but its "
                        f"{shown(grid_name)} {shown(grid.tolist())} holds {patches} patches (t * h * w); "
                        "give one row per patch, as the processor returns them"
                    )
                if width is not None and pixel.shape[0] and pixel.shape[1:] != width:
                    raise ValueError(
                        f"{names(index)}: {shown(pixel_name)} rows hold {pixel.shape[1:]}, the batch's first "
                        f"{width}; give every example's pixels from one processor"
                    )
                width = width or (tuple(pixel.shape[1:]) if pixel.shape[0] else None)
            grids[modality].append(grid)
            pixels[modality].append(pixel)
    seconds = [np.zeros(0, np.float64)] * rows
    if SECONDS in batch:
        seconds = []
        for index, value in enumerate(batch.objects(SECONDS)):
            given = np.zeros(0) if value is None else _array(value, index, SECONDS, names).reshape(-1)
            if given.size != grids[2][index].shape[0]:
                raise ValueError(
                    f"{names(index)}: {shown(SECONDS)} holds {given.size} values for "
                    f"{grids[2][index].shape[0]} videos; give one per video"
                )
            seconds.append(given.astype(np.float64))
    return Media(pixels, grids, seconds)


def mrope_positions(
    tokens: Ragged,
    types: Ragged,
    media: Media,
    mrope: MRope,
    names: Names,
    documents: np.ndarray | None = None,
) -> np.ndarray:
    """``[N, 3]`` int64: each token's (t, h, w) position, every document from 0 (docs/vision_language.md).

    ``documents`` (``[N]`` booleans) marks each document's first token (an example packed of several
    documents); ``None``: each example is one document.

    Example:
        >>> from zephon_collate.read.columns import concat
        >>> tokens = concat([np.array([5, 9, 9, 9, 9, 6])], "input_ids", str)
        >>> types = concat([np.array([0, 1, 1, 1, 1, 0])], "mm_token_type_ids", str)
        >>> media = Media({1: [np.zeros((16, 3))], 2: [np.zeros((0, 3))]},
        ...               {1: [np.array([[1, 4, 4]])], 2: [np.zeros((0, 3), np.int64)]}, [np.zeros(0)])
        >>> mrope_positions(tokens, types, media, MRope(), str).T.tolist()
        [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    """
    kind = np.asarray(types.values).astype(np.int64)
    bad = np.flatnonzero((kind < 0) | (kind > 2))
    offsets = tokens.offsets
    if bad.size:
        row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise ValueError(
            f"{names(row)}: {shown(MM_TOKEN_TYPE_IDS)} holds {int(kind[bad[0]])} at "
            f"{MM_TOKEN_TYPE_IDS}[{int(bad[0] - offsets[row])}]; give 0 (text), 1 (image) or 2 (video)"
        )
    count = kind.size
    first = np.zeros(count, dtype=bool) if documents is None else documents.copy()
    first[offsets[:-1][offsets[:-1] < count]] = True  # each example's first token opens a document
    if mrope.rule is not None:  # run on each example, each document then starting as the example's first
        planes = _by_rule(tokens, kind, media, mrope.rule)
        document = np.maximum.accumulate(np.where(first, np.arange(count), 0))  # its first token
        shifted: np.ndarray = planes - planes[document] + planes[np.repeat(offsets[:-1], tokens.lengths)]
        return shifted
    opens = first.copy()  # a run opens at a type change or a document's first token
    opens[1:] |= kind[1:] != kind[:-1]
    document_starts = np.flatnonzero(first)
    starts = np.flatnonzero(opens)
    ends = np.append(starts[1:], count)
    run_kind = kind[starts]
    run_example = np.searchsorted(offsets, starts, side="right") - 1
    grid, interval = _run_grids(run_kind, run_example, media, mrope, names)
    merge = mrope.spatial_merge_size
    lh, lw = grid[:, 1] // merge, grid[:, 2] // merge
    vision = run_kind != 0
    wanted = np.where(vision, grid[:, 0] * lh * lw, ends - starts)
    wrong = np.flatnonzero(wanted != ends - starts)
    if wrong.size:
        bad_run = int(wrong[0])
        row = int(run_example[bad_run])
        name = "image" if run_kind[bad_run] == 1 else "video"
        raise ValueError(
            f"{names(row)}: a run of {int(ends[bad_run] - starts[bad_run])} {name} placeholder tokens at "
            f"input_ids[{int(starts[bad_run] - offsets[row])}], but its grid "
            f"{shown(grid[bad_run].tolist())} needs {int(wanted[bad_run])} (t * h * w / "
            f"spatial_merge_size**2 = {merge}**2); give every "
            f"{name} all its placeholder tokens (a truncation must not cut them)"
        )
    advance = np.where(vision, np.maximum(lh, lw), ends - starts)
    before = np.cumsum(advance) - advance  # where each run starts, counted over the whole batch
    first_run = np.searchsorted(starts, document_starts)  # each document's first run (a run opens there)
    run_document = np.searchsorted(document_starts, starts, side="right") - 1
    opened: np.ndarray = before - before[first_run][run_document]  # each run's start, from its document's
    run = np.repeat(np.arange(starts.size), ends - starts)
    within = np.arange(count) - starts[run]
    plane = lh[run] * lw[run]
    safe_plane, safe_w, safe_h = np.maximum(plane, 1), np.maximum(lw[run], 1), np.maximum(lh[run], 1)
    t_index = within // safe_plane
    t = (t_index.astype(np.float32) * interval[run]).astype(np.int64)
    h = (within // safe_w) % safe_h
    w = within % safe_w
    text = ~vision[run]
    return opened[run][:, None] + np.where(text[:, None], within[:, None], np.stack([t, h, w], axis=1))


def _run_grids(
    run_kind: np.ndarray, run_example: np.ndarray, media: Media, mrope: MRope, names: Names
) -> tuple[np.ndarray, np.ndarray]:
    """Each run's grid ``[runs, 3]`` (text runs: ones) and time interval ``[runs]``, counts checked."""
    grid = np.ones((run_kind.size, 3), dtype=np.int64)
    interval = np.ones(run_kind.size, dtype=np.float32)
    examples = len(media.seconds)
    for modality in (1, 2):
        grids = media.grids[modality]
        times = [np.ones(g.shape[0], np.float32) for g in grids]
        if modality == 2 and mrope.video_time == "frames":  # Qwen3-VL: each frame a run of its own
            times = [np.ones(int(g[:, 0].sum()), np.float32) for g in grids]
            grids = [
                np.repeat(np.column_stack([np.ones(len(g), np.int64), g[:, 1:]]), g[:, 0], axis=0)
                for g in grids
            ]
        elif modality == 2 and mrope.video_time == "seconds":
            times = [
                np.float32(mrope.tokens_per_second)
                * (seconds.astype(np.float32) if seconds.size else np.ones(g.shape[0], np.float32))
                for g, seconds in zip(grids, media.seconds, strict=True)
            ]
        runs = run_kind == modality
        counts = np.bincount(run_example[runs], minlength=examples)
        for row in np.flatnonzero(counts != np.array([g.shape[0] for g in grids], dtype=np.int64)):
            name = "image" if modality == 1 else "video frame" if mrope.video_time == "frames" else "video"
            raise ValueError(
                f"{names(int(row))}: holds {int(counts[row])} runs of {name} placeholder tokens "
                f"({shown(MM_TOKEN_TYPE_IDS)} = {modality}) but {grids[row].shape[0]} {name} grids in "
                f"{shown(GRIDS[modality])}; give each {name} its grid and its run of placeholders"
            )
        if runs.any():
            grid[runs] = np.concatenate(grids)
            interval[runs] = np.concatenate(times)
    return grid, interval


def _by_rule(tokens: Ragged, kind: np.ndarray, media: Media, rule: Rule) -> np.ndarray:
    """The positions of a model's own rule, document by document."""
    values, offsets = np.asarray(tokens.values), tokens.offsets
    parts = []
    for row in range(len(offsets) - 1):
        start, end = int(offsets[row]), int(offsets[row + 1])
        found = rule(
            values[start:end], kind[start:end], media.grids[1][row], media.grids[2][row], media.seconds[row]
        )
        parts.append(np.asarray(found, dtype=np.int64).reshape(3, end - start).T)
    return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)


def _array(value: object, index: int, name: str, names: Names) -> np.ndarray:
    try:
        array = as_numpy(value) if isinstance(value, torch.Tensor) else np.asarray(value)
    except (TypeError, ValueError):
        raise TypeError(f"{names(index)}: {shown(name)} is not an array of numbers") from None
    if array.size == 0 and array.dtype.kind == "O":  # a table's empty row (datasets' NumPy format)
        return array.astype(np.float64)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{names(index)}: {shown(name)} holds {array.dtype}, not numbers")
    return array


def _grid(value: object, index: int, name: str, names: Names, merge: int) -> np.ndarray:
    """An example's grids ``[n, 3]`` (none: ``[0, 3]``), positive ints, h and w divisible by ``merge``."""
    if value is None:
        return np.zeros((0, 3), dtype=np.int64)
    grid = _array(value, index, name, names)
    if grid.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu":
        raise ValueError(
            f"{names(index)}: {shown(name)} has shape {tuple(grid.shape)} ({grid.dtype}); give [n, 3] "
            "integers (t, h, w) per image or video"
        )
    if (grid < 1).any() or (grid[:, 1:] % merge).any():
        raise ValueError(
            f"{names(index)}: {shown(name)} holds {shown(grid.tolist())}; each t, h, w must be >= 1, and "
            f"h, w multiples of spatial_merge_size={merge}"
        )
    return grid.astype(np.int64)
