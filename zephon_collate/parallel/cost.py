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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

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

    Raises:
        TypeError, ValueError: if a coefficient is not an int >= 0, both are 0, or ``unit`` is not
            a positive number.

    Example:
        >>> model = CostModel(linear=3, quadratic=1)
        >>> model.costs([1, 10, 100]).tolist()
        [4, 130, 10300]
        >>> model.cost(10), model.attention_share(10)
        (130, 0.7692307692307693)
    """

    linear: int
    quadratic: int
    unit: float = 1.0

    def __post_init__(self) -> None:
        owner = "CostModel"
        object.__setattr__(self, "linear", check_int(owner, "linear", self.linear, 0))
        object.__setattr__(self, "quadratic", check_int(owner, "quadratic", self.quadratic, 0))
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError("CostModel: linear and quadratic are both 0; give at least one a positive value")
        unit = self.unit
        if isinstance(unit, bool) or not isinstance(unit, (int, float)) or not 0 < unit < math.inf:
            raise ValueError(f"CostModel: unit must be a positive number, got {shown(unit)}")

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

    def attention_share(self, length: int) -> float:
        """The quadratic term's share of a ``length``-token document's cost (0 to 1)."""
        total = self.cost(length)
        return self.quadratic * length * length / total if total else 0.0

    @classmethod
    def from_model(
        cls,
        *,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        ffn_hidden_size: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        gated: bool = True,
        causal: bool = True,
        vocab_size: int = 0,
    ) -> CostModel:
        """The forward + backward FLOPs of a decoder-only transformer, per document.

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

        The two exact integer coefficients are divided by their greatest common
        divisor, which becomes :attr:`unit` (FLOPs per cost unit): costs stay small
        (a 131,072-token document of a Llama-3-8B-shaped model is about ``2.4e11``
        units) and exact. ``num_layers`` scales both terms alike, so it matters only
        beside the logits term.

        Parameters:
            hidden_size, num_layers, num_heads, ffn_hidden_size: the model's dimensions.
            num_kv_heads: key/value heads (grouped-query attention; default ``num_heads``).
            head_dim: per-head width (default ``hidden_size // num_heads``).
            gated: a gated MLP (SwiGLU: three matrices) or a plain one (two).
            causal: causal attention (half the score matrix) or full.
            vocab_size: add the output layer's GEMM (0: leave it out).

        Raises:
            TypeError, ValueError: for a dimension that is not a positive int, or ``num_kv_heads``
                that does not divide ``num_heads``.

        Example:
            >>> llama = CostModel.from_model(hidden_size=4096, num_layers=32, num_heads=32,
            ...     num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256)
            >>> llama.linear, llama.quadratic, llama.unit
            (343536, 7, 131072)
            >>> round(llama.attention_share(131072), 2), round(llama.attention_share(4096), 2)
            (0.73, 0.08)
        """
        owner = "CostModel.from_model"
        hidden = check_int(owner, "hidden_size", hidden_size, 1)
        layers = check_int(owner, "num_layers", num_layers, 1)
        heads = check_int(owner, "num_heads", num_heads, 1)
        ffn = check_int(owner, "ffn_hidden_size", ffn_hidden_size, 1)
        kv_heads = heads if num_kv_heads is None else check_int(owner, "num_kv_heads", num_kv_heads, 1)
        if heads % kv_heads:
            raise ValueError(f"{owner}: num_kv_heads={kv_heads} must divide num_heads={heads}")
        width = hidden // heads if head_dim is None else check_int(owner, "head_dim", head_dim, 1)
        if width < 1:
            raise ValueError(f"{owner}: hidden_size={hidden} < num_heads={heads}; pass head_dim")
        vocab = check_int(owner, "vocab_size", vocab_size, 0)
        for name, flag in (("gated", gated), ("causal", causal)):
            if not isinstance(flag, bool):
                raise TypeError(f"{owner}: {name} must be a bool, got {shown(flag)}")
        query, key_value = heads * width, kv_heads * width
        per_layer = hidden * (query + 2 * key_value) + query * hidden + hidden * ffn * (3 if gated else 2)
        linear = 6 * (layers * per_layer + hidden * vocab)
        quadratic = layers * query * (7 if causal else 14)
        unit = math.gcd(linear, quadratic)
        return cls(linear=linear // unit, quadratic=quadratic // unit, unit=unit)

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
