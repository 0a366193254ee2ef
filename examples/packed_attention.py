"""Packed attention: a packed batch, its attention metadata for each kernel, and proof nothing leaks.

Packs a few documents with pack_flat, turns them into training tensors, then
runs one attention layer with SDPA (dense mask) and FlexAttention (BlockMask),
per row and flattened, and checks each document's output equals the document
run alone. flash-attn and Mamba are called only when installed (with CUDA).

Run: python examples/packed_attention.py
"""

from __future__ import annotations

import importlib.util
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from zephon_collate import Chain, SampleBatch, SampleMeta, SampleRecord, pack_flat
from zephon_collate.functional.attention import (
    check_consistent,
    dense_document_mask,
    document_block_mask,
    segment_ids_from_positions,
)
from zephon_collate.inspection.leakage import check_no_leakage
from zephon_collate.transforms import CuSeqlens, SegmentIds, TokenShift

PAD, VOCAB, HEADS, HEAD_DIM = 0, 64, 2, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Without torch.compile, flex_attention runs an unfused reference (it warns so): fine for a demo on CPU.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def packed_batch():
    """Seven documents of 3..9 tokens packed into rows of 16, with trailing padding."""
    lengths = [5, 7, 3, 9, 4, 6, 8]
    docs = [
        SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": list(range(1 + i, 1 + i + n))})
        for i, n in enumerate(lengths)
    ]
    return pack_flat(docs, 16, pad_token_id=PAD)


# A tiny model: embeddings -> one attention layer -> logits. `attend` is the kernel under test.
generator = torch.Generator().manual_seed(0)
EMBED = torch.randn(VOCAB, 3, HEADS, HEAD_DIM, generator=generator).to(DEVICE)
UNEMBED = torch.randn(HEADS * HEAD_DIM, VOCAB, generator=generator).to(DEVICE)


def qkv(input_ids):
    """q, k, v [B, H, S, D] from the token ids."""
    return (EMBED[input_ids][:, :, i].transpose(1, 2) for i in range(3))


def sdpa_attend(input_ids, positions, segment_ids):
    """SDPA with the dense [B, 1, S, S] document mask (small S only: it is B*S*S bytes)."""
    q, k, v = qkv(input_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(segment_ids))


def flex_attend(input_ids, positions, segment_ids):
    """FlexAttention with the document BlockMask (wrap flex_attention in torch.compile for speed on GPU)."""
    q, k, v = qkv(input_ids)
    block_mask = document_block_mask(segment_ids)  # [B, S] ids; [N] batch-global ids for [1, N]
    return flex_attention(q, k, v, block_mask=block_mask)


def as_logits(attend):
    """model_fn(input_ids, positions, segment_ids) -> logits [B, S, V], for check_no_leakage."""

    def model_fn(input_ids, positions, segment_ids):
        out = attend(input_ids, positions, segment_ids)  # [B, H, S, D]
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM) @ UNEMBED

    return model_fn


def flash_attn_varlen(input_ids, cu_seqlens, max_seqlen):
    """flash-attn's varlen kernel (needs the flash-attn package and a CUDA GPU; half precision)."""
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM).half() for t in qkv(input_ids))
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)


def main() -> None:
    rows = packed_batch()
    options = {"return_labels": True, "return_padding_mask": True, "return_cu_seqlens": True}
    out = SampleBatch(rows).to_training(**options)
    input_ids = out["input_ids"].to(DEVICE)
    positions, padding_mask = out["positions"].to(DEVICE), out["padding_mask"].to(DEVICE)
    print("input_ids  ", input_ids.tolist())
    print("positions  ", positions.tolist())

    # 1. One source of truth: segment ids from the (input-aligned) positions; padding marked -1.
    segment_ids = segment_ids_from_positions(positions, padding_mask)
    print("segment_ids", segment_ids.tolist())
    print("cu_seqlens ", out["cu_seqlens"].tolist(), "max_seqlen", out["max_seqlen"].tolist())
    check_consistent(segment_ids, out["cu_seqlens"].to(DEVICE))

    # 2. SDPA and FlexAttention, per row [B, S]: each document's output equals the document alone.
    for name, attend in (("SDPA", sdpa_attend), ("FlexAttention", flex_attend)):
        report = check_no_leakage(as_logits(attend), input_ids, positions, padding_mask=padding_mask)
        print(f"{name:14s}", report)

    # 3. The same through the transform chain (a TensorDict on any device), and flattened to [1, B*S].
    td = SampleBatch(rows).to_tensordict().to(DEVICE)
    chain = Chain(TokenShift(input_keys=["positions"]), SegmentIds(mark_padding=True, shifted=True))
    assert torch.equal(chain(td)["segment_ids"], segment_ids)
    flat = Chain(
        TokenShift(input_keys=["positions"]),
        SegmentIds(flatten=True, mark_padding=True, shifted=True),
        CuSeqlens(flatten=True),
    )(td)
    check_consistent(segment_ids_from_positions(flat["positions"].reshape(-1)), flat["cu_seqlens"])
    flat_ids, flat_tokens = flat["segment_ids"], input_ids.reshape(1, -1)
    for name, attend in (("SDPA", sdpa_attend), ("FlexAttention", flex_attend)):
        flat_out = attend(flat_tokens, None, flat_ids)  # [1, H, B*S, D]
        per_row = attend(input_ids, None, segment_ids)  # [B, H, S, D]
        unflattened = flat_out.reshape(HEADS, *input_ids.shape, HEAD_DIM).transpose(0, 1)
        assert torch.allclose(unflattened, per_row, atol=1e-5)
        print(f"{name:14s} flattened [1, {flat_tokens.shape[1]}] layout equals the per-row one")

    # 4. A leaky model is caught: plain causal attention over the whole row.
    def causal_attend(input_ids, positions, segment_ids):
        q, k, v = qkv(input_ids)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    report = check_no_leakage(
        as_logits(causal_attend), input_ids, positions, padding_mask=padding_mask, raise_on_leak=False
    )
    print("causal only   ", report)
    assert not report.ok

    # 5. flash-attn varlen (flattened cu_seqlens + max_seqlen), only where installed.
    if DEVICE == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        flat_out = SampleBatch(rows).to_training(flatten=True, **options)
        varlen = flash_attn_varlen(
            flat_tokens, flat_out["cu_seqlens"].to(DEVICE), flat_out["max_seqlen"]
        )  # [B*S, H, D]
        print("flash-attn varlen output", tuple(varlen.shape))
    else:
        print("flash-attn varlen: skipped (needs the flash-attn package and a CUDA GPU)")


if __name__ == "__main__":
    main()
