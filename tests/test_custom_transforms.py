"""Your transforms run wherever the built-in ones run: in ``__call__``, in ``finish`` after the stack
crossed from DataLoader workers, compiled without recompiles; their keys are outputs like the others."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from helpers import PAD, as_lists, record

from zephon_collate import Chain, Collator, Transform
from zephon_collate.transforms import BoundaryMask, CuSeqlens, LossMask, TokenShift, Total


class PositionWeights(Transform):
    """A per-token loss weight: ``1 / (1 + position)`` on supervised labels, 0 elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels", "positions"], ["weights"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        supervised = (data["labels"] != -100).float()
        return {"weights": supervised / (1.0 + data["positions"].float())}


def packed(index: int, lengths: list[int]) -> object:
    """One row: documents of ``lengths`` tokens (ids from 3), then 2 pad tokens, positions restarting."""
    tokens, positions = [], []
    for n in lengths:
        tokens += [3 + (index + t) % 20 for t in range(n)]
        positions += list(range(n))
    tokens += [PAD, PAD]
    positions += [0, 1]
    return record({"input_ids": tokens, "positions": positions}, index, padding=2)


def hand(rows: list[object]) -> dict[str, list[list[float]]]:
    """Labels (boundary-safe, padding ignored) and the weights, one token at a time."""
    labels, weights = [], []
    for row in rows:
        tokens, positions = row.payload["input_ids"], row.payload["positions"]
        real = len(tokens) - row.meta.padding_length
        row_labels, row_weights = [], []
        for t in range(len(tokens) - 1):
            trained = t + 1 < real and positions[t + 1] != 0  # not padding, not the next document's start
            row_labels.append(tokens[t + 1] if trained else -100)
            row_weights.append(1.0 / (1 + positions[t]) if trained else 0.0)
        labels.append(row_labels)
        weights.append(row_weights)
    return {"labels": labels, "weights": weights}


OPTIONS = {"return_labels": True, "return_cu_seqlens": True, "return_num_valid_tokens": True}


def test_a_transform_of_yours_runs_after_the_builtin_chain_and_names_an_output():
    rows = [packed(0, [3, 4]), packed(1, [5, 2])]
    collate = Collator(transforms=[PositionWeights()], **OPTIONS)
    out = collate(rows)
    want = hand(rows)
    assert out["labels"].tolist() == want["labels"]
    torch.testing.assert_close(out["weights"], torch.tensor(want["weights"]))
    assert list(out)[-1] == "weights"  # after the page's outputs
    renamed = Collator(
        transforms=[PositionWeights()], rename_fields={"weights": "w"}, flatten=True, **OPTIONS
    )
    flat = renamed(rows)
    assert flat["w"].shape == (2 * 8,) and flat["cu_seqlens"].tolist() == [0, 3, 7, 8, 13, 15, 16]


def test_a_chain_of_yours_replaces_the_builtin_one():
    chain = [BoundaryMask(), TokenShift(input_keys=["positions"], label_keys=["loss_mask"]), LossMask()]
    collate = Collator(chain=[*chain, CuSeqlens()], transforms=[PositionWeights()])
    rows = [packed(0, [3, 4])]
    out = collate(rows)
    assert out["labels"].tolist() == hand(rows)["labels"]
    assert out["cu_seqlens"].tolist() == [[0, 3, 7, 8]] and out["num_valid_tokens"] == 5
    with pytest.raises(ValueError, match="chain= replaces the chain that return_labels would build"):
        Collator(chain=chain, return_labels=True)
    with pytest.raises(TypeError, match=r"transforms\[0\] .* is not a transform"):
        Collator(transforms=[lambda data: data])
    with pytest.raises(ValueError, match="PositionWeights reads 'labels'"):
        Collator(transforms=[PositionWeights()])([packed(0, [3])])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_workers_stack_and_finish_runs_your_transform(compiled):
    """stack in 2 DataLoader workers, finish here (compiled: no recompile over new sizes and lengths)."""
    collate = Collator(transforms=[PositionWeights()], compile=compiled, **OPTIONS)
    eager = Collator(transforms=[PositionWeights()], **OPTIONS)
    shapes = [(2, 10), (3, 12), (4, 9), (3, 17), (3, 14)]  # batch sizes 2-4, row lengths 9-17
    batches = [
        [packed(10 * b + i, [2 + i, length - 4 - i]) for i in range(size)]
        for b, (size, length) in enumerate(shapes)
    ]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, collate_fn=collate.stack)
    stacked = list(loader)
    assert [len(s) for s in stacked] == [2, 3, 4, 3, 3]
    first = collate.finish(stacked[0])  # warm-up: the graphs compile here
    assert as_lists(first) == as_lists(eager(batches[0]))
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch, arrived in zip(batches[1:], stacked[1:], strict=True):
            out = collate.finish(arrived)
            want = hand(batch)
            assert out["labels"].tolist() == want["labels"]
            torch.testing.assert_close(out["weights"], torch.tensor(want["weights"]))
            assert as_lists(out) == as_lists(eager(batch))


