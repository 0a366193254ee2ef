"""The public signatures are derived from the options dataclasses: type checkers see them.

Each option is one typed field (type, default, doc) of its options dataclass;
each entry point's signature is derived from it
(:func:`zephon_collate.core.checks.keywords`), so ``inspect`` and ``mypy
--strict`` see the same names, kinds and defaults, and a misspelled option in
user code is a type error.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zephon_collate import (
    Collator,
    FlatPacker,
    PackedStream,
    SampleBatch,
    pack_columns,
    pack_flat,
    to_training,
)
from zephon_collate.layouts.base import Settings
from zephon_collate.layouts.native import CollatorOptions
from zephon_collate.layouts.presets import PreferenceOptions, RolloutOptions
from zephon_collate.layouts.training import TrainingOptions
from zephon_collate.layouts.transformers import TransformersOptions
from zephon_collate.packing.reader import PackOptions, StreamOptions

ROOT = Path(__file__).resolve().parent.parent


def fields(*options: type) -> list[tuple[str, object]]:
    found: dict[str, object] = {}
    for option in options:
        for f in dataclasses.fields(option):
            if f.init:
                found[f.name] = f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
    return list(found.items())


def keywords(function: object, skip: int) -> list[tuple[str, object]]:
    parameters = list(inspect.signature(function).parameters.values())[skip:]  # type: ignore[arg-type]
    return [(p.name, p.default) for p in parameters]


@pytest.mark.parametrize(
    ("function", "skip", "options"),
    [
        (to_training, 1, [TrainingOptions]),
        (SampleBatch.to_training, 1, [TrainingOptions]),
        (Collator.__init__, 1, [CollatorOptions, Settings]),
    ],
    ids=["to_training", "SampleBatch.to_training", "Collator"],
)
def test_collate_signatures_equal_their_options(function, skip, options):
    assert keywords(function, skip) == fields(*options)
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    assert keywords(function, skip)[: len(fields(TrainingOptions))] == fields(
        TrainingOptions
    )  # the page's first


@pytest.mark.parametrize(
    ("preset", "options", "positional"),
    [
        ("for_transformers", TransformersOptions, ["tokenizer", "model"]),
        ("for_preference", PreferenceOptions, ["tokenizer"]),
        ("for_rollouts", RolloutOptions, ["tokenizer"]),
    ],
)
def test_preset_signatures_equal_their_options(preset, options, positional):
    function = getattr(Collator, preset)
    parameters = list(inspect.signature(function).parameters.values())
    assert [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert sorted(keywords(function, 0)) == sorted(fields(options, Settings))
    assert type(function(padding_free=True)) is Collator  # one class, every layout


@pytest.mark.parametrize(
    ("function", "skip", "options", "extra"),
    [
        (pack_flat, 1, PackOptions, []),
        (pack_columns, 1, PackOptions, []),
        (FlatPacker.__init__, 1, StreamOptions, []),
        (PackedStream.__init__, 2, StreamOptions, [("rank", None), ("world_size", None), ("balance", None)]),
    ],
    ids=["pack_flat", "pack_columns", "FlatPacker", "PackedStream"],
)
def test_packing_signatures_equal_their_options(function, skip, options, extra):
    assert keywords(function, skip) == fields(options) + extra


SNIPPET = """
from zephon_collate import Collator, FlatPacker, pack_flat, to_training

collate = Collator(retrun_labels=True)
hf = Collator.for_transformers(pad_token_id=0, pad_to_multiple=8)
rows = pack_flat([], 8, pad_token_id=0, stratgy="greedy")
packer = FlatPacker(8, pad_token_id=0, overflow="drop")
batch = to_training([], return_labels=1.5)
pairs = Collator.for_preference(padding_free=True, shared_promt=True)
"""


@pytest.mark.skipif(
    shutil.which("mypy") is None and not Path(sys.executable).with_name("mypy").exists(), reason="needs mypy"
)
def test_the_type_checker_reports_misspelled_and_wrong_options(tmp_path):
    """``mypy --strict`` sees the written-out signatures: a typo in user code is an error, not a no-op."""
    snippet = tmp_path / "user_code.py"
    snippet.write_text(textwrap.dedent(SNIPPET))
    mypy = Path(sys.executable).with_name("mypy")
    result = subprocess.run(
        [
            str(mypy if mypy.exists() else "mypy"),
            "--strict",
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    report = result.stdout
    assert result.returncode == 1, report
    assert 'Unexpected keyword argument "retrun_labels" for "Collator"' in report
    assert 'Unexpected keyword argument "pad_to_multiple"' in report
    assert 'Unexpected keyword argument "stratgy" for "pack_flat"' in report
    assert '"overflow"' in report and "drop" in report  # not one of the Literal choices
    assert '"return_labels"' in report  # a float where a bool belongs
    assert "user_code.py:4:" in report and "user_code.py:5:" in report
    assert 'Unexpected keyword argument "shared_promt"' in report  # the presets' signatures too
