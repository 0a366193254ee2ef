"""Compiled, eager and the CPU host path give the same batch, in every layout.

Each case is one layout with one sample of its options: the native ``Collator``
on records and on columns, ``for_transformers`` padded and padding-free,
``for_preference`` in its four layouts, ``for_rewards`` padded and
padding-free, and ``for_rollouts`` padding-free, shared-prompt and padded,
over supervision fields, ``boundary_safe_labels``,
EOS masking, positions modes, float fields and transforms of yours. A case
builds one collator per mode and runs the same batches (of several shapes)
through each:

- ``host``: the default on the CPU (the NumPy host path where it applies);
- ``eager``: the torch transforms (``use_host_pass(False)``), what a GPU runs;
- ``compiled``: ``compile=True`` on the CPU, one collator across every batch
  (dynamic shapes: the graphs compile once per case);
- ``cuda`` and ``cuda-compiled``: ``device="cuda"``, when a device is present.

Every output is compared key for key (the same keys in the same order), dtype
for dtype, shape for shape and value for value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from zephon_collate import Collator, FloatField, SampleMeta, SampleRecord, Transform, use_host_pass
from zephon_collate.layouts.vision import MRope
from zephon_collate.read.fields import TensorField

EOS, PAD = 2, 0
CUDA = torch.cuda.is_available()


class Weights(Transform):
    """A transform of yours: a per-token weight from the labels and the positions."""

    def __init__(self, positions: str = "positions") -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels", positions], ["weights"]
        self.positions = positions

    def compute(self, data):
        kept = (data["labels"] != -100).to(torch.float32)
        return {"weights": kept / (1.0 + data[self.positions].to(torch.float32))}


# -- batches --------------------------------------------------------------------------------------


def _documents(rng: np.random.Generator, total: int) -> list[int]:
    sizes = []
    while total > 0:
        size = int(min(total, rng.integers(1, 9)))
        sizes.append(size)
        total -= size
    return sizes


def packed_records(seed: int, rows: int, length: int, *, floats: bool = False, mask: bool = True) -> list:
    """Rows of packed documents: restarting positions, a 0/1 loss_mask, trailing padding, EOS ids."""
    rng = np.random.default_rng(seed)
    records = []
    for index in range(rows):
        padding = int(rng.integers(0, length // 3))
        sizes = _documents(rng, length - padding)
        positions = np.concatenate([np.arange(s) for s in sizes] + [np.arange(padding)]).astype(np.int64)
        tokens = rng.integers(3, 40, length)
        tokens[np.flatnonzero(positions == 0)[1:] - 1] = EOS  # documents end in EOS
        tokens[length - padding :] = PAD
        payload: dict[str, Any] = {"input_ids": tokens, "positions": positions, "weights_in": tokens % 3}
        if mask:
            payload["loss_mask"] = (rng.random(length) < 0.7).astype(np.int64)
        if floats:
            payload["old"] = rng.normal(size=length).astype(np.float32)
            payload.update(_top_k(rng, length))
            payload["adv"] = float(rng.normal())
        meta = SampleMeta((0, 0, seed * 100 + index), 0, 0, tags={"_padding_length": padding})
        records.append(SampleRecord(meta, payload))
    return records


def ragged_records(seed: int, rows: int, length: int) -> list:
    """Unpacked SFT examples of unequal lengths (one document each), for pad_token_id."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        size = int(rng.integers(1, length + 1))
        out.append({"input_ids": rng.integers(3, 40, size).tolist(), "loss_mask": [0] + [1] * (size - 1)})
    return out