def test_a_chain_checks_its_wiring_when_built():
    with pytest.raises(ValueError, match="PositionWeights reads 'positions'"):
        Chain(TokenShift(), PositionWeights(), input_keys=["input_ids"])


def test_an_empty_batch_names_your_outputs_too():
    """An empty batch emits every output the collator's chain would, yours included, empty: in one
    call and through stack/finish, with transforms= and with chain=."""
    appended = Collator(transforms=[PositionWeights()], **OPTIONS)
    assert appended([]) == {
        "ids": [],
        "texts": [],
        "input_ids": [],
        "labels": [],
        "num_valid_tokens": 0,
        "cu_seqlens": [],
        "max_seqlen": [],
        "weights": [],
    }
    assert appended.finish(appended.stack([])) == appended([])
    chain = [BoundaryMask(), TokenShift(input_keys=["positions"], label_keys=["loss_mask"]), LossMask()]
    replaced = Collator(chain=chain, transforms=[PositionWeights()])
    rows = [packed(0, [3, 4])]
    empty, full = replaced([]), replaced(rows)
    assert {"labels", "loss_mask", "weights"} <= set(empty) <= set(full)  # positions: only if listed
    assert all(value in ([], 0) for value in empty.values())
    assert replaced.finish(replaced.stack([])) == replaced([])


class RowTokenCount(Transform):
    """A 0-d output: how many tokens the batch holds."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["input_ids"], ["token_count"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"token_count": torch.tensor(data["input_ids"].numel())}


def test_a_scalar_output_of_yours_in_ragged_list_output():
    """dtype=None with rows of unequal length runs the chain row by row: a 0-d output of yours comes
    back as one value per row."""
    out = Collator(dtype=None, transforms=[RowTokenCount()])([record([1, 2, 3]), record([4])])
    assert out["input_ids"] == [[1, 2, 3], [4]] and out["token_count"] == [3, 1]


def test_a_ragged_list_batch_joins_each_output_by_the_step_that_wrote_it():
    """Rows of unequal length as lists run one by one: a 0-d output of yours is one value per row unless
    your step's ``join`` says otherwise; ``CuSeqlens`` continues its boundaries across the rows."""

    class Count(Transform):
        def __init__(self):
            super().__init__()
            self.in_keys, self.out_keys = ["input_ids"], ["tokens"]

        def compute(self, data):
            return {"tokens": torch.tensor(data["input_ids"].numel())}

    class Summed(Count):
        def join(self, key, rows):
            return sum(rows)

    rows = [{"input_ids": [1, 2, 3], "positions": [0, 1, 0]}, {"input_ids": [4, 5], "positions": [0, 1]}]
    options = {"dtype": None, "return_labels": True, "return_cu_seqlens": True, "flatten": True}
    each = Collator(**options, transforms=[Count()])(rows)
    summed = Collator(**options, transforms=[Summed()])(rows)
    assert each["tokens"] == [2, 1] and summed["tokens"] == 3
    assert each["input_ids"] == [1, 2, 4] and each["cu_seqlens"] == [0, 2, 3] and each["max_seqlen"] == 2
    per_row = Collator(**{**options, "flatten": False})(rows)
    assert per_row["cu_seqlens"] == [[0, 2], [0, 1]] and per_row["max_seqlen"] == [2, 1]
    steps = [TokenShift(input_keys=["positions"]), LossMask(supervision_key=None), Total(), CuSeqlens()]
    nested = Collator(dtype=None, chain=[Chain(*steps)])(rows)
    assert nested["num_valid_tokens"] == 3 and nested["cu_seqlens"] == [
        [0, 2],
        [0, 1],
    ]  # a Chain's steps join


