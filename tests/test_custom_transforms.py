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
    nested = Collator(dtype=None, chain=[Chain(*steps)], boundary_safe_labels=False)(rows)
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


class Sevens(Transform):
    """Writes 7 at every token under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.in_keys, self.out_keys = ["input_ids"], [key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.key: torch.full_like(data["input_ids"], 7)}


def test_an_output_of_yours_named_ids_or_texts_is_kept_or_refused_never_replaced():
    """The native Collator makes ``ids`` and ``texts`` row by row: a step of yours writing them is refused
    (its output was replaced by the sample ids). Elsewhere they are your outputs (they were dropped)."""
    for key in ("ids", "texts"):
        with pytest.raises(ValueError, match=rf"Sevens writes '{key}', an output this layout makes itself"):
            Collator(transforms=[Sevens(key)])([packed(0, [3])])
        with pytest.raises(ValueError, match=rf"Sevens writes '{key}'"):
            Collator(chain=[Sevens(key)])([packed(0, [3])])
        flat = Collator.for_transformers(padding_free=True, transforms=[Sevens(key)])([{"input_ids": [5, 6]}])
        assert flat[key].tolist() == [[7, 7]]
        pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4]}
        assert Collator.for_preference(padding_free=True, transforms=[Sevens(key)])([pair])[key].tolist() == [
            [7] * 6
        ]


@pytest.mark.parametrize(
    ("build", "given"),
    [
        (lambda chain: Collator(chain=chain, flatten=True), "flatten"),
        (lambda chain: Collator(chain=chain, ignore_index=-1), "ignore_index"),
        (lambda chain: Collator(chain=chain, num_boundaries=6), "num_boundaries"),
        (
            lambda chain: Collator.for_transformers(padding_free=True, return_seq_idx=True, chain=chain),
            "return_seq_idx",
        ),
        (
            lambda chain: Collator.for_transformers(pad_token_id=0, padding_side="left", chain=chain),
            "padding_side",
        ),
        (
            lambda chain: Collator.for_transformers(pad_token_id=0, label_pad_token_id=0, chain=chain),
            "label_pad_token_id",
        ),
        (
            lambda chain: Collator.for_preference(padding_free=True, return_seq_idx=True, chain=chain),
            "return_seq_idx",
        ),
    ],
)
def test_a_chain_of_yours_refuses_the_options_it_would_ignore(build, given):
    """Each option read by the built-in chain alone did nothing beside chain= (flatten=True left [B, S]
    outputs, num_boundaries no static shape, padding_side='left' right padding)."""
    with pytest.raises(ValueError, match=rf"chain= replaces the chain that {given} would build"):
        build([CuSeqlens()])


def test_a_chain_of_yours_keeps_labels_inside_documents_unless_told_not_to():
    """Where the layout promises labels never cross a document (the Collator, padding-free presets), a
    chain of yours that makes labels needs a BoundaryMask before it, or boundary_safe_labels=False."""
    rows = [packed(0, [3, 4])]  # tokens 3 4 5 | 3 4 5 6 | pad pad
    plain = [TokenShift(input_keys=["positions"]), LossMask(supervision_key=None)]
    with pytest.raises(ValueError, match=r"your steps make labels \(TokenShift\) that no BoundaryMask keeps"):
        Collator(chain=plain)(rows)
    from zephon_collate import pack_flat

    unpositioned = pack_flat(
        [{"input_ids": [3, 4, 5]}, {"input_ids": [3, 4]}], 8, pad_token_id=0, emit_positions=False
    )
    with pytest.raises(ValueError, match=r"a packed row of 2 documents .* given without positions"):
        Collator(chain=[TokenShift(), LossMask(supervision_key=None)])(unpositioned)
    with pytest.raises(ValueError, match=r"your steps make labels \(TokenShift\)"):
        Collator(transforms=plain)(rows)  # appended to a built-in chain that makes no labels: the same
    crossing = Collator(chain=plain, boundary_safe_labels=False)(rows)
    assert crossing["labels"].tolist() == [[4, 5, 3, 4, 5, 6, -100, -100]]  # 5 -> 3 crosses, as asked
    safe = [BoundaryMask(), TokenShift(input_keys=["positions"], label_keys=["loss_mask"]), LossMask()]
    assert Collator(chain=safe)(rows)["labels"].tolist() == hand(rows)["labels"]
    from zephon_collate.transforms import UnshiftedLabels

    with pytest.raises(
        ValueError, match=r"BoundaryMask\('position_ids'\) before UnshiftedLabels .* its mask, or pass"
    ):
        Collator.for_transformers(padding_free=True, chain=[UnshiftedLabels()])([{"input_ids": [5, 6]}])
    padded = Collator.for_transformers(pad_token_id=0, chain=[UnshiftedLabels()])([{"input_ids": [5, 6]}])
    assert padded["labels"].tolist() == [[5, 6]]  # a padded row is one document


def _misordered() -> list[tuple[list[Transform], str]]:
    from zephon_collate.transforms import EosMask, Flatten, LeftPadding, PaddingMask, Positions, SegmentIds

    return [
        (
            [TokenShift(input_keys=["positions"]), BoundaryMask()],
            r"BoundaryMask \(step 1\) must run before TokenShift",
        ),
        (
            [BoundaryMask(), TokenShift(input_keys=["positions", "loss_mask"])],
            r"cuts 'loss_mask' the other way: .* label_keys",
        ),
        (
            [PaddingMask(), TokenShift(input_keys=["positions"], label_keys=["padding_mask"])],
            "cuts 'padding_mask' the other way",
        ),
        (
            [TokenShift(input_keys=["positions"]), PaddingMask()],
            r"PaddingMask \(step 1\) must run before TokenShift",
        ),
        (
            [TokenShift(input_keys=["positions"]), LossMask(supervision_key=None), EosMask(2)],
            r"EosMask \(step 2\) must run before LossMask",
        ),
        (
            [CuSeqlens(), TokenShift(input_keys=["positions"])],
            r"TokenShift \(step 1\) must run before CuSeqlens",
        ),
        (
            [SegmentIds(), TokenShift(input_keys=["positions"])],
            r"TokenShift \(step 1\) must run before SegmentIds",
        ),
        ([Positions("sequence"), CuSeqlens()], r"CuSeqlens \(step 1\) must run before Positions"),
        (  # after LeftPadding, column 0 of a padded row is padding, not its first token
            [BoundaryMask(), LeftPadding(["input_ids", "loss_mask"]), BoundaryMask(None)],
            r"BoundaryMask \(step 2\) must run before LeftPadding",
        ),
        (
            [
                TokenShift(input_keys=["positions"]),
                Flatten(["input_ids", "labels"]),
                LossMask(supervision_key=None),
            ],
            r"LossMask \(step 2\) reads 'labels', which Flatten \(step 1\) reshaped",
        ),
    ]


@pytest.mark.parametrize("index", range(10))
def test_built_in_steps_in_an_order_that_gives_a_wrong_batch_are_refused(index):
    """Each of these ran (host, eager and compiled alike, or the host path alone) and gave a wrong batch:
    a label across documents, the EOS marked as padding, cu_seqlens past the row, a count off by one."""
    steps, match = _misordered()[index]
    with pytest.raises(ValueError, match=match):
        Chain(*steps)
    with pytest.raises(ValueError, match=match):
        Collator(chain=steps, boundary_safe_labels=False)([packed(0, [3, 4])])
    with pytest.raises(ValueError, match=match):
        Chain(Chain(*steps[:1]), *steps[1:])  # nested, as the Collator flattens a chain of yours


def test_a_chain_of_yours_in_a_preset_never_shows_the_layouts_own_keys():
    """The roles a pair's SequenceRoles reads are the layout's own: a chain without it left them as an
    output (``'sequence_roles:chosen,rejected'``)."""
    from zephon_collate.transforms import AttentionMask, PaddingMask

    pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4]}
    out = Collator.for_preference(pad_token_id=0, chain=[PaddingMask(), AttentionMask()])([pair])
    assert list(out) == [
        "input_ids",
        "attention_mask",
        "document_ids",
        "branch_ids",
        "logits_index",
        "sequence_index",
    ]


def test_an_empty_batch_gives_a_flattened_cu_seqlens_of_yours_its_zero():
    collate = Collator(chain=[CuSeqlens(flatten=True)])
    assert collate([]) == {"ids": [], "texts": [], "input_ids": [], "cu_seqlens": [0], "max_seqlen": 0}
    assert collate([packed(0, [3])])["cu_seqlens"].tolist() == [0, 3, 5]  # the padding: a segment


def test_chains_the_order_checks_must_not_refuse():
    """Valid chains: steps that share no key are in no order (positions written under another name, a
    copy of a key Flatten left alone), UnshiftedLabels cuts nothing, padding_side="right" (a tokenizer's)
    builds nothing, the stacked keys of return_flash_attn_kwargs / return_sequence_map feed a chain of
    yours, and tensordict's own modules have no empty outputs."""
    from tensordict.nn import TensorDictModule

    from zephon_collate.transforms import CopyKeys, Flatten, Positions, SequenceMap, UnshiftedLabels

    Chain(Positions("sequence", out_key="numbered"), CuSeqlens())
    Chain(CuSeqlens(flatten=True), Flatten(["input_ids"]), CopyKeys({"cu_seqlens": "cu_seq_lens_q"}))
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    labelled = [UnshiftedLabels(), BoundaryMask("position_ids"), LossMask(out_key=None, count_key=None)]
    out = Collator.for_transformers(padding_free=True, chain=labelled)(examples)
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    padded = Collator.for_transformers(pad_token_id=0, padding_side="right", chain=[UnshiftedLabels()])
    assert padded(examples)["labels"].tolist() == [[5, 6, 7], [8, 9, 0]]
    mapped = Collator.for_transformers(
        padding_free=True, return_sequence_map=True, chain=[SequenceMap("position_ids")]
    )
    assert mapped(examples)["num_sequences"] == 2
    cu = CuSeqlens("positions", flatten=True, out_key="cu_seq_lens_q", max_key="max_length_q")
    flash = Collator.for_transformers(
        padding_free=True, return_position_ids=False, return_flash_attn_kwargs=True, chain=[cu]
    )
    assert flash(examples)["cu_seq_lens_q"].tolist() == [0, 3, 5]
    double = TensorDictModule(lambda x: x * 2, in_keys=["input_ids"], out_keys=["doubled"])
    assert Collator(transforms=[double])([]) == {"ids": [], "texts": [], "input_ids": [], "doubled": []}
    copied = Collator(chain=[CuSeqlens(flatten=True), CopyKeys({"cu_seqlens": "cu_k"})])([])
    assert copied["cu_k"] == [0] and copied["cu_seqlens"] == [0]


def test_wrong_orders_are_found_inside_tensordict_sequences_and_in_subclasses():
    from tensordict.nn import TensorDictSequential

    from zephon_collate.transforms import Flatten, UnshiftedLabels

    class MyLossMask(LossMask):
        pass

    with pytest.raises(ValueError, match=r"BoundaryMask \(step 1\) must run before TokenShift"):
        Chain(TensorDictSequential(TokenShift(input_keys=["positions"]), BoundaryMask()))
    wrapped = TensorDictSequential(TokenShift(input_keys=["positions"]), LossMask(supervision_key=None))
    with pytest.raises(ValueError, match="that no BoundaryMask keeps"):
        Collator(chain=[wrapped])([packed(0, [3, 4])])
    with pytest.raises(ValueError, match=r"MyLossMask \(step 2\) reads 'labels', which Flatten"):
        Chain(TokenShift(), Flatten(["input_ids", "labels"]), MyLossMask(supervision_key=None))
    pair = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4]}
    no_opt_out = r"before UnshiftedLabels and a LossMask reading its mask$"  # presets have no such option
    with pytest.raises(ValueError, match=no_opt_out):
        Collator.for_preference(padding_free=True, chain=[UnshiftedLabels()])([pair])


