"""The cost of a document: ``linear * length + quadratic * length**2``, in exact integers.

Packed training with a varlen or block-sparse attention kernel does work in
proportion to its tokens (every GEMM: projections, MLP, logits) plus work in
proportion to the sum of its documents' squared lengths (attention stays inside
each document). Two ranks with the same token count can therefore do very
different work. :class:`CostModel` holds the two coefficients as integers, so
every cost, sum and comparison a plan makes is exact and the same on every
rank: built from a model's dimensions (:meth:`CostModel.from_model`), from
measured coefficients (:meth:`CostModel.from_coefficients`) or fitted to
measured step times (:meth:`CostModel.fit`).

Vision-language documents also run the vision tower (ViT) over their images:
``vision_linear`` per patch plus ``vision_quadratic`` per squared patch of each
attention segment (a frame). :meth:`CostModel.vision_costs` turns each
document's grids into that cost, which the planner adds to the document's own
(``extra_costs``).

A tree of sequences that share prefixes (``Collator.for_trees``) is not a flat
document: a token at position ``p`` along its path attends to ``p + 1`` keys, not
to every earlier token of the row. :meth:`CostModel.tree_costs` prices each tree
from its tokens' positions, in the same units, and the planner takes those as the
documents' costs (``costs``).
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
        unit: what one cost unit stands for (FLOPs from :meth:`from_model`, seconds from
            :meth:`fit`); for reports only, never used in planning.
        vision_linear: cost units per vision patch (the vision tower's GEMMs), an int >= 0.
        vision_quadratic: cost units per squared patch of each attention segment of the
            vision tower (one frame of ``h * w`` patches), an int >= 0. Both vision terms
            count only through :meth:`vision_costs`, passed to the planner as ``extra_costs``.

    Raises:
        TypeError, ValueError: if a coefficient is not an int >= 0, ``linear`` and ``quadratic``
            are both 0, or ``unit`` is not a positive number.

    Example:
        >>> model = CostModel(linear=3, quadratic=1)
        >>> model.costs([1, 10, 100]).tolist()
        [4, 130, 10300]
        >>> model.cost(10), model.attention_share(10)
        (130, 0.7692307692307693)
        >>> vision = CostModel(linear=3, quadratic=1, vision_linear=2, vision_quadratic=1)
        >>> vision.vision_costs([[[1, 2, 2]], []]).tolist()  # 4 patches in one frame: 2*4 + 4**2; text only
        [24, 0]
        >>> model.tree_costs([[0, 1, 2, 3], [0, 1, 2, 2]]).tolist()  # a chain of 4 is cost(4); a fork is less
        [28, 26]
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
        """The costs of documents of ``lengths`` tokens, as int64 (exact).

        Raises:
            ValueError: if a length is negative or not an integer, or a cost would not fit in
                :data:`COST_LIMIT` (then use coarser coefficients, e.g. ``linear // k`` and
                ``quadratic // k``).
        """
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
        """The vision tower's cost of each document, as int64 (exact): ``extra_costs`` for the planner.

        A grid ``(t, h, w)`` (a row of ``image_grid_thw`` or ``video_grid_thw``) is ``t``
        frames of ``h * w`` patches, and the tower attends within each frame, so a document
        costs ``sum over its grids of vision_linear * t*h*w + vision_quadratic * t * (h*w)**2``.

        Parameters:
            grids: one ``[n_i, 3]`` array-like of ``(t, h, w)`` ints >= 1 per document, images
                and videos together (a document without media: an empty one, ``[]``).

        Returns:
            ``[documents]`` int64 costs (0 for a document without media).

        Raises:
            TypeError: if ``grids`` is not a sequence of arrays, or a grid holds non-integers.
            ValueError: naming the document, for a grid not of shape ``[n, 3]``, an entry below 1,
                or a cost beyond :data:`COST_LIMIT` (then use coarser coefficients).

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
        """Each tree's cost from its tokens' positions, as int64 (exact): ``costs`` for the planner.

        In a tree (``Collator.for_trees``: shared prefixes laid out once, depth-first) a
        token at position ``p`` along its path attends to exactly ``p + 1`` keys, its
        ancestors and the earlier tokens of its node, so a tree of ``T`` tokens holds
        ``K = sum(p + 1) = sum(p) + T`` (query, key) pairs. A causal chain of ``L`` tokens
        holds ``L * (L + 1) / 2`` of them, which :meth:`cost` prices as ``quadratic * L**2``:
        the quadratic term counts ``2 * K - T`` (that is ``L**2`` for a chain), so a tree costs::

            linear * T + quadratic * (2 * sum(positions) + T)

        and a plain document (positions ``0 .. L - 1``) costs exactly ``cost(L)``. A tree
        costs at least its longest path and at most its ``T`` tokens as one document, and
        costs add up: a row of several trees (padding too: position 0, one key each) costs
        the sum of its parts.

        Parameters:
            positions: one 1-D array-like of ints per tree (its ``position_ids``, each token's
                position along its path; CPU tensors too). Every position from 0 to the
                largest must occur (a token at ``p`` has ancestors at ``0 .. p - 1``); an
                empty tree costs 0.

        Returns:
            ``[trees]`` int64 costs.

        Raises:
            TypeError: if ``positions`` is not a sequence of arrays, or a tree holds non-integers.
            ValueError: naming the tree, for one that is not 1-D, a negative position, a missing
                position (not a tree's: split a row by ``document_ids`` first, and pass positions,
                not lengths), or a cost beyond :data:`COST_LIMIT` (then use coarser coefficients).

        Example:
            >>> model = CostModel(linear=1, quadratic=1)
            >>> prompt_and_two = [0, 1, 2, 3, 2, 3]  # a 2-token prompt, two completions of 2 tokens
            >>> model.tree_costs([prompt_and_two, [0, 1, 2, 3]]).tolist()  # 6 + (2*11 + 6); 4 + 4**2
            [34, 20]
            >>> model.cost(6), model.cost(4)  # the same 6 tokens as one document; its longest path
            (42, 20)
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

        Per token and layer, the GEMMs follow Megatron-LM's
        ``num_floating_point_operations`` (``megatron/training/training.py``): each GEMM
        runs three times (forward, weight and data gradients) at 2 FLOPs per
        multiply-add, over the Q/K/V projections
        ``hidden * (heads + 2 * kv_heads) * head_dim``, the output projection
        ``heads * head_dim * hidden`` and the MLP ``hidden * ffn * (3 if gated else 2)``;
        the logits add ``6 * hidden * vocab_size`` per token once. Attention follows
        FlashAttention's benchmark counts: the forward pass is
        ``4 * length**2 * heads * head_dim`` FLOPs (``QK^T`` and ``PV``), halved when
        causal, and the backward pass 2.5 times the forward (it recomputes ``QK^T``):
        ``7 * heads * head_dim * length**2`` per causal layer. Megatron counts the
        backward at 2x (6 instead of 7); the difference moves the cost by at most
        a sixth of its quadratic part.

        A vision-language ``config`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: one with a
        ``vision_config``) also fills :attr:`vision_linear` and :attr:`vision_quadratic`
        with the same accounting for the vision tower, of width ``d`` (``embed_dim`` in
        Qwen2-VL, else ``hidden_size``), ``depth`` layers, MLP width ``f``
        (``intermediate_size``, or ``embed_dim * mlp_ratio``; gated in Qwen2.5-VL only),
        merge size ``m``, output width ``o`` (the patch merger's) and bidirectional
        attention within each frame. Per patch, the multiply-adds are the patch embedding
        ``in_channels * temporal_patch_size * patch_size**2 * d``, per layer
        ``4 * d**2 + d * f * (3 if gated else 2)`` (Q/K/V and output projections, MLP), and
        per patch merger ``d**2 * m**2 + d * o`` (its two matrices over ``m**2`` patches;
        Qwen3-VL has ``1 + len(deepstack_visual_indexes)`` mergers)::

            vision_linear    = 6 * (embed + depth * layer + mergers * merger) + W * 14 * d * window
            vision_quadratic = full * 14 * d

        per FLOP, where ``full`` counts the layers attending over whole frames (all, or
        Qwen2.5-VL's ``fullatt_block_indexes``) and ``W`` the others (Qwen2.5-VL's
        windowed layers), each patch attending to at most ``window`` patches
        (``(window_size // (m * patch_size) * m)**2``, 64 for Qwen2.5-VL; an upper bound,
        since edge windows are smaller). ``14 = 4 + 2.5 * 4`` is the text attention count
        without the causal half. ``train_vision=False`` (a frozen tower, no backward
        through it) counts the forward alone: 2 instead of 6, and 4 instead of 14.

        The exact integer coefficients (text and vision, all FLOPs) are divided by their
        greatest common divisor, which becomes :attr:`unit` (FLOPs per cost unit): costs
        stay small (a 131,072-token document of a Llama-3-8B-shaped model is about
        ``2.4e11`` units) and exact, and a text-only model gets the same coefficients as
        before the vision terms existed. ``num_layers`` scales both text terms alike, so
        it matters only beside the logits term.

        Parameters:
            config: a Hugging Face model config (``model.config``), positional: the text
                dimensions are read from its text config (``hidden_size``, ``num_hidden_layers``,
                ``num_attention_heads``, ``intermediate_size``, ``num_key_value_heads``,
                ``head_dim``, ``vocab_size``; an argument given here wins over the config's), and a
                ``vision_config`` adds the vision terms. ``None``: give the dimensions.
            hidden_size, num_layers, num_heads, ffn_hidden_size: the model's dimensions (required
                without ``config``).
            num_kv_heads: key/value heads (grouped-query attention; default ``num_heads``).
            head_dim: per-head width (default ``hidden_size // num_heads``).
            gated: a gated MLP (SwiGLU: three matrices) or a plain one (two), text layers.
            causal: causal attention (half the score matrix) or full, text layers.
            vocab_size: add the output layer's GEMM (0: leave it out; default 0, or the config's).
            train_vision: the vision tower is trained (forward + backward) or frozen (forward).

        Raises:
            TypeError, ValueError: for a dimension that is not a positive int (named, with the
                config attribute it came from), ``num_kv_heads`` that does not divide ``num_heads``,
                a missing dimension, a mixture-of-experts config (give ``ffn_hidden_size``: the
                active experts' width), or a ``vision_config`` of another family.

        Example:
            >>> llama = CostModel.from_model(hidden_size=4096, num_layers=32, num_heads=32,
            ...     num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256)
            >>> llama.linear, llama.quadratic, llama.unit
            (343536, 7, 131072)
            >>> round(llama.attention_share(131072), 2), round(llama.attention_share(4096), 2)
            (0.73, 0.08)

            A Qwen2.5-VL-7B-shaped config (``Qwen2_5_VLConfig`` reads the same); a 1,024 x 1,024
            image is a grid of (1, 74, 74) patches, 1,369 tokens after the 2 x 2 merge:

            >>> from types import SimpleNamespace as Config
            >>> qwen = CostModel.from_model(Config(model_type="qwen2_5_vl",
            ...     text_config=Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
            ...         num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
            ...     vision_config=Config(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
            ...         out_hidden_size=3584, in_channels=3, patch_size=14, temporal_patch_size=2,
            ...         spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])))
            >>> qwen.linear, qwen.quadratic, qwen.vision_linear, qwen.vision_quadratic, qwen.unit
            (2959104, 49, 271190, 5, 14336)
            >>> image = int(qwen.vision_costs([[[1, 74, 74]]])[0])
            >>> round(image / qwen.cost(1369), 2)  # the tower adds 39% to the LLM's work on its tokens
            0.39
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
        vision = getattr(config, "vision_config", None) if config is not None else None
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
        """Integer coefficients in the ratio of measured ones (e.g. seconds per token and per squared token).

        Only the ratio ``linear / quadratic`` matters to a plan; it is kept as the
        closest fraction with a denominator up to ``max_denominator``, and
        :attr:`unit` records what one cost unit is worth in the measured quantity.

        Raises:
            ValueError: if a coefficient is negative or not finite, or both are 0.

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

        ``tokens[k]`` and ``squared_tokens[k]`` are micro-batch ``k``'s token count and
        sum of squared document lengths, ``seconds[k]`` its measured time. The constant
        ``c`` (fixed per-step overhead, the same on every rank) is fitted and dropped;
        a negative ``a`` or ``b`` is clipped to 0 and the other refitted.

        Raises:
            TypeError: for a measurement that is not a number.
            ValueError: for fewer than 3 measurements, sequences of different lengths, or a measurement
                that is not finite (NaN, inf).

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
"""The vision-language ``model_type`` values whose vision tower :meth:`CostModel.from_model` counts, and
whether that tower's MLP is gated (Qwen2.5-VL's is SwiGLU; the others' are two plain matrices)."""


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
    """An argument of :meth:`CostModel.from_model`: as given, else the config's ``attribute``, else
    ``default``; ``TypeError`` when none of them is there."""
    if given is not None:
        return check_int(owner, name, given, minimum)
    value = getattr(text, attribute, None) if text is not None else None
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
    """One of :meth:`CostModel.fit`'s sequences as float64: ``TypeError`` unless numbers, ``ValueError``
    naming the first measurement that is not finite (a failed one, which would skew the fit)."""
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
