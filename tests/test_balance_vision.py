"""Vision tokens in the rank balance: ``CostModel.vision_costs``, ``from_model`` on vision-language configs,
and ``extra_costs`` in ``plan_balance`` and ``BalancedBatchSampler``.

Hand-worked costs; the vision FLOPs of ``from_model(config, train_vision=False)`` equal torch's
``FlopCounterMode`` count of the tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers' forward pass; a
hypothesis property recomputing each micro-batch's cost (with its extra costs) from the plan's cells
and rows; extra costs of zero change nothing.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import grouped
from test_balance import next_fit, saved
from transformers import LlamaConfig, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

from zephon_collate.parallel.balance import BalanceOptions, plan_balance
from zephon_collate.parallel.cost import CostModel
from zephon_collate.parallel.sampler import BalancedBatchSampler

TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 512,
    "bos_token_id": None,
    "eos_token_id": None,
}
QWEN2_5_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
}


def qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(QWEN2_5_VISION))


def configs():
    """Tiny configs of the three families, and each one's vision tower class."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    qwen2 = Qwen2VLConfig(
        text_config=dict(TEXT),
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "mlp_ratio": 4,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    )
    qwen3 = Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 16},
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_heads": 4,
            "out_hidden_size": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 2],
        },
    )
    return {
        "qwen2_vl": (qwen2, Qwen2VisionTransformerPretrainedModel),
        "qwen2_5_vl": (qwen2_5_vl_config(), Qwen2_5_VisionTransformerPretrainedModel),
        "qwen3_vl": (qwen3, Qwen3VLVisionModel),
    }


# --- CostModel.vision_costs ----------------------------------------------------------------------


def test_vision_costs_hand_worked():
    model = CostModel(linear=1, quadratic=0, vision_linear=3, vision_quadratic=2)
    grids = [
        [[1, 2, 3]],  # one image of 6 patches: 3 * 6 + 2 * 6**2
        [],  # text only
        [[2, 2, 2], [1, 1, 1]],  # a 2-frame video (each frame its own segment), then a 1-patch image
        np.zeros((0, 3), np.int64),  # text only, as an empty image_grid_thw
        torch.tensor([[1, 4, 4]]),  # a tensor row: 3 * 16 + 2 * 16**2
    ]
    costs = model.vision_costs(grids)
    assert costs.dtype == np.int64
    assert costs.tolist() == [90, 0, 2 * (3 * 4 + 2 * 16) + (3 + 2), 0, 560]
    assert CostModel(linear=1, quadratic=0).vision_costs(grids).tolist() == [0] * 5
    assert model.vision_costs([]).tolist() == []
    # exact at the limit: one frame of 2**15 x 2**15 patches is 2**60 squared patches
    assert CostModel(linear=1, quadratic=0, vision_quadratic=4).vision_costs(
        [[[1, 2**15, 2**15]]]
    ).tolist() == [2**62]
    with pytest.raises(ValueError, match=r"media of document 0 cost more than 2\*\*62"):
        CostModel(linear=1, quadratic=0, vision_quadratic=4, vision_linear=1).vision_costs(
            [[[1, 2**15, 2**15]]]
        )


@pytest.mark.parametrize(
    ("grids", "error", "match"),
    [
        ([[1, 2, 3]], ValueError, r"grids\[0\] must have shape \[n, 3\]"),  # one grid, not one per document
        ([[], [[1, 2]]], ValueError, r"grids\[1\] must have shape \[n, 3\].*got shape \[1, 2\]"),
        ([[[1.0, 2.0, 2.0]]], TypeError, r"grids\[0\] must hold ints"),
        ([[], [], [[1, 0, 2]]], ValueError, r"grids\[2\] holds 0; t, h and w must be >= 1"),
        (5, TypeError, "grids must be a sequence"),
        ("123", TypeError, "grids must be a sequence"),
    ],
)
def test_vision_costs_refuses_bad_grids(grids, error, match):
    with pytest.raises(error, match=match):
        CostModel(linear=1, quadratic=1, vision_linear=1).vision_costs(grids)


def test_vision_coefficients_are_validated_and_text_only_models_read_as_before():
    with pytest.raises(ValueError, match="vision_linear must be an int >= 0, got -1"):
        CostModel(linear=1, quadratic=0, vision_linear=-1)
    with pytest.raises(TypeError, match="vision_quadratic must be an int"):
        CostModel(linear=1, quadratic=0, vision_quadratic=1.5)
    assert repr(CostModel(linear=3, quadratic=1)) == "CostModel(linear=3, quadratic=1, unit=1.0)"
    model = CostModel(linear=3, quadratic=1, vision_linear=2, vision_quadratic=1)
    assert repr(model) == "CostModel(linear=3, quadratic=1, unit=1.0, vision_linear=2, vision_quadratic=1)"
    assert eval(repr(model)) == model != CostModel(linear=3, quadratic=1)


