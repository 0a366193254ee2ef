"""Build a few packed records, batch them, and turn them into training tensors.

Run: python examples/quickstart.py
"""

from __future__ import annotations

from zephon_collate import SampleBatch, SampleMeta, SampleRecord

BOS, EOS, PAD = 1, 2, 0


def make_batch() -> SampleBatch:
    """Two packed rows of 8 tokens: documents bracketed by BOS/EOS, trailing padding."""
    rows = [
        # doc A (3 tokens) + doc B (4 tokens) + 1 pad
        ([BOS, 10, EOS, BOS, 11, 12, EOS, PAD], [0, 1, 2, 0, 1, 2, 3, 0], 1),
        # doc C (5 tokens, prompt of 2 unsupervised) + 3 pad
        ([BOS, 20, 21, 22, EOS, PAD, PAD, PAD], [0, 1, 2, 3, 4, 0, 1, 2], 3),
    ]
    masks = [[1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]]
    records = []
    for index, ((tokens, positions, padding), mask) in enumerate(zip(rows, masks, strict=True)):
        meta = SampleMeta(
            sample_id=(0, 0, index),
            lane_id=index % 2,
            chunk_id=7,
            chunk_offset=index,
            component_sample_counts={index: 1},
            tags={"_padding_length": padding},
        )
        payload = {"input_ids": tokens, "positions": positions, "loss_mask": mask, "text": f"row {index}"}
        records.append(SampleRecord(meta, payload))
    return SampleBatch(records)


def main() -> None:
    batch = make_batch()
    print("records:")
    for record in batch.records:
        print(f"  {record.meta.sample_id} padding={record.meta.padding_length} {record.payload['input_ids']}")
    print("lane_ids:", batch.lane_ids, "chunk_ids:", batch.chunk_ids)
    print("\nstacked TensorDict:\n", batch.to_tensordict())
    out = batch.to_training(
        return_labels=True,
        return_loss_mask=True,
        return_num_valid_tokens=True,
        return_cu_seqlens=True,
        return_padding_mask=True,
        eos_mask_loss=True,
        eos_token_id=EOS,
    )
    print("\nto_training:")
    for key, value in out.items():
        print(f"  {key}: {value.tolist() if hasattr(value, 'tolist') else value}")


if __name__ == "__main__":
    main()
