"""Vision-language packing, exact: tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL built from configs.

The positions equal each model's own ``get_rope_index`` per document; the logits of a packed
padding-free batch equal each example run alone (float32 and float64), and so do a padded batch's;
the media travel in document order; every refusal names the example and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vlm_models import FAMILIES, IMAGE_TOKEN_ID, alone, reference_positions, rope_alone, sample, tiny_model

from zephon_collate import Collator, FlatPacker, SampleMeta, SampleRecord, pack_flat
from zephon_collate.layouts.vision import MRope

MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def model_of(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if (family, dtype) not in MODELS:
        MODELS[family, dtype] = tiny_model(family, dtype)
    return MODELS[family, dtype]


def mix(family: str, seed: int, count: int = 4) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        sample(family, None, rng, int(rng.integers(0, 3)), int(rng.integers(0, 2)), int(rng.integers(1, 6)))
        for _ in range(count)
    ]


def packed_batch(family: str, examples: list[dict]) -> dict:
    model = model_of(family)
    return Collator.for_transformers(padding_free=True, mrope=MRope.from_config(model.config))(examples)


def run(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model on a collated batch, as a training step feeds it (no cache: packing needs none)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(4))
def test_positions_equal_the_models_get_rope_index_per_document(family, seed):
    examples = mix(family, seed)
    got = packed_batch(family, examples)["position_ids"]
    assert torch.equal(got, reference_positions(model_of(family), examples))


def joined(examples: list[dict]) -> dict:
    """The examples as one example of several documents, as TRL's packing writes it (``seq_lengths``)."""
    out: dict = {"seq_lengths": [len(example["input_ids"]) for example in examples]}
    for key in dict.fromkeys(key for example in examples for key in example):
        parts = [example[key] for example in examples if key in example]
        out[key] = (
            np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [x for part in parts for x in part]
        )
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_an_example_of_several_documents_numbers_each_from_zero(family):
    """Every document keeps its own 3-D positions, also inside one example (positions and logits)."""
    examples = mix(family, 20 + FAMILIES.index(family), count=3)
    together = packed_batch(family, [joined(examples)])
    apart = packed_batch(family, examples)
    assert torch.equal(together["position_ids"], apart["position_ids"])
    assert torch.equal(together["position_ids"], reference_positions(model_of(family), examples))
    if family == "qwen2_5_vl":
        model = model_of(family, torch.float64)
        together["pixel_values"] = together["pixel_values"].double()
        if "pixel_values_videos" in together:
            together["pixel_values_videos"] = together["pixel_values_videos"].double()
        want = torch.cat([alone(model, example) for example in examples])
        assert (run(model, together)[0] - want).abs().max() <= 1e-12