class DoubledTotal(Total):
    """A built-in step subclassed, ``compute`` overridden and ``host`` not: its ``compute`` must run."""

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value * 2 for key, value in super().compute(data).items()}


class DoubledBothWays(DoubledTotal):
    """The same, with a ``host`` of its own below its ``compute``: the host path runs that."""

    def host(self, data: Mapping[str, object]) -> dict[str, object]:
        import numpy as np

        return {key: np.array(value * 2) for key, value in super().host(data).items()}  # type: ignore[operator]


@pytest.mark.parametrize("step", [DoubledTotal, DoubledBothWays])
def test_a_subclass_overriding_compute_alone_runs_it_on_the_host_path_too(step):
    # The inherited Total.host ran on the host path (the CPU default): 4 there, 8 in eager.
    from zephon_collate import use_host_pass

    rows = [packed(0, [3, 2])]
    collator = Collator(return_labels=True, return_num_valid_tokens=True, transforms=[step()])
    want = 2 * Collator(return_labels=True, return_num_valid_tokens=True)(rows)["num_valid_tokens"]
    for host in (True, False):
        with use_host_pass(host):
            assert collator(rows)["num_valid_tokens"] == want
            assert collator.finish(collator.stack(rows))["num_valid_tokens"] == want


class _Writes(Transform):
    """Writes ``key`` from the tokens (a user step under test)."""

    def __init__(self, key: str, value: float | None = None, reads: str = "input_ids") -> None:
        super().__init__()
        self.key, self.value = key, value
        self.in_keys, self.out_keys = [reads], [key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        given = next(iter(data.values()))
        if self.value is not None:
            return {self.key: torch.tensor(self.value)}
        return {self.key: torch.ones_like(given)}


class _HostOnly(Transform):
    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["input_ids"], ["ones"]

    def host(self, data):  # type: ignore[no-untyped-def]
        return {"ones": data["input_ids"] * 0 + 1}


def test_what_your_steps_write_is_what_comes_out():
    """A key the layout keeps to itself is refused (it would reach no output); a float count you write
    stays a float; a Chain of yours consumes its inputs for the steps after it; compute is required."""
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    for key in ("positions", "loss_mask", "padding_mask"):
        collate = Collator.for_transformers(padding_free=True, transforms=[_Writes(key)])
        with pytest.raises(ValueError, match=rf"transform _Writes writes '{key}', which this layout keeps"):
            collate(examples)
    read_later = [_Writes("positions"), _Writes("twice", reads="positions")]  # read by a later step: fine
    assert "twice" in Collator.for_transformers(padding_free=True, transforms=read_later)(examples)
    weighted = Collator(return_labels=True, return_num_valid_tokens=True, pad_token_id=PAD,
                        transforms=[_Writes("num_valid_tokens", 4.5)])(examples)  # fmt: skip
    assert weighted["num_valid_tokens"] == 4.5 and isinstance(weighted["num_valid_tokens"], float)

    class Consumes(Transform):
        dropped_keys = ("positions",)

        def __init__(self) -> None:
            super().__init__()
            self.in_keys, self.out_keys = ["positions"], ["seen"]

        def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"seen": data["positions"].sum()}

    class Looks(Transform):
        def __init__(self) -> None:
            super().__init__()
            self.in_keys, self.optional_keys, self.out_keys = ["input_ids"], ["positions"], ["looked"]

        def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"looked": torch.tensor("positions" in data)}

    positioned = [
        {"input_ids": [5, 6, 7], "positions": [0, 1, 2]},
        {"input_ids": [8, 9], "positions": [0, 1]},
    ]
    for steps in ([Consumes(), Looks()], [Chain(Consumes()), Looks()]):
        out = Collator(return_labels=True, pad_token_id=PAD, transforms=steps)(positioned)
        assert bool(out["looked"]) is False and "positions" not in out, steps
    with pytest.raises(TypeError, match=r"transforms\[0\] \(_HostOnly\) defines no compute"):
        Collator(transforms=[_HostOnly()])
