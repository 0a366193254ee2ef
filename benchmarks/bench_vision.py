"""Vision-language packing: tokens per step against padded batches, and the mRoPE layout's cost.

A realistic mix: each example holds 1-4 images of 8 x 8 to 40 x 40 merged tokens (patch grids of 16 to
80 a side, merged by 2) and 50-2,000 text tokens. For batches of 8 and 32 examples, in one run:

- tokens per step: the padded batch (rows x the longest) against the padding-free row (the tokens);
- time: the whole padding-free ``Collator.for_transformers(mrope=...)`` call, and its mRoPE positions
  alone (``mrope_positions``), against Qwen2.5-VL's own ``get_rope_index`` on the padded batch (what
  the model computes when a padded batch has no ``position_ids``). Pixel rows are 24 wide here (the
  positions do not read them; a real processor's 1,176 would add one memory copy to either side).

Run: python benchmarks/bench_vision.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compare

from zephon_collate import Collator
from zephon_collate.layouts.vision import MRope, mrope_positions, read_media
from zephon_collate.read.rows import examples_of

IMAGE = 120


def examples(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` examples of the mix in the module doc, as a Qwen2.5-VL processor lays them out."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids: list[int] = []
        grids = []
        text = int(rng.integers(50, 2001))
        cuts = np.sort(rng.integers(0, text, int(rng.integers(1, 5))))
        words = rng.integers(0, 100, text).tolist()
        start = 0
        for cut in cuts:
            ids += [*words[start:cut], 121]
            grid = [1, int(rng.integers(8, 41)) * 2, int(rng.integers(8, 41)) * 2]
            ids += [IMAGE] * (grid[1] * grid[2] // 4) + [122]
            grids.append(grid)
            start = int(cut)
        ids += words[start:]
        patches = sum(t * h * w for t, h, w in grids)
        out.append(
            {
                "input_ids": ids,
                "mm_token_type_ids": [int(token == IMAGE) for token in ids],
                "pixel_values": np.zeros((patches, 24), np.float32),
                "image_grid_thw": grids,
            }
        )
    return out


def rope_model() -> Qwen2_5_VLModel:
    """A Qwen2.5-VL with the smallest weights: ``get_rope_index`` reads only its config."""
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 128,
                     "bos_token_id": 0, "eos_token_id": 1,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                       "out_hidden_size": 16, "spatial_merge_size": 2, "fullatt_block_indexes": [0]},
        image_token_id=IMAGE, video_token_id=123, vision_start_token_id=121,
    )  # fmt: skip
    return Qwen2_5_VLModel(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = rope_model()
    mrope = MRope.from_config(model.config)
    collate = Collator.for_transformers(padding_free=True, mrope=mrope)
    padded = Collator.for_transformers(pad_token_id=0, mrope=mrope)
    print("| examples | padded tokens | padding-free tokens | padded / packed | padding share |")
    print("|---:|---:|---:|---:|---:|")
    timings = []
    for count in (8, 32):
        batch = examples(count)
        lengths = [len(example["input_ids"]) for example in batch]
        dense, real = len(lengths) * max(lengths), sum(lengths)
        print(f"| {count} | {dense:,} | {real:,} | {dense / real:.2f} | {1 - real / dense:.0%} |")
        rows = padded(batch)
        flat = collate(batch)
        rope_inputs = {
            "input_ids": rows["input_ids"],
            "mm_token_type_ids": rows["mm_token_type_ids"],
            "image_grid_thw": rows["image_grid_thw"],
            "attention_mask": rows["attention_mask"],
        }
        reader = examples_of(batch, "bench")
        fields = collate.layout.fields(reader)[0]
        media = read_media(reader, reader.names, mrope)
        tokens, types = fields["input_ids"], fields["mm_token_type_ids"]
        theirs = model.get_rope_index(**rope_inputs)[0]
        mask = rows["attention_mask"].bool()
        ours = flat["position_ids"][1:, 0]
        assert torch.equal(ours, theirs[:, mask]), "positions differ from get_rope_index"
        times = compare(
            {
                "collate": lambda batch=batch: collate(batch),
                "positions": lambda t=tokens, k=types, m=media: mrope_positions(t, k, m, mrope, str),
                "get_rope_index": lambda given=rope_inputs: model.get_rope_index(**given),
            },
            rounds=args.rounds,
        )
        timings.append((count, times))
    print()
    print("| examples | padding-free collate | its mRoPE positions | get_rope_index (padded) | get_rope_index / collate | get_rope_index / positions |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for count, times in timings:
        print(
            f"| {count} | {times['collate'] * 1e3:.2f} ms | {times['positions'] * 1e3:.2f} ms | "
            f"{times['get_rope_index'] * 1e3:.2f} ms | {times['get_rope_index'] / times['collate']:.1f} | "
            f"{times['get_rope_index'] / times['positions']:.1f} |"
        )


if __name__ == "__main__":
    main()