# --- CostModel.from_model on vision-language configs ---------------------------------------------


def test_from_model_on_a_tiny_qwen2_5_vl_config():
    config = qwen2_5_vl_config()
    model = CostModel.from_model(config)
    text = CostModel.from_model(config.text_config)
    assert model.vision_linear > 0 and model.vision_quadratic > 0
    assert (text.vision_linear, text.vision_quadratic) == (0, 0)
    # the text terms are those of the text config alone, in FLOPs; the unit is the greatest common
    # divisor of all four FLOP coefficients (here 64 against the text's 128), so the ratio is kept
    assert model.linear * model.unit == text.linear * text.unit
    assert model.quadratic * model.unit == text.quadratic * text.unit
    assert (model.linear, model.quadratic, model.unit) == (2 * text.linear, 2 * text.quadratic, text.unit / 2)
    # so text-only documents get the same plan from either model
    lengths = np.random.default_rng(0).integers(1, 300, 60).tolist()
    for cost in (model, text):
        for budget in ({"max_tokens": 512}, {"rows": 2, "seq_len": 300}):
            options = BalanceOptions(cost=cost, micro_batches=2, **budget)
            assert (
                plan_balance(lengths, options, ranks=3).digest()
                == plan_balance(
                    lengths, BalanceOptions(cost=text, micro_batches=2, **budget), ranks=3
                ).digest()
            )
    # ... and those of the dimensions given by hand (the config's vocabulary counted)
    assert text == CostModel.from_model(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, vocab_size=512
    )
    # the vision terms by hand: width 32, 3 layers (layer 1 full, 2 windowed over 8 x 8 = 64 patches),
    # SwiGLU 48, patch embedding 3 * 2 * 14 * 14, one merger (2 x 2 patches into 64 wide)
    embed, layer, merger = 3 * 2 * 14 * 14 * 32, 4 * 32 * 32 + 32 * 48 * 3, 32 * 32 * 4 + 32 * 64
    linear = 6 * (embed + 3 * layer + merger) + 2 * 14 * 32 * 64
    assert model.vision_linear * model.unit == linear
    assert model.vision_quadratic * model.unit == 1 * 14 * 32
    assert math.gcd(model.linear, model.quadratic, model.vision_linear, model.vision_quadratic) == 1
    frozen = CostModel.from_model(config, train_vision=False)
    assert frozen.vision_linear * frozen.unit == 2 * (embed + 3 * layer + merger) + 2 * 4 * 32 * 64
    assert frozen.vision_quadratic * frozen.unit == 4 * 32
    assert frozen.linear * frozen.unit == text.linear * text.unit


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_forward_flops_equal_torchs_count_of_the_tower(family):
    """Forward only (``train_vision=False``): every GEMM, convolution and attention product of the
    tower, as torch's FlopCounterMode counts them, for images and a video whose frames fill whole
    Qwen2.5-VL windows (8 x 8 patches)."""
    from torch.utils.flop_counter import FlopCounterMode

    config, tower_class = configs()[family]
    vision = config.vision_config
    tower = tower_class._from_config(vision, attn_implementation="eager").eval()
    model = CostModel.from_model(config, train_vision=False)
    grid = torch.tensor([[1, 16, 8], [2, 8, 8], [1, 8, 24]])
    pixels = torch.randn(
        int(grid.prod(-1).sum()), vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    )
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grid)
    assert int(model.vision_costs([grid])[0]) * model.unit == counter.get_total_flops()
    assert (
        model.linear * model.unit
        == CostModel.from_model(config.text_config).linear * CostModel.from_model(config.text_config).unit
    )


def test_from_model_text_config_and_refusals():
    llama = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    )
    assert CostModel.from_model(llama) == CostModel(linear=343536, quadratic=7, unit=131072)
    assert CostModel.from_model(llama, vocab_size=0) == CostModel.from_model(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336
    )
    with pytest.raises(TypeError, match="give num_layers="):
        CostModel.from_model(hidden_size=64, num_heads=4, ffn_hidden_size=64)
    bad = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=0, intermediate_size=64)
    with pytest.raises(
        ValueError, match=r"num_heads \(config.num_attention_heads\) must be an int >= 1, got 0"
    ):
        CostModel.from_model(bad)
    with pytest.raises(ValueError, match=r"mixture of experts.*ffn_hidden_size="):
        CostModel.from_model(LlamaConfig(hidden_size=64, num_attention_heads=4, num_experts_per_tok=2))

    class Other:
        model_type = "llava"
        text_config = llama
        vision_config = object()

    with pytest.raises(ValueError, match="model_type 'llava' is not one of"):
        CostModel.from_model(Other())
    with pytest.raises(TypeError, match="train_vision must be a bool"):
        CostModel.from_model(qwen2_5_vl_config(), train_vision=1)


