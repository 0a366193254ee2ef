"""A small causal transformer whose attention stays inside each packed document.

The collator's outputs drive it: ``positions`` (restarting at 0 on every
segment) rotate the queries and keys (RoPE), and the segment ids derived from
them (:func:`zephon_collate.functional.attention.segment_ids_from_positions`) build the
attention mask (:func:`zephon_collate.functional.attention.dense_document_mask`): a token
sees the tokens before it in its own document, and nothing else. Each
document in a packed row is therefore computed exactly as if it were alone,
which :func:`zephon_collate.inspection.leakage.check_no_leakage` checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from zephon_collate.functional.attention import dense_document_mask

__all__ = ["DocumentTransformer", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`DocumentTransformer`."""

    vocab_size: int = 259
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    rope_base: float = 10000.0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, S, D]`` with ``cos``/``sin`` ``[B, 1, S, D/2]``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class _Block(nn.Module):
    """Pre-norm attention and MLP, with residuals."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attention_norm = nn.RMSNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(config.dim)
        hidden = config.mlp_ratio * config.dim
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, config.dim, bias=False)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        rows, length, dim = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(rows, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, S, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, length, dim))
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class DocumentTransformer(nn.Module):
    """A decoder-only byte-level language model over packed rows.

    ``forward(input_ids, positions, segment_ids)`` takes ``[B, S]`` token ids,
    segment-restarting positions and segment ids (marked padding ``-1``) and
    returns ``[B, S, vocab_size]`` logits; the signature is the ``model_fn`` of
    :func:`zephon_collate.inspection.leakage.check_no_leakage`.

    Example:
        >>> model = DocumentTransformer(ModelConfig(dim=16, layers=1, heads=2))
        >>> ids, pos = torch.tensor([[1, 50, 2, 1, 60]]), torch.tensor([[0, 1, 2, 0, 1]])
        >>> model(ids, pos, torch.tensor([[0, 0, 0, 1, 1]])).shape
        torch.Size([1, 5, 259])
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ModelConfig()
        if config.dim % (2 * config.heads):
            raise ValueError(f"dim ({config.dim}) must be a multiple of 2 * heads ({2 * config.heads})")
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim)
        half = config.dim // config.heads // 2
        frequencies = config.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("frequencies", frequencies, persistent=False)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = (
                    0.02 / (2 * config.layers) ** 0.5
                    if name.endswith(("out.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(parameter, std=std)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor
    ) -> torch.Tensor:
        frequencies = cast(torch.Tensor, self.frequencies)  # a buffer
        angles = positions.unsqueeze(-1).float() * frequencies  # [B, S, D/2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [B, 1, S, D/2]
        mask = dense_document_mask(segment_ids)  # [B, 1, S, S]: own document, causal
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos.to(x.dtype), sin.to(x.dtype), mask)
        logits: torch.Tensor = self.norm(x) @ self.embed.weight.T  # tied input and output embeddings
        return logits

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, stop_token: int | None = None) -> list[int]:
        """Greedy continuation of one ``[S]`` prompt (a single document), as a list of new ids."""
        ids = prompt.reshape(1, -1)
        new: list[int] = []
        for _ in range(max_new_tokens):
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            logits = self(ids, positions, torch.zeros_like(ids, dtype=torch.int32))
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token == stop_token:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        return new
