"""torch.compile on the CPU's inductor backend: compiled equals eager element for element, no recompiles."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, FULL_OPTIONS, PackedRecords, as_lists
from tensordict import TensorDict

from zephon_collate import Collator
from zephon_collate.transforms import CuSeqlens, EosMask, LossMask, PaddingMask, Positions, TokenShift

pytestmark = pytest.mark.compile

OPTIONS = {**FULL_OPTIONS, "position_mode": "sequence"}
SHAPES = [(4, 16), (3, 40), (6, 24), (2, 64), (5, 33)]


def records(rows, length, offset=0):
    data = PackedRecords(offset + rows, length)
    return [data[i] for i in range(offset, offset + rows)]


def test_compiled_collator_equals_eager_without_recompiles():
    compiled = Collator(compile=True, **OPTIONS)
    eager = Collator(device="cpu", **OPTIONS)
    warm = records(*SHAPES[0])
    assert as_lists(compiled(warm)) == as_lists(eager(warm))
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows, length in SHAPES[1:]:
            batch = records(rows, length, offset=rows)
            assert as_lists(compiled(batch)) == as_lists(eager(batch))


def test_static_cu_seqlens_compiles_whole_chain():
    compiled = Collator(compile=True, num_boundaries=8, flatten=False, **OPTIONS)
    eager = Collator(device="cpu", num_boundaries=8, **OPTIONS)
    plan = compiled.plan(tuple(compiled.stack(records(2, 16)).td.keys()))
    assert plan.eager_steps == []  # one compiled graph, CuSeqlens included
    warm = records(*SHAPES[0])
    assert as_lists(compiled(warm)) == as_lists(eager(warm))
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows, length in SHAPES[1:]:
            batch = records(rows, length)
            assert as_lists(compiled(batch)) == as_lists(eager(batch))


def test_each_plan_compiles_code_of_its_own():
    """Collators with distinct options never share dynamo's per-code cache: with a limit of one compiled
    graph per code object, three differently configured compiled collators all compile and match eager."""
    batch = records(2, 12)
    variants = [
        {"return_labels": True},
        {"return_labels": True, "ignore_index": -1},
        {"return_labels": True, "return_loss_mask": True},
    ]
    with torch._dynamo.config.patch(recompile_limit=1):
        for options in variants:
            compiled = Collator(compile=True, **options)
            assert as_lists(compiled(batch)) == as_lists(Collator(**options)(batch)), options


def _td(rows, length):
    generator = torch.Generator().manual_seed(rows * 100 + length)
    positions = torch.arange(length).remainder(5).expand(rows, length)
    return TensorDict(
        input_ids=torch.randint(0, 6, (rows, length), generator=generator),
        positions=positions.contiguous(),
        loss_mask=torch.randint(0, 2, (rows, length), generator=generator),
        padding_length=torch.randint(0, 3, (rows,), generator=generator),
        batch_size=[rows],
    )


TRANSFORMS = {
    "TokenShift": lambda: TokenShift(input_keys=["positions"], label_keys=["loss_mask"]),
    "PaddingMask": PaddingMask,
    "EosMask": lambda: EosMask(EOS),
    "LossMask": LossMask,
    "Positions": lambda: Positions("sequence"),
    "CuSeqlens(static)": lambda: CuSeqlens(num_boundaries=8),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_every_transform_compiles_fullgraph(name):
    transform = TRANSFORMS[name]()
    prepare = TokenShift(label_keys=["loss_mask"]) if name in ("EosMask", "LossMask") else None
    compiled = torch.compile(transform, dynamic=True, fullgraph=True)
    for rows, length in [(3, 20), (5, 30)]:
        td = _td(rows, length)
        td = prepare(td) if prepare is not None else td
        expected, got = transform(td), compiled(td)
        assert sorted(got.keys()) == sorted(expected.keys())
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
