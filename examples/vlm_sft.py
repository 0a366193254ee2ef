"""Vision-language SFT on packed rows: a tiny Qwen2.5-VL learns to name the image it is shown.

Each example is a prompt of text around 1-2 images (each one of 4 patterns, plus noise), then the
answer: one token per image, the pattern's name. The prompt and the image placeholders are not
trained. ``Collator.for_transformers(padding_free=True, mrope=MRope.from_config(model.config))``
packs a batch into one row with the media in document order and each document's own 3-D positions;
the model runs with ``use_cache=False`` (packed rows need it) and no attention mask.

Before training, the packed batch's logits are checked equal to each example run alone.

Run: python examples/vlm_sft.py [--steps 60]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from zephon_collate import Collator
from zephon_collate.layouts.vision import MRope

IMAGE, START, END, ANSWER = 120, 121, 122, 100  # ANSWER + k names pattern k
PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
PATTERNS = np.random.default_rng(123).normal(size=(4, PATCH_DIM)).astype(np.float32)


def tiny_qwen() -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
                     "bos_token_id": 0, "eos_token_id": 1,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                       "out_hidden_size": 64, "patch_size": 2, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 8, "fullatt_block_indexes": [1]},
        image_token_id=IMAGE, video_token_id=123, vision_start_token_id=START,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()


def example(rng: np.random.Generator) -> dict:
    """A prompt with 1-2 images, then one answer token per image (the only tokens trained)."""
    ids: list[int] = rng.integers(2, 90, int(rng.integers(3, 12))).tolist()
    pixels, grids, answers = [], [], []
    for _ in range(int(rng.integers(1, 3))):
        side = int(rng.choice([2, 4]))
        kind = int(rng.integers(4))
        ids += [START] + [IMAGE] * (side * side // 4) + [END] + rng.integers(2, 90, 2).tolist()
        pixels.append(PATTERNS[kind] + 0.3 * rng.normal(size=(side * side, PATCH_DIM)).astype(np.float32))
        grids.append([1, side, side])
        answers.append(ANSWER + kind)
    tokens = ids + answers
    return {
        "input_ids": tokens,
        "completion_mask": [0] * len(ids) + [1] * len(answers),
        "mm_token_type_ids": [int(token == IMAGE) for token in tokens],
        "pixel_values": np.concatenate(pixels),
        "image_grid_thw": grids,
    }


def forward(model: Qwen2_5_VLForConditionalGeneration, batch: dict) -> torch.Tensor:
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    return model(**inputs, use_cache=False).logits


def check_packed_equals_alone(model, collate, examples) -> float:
    with torch.no_grad():
        packed = forward(model, collate(examples))[0]
        alone = torch.cat([forward(model, collate([e]))[0] for e in examples])
    return float((packed - alone).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    model = tiny_qwen()
    collate = Collator.for_transformers(padding_free=True, mrope=MRope.from_config(model.config))
    data = [example(rng) for _ in range(256)]
    difference = check_packed_equals_alone(model, collate, data[:6])
    print(f"packed logits vs each example alone: max difference {difference:.2e}")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = last = 0.0
    for step in range(args.steps):
        batch = collate([data[(16 * step + i) % len(data)] for i in range(16)])
        logits = forward(model, batch)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = float(loss.detach())
        first, last = (value, value) if step == 0 else (first, value)
        if step % 20 == 0 or step == args.steps - 1:
            tokens, images = batch["input_ids"].shape[1], len(batch["image_grid_thw"])
            print(f"step {step:3d}  {tokens} tokens, {images} images in one row  loss {value:.3f}")
    print(f"loss {first:.3f} -> {last:.3f} (naming a pattern without seeing it: ln 4 = {np.log(4):.3f})")


if __name__ == "__main__":
    main()