class _InPlace(Transform):
    """Masks the first label by writing its input in place (the bug of a user step under test)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["labels"], ["labels"]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = data["labels"]
        labels[..., 0] = -100
        return {"labels": labels}


def test_a_step_of_yours_that_writes_its_input_in_place_is_refused():
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from zephon_collate import use_host_pass

    collator = Collator(return_labels=True, transforms=[_InPlace()])
    for host in (True, False):  # the host path hands it tensors on the earlier steps' arrays
        with (
            use_host_pass(host),
            pytest.raises(ValueError, match=r"_InPlace wrote its input 'labels' in place"),
        ):
            collator([packed(0, [3, 2])])
    given = TensorDict({"labels": torch.tensor([[5, 6, 7]])}, batch_size=[1])
    adds = TensorDictModule(lambda labels: labels.add_(1), in_keys=["labels"], out_keys=["labels"])
    for step in (_InPlace(), Chain(_InPlace()), Chain(adds)):
        with pytest.raises(ValueError, match=r"wrote its input 'labels' in place; a step must not change"):
            step(given.clone())
    clean = TensorDictModule(lambda labels: labels + 1, in_keys=["labels"], out_keys=["labels"])
    assert Chain(clean)(given)["labels"].tolist() == [[6, 7, 8]] and given["labels"].tolist() == [[5, 6, 7]]


def test_a_step_of_yours_called_alone_on_a_tensordict_can_iterate_what_it_reads():
    from tensordict import TensorDict

    given = TensorDict({"labels": torch.tensor([[5, 6, 7]]), "other": torch.zeros(1, 3)}, batch_size=[1])
    assert _Writes("ones", reads="labels")(given)["ones"].tolist() == [[1, 1, 1]]