def test_a_document_boundary_between_two_images_splits_their_runs():
    """An example packed of two documents, the first ending with an image and the second opening with
    one: two runs of placeholders, one per document, numbered as the documents apart."""
    image, grid = [IMAGE_TOKEN_ID] * 4, [[1, 4, 4]]
    a = {"input_ids": [5, 5, *image], "mm_token_type_ids": [0, 0, 1, 1, 1, 1], "image_grid_thw": grid}
    b = {"input_ids": [*image, 6], "mm_token_type_ids": [1, 1, 1, 1, 0], "image_grid_thw": grid}
    for example in (a, b):
        example["pixel_values"] = np.zeros((16, 24), np.float32)
    packed = {
        "input_ids": a["input_ids"] + b["input_ids"],
        "mm_token_type_ids": a["mm_token_type_ids"] + b["mm_token_type_ids"],
        "pixel_values": np.zeros((32, 24), np.float32),
        "image_grid_thw": grid * 2,
        "seq_lengths": [6, 5],
    }
    collate = Collator.for_transformers(padding_free=True, mrope=MRope())
    assert collate([packed])["position_ids"].tolist() == collate([a, b])["position_ids"].tolist()
    assert collate([packed])["position_ids"][1:, 0].tolist() == [
        [0, 1, 2, 2, 2, 2, 0, 0, 0, 0, 2],
        [0, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2],
        [0, 1, 2, 3, 2, 3, 0, 1, 0, 1, 2],
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_each_example_alone_float32(family):
    model = model_of(family)
    examples = mix(family, 10 + FAMILIES.index(family))
    batch = packed_batch(family, examples)
    got = run(model, batch)[0]
    want = torch.cat([alone(model, example) for example in examples])
    assert (got - want).abs().max() <= 1e-5


def test_packed_logits_equal_each_example_alone_float64():
    model = model_of("qwen2_5_vl", torch.float64)
    examples = mix("qwen2_5_vl", 7)
    batch = packed_batch("qwen2_5_vl", examples)
    batch["pixel_values"] = batch["pixel_values"].double()
    if "pixel_values_videos" in batch:
        batch["pixel_values_videos"] = batch["pixel_values_videos"].double()
    got = run(model, batch)[0]
    want = torch.cat([alone(model, example) for example in examples])
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_equals_each_example_alone(side):
    family = "qwen2_5_vl"
    model = model_of(family)
    examples = mix(family, 3)
    collate = Collator.for_transformers(
        pad_token_id=0, padding_side=side, mrope=MRope.from_config(model.config)
    )
    batch = collate(examples)
    assert "position_ids" not in batch  # padded, the model computes them from the types and grids
    logits = run(model, batch)
    width = logits.shape[1]
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        real = logits[row, :length] if side == "right" else logits[row, width - length :]
        assert (real - alone(model, example)).abs().max() <= 1e-5


def test_options_that_would_replace_the_mrope_positions_are_refused():
    for options in (
        {"padding_free": True, "return_position_ids": False},
        {"pad_token_id": 0, "return_position_ids": True},
    ):
        with pytest.raises(ValueError, match="leave return_position_ids at its default"):
            Collator.for_transformers(mrope=MRope(), **options)
    with pytest.raises(ValueError, match="drop position_ids_start"):
        Collator.for_transformers(padding_free=True, mrope=MRope(), position_ids_start=2)


def test_seconds_travel_in_float32_as_the_model_rounds_them():
    """A padded batch's video times: the model multiplies by second_per_grid_ts in its own dtype."""
    model = model_of("qwen2_5_vl")
    video = {
        "input_ids": [5] + [121] * 46 + [6],
        "mm_token_type_ids": [0] + [2] * 46 + [0],
        "pixel_values_videos": np.zeros((46 * 4, 24), np.float32),
        "video_grid_thw": [[46, 2, 2]],
        "second_per_grid_ts": [0.7],
    }
    padded = Collator.for_transformers(pad_token_id=0, mrope=MRope.from_config(model.config))([video])
    assert padded["second_per_grid_ts"].dtype == torch.float32
    inputs = {
        key: padded[key] for key in ("input_ids", "mm_token_type_ids", "video_grid_thw", "attention_mask")
    }
    theirs = model.model.get_rope_index(**inputs, second_per_grid_ts=padded["second_per_grid_ts"])[0][:, 0]
    packed = packed_batch("qwen2_5_vl", [video])["position_ids"][1:, 0]
    assert torch.equal(theirs, packed)


def test_the_layout_by_hand():
    """The module doc's drawing: two documents, one image each, and a text-only one."""

    def example(before: int, grid: list[int], after: int) -> dict:
        placeholders = grid[0] * grid[1] * grid[2] // 4
        return {
            "input_ids": [5] * before + [IMAGE_TOKEN_ID] * placeholders + [6] * after,
            "mm_token_type_ids": [0] * before + [1] * placeholders + [0] * after,
            "pixel_values": np.full((grid[0] * grid[1] * grid[2], 2), float(grid[2])),
            "image_grid_thw": [grid],
        }

    out = Collator.for_transformers(padding_free=True, mrope=MRope())(
        [example(2, [1, 4, 4], 2), example(1, [1, 4, 6], 1), {"input_ids": [7, 8]}]
    )
    assert out["position_ids"][:, 0].tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1],
        [0, 1, 2, 2, 2, 2, 4, 5, 0, 1, 1, 1, 1, 1, 1, 4, 0, 1],
        [0, 1, 2, 2, 3, 3, 4, 5, 0, 1, 1, 1, 2, 2, 2, 4, 0, 1],
        [0, 1, 2, 3, 2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 3, 4, 0, 1],
    ]
    # a placeholder is never a label; each document's first token predicts nothing
    assert out["labels"].tolist() == [[-100, 5] + [-100] * 4 + [6, 6, -100] + [-100] * 6 + [6, -100, 8]]
    assert out["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert out["image_counts"].tolist() == [1, 1, 0]  # each document's images: a row of the grids each
    assert out["pixel_values"][:, 0].tolist() == [4.0] * 16 + [6.0] * 24  # in document order


def test_a_rule_of_its_own_keeps_its_numbering_and_each_document_starts_as_the_first():
    def rule(ids, types, image_grid, video_grid, seconds):
        n = len(ids)
        return np.stack([np.arange(n) + 5, np.arange(n), np.arange(n)])  # t counted from 5

    collate = Collator.for_transformers(padding_free=True, mrope=MRope(rule=rule))
    one = {"input_ids": [5, 6, 7], "mm_token_type_ids": [0, 0, 0]}
    assert collate([one])["position_ids"][1, 0].tolist() == [5, 6, 7]
    two = {"input_ids": [5, 6, 7, 8, 9], "mm_token_type_ids": [0] * 5, "seq_lengths": [3, 2]}
    assert collate([two])["position_ids"][1:, 0].tolist() == [
        [5, 6, 7, 5, 6],
        [0, 1, 2, 0, 1],
        [0, 1, 2, 0, 1],
    ]


def test_a_models_own_rule_through_the_hook():
    model = model_of("qwen2_vl")

    def rule(ids, types, images, videos, seconds):
        example = {"input_ids": ids.tolist(), "mm_token_type_ids": types.tolist(), "image_grid_thw": images}
        if videos.size:
            example["video_grid_thw"] = videos
        return rope_alone(model, example).numpy()

    examples = mix("qwen2_vl", 5)
    hooked = Collator.for_transformers(padding_free=True, mrope=MRope(rule=rule))(examples)
    assert torch.equal(hooked["position_ids"], packed_batch("qwen2_vl", examples)["position_ids"])


def test_truncation_keeps_an_image_whole_or_refuses():
    examples = mix("qwen2_vl", 1, count=6)
    with_image = next(e for e in examples if len(e["image_grid_thw"]) and 2 not in e["mm_token_type_ids"])
    first = with_image["mm_token_type_ids"].index(1)
    collate = Collator.for_transformers(
        padding_free=True, mrope=MRope(), max_length=first + 1, truncation_mode="keep_start"
    )
    cut = r"example 0: max_length={} with truncation_mode='{}' would cut {} of its image placeholder tokens"
    fix = r".*cut the example's text before its images and videos, or raise max_length"
    run = with_image["mm_token_type_ids"].count(1)
    with pytest.raises(ValueError, match=cut.format(first + 1, "keep_start", run - 1) + fix):
        collate([with_image])
    before = Collator.for_transformers(
        padding_free=True, mrope=MRope(), max_length=first, truncation_mode="keep_start"
    )
    with pytest.raises(ValueError, match=cut.format(first, "keep_start", run) + fix):
        before([with_image])  # the whole image cut away, its pixels still given
    last = with_image["mm_token_type_ids"][::-1].index(1)  # the tokens after the last image token
    assert set(with_image["mm_token_type_ids"][-last:]) == {0}
    after = Collator.for_transformers(
        padding_free=True, mrope=MRope(), max_length=last, truncation_mode="keep_end"
    )
    with pytest.raises(ValueError, match=cut.format(last, "keep_end", run) + fix):
        after([with_image])
    kept = len(with_image["input_ids"]) - first  # from the first image on: only text before it is cut
    whole = Collator.for_transformers(
        padding_free=True, mrope=MRope(), max_length=kept, truncation_mode="keep_end"
    )
    assert whole([with_image])["input_ids"].shape[1] == kept
    # keep_eos puts the EOS on the last kept token: an image kept up to max_length loses its last placeholder
    ending = {**with_image, "input_ids": [*with_image["input_ids"][:-1], 2], "labels": None}
    ending = {key: value for key, value in ending.items() if value is not None}
    image_end = len(with_image["mm_token_type_ids"]) - last  # right after the last image token
    eos = Collator.for_transformers(padding_free=True, mrope=MRope(), max_length=image_end,
                                    truncation_mode="keep_start", keep_eos=True, eos_token_id=2)  # fmt: skip
    with pytest.raises(ValueError, match=cut.format(image_end, "keep_start", 1) + r" .*\(keep_eos=True puts"):
        eos([ending])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"image_grid_thw": [[1, 4, 4], [1, 2, 2]], "pixel_values": np.zeros((20, 2), np.float32)}, r"holds 1 runs of image placeholder tokens .* but 2 image"),
        ({"image_grid_thw": [[1, 4, 6]], "pixel_values": np.zeros((24, 2), np.float32)}, r"a run of 4 image placeholder tokens .* needs 6"),
        ({"image_grid_thw": [[1, 3, 4]]}, r"multiples of spatial_merge_size=2"),
        ({"image_grid_thw": [[1, 4]]}, r"has shape \(1, 2\).*give \[n, 3\] integers"),
        ({"pixel_values": np.zeros((15, 2), np.float32)}, r"'pixel_values' has shape \(15, 2\), but its 'image_grid_thw'"),
        ({"pixel_values": None}, r"has 'image_grid_thw' of 1 grids but no 'pixel_values'"),
        ({"mm_token_type_ids": [0, 3, 1, 1, 1, 0]}, r"'mm_token_type_ids' holds 3 at mm_token_type_ids\[1\]"),
        ({"second_per_grid_ts": [1.0]}, r"'second_per_grid_ts' holds 1 values for 0 videos"),
    ],
)  # fmt: skip
def test_bad_vision_examples_name_the_example_and_the_fix(change, match):
    example = {
        "input_ids": [5, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 6],
        "mm_token_type_ids": [0, 1, 1, 1, 1, 0],
        "pixel_values": np.zeros((16, 2), np.float32),
        "image_grid_thw": [[1, 4, 4]],
    }
    bad = {key: value for key, value in {**example, **change}.items() if value is not None}
    with pytest.raises(ValueError, match=match):
        Collator.for_transformers(padding_free=True, mrope=MRope())([example, bad])
    wider = {**example, "pixel_values": np.zeros((16, 3), np.float32)}
    with pytest.raises(
        ValueError, match=r"example 1: 'pixel_values' rows hold \(3,\), the batch's first \(2,\)"
    ):
        Collator.for_transformers(padding_free=True, mrope=MRope())([example, wider])


