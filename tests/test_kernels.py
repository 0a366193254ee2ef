"""Every kernel of the registry, against a pure-Python reference, over integer dtypes and edge lengths.

``functional.KERNELS`` lists the public kernels; each has a case here (a test
fails when one is added without): inputs drawn for a given integer dtype and
row length, and a reference computed token by token in plain Python. Every
case runs on the CPU for int8, int16, int32, int64 and uint8 at lengths near
those dtypes' limits (0, 1, 127-128, 255-256, 300), on CUDA when there is one
(the same inputs, the same answers), and a few under ``torch.compile``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from zephon_collate import functional
from zephon_collate.functional import attention

DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
LENGTHS = [0, 1, 2, 127, 128, 255, 256, 300]
ROWS = 3


def top(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).max


def restarting(length: int, dtype: torch.dtype, rng: random.Random) -> list[int]:
    """Segment-restarting positions of one row whose values fit ``dtype``."""
    out, position = [], 0
    for t in range(length):
        if t == 0 or position >= top(dtype) or rng.random() < 0.05:
            position = 0 if t else rng.choice([0, 0, 3])  # a row may start mid-document
        out.append(position)
        position += 1
    return out


def starts_of(row: list[int]) -> list[bool]:
    return [t == 0 or p == 0 for t, p in enumerate(row)]


def ref_boundaries(row: list[int], width: int | None = None) -> list[int]:
    bounds = [t for t, start in enumerate(starts_of(row)) if start] + [len(row)]
    return bounds if width is None else bounds + [len(row)] * (width - len(bounds))


def longest(bounds: list[int]) -> int:
    return max((b - a for a, b in itertools.pairwise(bounds)), default=0)


@dataclass
class Case:
    """Inputs for one dtype and length, and the reference answer for them."""

    make: Callable[[torch.dtype, int, random.Random], tuple[Any, ...]]
    reference: Callable[..., Any]
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES)


def _counts(dtype: torch.dtype, length: int, rng: random.Random) -> torch.Tensor:
    choices = [0, 1, length, length + 5, rng.randint(0, max(length, 1))]
    return torch.tensor([min(c, top(dtype)) for c in rng.sample(choices, ROWS)], dtype=dtype)


def _tokens(dtype: torch.dtype, length: int, rng: random.Random, low: int = 0) -> torch.Tensor:
    high = min(top(dtype), 1000)
    return torch.tensor([[rng.randint(low, high) for _ in range(length)] for _ in range(ROWS)], dtype=dtype)


def _mask(length: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([[rng.random() < 0.3 for _ in range(length)] for _ in range(ROWS)], dtype=torch.bool)


def _ignore(dtype: torch.dtype) -> int:
    return top(dtype) if dtype == torch.uint8 else -100


def _positions(dtype: torch.dtype, length: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([restarting(length, dtype, rng) for _ in range(ROWS)], dtype=dtype)


def _label_masking(labels: list[list[int]], drop: list[list[bool]], ignore: int) -> list[list[int]]:
    return [
        [ignore if d else x for x, d in zip(row, ds, strict=True)]
        for row, ds in zip(labels, drop, strict=True)
    ]


def _trailing(count: int, length: int) -> list[bool]:
    return [t >= length - count for t in range(length)]


def _ref_apply_loss_mask(labels, supervision, counts, ignore):
    drop = [
        [s == 0 or pad for s, pad in zip(srow, _trailing(count, len(srow)), strict=True)]
        for srow, count in zip(supervision.tolist(), counts.tolist(), strict=True)
    ]
    masked = _label_masking(labels.tolist(), drop, ignore)
    valid = [[float(x != ignore) for x in row] for row in masked]
    return masked, valid, [int(sum(row)) for row in valid]


def _ref_segment_ids(positions, padding=None):
    out = []
    for r, row in enumerate(positions.tolist()):
        ids, current = [], -1
        for t, start in enumerate(starts_of(row)):
            pad = padding is not None and bool(padding[r, t])
            current += int(start and not pad)
            ids.append(-1 if pad else current)
        out.append(ids)
    return out


def _segment_case_ids(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    ids = functional.segment_ids_from_positions(_positions(torch.int64, length, rng)).to(dtype)
    return (ids,)


def _ref_flatten(ids):
    out, offset = [], 0
    for row in ids.tolist():
        out += [x + offset if x >= 0 else x for x in row]
        offset += max(row, default=-1) + 1
    return out


def _ref_dense(ids):
    rows = ids.tolist() if ids.dim() == 2 else [ids.tolist()]
    return [
        [
            [
                [(q_id == k_id and q_id >= 0 and k <= q) or q == k for k, k_id in enumerate(row)]
                for q, q_id in enumerate(row)
            ]
        ]
        for row in rows
    ]


def _branch_case(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    """Documents of a prompt (branch 0) and responses (branches 1, 2, ...), padding -1 (signed dtypes)."""
    docs, branches = [], []
    for _ in range(ROWS):
        doc_row, branch_row, doc, branch = [], [], -1, 0
        for t in range(length):
            if t == 0 or rng.random() < 0.1:
                doc, branch = doc + 1, 0
            elif rng.random() < 0.2:
                branch += 1
            doc_row.append(doc)
            branch_row.append(branch)
        pad = rng.randint(0, length) if length else 0
        docs.append(doc_row[: length - pad] + [-1] * pad)
        branches.append(branch_row[: length - pad] + [-1] * pad)
    return torch.tensor(docs, dtype=dtype), torch.tensor(branches, dtype=dtype)


def _ref_branch(docs, branches):
    return [
        [
            [
                [
                    (d[q] == d[k] and d[q] >= 0 and k <= q and (b[k] == 0 or b[k] == b[q])) or q == k
                    for k in range(len(d))
                ]
                for q in range(len(d))
            ]
        ]
        for d, b in zip(docs.tolist(), branches.tolist(), strict=True)
    ]


def _ref_from_ids(ids):
    rows = ids.tolist()
    bounds = [[t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]] + [len(row)] for row in rows]
    width = max((len(b) for b in bounds), default=1)
    padded = [b + [len(row)] * (width - len(b)) for b, row in zip(bounds, rows, strict=True)]
    return padded, [longest(b) for b in padded]


def _cp_inputs(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    sizes = [4 * rng.randint(0, 3) for _ in range(max(1, length // 100))]
    cu = [0]
    for size in sizes:
        cu.append(cu[-1] + size)
    return torch.tensor(cu, dtype=torch.int64), 2, rng.randint(0, 1)


def _ref_cp(cu, size, rank):
    out = []
    for start, end in zip(cu.tolist(), cu.tolist()[1:], strict=False):
        chunk = (end - start) // (2 * size)
        for which in (rank, 2 * size - 1 - rank):
            out += list(range(start + which * chunk, start + (which + 1) * chunk))
    return out


def _sequences_case(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    """Sequences numbered in order across rows (at most 100, so int8 holds them), -1 on each row's end;
    ids with a skipped id sometimes at a sequence's end, sometimes throughout."""
    rows, ids, number = [], [], -1
    for _ in range(ROWS):
        row = []
        for t in range(length):
            if number < 0 or (number < 99 and (t == 0 or rng.random() < 0.1)):
                number += 1
            row.append(number)
        pad = rng.randint(0, length) if length else 0
        rows.append(row[: length - pad] + [-1] * pad)
        ids.append([rng.choice([2, 2, 5, 7]) for _ in range(length)])
    skip = rng.choice([None, 2])
    return torch.tensor(rows, dtype=dtype), torch.tensor(ids, dtype=dtype), skip