def columns(seed: int, rows: int, length: int) -> dict:
    """A columnar batch: (values, offsets) pairs of tokens and a loss_mask."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(3, 40, int(offsets[-1]))
    mask = (rng.random(int(offsets[-1])) < 0.7).astype(np.int64)
    return {"input_ids": (tokens, offsets), "loss_mask": (mask, offsets)}


def hf_examples(seed: int, rows: int, length: int, *, packed: bool = False, floats: bool = False) -> list:
    """Hugging Face examples: -100 labels on a prompt, assistant masks, padding masks on either side."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(rows):
        size = int(rng.integers(2, length + 1))
        tokens = rng.integers(3, 40, size).tolist()
        prompt = int(rng.integers(0, size))
        example: dict[str, Any] = {"input_ids": tokens}
        if index % 2 == 0:
            example["labels"] = [-100] * prompt + tokens[prompt:]
        else:
            example["assistant_masks"] = [0] * prompt + [1] * (size - prompt)
        if packed:
            example["seq_lengths"] = _documents(rng, size)
        if floats:
            example["old"] = rng.normal(size=size).astype(np.float32).tolist()
            example.update(_top_k(rng, size))
            example["adv"] = float(rng.normal())
        out.append(example)
    return out


def padded_examples(seed: int, rows: int, length: int) -> list:
    """Examples padded already, with an attention_mask (left or right padding)."""
    out = []
    for index, example in enumerate(hf_examples(seed, rows, length)):
        pad = index % 3
        left = index % 2 == 0
        tokens = example["input_ids"]
        ids = [PAD] * pad + tokens if left else tokens + [PAD] * pad
        mask = [0] * pad + [1] * len(tokens) if left else [1] * len(tokens) + [0] * pad
        example = {key: value for key, value in example.items() if key != "labels"}
        if "assistant_masks" in example:
            masks = example["assistant_masks"]
            example["assistant_masks"] = [0] * pad + masks if left else masks + [0] * pad
        out.append({**example, "input_ids": ids, "attention_mask": mask})
    return out


def pairs(seed: int, rows: int, length: int, *, shared: bool = False) -> list:
    """Preference pairs (TRL's names); with ``shared``, pairs of one prompt follow each other."""
    rng = np.random.default_rng(seed)
    out = []
    prompt: list[int] = []
    for index in range(rows):
        if not shared or index % 2 == 0:
            prompt = rng.integers(3, 40, int(rng.integers(1, length))).tolist()
        out.append(
            {
                "prompt_input_ids": prompt,
                "chosen_input_ids": rng.integers(3, 40, int(rng.integers(1, length))).tolist(),
                "rejected_input_ids": rng.integers(3, 40, int(rng.integers(1, length))).tolist(),
                "ref_chosen_logps": float(rng.normal()),
                "ref_rejected_logps": float(rng.normal()),
            }
        )
    return out


def reward_pairs(seed: int, rows: int, length: int) -> list:
    """Reward pairs (TRL's names), whole sequences often ending in EOS, a margin each."""
    rng = np.random.default_rng(seed)
    return [
        {
            "chosen_ids": [*rng.integers(2, 40, int(rng.integers(1, length))).tolist(), EOS],
            "rejected_ids": rng.integers(2, 40, int(rng.integers(1, length))).tolist(),
            "margin": float(rng.normal()),
        }
        for _ in range(rows)
    ]


