"""The cost of a document for the balance planner: ``linear * length + quadratic * length**2``, exact.

The formulas: docs/distributed.md, "The cost model".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from zephon_collate.core.checks import check_int
from zephon_collate.core.text import shown

__all__ = ["COST_LIMIT", "CostModel"]

COST_LIMIT = 2**62
"""The largest total cost a plan may hold (int64 with room for sums and differences)."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """``cost(document) = linear * length + quadratic * length**2`` in integer cost units.

    Parameters:
        linear: cost units per token (the GEMMs), an int >= 0.
        quadratic: cost units per squared token of a document (attention), an int >= 0.
        unit: what one cost unit stands for (FLOPs, seconds); for reports only.
        vision_linear: cost units per vision patch, an int >= 0 (:meth:`vision_costs`).
        vision_quadratic: cost units per squared patch of a frame, an int >= 0 (:meth:`vision_costs`).

    Example:
        >>> model = CostModel(linear=3, quadratic=1)
        >>> model.costs([1, 10, 100]).tolist()
        [4, 130, 10300]
    """

    linear: int
    quadratic: int
    unit: float = 1.0
    vision_linear: int = 0
    vision_quadratic: int = 0

    def __post_init__(self) -> None:
        owner = "CostModel"
        object.__setattr__(self, "linear", check_int(owner, "linear", self.linear, 0))
        object.__setattr__(self, "quadratic", check_int(owner, "quadratic", self.quadratic, 0))
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError("CostModel: linear and quadratic are both 0; give at least one a positive value")
        unit = self.unit
        if isinstance(unit, bool) or not isinstance(unit, (int, float)) or not 0 < unit < math.inf:
            raise ValueError(f"CostModel: unit must be a positive number, got {shown(unit)}")
        for name in ("vision_linear", "vision_quadratic"):
            object.__setattr__(self, name, check_int(owner, name, getattr(self, name), 0))

    def __repr__(self) -> str:
        # The vision coefficients only when set: a text-only model reads (and is saved in sampler
        # states) as it did before they existed.
        text = f"CostModel(linear={self.linear!r}, quadratic={self.quadratic!r}, unit={self.unit!r}"
        if self.vision_linear or self.vision_quadratic:
            text += f", vision_linear={self.vision_linear!r}, vision_quadratic={self.vision_quadratic!r}"
        return text + ")"

    def cost(self, length: int) -> int:
        """The cost of one document of ``length`` tokens, a Python int (exact at any size)."""
        length = check_int("CostModel.cost", "length", length, 0)
        return self.linear * length + self.quadratic * length * length

    def costs(self, lengths: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The costs of documents of ``lengths`` tokens, as int64 (at most :data:`COST_LIMIT`)."""
        values = np.asarray(lengths)
        if values.dtype.kind not in "iu" and values.size:
            raise ValueError(f"CostModel.costs: lengths must be integers, got dtype {values.dtype}")
        exact: npt.NDArray[np.int64] = values.astype(np.int64, copy=False)
        if exact.size and int(exact.min()) < 0:
            raise ValueError(f"CostModel.costs: lengths must be >= 0, got {int(exact.min())}")
        if exact.size:
            longest = int(exact.max())
            if self.linear * longest + self.quadratic * longest * longest > COST_LIMIT:
                raise ValueError(
                    f"CostModel.costs: a document of {longest} tokens costs more than 2**62 units; use "
                    "coarser coefficients (divide linear and quadratic by a common factor)"
                )
        return self.linear * exact + self.quadratic * exact * exact

    def vision_costs(self, grids: Iterable[npt.ArrayLike]) -> npt.NDArray[np.int64]:
        """The vision tower's cost of each document, as int64: ``extra_costs`` for the planner.

        Parameters:
            grids: one ``[n_i, 3]`` array-like of ``(t, h, w)`` rows per document (``[]`` without media).

        Example:
            >>> model = CostModel(linear=1, quadratic=0, vision_linear=10, vision_quadratic=1)
            >>> grids = [[[1, 4, 6]], [], [[2, 2, 2], [1, 2, 2]]]  # an image; no media; a video and an image
            >>> model.vision_costs(grids).tolist()  # 10*24 + 24**2; 0; (10*8 + 2*4**2) + (10*4 + 4**2)
            [816, 0, 168]
        """
        owner = "CostModel.vision_costs"
        if isinstance(grids, (str, bytes, Mapping)) or not isinstance(grids, Iterable):
            raise TypeError(
                f"{owner}: grids must be a sequence with one [n, 3] array of (t, h, w) per document, got "
                f"{shown(grids)}"
            )
        out: list[int] = []
        for index, grid in enumerate(grids):
            array = np.asarray(grid)
            if array.size == 0:
                out.append(0)
                continue
            if array.dtype.kind not in "iu":
                raise TypeError(f"{owner}: grids[{index}] must hold ints (t, h, w), got dtype {array.dtype}")
            if array.ndim != 2 or array.shape[1] != 3:
                raise ValueError(
                    f"{owner}: grids[{index}] must have shape [n, 3] (one (t, h, w) row per image or "
                    f"video), got shape {list(array.shape)}"
                )
            if int(array.min()) < 1:
                raise ValueError(f"{owner}: grids[{index}] holds {int(array.min())}; t, h and w must be >= 1")
            total = 0
            for t, h, w in array.tolist():  # Python ints: exact at any size
                patches = h * w
                total += t * (self.vision_linear * patches + self.vision_quadratic * patches * patches)
            if total > COST_LIMIT:
                raise ValueError(
                    f"{owner}: the media of document {index} cost more than 2**62 units; use coarser "
                    "coefficients (divide all four by a common factor)"
                )
            out.append(total)
        return np.array(out, dtype=np.int64)

    def tree_costs(self, positions: Iterable[npt.ArrayLike]) -> npt.NDArray[np.int64]:
        """Each tree's cost from its tokens' positions, as int64: ``costs`` for the planner.

        Parameters:
            positions: one 1-D array-like of ints per tree (its ``position_ids``).

        Example:
            >>> model = CostModel(linear=1, quadratic=1)
            >>> prompt_and_two = [0, 1, 2, 3, 2, 3]  # a 2-token prompt, two completions of 2 tokens
            >>> model.tree_costs([prompt_and_two, [0, 1, 2, 3]]).tolist()  # 6 + (2*11 + 6); 4 + 4**2
            [34, 20]
        """
        owner = "CostModel.tree_costs"
        if isinstance(positions, (str, bytes, Mapping)) or not isinstance(positions, Iterable):
            raise TypeError(
                f"{owner}: positions must be a sequence with one 1-D array of positions per tree, got "
                f"{shown(positions)}"
            )
        out: list[int] = []
        for index, tree in enumerate(positions):
            array = np.asarray(tree)
            if array.ndim == 1 and array.size == 0:
                out.append(0)
                continue
            if array.dtype.kind not in "iu":
                raise TypeError(f"{owner}: positions[{index}] must hold ints, got dtype {array.dtype}")
            if array.ndim != 1:
                raise ValueError(
                    f"{owner}: positions[{index}] must be 1-D (one tree's positions), got shape "
                    f"{list(array.shape)}; for a single tree pass [positions]"
                )
            tokens = int(array.size)
            lowest, highest = int(array.min()), int(array.max())
            if lowest < 0:
                raise ValueError(f"{owner}: positions[{index}] holds {lowest}; positions must be >= 0")
            # A tree of T tokens is at most T deep: checked first, so bincount allocates at most T counts.
            if (
                highest >= tokens
                or not np.bincount(array.astype(np.int64), minlength=tokens)[: highest + 1].all()
            ):
                seen = np.unique(array)
                missing = int(np.flatnonzero(seen != np.arange(seen.size))[0])  # the first position absent
                raise ValueError(
                    f"{owner}: positions[{index}] has a token at position {highest} but none at {missing}, "
                    "so it is not one tree's positions (each token's ancestors are at 0 .. p - 1); pass each "
                    "tree's position_ids (split a row by document_ids), not lengths or offsets"
                )
            # sum(p) < T**2: int64 is exact below 2**31 tokens, Python ints beyond.
            total = int(array.sum(dtype=np.int64)) if tokens < 2**31 else sum(array.tolist())
            cost = self.linear * tokens + self.quadratic * (2 * total + tokens)
            if cost > COST_LIMIT:
                raise ValueError(
                    f"{owner}: tree {index} ({tokens} tokens) costs more than 2**62 units; use coarser "
                    "coefficients (divide linear and quadratic by a common factor)"
                )
            out.append(cost)
        return np.array(out, dtype=np.int64)

    def attention_share(self, length: int) -> float:
        """The quadratic term's share of a ``length``-token document's cost (0 to 1)."""
        total = self.cost(length)
        return self.quadratic * length * length / total if total else 0.0

    @classmethod
    def from_model(
        cls,
        config: Any = None,
        /,
        *,
        hidden_size: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        gated: bool = True,
        causal: bool = True,
        vocab_size: int | None = None,
        train_vision: bool = True,
    ) -> CostModel:
        """The forward + backward FLOPs of a decoder-only transformer (and its vision tower), per document.

        Parameters:
            config: a Hugging Face model config, positional, or ``None`` (an argument given here wins).
            hidden_size, num_layers, num_heads, ffn_hidden_size: the dimensions (required without ``config``;
                for a mixture of experts, ``ffn_hidden_size`` is the active experts' width).
            num_kv_heads: key/value heads (default ``num_heads``).
            head_dim: per-head width (default ``hidden_size // num_heads``).
            gated: a gated MLP (three matrices) or a plain one (two).
            causal: causal attention or full.
            vocab_size: add the output layer's GEMM (default 0, or the config's).
            train_vision: the vision tower is trained (forward + backward) or frozen (forward).

        Example:
            >>> llama = CostModel.from_model(hidden_size=4096, num_layers=32, num_heads=32,
            ...     num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256)
            >>> llama.linear, llama.quadratic, llama.unit
            (343536, 7, 131072)
        """
        owner = "CostModel.from_model"
        text = _text_config(config)
        for name, flag in (("gated", gated), ("causal", causal), ("train_vision", train_vision)):
            if not isinstance(flag, bool):
                raise TypeError(f"{owner}: {name} must be a bool, got {shown(flag)}")
        if text is not None and ffn_hidden_size is None:
            experts = [key for key in _EXPERT_KEYS if getattr(text, key, None)]
            if experts:
                raise ValueError(
                    f"{owner}: the config describes a mixture of experts ({experts[0]}="
                    f"{shown(getattr(text, experts[0]))}); intermediate_size is not the work per token: "
                    "give ffn_hidden_size= (the width of the experts each token runs, shared ones included)"
                )
        hidden = _dimension(owner, text, "hidden_size", hidden_size, "hidden_size")
        layers = _dimension(owner, text, "num_layers", num_layers, "num_hidden_layers")
        heads = _dimension(owner, text, "num_heads", num_heads, "num_attention_heads")
        ffn = _dimension(owner, text, "ffn_hidden_size", ffn_hidden_size, "intermediate_size")
        kv_heads = _dimension(owner, text, "num_kv_heads", num_kv_heads, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"{owner}: num_kv_heads={kv_heads} must divide num_heads={heads}")
        width = _dimension(owner, text, "head_dim", head_dim, "head_dim", hidden // heads)
        if width < 1:
            raise ValueError(f"{owner}: hidden_size={hidden} < num_heads={heads}; pass head_dim")
        vocab = _dimension(owner, text, "vocab_size", vocab_size, "vocab_size", 0, minimum=0)
        query, key_value = heads * width, kv_heads * width
        per_layer = hidden * (query + 2 * key_value) + query * hidden + hidden * ffn * (3 if gated else 2)
        linear = 6 * (layers * per_layer + hidden * vocab)
        quadratic = layers * query * (7 if causal else 14)
        vision = getattr(config, "vision_config", None)
        vision_linear, vision_quadratic = (
            (0, 0) if vision is None else _vision_flops(config, vision, train_vision)
        )
        unit = math.gcd(linear, quadratic, vision_linear, vision_quadratic)
        return cls(
            linear=linear // unit,
            quadratic=quadratic // unit,
            unit=unit,
            vision_linear=vision_linear // unit,
            vision_quadratic=vision_quadratic // unit,
        )

    @classmethod
    def from_coefficients(cls, linear: float, quadratic: float, *, max_denominator: int = 4096) -> CostModel:
        """Integer coefficients in the ratio of measured ones (kept as a fraction up to ``max_denominator``).

        Example:
            >>> CostModel.from_coefficients(2.5e-7, 1e-10)  # seconds per token, per squared token
            CostModel(linear=2500, quadratic=1, unit=1e-10)
        """
        for name, value in (("linear", linear), ("quadratic", quadratic)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(
                    f"CostModel.from_coefficients: {name} must be a finite number >= 0, got {shown(value)}"
                )
        if quadratic == 0:
            if linear == 0:
                raise ValueError("CostModel.from_coefficients: linear and quadratic are both 0")
            return cls(linear=1, quadratic=0, unit=float(linear))
        if linear == 0:
            return cls(linear=0, quadratic=1, unit=float(quadratic))
        ratio = Fraction(linear / quadratic).limit_denominator(max_denominator)
        if ratio == 0:  # the linear term is negligible at this resolution
            return cls(linear=0, quadratic=1, unit=float(quadratic))
        return cls(linear=ratio.numerator, quadratic=ratio.denominator, unit=quadratic / ratio.denominator)

    @classmethod
    def fit(cls, tokens: Sequence[int], squared_tokens: Sequence[int], seconds: Sequence[float]) -> CostModel:
        """Least-squares coefficients from measured step times: ``seconds ~ c + a * tokens + b * squared``.

        Parameters:
            tokens: each measured micro-batch's token count.
            squared_tokens: each one's sum of squared document lengths.
            seconds: each one's measured time (at least 3, all finite).

        Example:
            >>> sizes = [[100], [50, 50], [200], [10] * 20]
            >>> tokens = [sum(s) for s in sizes]
            >>> squared = [sum(n * n for n in s) for s in sizes]
            >>> seconds = [0.01 + 4e-4 * n + 2e-6 * q for n, q in zip(tokens, squared)]
            >>> model = CostModel.fit(tokens, squared, seconds)
            >>> model.linear, model.quadratic, f"{model.unit:.3g} s"
            (200, 1, '2e-06 s')
        """
        n = len(seconds)
        if not len(tokens) == len(squared_tokens) == n:
            raise ValueError(
                f"CostModel.fit: tokens, squared_tokens and seconds differ in length "
                f"({len(tokens)}, {len(squared_tokens)}, {n})"
            )
        if n < 3:
            raise ValueError(f"CostModel.fit: needs at least 3 measurements, got {n}")
        design = np.column_stack(
            [np.ones(n), _measured(tokens, "tokens"), _measured(squared_tokens, "squared_tokens")]
        )
        target = _measured(seconds, "seconds")
        coefficients = np.linalg.lstsq(design, target, rcond=None)[0]
        linear, quadratic = float(coefficients[1]), float(coefficients[2])
        if linear < 0 or quadratic < 0:  # refit with the offending term dropped
            keep = 1 if linear >= quadratic else 2
            single = np.linalg.lstsq(design[:, [0, keep]], target, rcond=None)[0]
            value = max(float(single[1]), 0.0)
            linear, quadratic = (value, 0.0) if keep == 1 else (0.0, value)
        if linear == 0 and quadratic == 0:
            raise ValueError("CostModel.fit: the times do not grow with tokens; measure larger batches")
        return cls.from_coefficients(linear, quadratic)


_EXPERT_KEYS = (
    "num_experts_per_tok",
    "num_local_experts",
    "n_routed_experts",
    "num_experts",
    "moe_num_experts",
)
"""Config attributes of a mixture of experts, whose ``intermediate_size`` is not the work per token."""

_VISION_FAMILIES = {"qwen2_vl": False, "qwen2_5_vl": True, "qwen3_vl": False, "qwen3_vl_moe": False}
"""The vision-language ``model_type`` s :meth:`CostModel.from_model` counts: is the tower's MLP gated."""


def _text_config(config: Any) -> Any:
    """The text part of a config: ``get_text_config()``, else ``text_config``, else the config itself."""
    if config is None:
        return None
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter()
    return getattr(config, "text_config", None) or config


def _dimension(
    owner: str,
    text: Any,
    name: str,
    given: object,
    attribute: str,
    default: int | None = None,
    minimum: int = 1,
) -> int:
    """A :meth:`CostModel.from_model` argument: as given, else the config's, else ``default``."""
    if given is not None:
        return check_int(owner, name, given, minimum)
    value = getattr(text, attribute, None)  # None without a config
    if value is not None:
        return check_int(owner, f"{name} (config.{attribute})", value, minimum)
    if default is not None:
        return default
    where = f"; the config has no {attribute}" if text is not None else " (or a model config)"
    raise TypeError(f"{owner}: give {name}={where}")


def _vision_flops(config: Any, vision: Any, train: bool) -> tuple[int, int]:
    """The vision tower's FLOPs per patch and per squared patch of a frame (:meth:`CostModel.from_model`)."""
    owner = "CostModel.from_model"
    kind = getattr(config, "model_type", None)
    if kind not in _VISION_FAMILIES:
        raise ValueError(
            f"{owner}: the config has a vision_config, but its model_type {shown(kind)} is not one of "
            f"{sorted(_VISION_FAMILIES)}; count that tower by hand (CostModel(..., vision_linear=, "
            "vision_quadratic=)) or pass its text config for the text terms alone"
        )

    def dim(attribute: str) -> int:
        return check_int(owner, f"vision_config.{attribute}", getattr(vision, attribute, None), 1)

    if getattr(vision, "embed_dim", None) is not None:  # Qwen2-VL: hidden_size is the merger's output
        width, out = dim("embed_dim"), dim("hidden_size")
    else:
        width, out = dim("hidden_size"), dim("out_hidden_size")
    depth, merge, patch = dim("depth"), dim("spatial_merge_size"), dim("patch_size")
    if getattr(vision, "intermediate_size", None) is not None:
        ffn = dim("intermediate_size")
    else:  # Qwen2-VL: int(embed_dim * mlp_ratio), as its VisionMlp
        ratio = getattr(vision, "mlp_ratio", None)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf:
            raise ValueError(
                f"{owner}: vision_config.mlp_ratio must be a positive number, got {shown(ratio)}"
            )
        ffn = check_int(owner, "vision_config.embed_dim * mlp_ratio", int(width * ratio), 1)
    embed = dim("in_channels") * dim("temporal_patch_size") * patch * patch * width
    layer = 4 * width * width + width * ffn * (3 if _VISION_FAMILIES[kind] else 2)
    mergers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or ())
    merger = width * width * merge * merge + width * out
    full_layers, window = depth, 0
    indexes = getattr(vision, "fullatt_block_indexes", None)
    if indexes is not None and getattr(vision, "window_size", None):
        full_layers = len({int(i) for i in indexes if 0 <= int(i) < depth})
        side = dim("window_size") // (merge * patch) * merge
        if side < 1:
            raise ValueError(
                f"{owner}: vision_config.window_size is below one merged patch ({merge * patch})"
            )
        window = side * side
    gemm, attention = (6, 14) if train else (2, 4)
    linear = (
        gemm * (embed + depth * layer + mergers * merger) + (depth - full_layers) * attention * width * window
    )
    return linear, full_layers * attention * width


def _measured(values: Sequence[float], name: str) -> npt.NDArray[np.float64]:
    """One of :meth:`CostModel.fit`'s sequences as float64, every measurement a finite number."""
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iuf":
        raise TypeError(
            f"CostModel.fit: {name} must be a sequence of numbers (one per measured micro-batch), got "
            f"{shown(values)}"
        )
    measured: npt.NDArray[np.float64] = array.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(measured))
    if bad.size:
        raise ValueError(
            f"CostModel.fit: {name}[{int(bad[0])}] is {measured[bad[0]]}; every measurement must be a finite "
            "number: drop the failed measurement (and its entries in the other sequences)"
        )
    return measured