# --- plan_balance(extra_costs=...) ---------------------------------------------------------------


def test_equal_lengths_with_different_images_go_to_different_ranks():
    cost = CostModel(linear=1, quadratic=0, vision_linear=1, vision_quadratic=1)
    options = BalanceOptions(cost=cost, max_tokens=16, micro_batches=1)
    lengths = [4, 4, 8]  # documents 0 and 1: 4 tokens each, a tiny image and a large one
    grids = [[[1, 2, 2]], [[1, 16, 16]], []]
    extra = cost.vision_costs(grids)
    assert extra.tolist() == [4 + 16, 256 + 256**2, 0]
    plain = plan_balance(lengths, options, ranks=2)
    assert sorted(plain.cells[0]) == [(0, 1), (2,)]  # tokens alone: the two short documents together
    weighted = plan_balance(lengths, options, ranks=2, extra_costs=extra)
    assert sorted(weighted.cells[0]) == [(0, 2), (1,)]
    assert sorted(weighted.costs[0].tolist()) == [4 + 20 + 8, 4 + 256 + 256**2]
    assert sorted(weighted.tokens[0].tolist()) == [4, 12]  # a token budget of 16 either way
    assert weighted.largest.tolist() == [4 + 256 + 256**2]
    assert weighted.digest() != plain.digest()


def test_extra_costs_do_not_change_token_budgets():
    """A costly document still takes only its tokens' room: two fit one 16-token micro-batch."""
    options = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=16, micro_batches=1)
    plan = plan_balance([8, 8], options, ranks=1, extra_costs=[10**9, 10**9])
    assert plan.cells == (((0, 1),),) and plan.held == ()
    assert plan.costs.tolist() == [[16 + 2 * 10**9]]


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ([1, 2], ValueError, "extra_costs has 2 entries for 3 documents"),
        ([1, -1, 2], ValueError, r"plan_balance: extra_costs\[1\] is -1"),
        ([1.0, 2.0, 3.0], TypeError, "plan_balance: extra_costs must be a 1-D sequence of ints"),
        ([[1, 2, 3]], TypeError, "extra_costs must be a 1-D sequence of ints"),
        ([2**62, 0, 0], ValueError, r"total cost exceeds 2\*\*62.*extra_costs"),
    ],
)
def test_bad_extra_costs_are_named(extra, error, match):
    options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=8, micro_batches=1)
    with pytest.raises(error, match=match):
        plan_balance([1, 2, 3], options, ranks=2, extra_costs=extra)


@st.composite
def windows(draw):
    fixed = draw(st.booleans())
    ranks = draw(st.integers(1, 4))
    budget = draw(st.integers(4, 24))
    lengths = draw(st.lists(st.integers(1, budget), min_size=1, max_size=30))
    groups = None
    if not fixed and draw(st.booleans()):
        lengths, groups = grouped(draw, lengths, budget)
    budget_kwargs = {"rows": draw(st.integers(1, 3)), "seq_len": budget} if fixed else {"max_tokens": budget}
    options = BalanceOptions(
        cost=draw(st.sampled_from([CostModel(linear=0, quadratic=1), CostModel(linear=3, quadratic=1)])),
        micro_batches=draw(st.none() | st.integers(1, 3)),
        hold_back=draw(st.integers(0, 2)),
        **budget_kwargs,
    )
    extra = draw(st.lists(st.integers(0, 2000), min_size=len(lengths), max_size=len(lengths)))
    waited = draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    return options, ranks, lengths, groups, waited, extra, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(windows())
