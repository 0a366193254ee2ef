"""Small builders shared by the tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zephon_collate import SampleBatch, SampleMeta, SampleRecord

BOS, EOS, PAD = 1, 2, 0

# Every to_training output at once: the options most tests of the collator use.
FULL_OPTIONS = {
    "return_labels": True,
    "return_loss_mask": True,
    "return_num_valid_tokens": True,
    "return_cu_seqlens": True,
    "return_padding_mask": True,
    "eos_mask_loss": True,
    "eos_token_id": EOS,
}


def record(payload: Any, index: int = 0, padding: int | None = None, **meta: Any) -> SampleRecord:
    """A record with sample_id (0, 0, index) and, when given, a ``_padding_length`` tag."""
    tags = {} if padding is None else {"_padding_length": padding}
    fields = {"lane_id": 0, "chunk_id": 0, "tags": tags, **meta}
    return SampleRecord(SampleMeta((0, 0, index), **fields), payload)


def batch(*payloads: Any, paddings: list[int | None] | None = None) -> SampleBatch:
    """A batch of records built from payloads, with optional per-record padding lengths."""
    paddings = paddings or [None] * len(payloads)
    return SampleBatch([record(p, i, pad) for i, (p, pad) in enumerate(zip(payloads, paddings, strict=True))])


def as_lists(value: Any) -> Any:
    """Tensors and arrays to nested lists, in dict values and lists too, for comparisons."""
    if isinstance(value, dict):
        return {key: as_lists(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_lists(item) for item in value]
    if isinstance(value, torch.Tensor) and (value.is_meta or value.layout != torch.strided):
        return ("tensor without plain data", value.dtype, tuple(value.shape))  # e.g. a meta "text"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    return value


class PackedRecords(torch.utils.data.Dataset):
    """A map-style dataset of packed records (two documents and padding per row), for DataLoader tests."""

    def __init__(self, size: int = 24, length: int = 16) -> None:
        self.size, self.length = size, length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        first = int(torch.randint(2, self.length // 2, (1,), generator=generator))
        second = int(torch.randint(2, self.length - first, (1,), generator=generator))
        padding = self.length - first - second
        tokens = torch.randint(3, 50, (self.length,), generator=generator)
        tokens[-padding:] = PAD if padding else tokens[-padding:]
        positions = torch.cat([torch.arange(first), torch.arange(second), torch.arange(padding)])
        mask = (torch.arange(self.length) >= 1).long()
        payload = {"input_ids": tokens, "positions": positions, "loss_mask": mask}
        return record(payload, index, padding)


def snapshot(td):
    """Each tensor of a TensorDict, cloned, with its version counter."""
    return {key: (value.clone(), value._version) for key, value in td.items()}


def assert_unchanged(td, before):
    """The TensorDict holds the same keys, values and tensor versions as in ``before``."""
    assert set(td.keys()) == set(before)
    for key, (value, version) in before.items():
        assert torch.equal(td.get(key), value) and td.get(key)._version == version, key


def run_checked(transform, td):
    """Run a transform, checking it returns a new TensorDict and leaves its input untouched."""
    before = snapshot(td)
    out = transform(td)
    assert out is not td
    assert_unchanged(td, before)
    return out