def _ref_last_tokens(sequence_index, input_ids, skip):
    flat = list(itertools.chain(*sequence_index.tolist()))
    tokens = list(itertools.chain(*input_ids.tolist()))
    count = max(flat, default=-1) + 1
    out = []
    for s in range(count):
        places = [t for t, x in enumerate(flat) if x == s]
        kept = [t for t in places if skip is None or tokens[t] != skip]
        out.append(kept[-1] if kept else (places[0] if places else -1))
    return out


def _predicted_case(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    """Labels and the place predicting each (-1: none); a place predicting several tokens gets equal labels."""
    ignore = -100 if dtype.is_signed else top(dtype)
    labels, index = [], []
    for _ in range(ROWS):
        targets: dict[int, int] = {}
        row_labels, row_index = [], []
        for _ in range(length):
            label = ignore if rng.random() < 0.2 else rng.randint(0, min(top(dtype) - 1, 50))
            place = -1 if rng.random() < 0.2 else rng.randrange(length)
            if place >= 0 and label != ignore:
                label = targets.setdefault(place, label)
            row_labels.append(label)
            row_index.append(place)
        labels.append(row_labels)
        index.append(row_index)
    shape = (ROWS, length)
    return (
        torch.tensor(labels, dtype=dtype).reshape(shape), torch.tensor(index, dtype=torch.int64).reshape(shape),
        ignore,
    )  # fmt: skip


def _ref_predicted(labels, logits_index, ignore):
    out = []
    for row_labels, row_index in zip(labels.tolist(), logits_index.tolist(), strict=True):
        row = [ignore] * len(row_labels)
        for label, place in zip(row_labels, row_index, strict=True):
            if place >= 0 and label != ignore:
                row[place] = label
        out.append(row)
    return out


def _map_case(dtype: torch.dtype, length: int, rng: random.Random) -> tuple[Any, ...]:
    """One padding-free row: examples (some empty) laid end to end, positions restarting at each and
    sometimes inside one, then trailing padding."""
    pad = rng.randint(0, length) if length else 0
    lengths, left = [], length - pad
    while left or rng.random() < 0.3:
        size = rng.choice([0, rng.randint(1, max(left, 1))]) if left else 0
        lengths.append(size)
        left -= size
    positions: list[int] = []
    for size in lengths:
        start = len(positions)
        for t in range(size):
            if t == 0:  # an example starts a sequence, its first position 0 or not
                positions.append(rng.choice([0, 0, 1]))
                continue
            restart = positions[-1] >= top(dtype) - 1 or rng.random() < 0.05
            positions.append(0 if restart else positions[-1] + 1)
        assert len(positions) - start == size
    positions += [0] * pad
    return (
        torch.tensor([positions], dtype=dtype),
        torch.tensor([pad], dtype=dtype if pad <= top(dtype) else torch.int64),
        torch.tensor([lengths], dtype=torch.int64),
    )


def _ref_sequence_map(positions, padding_length, example_lengths):
    places = positions.tolist()[0]
    index, number, sequence, t = [], [], -1, 0
    for size in example_lengths.tolist()[0]:
        if not size:
            sequence += 1
        for k in range(size):
            first = k == 0 or places[t] == 0
            sequence += first
            index.append(-1 if first else t - 1)
            number.append(sequence)
            t += 1
    pad = int(padding_length[0])
    return [index + [-1] * pad], [number + [-1] * pad], sequence + 1


CASES: dict[str, Case] = {
    "shift_tokens": Case(
        lambda dtype, length, rng: (_tokens(dtype, length, rng),),
        lambda tokens: ([row[:-1] for row in tokens.tolist()], [row[1:] for row in tokens.tolist()]),
    ),
    "trailing_mask": Case(
        lambda dtype, length, rng: (_counts(dtype, length, rng), length),
        lambda counts, length: [_trailing(c, length) for c in counts.tolist()],
    ),
    "padding_from_length": Case(
        lambda dtype, length, rng: (_counts(dtype, length, rng), length, rng.random() < 0.5),
        lambda counts, length, shifted: [
            _trailing(max(c - 1, 0) if shifted else c, length) for c in counts.tolist()
        ],
    ),
    "mask_labels": Case(
        lambda dtype, length, rng: (_tokens(dtype, length, rng), _mask(length, rng), _ignore(dtype)),
        lambda labels, mask, ignore: _label_masking(labels.tolist(), mask.tolist(), ignore),
    ),
    "as_float": Case(
        lambda dtype, length, rng: (_mask(length, rng),),
        lambda mask: [[float(x) for x in row] for row in mask.tolist()],
        (torch.int64,),
    ),
    "eos_label_mask": Case(
        lambda dtype, length, rng: (_tokens(dtype, length, rng), rng.choice([2, top(dtype) + 5])),
        lambda inputs, eos: [[x == eos for x in row] for row in inputs.tolist()],
    ),
    "apply_loss_mask": Case(
        lambda dtype, length, rng: (
            _tokens(dtype, length, rng),
            (~_mask(length, rng)).long(),
            _counts(dtype, length, rng),
            _ignore(dtype),
        ),
        _ref_apply_loss_mask,
    ),
    "sequence_positions": Case(
        lambda dtype, length, rng: (torch.zeros(ROWS, min(length, top(dtype) + 1), dtype=dtype),),
        lambda like: [list(range(like.shape[1]))] * ROWS,
    ),
    "segment_starts": Case(
        lambda dtype, length, rng: (_positions(dtype, length, rng),),
        lambda positions: [starts_of(row) for row in positions.tolist()],
    ),
    "cu_seqlens_rows": Case(
        lambda dtype, length, rng: (_positions(dtype, length, rng), rng.choice([None, length + 2])),
        lambda positions, width: (
            [
                ref_boundaries(row, width or max(len(ref_boundaries(r)) for r in positions.tolist()))
                for row in positions.tolist()
            ],
            [
                longest(ref_boundaries(row, width or max(len(ref_boundaries(r)) for r in positions.tolist())))
                for row in positions.tolist()
            ],
        ),
    ),
    "cu_seqlens_flat": Case(
        lambda dtype, length, rng: (_positions(dtype, length, rng), rng.choice([None, ROWS * length + 2])),
        lambda positions, width: (
            lambda flat: (
                flat + [ROWS * positions.shape[1]] * ((width or len(flat)) - len(flat)),
                longest(flat),
            )
        )(
            [t for t, start in enumerate(itertools.chain(*map(starts_of, positions.tolist()))) if start]
            + [positions.numel()]
        ),
    ),
    "segment_ids_from_positions": Case(
        lambda dtype, length, rng: (
            _positions(dtype, length, rng),
            _mask(length, rng) if rng.random() < 0.5 else None,
        ),
        _ref_segment_ids,
    ),
    "flatten_segment_ids": Case(_segment_case_ids, _ref_flatten),
    "cp_partition_index": Case(_cp_inputs, _ref_cp, (torch.int64,)),
    "dense_document_mask": Case(
        lambda dtype, length, rng: _segment_case_ids(dtype, min(length, 40), rng), _ref_dense
    ),
    "cu_seqlens_from_segment_ids": Case(_segment_case_ids, _ref_from_ids),
    "dense_branch_mask": Case(
        lambda dtype, length, rng: _branch_case(dtype, min(length, 40), rng), _ref_branch, tuple(DTYPES[:4])
    ),
    "last_token_index": Case(_sequences_case, _ref_last_tokens, tuple(DTYPES[:4])),
    "sequence_map": Case(_map_case, _ref_sequence_map),
    "predicted_labels": Case(_predicted_case, _ref_predicted),
}


def as_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return tuple(as_plain(v) for v in value)
    return value


def test_every_registered_kernel_has_a_case():
    assert sorted(functional.KERNELS) == sorted(CASES)
    assert set(functional.KERNELS) <= set(functional.__all__) | set(attention.__all__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_equals_its_reference_on_every_dtype_and_edge_length(name):
    """One answer for every integer dtype: narrow and unsigned counts never wrap around."""
    case, kernel = CASES[name], functional.KERNELS[name]
    rng = random.Random(name)
    for dtype in case.dtypes:
        for length in LENGTHS:
            args = case.make(dtype, length, rng)
            got = as_plain(kernel(*args))
            want = case.reference(*args)
            assert got == (tuple(want) if isinstance(want, tuple) else want), (name, dtype, length)


def test_narrow_pad_counts_hand_worked():
    """The reproductions: a uint8 count of 255 in a row of 300, and a uint8 count of 0 shifted."""
    assert int(functional.trailing_mask(torch.tensor([255, 2], dtype=torch.uint8), 300).sum()) == 257
    shifted = functional.padding_from_length(torch.tensor([0], dtype=torch.uint8), 4, shifted=True)
    assert shifted.tolist() == [[False, False, False, False]]


def test_sequence_positions_refuse_a_dtype_that_cannot_count_them():
    with pytest.raises(ValueError, match=r"300 positions do not fit dtype torch\.int8"):
        functional.sequence_positions(torch.zeros(1, 300, dtype=torch.int8))


def test_eos_and_mask_labels():
    """An EOS id the dtype cannot hold matches nothing; an ignore_index it cannot hold is refused."""
    inputs = torch.tensor([[5, 6]], dtype=torch.int8)
    assert functional.eos_label_mask(inputs, 261).tolist() == [[False, False]]
    with pytest.raises(ValueError, match=r"ignore_index -100 does not fit dtype torch\.uint8"):
        functional.mask_labels(inputs.to(torch.uint8), torch.tensor([[True, False]]), -100)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_gives_the_cpu_answer_on_cuda(name):
    case, kernel = CASES[name], functional.KERNELS[name]
    rng = random.Random(name)
    for dtype in case.dtypes:
        for length in LENGTHS:
            args = case.make(dtype, length, rng)
            moved = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
            assert as_plain(kernel(*moved)) == as_plain(kernel(*args)), (name, dtype, length)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["trailing_mask", "apply_loss_mask", "segment_ids_from_positions"])
def test_kernel_compiles_to_the_same_answer(name):
    """A few kernels through torch.compile (fullgraph, dynamic): seconds each on a CPU, so only these."""
    case, kernel = CASES[name], functional.KERNELS[name]
    compiled = torch.compile(kernel, fullgraph=True, dynamic=True)
    rng = random.Random(name)
    for length in (5, 9):
        args = case.make(torch.int64, length, rng)
        assert as_plain(compiled(*args)) == as_plain(kernel(*args))