def _top_k(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    return {
        "top_ids": rng.integers(0, 40, (length, 2)),
        "top_logprobs": _absent(rng.normal(size=(length, 2))),
    }


def _absent(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float32)
    values[values > 1.5] = -np.inf  # a token with fewer entries
    return values


def vlm_examples(seed: int, rows: int, length: int) -> list:
    """Qwen-VL examples: text, 0-2 images (grids of 2-6 patches a side, merged by 2), a video now and then."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        ids: list[int] = []
        types: list[int] = []
        grids = {1: [], 2: []}
        for _ in range(int(rng.integers(0, 3))):
            modality = 2 if rng.random() < 0.25 else 1
            grid = [int(rng.integers(2, 4)) if modality == 2 else 1, *(2 * rng.integers(1, 4, 2)).tolist()]
            text = rng.integers(3, 40, int(rng.integers(1, max(2, length // 4)))).tolist()
            ids += text + [90 + modality] * (grid[0] * grid[1] * grid[2] // 4)
            types += [0] * len(text) + [modality] * (grid[0] * grid[1] * grid[2] // 4)
            grids[modality].append(grid)
        tail = rng.integers(3, 40, int(rng.integers(1, length))).tolist()
        example: dict[str, Any] = {"input_ids": ids + tail, "mm_token_type_ids": types + [0] * len(tail)}
        for modality, pixels, grid_name in ((1, "pixel_values", "image_grid_thw"),
                                            (2, "pixel_values_videos", "video_grid_thw")):  # fmt: skip
            if grids[modality]:
                patches = sum(t * h * w for t, h, w in grids[modality])
                example[pixels] = rng.normal(size=(patches, 6)).astype(np.float32)
                example[grid_name] = grids[modality]
        if grids[2]:
            example["second_per_grid_ts"] = [0.5] * len(grids[2])
        out.append(example)
    return out


def rollouts(seed: int, rows: int, length: int) -> list:
    """GRPO groups: completions after one prompt, behaviour log-probs, an advantage per rollout."""
    rng = np.random.default_rng(seed)
    out = []
    prompt: list[int] = []
    for index in range(rows):
        if index % 3 == 0:
            prompt = rng.integers(3, 40, int(rng.integers(1, length))).tolist()
        completion = rng.integers(3, 40, int(rng.integers(1, length))).tolist()
        out.append(
            {
                "input_ids": prompt + completion,
                "completion_mask": [0] * len(prompt) + [1] * len(completion),
                "old": [0.0] * len(prompt) + rng.normal(size=len(completion)).astype(np.float32).tolist(),
                **_top_k(rng, len(prompt) + len(completion)),
                "adv": float(rng.normal()),
            }
        )
    return out


def trajectories(seed: int, rows: int, length: int) -> list:
    """Agentic trajectories that branch at several depths: each continues an earlier one (or a new
    prompt) from a random place, trained and untrained spans alternating; two groups."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    for index in range(rows):
        if index and rng.random() < 0.8:
            base = out[int(rng.integers(0, index))]
            cut = int(rng.integers(1, len(base["input_ids"]) + 1))
            ids, trained = base["input_ids"][:cut], base["completion_mask"][:cut]
            old = base["old"][:cut]
        else:
            ids = rng.integers(3, 40, int(rng.integers(1, length))).tolist()
            trained, old = [0] * len(ids), [0.0] * len(ids)
        for _ in range(int(rng.integers(1, 3))):
            span = int(rng.integers(1, length))
            flag = int(rng.integers(0, 2))
            ids = ids + rng.integers(3, 40, span).tolist()
            trained = trained + [flag] * span
            old = old + rng.normal(size=span).astype(np.float32).tolist()
        out.append(
            {
                "input_ids": ids,
                "completion_mask": trained,
                "old": old,
                "adv": float(rng.normal()),
                "group": index % 2,
            }
        )
    return out


SHAPES = [(3, 16), (2, 9), (4, 23), (1, 12)]
"""(rows, length) of each batch a case runs: several shapes, so compiled graphs see dynamic sizes."""

TOP = [  # a teacher's top-2 per prediction, some entries absent (-inf): tensor-valued fields
    TensorField("top_ids", align="label", dtype=torch.int32, shape=(2,)),
    TensorField("top_logprobs", align="label", fill=float("-inf"), shape=(None,)),
]
FLOATS = ["old", FloatField("adv", "sequence"), *TOP]
ROLLOUT_FLOATS = ["old", FloatField("adv", "sequence", broadcast=True), *TOP]
TREE_FLOATS = ["old", FloatField("adv", "sequence")]
NATIVE_FULL = {
    "return_labels": True,
    "return_loss_mask": True,
    "return_num_valid_tokens": True,
    "return_cu_seqlens": True,
    "return_padding_mask": True,
}

# (name, make(**mode) -> collator, batches(seed, rows, length) -> samples)
CASES: list[tuple[str, Callable[..., Any], Callable[[int, int, int], Any]]] = [
    ("native-full", lambda **m: Collator(**NATIVE_FULL, **m), packed_records),
    (
        "native-eos-static-boundaries",
        lambda **m: Collator(**NATIVE_FULL, eos_mask_loss=True, eos_token_id=EOS, num_boundaries=12, **m),
        packed_records,
    ),
    (
        "native-sequence-positions-flatten",
        lambda **m: Collator(
            return_labels=True, return_cu_seqlens=True, position_mode="sequence", flatten=True, **m
        ),
        packed_records,
    ),
    (
        "native-labels-only",  # the supervision and the positions reach the compiled BoundaryMask
        lambda **m: Collator(return_labels=True, **m),
        packed_records,
    ),
    (
        "native-no-mask-page-labels",
        lambda **m: Collator(
            return_labels=True, boundary_safe_labels=False, extra_fields=["weights_in"], **m
        ),
        lambda s, r, n: packed_records(s, r, n, mask=False),
    ),
    (
        "native-floats-and-yours",
        lambda **m: Collator(
            return_labels=True, return_loss_mask=True, float_fields=FLOATS, transforms=[Weights()], **m
        ),
        lambda s, r, n: packed_records(s, r, n, floats=True),
    ),
    (
        "native-no-labels",
        lambda **m: Collator(return_cu_seqlens=True, return_padding_mask=True, **m),
        packed_records,
    ),
    (
        "native-padded-sft",
        lambda **m: Collator(
            return_labels=True, return_loss_mask=True, pad_token_id=PAD, pad_to_multiple_of=8, **m
        ),
        ragged_records,
    ),
    (
        "native-columns",
        lambda **m: Collator(return_labels=True, return_num_valid_tokens=True, pad_token_id=PAD, **m),
        columns,
    ),
    (
        "transformers-padded",
        lambda **m: Collator.for_transformers(pad_token_id=PAD, float_fields=FLOATS, **m),
        lambda s, r, n: hf_examples(s, r, n, floats=True),
    ),
    (
        "transformers-left-padded-masks",
        lambda **m: Collator.for_transformers(
            pad_token_id=PAD, padding_side="left", pad_to_multiple_of=4, label_pad_token_id=-1, **m
        ),
        padded_examples,
    ),
    (
        "transformers-vision-language-packed",
        lambda **m: Collator.for_transformers(
            padding_free=True, mrope=MRope(video_time="seconds"), return_flash_attn_kwargs=True, **m
        ),
        vlm_examples,
    ),
    (
        "transformers-vision-language-padded",
        lambda **m: Collator.for_transformers(pad_token_id=PAD, mrope=MRope(video_time="index"), **m),
        vlm_examples,
    ),
    (
        "transformers-padding-free",
        lambda **m: Collator.for_transformers(
            padding_free=True, return_flash_attn_kwargs=True, return_seq_idx=True, **m
        ),
        lambda s, r, n: hf_examples(s, r, n, packed=True),
    ),
    (
        "transformers-padding-free-offsets",
        lambda **m: Collator.for_transformers(
            padding_free=True,
            position_ids_start=1,
            separator_id=-7,
            pad_token_id=PAD,
            pad_to_multiple_of=8,
            transforms=[Weights("position_ids")],
            **m,
        ),
        hf_examples,
    ),
    (
        "transformers-padding-free-sequence-map",
        lambda **m: Collator.for_transformers(
            padding_free=True, return_sequence_map=True, pad_token_id=PAD, pad_to_multiple_of=8, **m
        ),
        lambda s, r, n: hf_examples(s, r, n, packed=True),
    ),
    (
        "preference-padded",
        lambda **m: Collator.for_preference(pad_token_id=PAD, **m),
        pairs,
    ),
    (
        "preference-padding-free",
        lambda **m: Collator.for_preference(padding_free=True, return_flash_attn_kwargs=True, **m),
        pairs,
    ),
    (
        "preference-shared-padded",
        lambda **m: Collator.for_preference(pad_token_id=PAD, shared_prompt=True, **m),
        lambda s, r, n: pairs(s, r, n, shared=True),
    ),
    (
        "preference-shared-padding-free",
        lambda **m: Collator.for_preference(padding_free=True, shared_prompt=True, **m),
        lambda s, r, n: pairs(s, r, n, shared=True),
    ),
    (
        "rewards-padded",
        lambda **m: Collator.for_rewards(pad_token_id=PAD, pad_to_multiple_of=4, **m),
        lambda s, r, n: reward_pairs(s, r, n),
    ),
    (
        "rewards-padding-free-skip-eos",
        lambda **m: Collator.for_rewards(
            padding_free=True, return_flash_attn_kwargs=True, last_token_skip_id=EOS, **m
        ),
        lambda s, r, n: reward_pairs(s, r, n),
    ),
    (
        "rollouts-padding-free",
        lambda **m: Collator.for_rollouts(padding_free=True, float_fields=ROLLOUT_FLOATS, **m),
        rollouts,
    ),
    (
        "rollouts-shared-prompt",
        lambda **m: Collator.for_rollouts(
            padding_free=True, shared_prompt=True, float_fields=ROLLOUT_FLOATS, **m
        ),
        rollouts,
    ),
    (
        "rollouts-padded",
        lambda **m: Collator.for_rollouts(pad_token_id=PAD, float_fields=FLOATS, **m),
        rollouts,
    ),
    (
        "trees-group",
        lambda **m: Collator.for_trees(float_fields=TREE_FLOATS, pad_token_id=PAD, pad_to_multiple_of=4, **m),
        trajectories,
    ),
    (
        "trees-batch-copied-rows",
        lambda **m: Collator.for_trees(
            share="batch",
            copy_openers=True,
            max_row_tokens=160,
            oversized="split",
            float_fields=TREE_FLOATS,
            **m,
        ),
        trajectories,
    ),
    (
        "trees-padded",
        lambda **m: Collator.for_trees(padding_free=False, pad_token_id=PAD, float_fields=TREE_FLOATS, **m),
        trajectories,
    ),
]


def on_host(value: Any) -> Any:
    """An output as the CPU holds it: tensors moved to the CPU, containers walked."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: on_host(item) for key, item in value.items()}
    return value


def assert_same(got: dict, want: dict, where: str) -> None:
    """Key for key (in order), dtype for dtype, shape for shape, value for value."""
    assert list(got) == list(want), (where, list(got), list(want))
    for key, expected in want.items():
        value = got[key]
        assert type(value) is type(expected), (where, key, type(value), type(expected))
        if isinstance(expected, torch.Tensor):
            assert value.dtype == expected.dtype, (where, key, value.dtype, expected.dtype)
            assert value.shape == expected.shape, (where, key, value.shape, expected.shape)
            assert torch.equal(value, expected), (where, key, value, expected)
        elif isinstance(expected, np.ndarray):
            assert value.dtype == expected.dtype and np.array_equal(value, expected), (where, key)
        else:
            assert value == expected, (where, key, value, expected)


def run(collator: Any, samples: Any, *, host: bool = True) -> dict:
    with use_host_pass(host):
        return on_host(collator(samples))


@pytest.mark.compile
@pytest.mark.parametrize("name, make, batches", CASES, ids=[case[0] for case in CASES])
def test_every_mode_gives_the_same_batch(name, make, batches):
    modes: dict[str, Any] = {"compiled": make(compile=True)}
    if CUDA:
        modes["cuda"] = make(device="cuda")
        modes["cuda-compiled"] = make(device="cuda", compile=True)
    host, eager = make(), make()
    for index, (rows, length) in enumerate(SHAPES):
        samples = batches(1000 * len(name) + index, rows, length)
        want = run(eager, samples, host=False)
        assert_same(run(host, samples), want, f"{name} host, batch {index}")
        for mode, collator in modes.items():
            assert_same(run(collator, samples), want, f"{name} {mode}, batch {index}")


@pytest.mark.parametrize("name, make, batches", CASES, ids=[case[0] for case in CASES])
def test_stack_and_finish_give_the_same_batch(name, make, batches):
    """The worker split (stack, then finish) equals the one-step call, host path and torch alike."""
    collator = make()
    for index, (rows, length) in enumerate(SHAPES[:2]):
        samples = batches(7 + index, rows, length)
        want = run(collator, samples, host=False)
        for host in (True, False):
            with use_host_pass(host):
                got = on_host(collator.finish(collator.stack(samples)))
            assert_same(got, want, f"{name} stack/finish host={host}, batch {index}")


def test_the_reported_compiled_case_keeps_the_prompt_unsupervised():
    """A compiled chain is fed the supervision: the prompt of each document stays -100."""
    row = SampleRecord(
        SampleMeta((0, 0, 0), 0, 0),
        {
            "input_ids": [1, 5, 6, 2, 1, 7, 8, 2],
            "positions": [0, 1, 2, 3, 0, 1, 2, 3],
            "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1],
        },
    )
    want = [[-100, 6, 2, -100, -100, 8, 2]]
    assert Collator(return_labels=True)([row])["labels"].tolist() == want
    assert Collator(return_labels=True, compile=True)([row])["labels"].tolist() == want


class Sneaky(Transform):
    """Reads ``positions`` without declaring it, the way the compiled chain once lost the supervision."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.in_keys, self.out_keys, self.how = ["labels"], ["weights"], how

    def compute(self, data):
        if self.how == "get":
            extra = data.get("positions")
        elif self.how == "in":
            extra = data["labels"] if "positions" in data else None
        else:
            extra = data["positions"]
        return {"weights": torch.zeros_like(data["labels"]) if extra is None else extra.float()}


class Optional(Transform):
    """Declares ``positions`` as optional: read when present, ``None`` when absent, in every mode."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys, self.optional_keys = ["labels"], ["weights"], ("positions",)

    def compute(self, data):
        positions = data.get("positions")
        base = torch.ones_like(data["labels"], dtype=torch.float32)
        return {"weights": base if positions is None else base + positions.to(torch.float32)}


@pytest.mark.parametrize("how", ["item", "get", "in"])
def test_an_undeclared_read_fails_in_eager_mode(how):
    from tensordict import TensorDict

    from zephon_collate import Chain
    from zephon_collate.transforms.base import UndeclaredKeyError

    td = TensorDict(labels=torch.tensor([[5, 6]]), positions=torch.tensor([[0, 1]]), batch_size=[1])
    message = r"Sneaky reads 'positions', which it does not declare .* add it to in_keys"
    with pytest.raises(UndeclaredKeyError, match=message):
        Sneaky(how)(td)
    with pytest.raises(UndeclaredKeyError, match=message):
        Chain(Sneaky(how))(td)
    rows = packed_records(3, 2, 8)
    for host in (True, False):
        with use_host_pass(host), pytest.raises(UndeclaredKeyError, match=message):
            Collator(return_labels=True, transforms=[Sneaky(how)])(rows)


def test_optional_keys_are_fed_in_every_mode():
    rows = packed_records(3, 2, 8)
    with_positions = Collator(return_labels=True, transforms=[Optional()])
    want = run(with_positions, rows, host=False)
    assert torch.equal(want["weights"], 1.0 + want["positions"].float())
    assert_same(run(with_positions, rows), want, "host")
    assert_same(
        run(Collator(return_labels=True, transforms=[Optional()], compile=True), rows), want, "compiled"
    )
    unpositioned = [{"input_ids": [5, 6, 7]}]
    plain = Collator(return_labels=True, transforms=[Optional()])(unpositioned)
    assert plain["weights"].tolist() == [[1.0, 1.0]]