def test_plan_costs_are_the_documents_costs_plus_their_extra_costs(case):
    options, ranks, lengths, groups, waited, extra, final = case
    plan = plan_balance(
        lengths, options, ranks=ranks, groups=groups, waited=waited, final=final, extra_costs=extra
    )
    cost = options.cost
    placed = [doc for slot in plan.cells for cell in slot for doc in cell]
    assert sorted(placed + list(plan.held)) == list(range(len(lengths)))
    for slot in range(plan.num_slots):
        for rank in range(ranks):
            cell = plan.cells[slot][rank]
            expected = sum(cost.cost(lengths[doc]) + extra[doc] for doc in cell)
            tokens = sum(lengths[doc] for doc in cell)
            if options.fixed_rows:
                rows = plan.rows[slot][rank]
                assert [doc for row in rows for doc in row] == list(cell)
                assert next_fit(cell, lengths, options.seq_len, groups) == list(rows)
                assert len(rows) <= options.rows
                expected += sum(cost.cost(options.seq_len - sum(lengths[d] for d in row)) for row in rows)
            else:
                assert tokens <= options.max_tokens
            assert int(plan.costs[slot, rank]) == expected
            assert int(plan.tokens[slot, rank]) == tokens
        # the costliest unit of the slot, extra costs included
        units = {}
        for cell in plan.cells[slot]:
            for doc in cell:
                key = doc if groups is None else groups[doc]
                units[key] = units.get(key, 0) + cost.cost(lengths[doc]) + extra[doc]
        assert int(plan.largest[slot]) == max(units.values(), default=0)
    # extra costs of zero are no extra costs
    zero = plan_balance(
        lengths,
        options,
        ranks=ranks,
        groups=groups,
        waited=waited,
        final=final,
        extra_costs=[0] * len(lengths),
    )
    alone = plan_balance(lengths, options, ranks=ranks, groups=groups, waited=waited, final=final)
    assert zero.digest() == alone.digest() and zero.costs.tolist() == alone.costs.tolist()
    # a plan depends on cost ratios only: every cost (and extra cost) doubled, the same plan
    doubled = BalanceOptions(
        cost=CostModel(linear=2 * cost.linear, quadratic=2 * cost.quadratic),
        micro_batches=options.micro_batches,
        max_tokens=options.max_tokens,
        rows=options.rows,
        seq_len=options.seq_len,
        hold_back=options.hold_back,
    )
    twice = plan_balance(
        lengths,
        doubled,
        ranks=ranks,
        groups=groups,
        waited=waited,
        final=final,
        extra_costs=[2 * e for e in extra],
    )
    assert twice.digest() == plan.digest() and twice.costs.tolist() == (2 * plan.costs).tolist()


# --- BalancedBatchSampler(extra_costs=...) -------------------------------------------------------

RNG = np.random.default_rng(5)
LENGTHS = RNG.integers(1, 40, 200).tolist()
GRIDS = [
    [[1, 2 * int(RNG.integers(1, 12)), 2 * int(RNG.integers(1, 12))]] if RNG.random() < 0.4 else []
    for _ in LENGTHS
]
VISION = CostModel(linear=3, quadratic=1, vision_linear=2, vision_quadratic=1)
OPTIONS = BalanceOptions(cost=VISION, max_tokens=64, micro_batches=3)
EXTRA = VISION.vision_costs(GRIDS)


def sampler(rank=0, extra=EXTRA, **kwargs):
    return BalancedBatchSampler(
        LENGTHS, OPTIONS, num_replicas=3, rank=rank, seed=7, extra_costs=extra, **kwargs
    )


def test_sampler_takes_extra_costs_and_every_rank_plans_alike():
    plans = [list(sampler(rank).plans()) for rank in range(3)]
    assert [p.digest() for p in plans[0]] == [p.digest() for p in plans[1]] == [p.digest() for p in plans[2]]
    per_rank = [list(sampler(rank)) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [slot for plan in plans[0] for slot in plan.cells]
    for rank in range(3):
        assert [list(slot[rank]) for slot in flat] == per_rank[rank]
    dropped = sum(len(plan.dropped) for plan in plans[0])
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert len(seen) == len(set(seen)) == len(LENGTHS) - dropped
    assert all(sum(LENGTHS[i] for i in batch) <= 64 for batches in per_rank for batch in batches)
    # each micro-batch's planned cost includes its documents' vision costs
    for plan in plans[0]:
        for slot, cells in enumerate(plan.cells):
            for rank, cell in enumerate(cells):
                assert int(plan.costs[slot, rank]) == sum(
                    VISION.cost(LENGTHS[i]) + int(EXTRA[i]) for i in cell
                )
    assert [p.digest() for p in sampler(extra=None).plans()] != [p.digest() for p in plans[0]]
    assert [p.digest() for p in sampler(extra=np.zeros(len(LENGTHS), np.int64)).plans()] == [
        p.digest() for p in sampler(extra=None).plans()
    ]


def test_sampler_with_extra_costs_resumes_exactly_and_refuses_other_extra_costs():
    full = list(sampler(rank=1))
    for stop in (0, 5, len(full) - 1):
        first = sampler(rank=1)
        taken = list(zip(range(stop), iter(first), strict=False))
        state = saved(first.state_dict())
        resumed = sampler(rank=1)
        resumed.load_state_dict(state)
        assert [batch for _, batch in taken] + list(resumed) == full
    with pytest.raises(ValueError, match="another data"):
        sampler(rank=1, extra=None).load_state_dict(saved(sampler(rank=1).state_dict()))


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ([1, 2], ValueError, "BalancedBatchSampler: extra_costs has 2 entries for 200 lengths"),
        ([-1] * 200, ValueError, r"BalancedBatchSampler: extra_costs\[0\] is -1"),
        ([0.5] * 200, TypeError, "BalancedBatchSampler: extra_costs must be a 1-D sequence of ints"),
    ],
)
def test_sampler_refuses_bad_extra_costs(extra, error, match):
    with pytest.raises(error, match=match):
        sampler(extra=extra)