def test_media_without_mrope_are_refused_never_dropped():
    example = sample("qwen2_5_vl", None, np.random.default_rng(0), 1, 0, 2)
    for collate in (Collator.for_transformers(padding_free=True), Collator.for_transformers(pad_token_id=0)):
        with pytest.raises(
            ValueError, match=r"example 0: carries 'pixel_values'.*pass mrope=MRope.from_config"
        ):
            collate([example])
    text = {key: value for key, value in example.items() if key != "labels"}
    records = [SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), text)]
    fix = r"carries 'pixel_values'.*which the (Collator|packer) does not read.*Collator.for_transformers\("
    for refused in (
        lambda: Collator(return_labels=True, pad_token_id=0)(records),
        lambda: pack_flat(records, 64, pad_token_id=0),
        lambda: list(FlatPacker(64, pad_token_id=0).pack(records)),
    ):
        with pytest.raises(ValueError, match=fix):
            refused()
    only_types = {"input_ids": [1, 2], "mm_token_type_ids": [0, 0]}
    with pytest.raises(ValueError, match=r"carries 'mm_token_type_ids'.*the packer does not read"):
        pack_flat([only_types], 8, pad_token_id=0)


def test_bad_mrope_declarations():
    with pytest.raises(TypeError, match="spatial_merge_size must be an int >= 1"):
        MRope(spatial_merge_size=0)
    with pytest.raises(ValueError, match="video_time must be 'index', 'seconds' or 'frames'"):
        MRope(video_time="time")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens_per_second must be a number > 0"):
        MRope(tokens_per_second=0)
    with pytest.raises(TypeError, match="rule must be a function"):
        MRope(rule=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model_type 'llama' is not one of .*MRope\(rule=\.\.\.\)"):
        MRope.from_config(type("Config", (), {"model_type": "llama"})())
    with pytest.raises(TypeError, match="mrope must be an MRope"):
        Collator.for_transformers(padding_free=True, mrope={"spatial_merge_size": 2})
    assert MRope.from_config(model_of("qwen3_vl").config).video_time == "frames"


def test_a_text_only_batch_gets_a_dummy_image_that_changes_nothing():
    model = model_of("qwen2_5_vl")
    text = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}]
    plain = Collator.for_transformers(padding_free=True, mrope=MRope.from_config(model.config))(text)
    dummy = MRope.from_config(model.config, dummy_image=True)
    batch = Collator.for_transformers(padding_free=True, mrope=dummy)(text)
    assert "pixel_values" not in plain
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, IMAGE_TOKEN_ID]]
    assert batch["labels"][0, -1] == -100 and batch["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert batch["pixel_values"].shape == (4, 24) and not batch["pixel_values"].any()
    assert batch["position_ids"][:, 0, -1].tolist() == [0, 0, 0, 0]  # a document of its own
    logits = run(model, batch)[0]
    assert (logits[:-1] - run(model, plain)[0]).abs().max() <= 1e-5  # the real tokens see no image
    # a batch with an image already runs the tower: nothing is added
    examples = mix("qwen2_5_vl", 2)
    assert torch.equal(
        Collator.for_transformers(padding_free=True, mrope=dummy)(examples)["input_ids"],
        packed_batch("qwen2_5_vl", examples)["input_ids"],
    )
    with pytest.raises(
        ValueError, match=r"dummy_image=\.\.\.\) adds its image as one more document of a padding-free"
    ):
        Collator.for_transformers(pad_token_id=0, mrope=dummy)(text)
    with pytest.raises(TypeError, match=r"dummy_image must be \(image_token_id, pixel_width\)"):
        MRope(dummy_image=(120,))  # type: ignore[arg-type]


def test_separator_id_never_labels_a_placeholder_nor_the_dummy_image():
    """HF's separator label goes on each document's first token, except an image placeholder (never a
    label): an example opening with an image, and the dummy image, whose separator trained the last real
    token to predict it (the loss moved from 5.8531 to 5.7809)."""
    from zephon_collate import use_host_pass

    text = {"input_ids": [5, 6, 7, 8]}
    image = {
        "input_ids": [IMAGE_TOKEN_ID] * 4 + [6],
        "mm_token_type_ids": [1] * 4 + [0],
        "image_grid_thw": [[1, 4, 4]],
        "pixel_values": np.zeros((16, 24), np.float32),
    }
    model = model_of("qwen2_5_vl")
    dummy = MRope.from_config(model.config, dummy_image=True)
    for host in (True, False):
        with use_host_pass(host):
            opened = Collator.for_transformers(padding_free=True, mrope=MRope(), separator_id=3)(
                [text, image]
            )
            assert opened["labels"].tolist() == [[3, 6, 7, 8, -100, -100, -100, -100, 6]]
            batch = Collator.for_transformers(padding_free=True, mrope=dummy, separator_id=3)([text, text])
            assert batch["labels"].tolist() == [[3, 6, 7, 8, 3, 6, 7, 8, -100]]


def test_the_dummy_image_is_no_sequence_of_the_sequence_map():
    # It counted as a third sequence: sequence_logprobs gave 3 entries for 2 examples, and the
    # seq-mean modes with empty="count" divided by 3.
    from zephon_collate.losses import aggregate_loss, sequence_logprobs, token_logprobs

    model = model_of("qwen2_5_vl")
    text = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}]
    batches = [
        Collator.for_transformers(
            padding_free=True, return_sequence_map=True, mrope=MRope.from_config(model.config, dummy_image=d)
        )(text)
        for d in (False, True)
    ]
    plain, dummy = batches
    assert int(dummy["num_sequences"]) == 2
    assert dummy["sequence_index"].tolist() == [[0, 0, 0, 0, 1, 1, 1, -1]]
    assert dummy["logits_index"][0, -1] == -1
    logits = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    alone = sequence_logprobs(logits[:, :7], plain)
    with_dummy = sequence_logprobs(logits, dummy)
    assert torch.equal(with_dummy.counts, alone.counts) and torch.equal(with_dummy.sums, alone.sums)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        want = aggregate_loss(token_logprobs(logits[:, :7], plain), plain, mode=mode, empty="count")
        got = aggregate_loss(token_logprobs(logits, dummy), dummy, mode=mode, empty="count")
        assert torch.equal(got, want), mode
    unmapped = Collator.for_transformers(padding_free=True, mrope=MRope.from_config(model.config))(text)
    with pytest.raises(ValueError, match=r"has shape \(4, 1, 7\).* collate it with return_sequence_map=True"):
        sequence_logprobs(logits[:, :7], unmapped)


def test_vision_cu_seqlens_are_the_towers_own():
    from transformers.vision_utils import get_vision_cu_seqlens

    examples = mix("qwen2_5_vl", 4, count=5)
    model = model_of("qwen2_5_vl")
    mrope = MRope.from_config(model.config)
    batch = Collator.for_transformers(
        padding_free=True,
        mrope=MRope(mrope.spatial_merge_size, mrope.video_time, 2.0, vision_cu_seqlens=True),
    )(examples)
    for kind in ("image", "video"):
        if f"{kind}_grid_thw" in batch:
            want = get_vision_cu_seqlens(batch[f"{kind}_grid_thw"])
            assert batch[f"{kind}_cu_seqlens"].dtype == torch.int32
            assert torch.equal(batch[f"{kind}_cu_seqlens"], want)
    assert "image_cu_seqlens" not in packed_batch("qwen2_5_vl", examples)
    with pytest.raises(TypeError, match="vision_cu_seqlens must be a bool"):
        MRope(vision_cu_seqlens=1)  # type: ignore[arg-type]


def test_image_free_rows_of_a_table_hold_empty_lists():
    """A table's column gives an image-free row ``[]`` pixels and grids: no media, as if left out."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(3)
    examples = [sample("qwen2_5_vl", None, rng, images, 0, 2) for images in (0, 2, 0, 1)]
    rows = [
        {key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in example.items()}
        for example in examples
    ]
    rows = [{"pixel_values": [], "image_grid_thw": [], **row} for row in rows]
    want = packed_batch("qwen2_5_vl", examples)
    dataset = datasets.Dataset.from_list(rows)
    numpy = list(dataset.with_format("numpy"))  # an image-free row: empty object arrays
    for given in (rows, dataset.with_format("arrow")[:], numpy):
        got = packed_batch("qwen2_5_vl", given)
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key].to(want[key].dtype), want[key]), key


def test_pixels_keep_their_dtype_in_every_input_format():
    """A column's pixels come out in the column's dtype, as its rows' arrays do; Python floats in float32."""
    pa = pytest.importorskip("pyarrow")
    rng = np.random.default_rng(5)
    examples = [sample("qwen2_5_vl", None, rng, images, 0, 2) for images in (1, 2)]
    for dtype, arrow_type in ((np.float32, pa.float32()), (np.float64, pa.float64())):
        rows = [{**example, "pixel_values": example["pixel_values"].astype(dtype)} for example in examples]
        want = packed_batch("qwen2_5_vl", rows)
        column = pa.array([row["pixel_values"].tolist() for row in rows], pa.list_(pa.list_(arrow_type)))
        others = {
            key: [np.asarray(row[key]).tolist() for row in rows] for key in rows[0] if key != "pixel_values"
        }
        table = pa.table({**others, "pixel_values": column})
        values = np.concatenate([row["pixel_values"] for row in rows])
        offsets = np.cumsum([0] + [len(row["pixel_values"]) for row in rows])
        pairs = {**{key: pa.array(value) for key, value in others.items()}, "pixel_values": (values, offsets)}
        for given in (table, pairs):
            got = packed_batch("qwen2_5_vl", given)
            assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.from_numpy(values).dtype
            assert torch.equal(got["pixel_values"], want["pixel_values"])
    as_lists = [{**example, "pixel_values": example["pixel_values"].tolist()} for example in examples]
    assert packed_batch("qwen2_5_vl", as_lists)["pixel_values"].dtype == torch.float32
