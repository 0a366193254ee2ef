"""The public signatures are written out: type checkers see them, and they equal the options dataclasses.

Each entry point spells its keyword arguments out (no ``**options``), so
``mypy --strict`` reports a misspelled option in user code; a test per entry
point checks that the spelled-out parameters are the options dataclass's
fields, with the same names, order and defaults (so the two cannot drift apart).
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
    CollatorOptions,
    FlatPacker,
    PackedStream,
    SampleBatch,
    TrainingOptions,
    TransformersCollator,
    TransformersOptions,
    pack_flat,
    to_training,
)
from zephon_collate.collate import PreferenceCollator, PreferenceOptions, RolloutCollator, RolloutOptions
from zephon_collate.collate.hf import TRANSFORMERS_COLLATOR_OPTIONS
from zephon_collate.packing.reader import PackOptions

ROOT = Path(__file__).resolve().parent.parent


def fields(options: type) -> list[tuple[str, object]]:
    return [
        (f.name, f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
        for f in dataclasses.fields(options)
        if f.init
    ]


def keywords(function: object, skip: int) -> list[tuple[str, object]]:
    parameters = list(inspect.signature(function).parameters.values())[skip:]  # type: ignore[arg-type]
    return [(p.name, p.default) for p in parameters]


@pytest.mark.parametrize(
    ("function", "skip", "options"),
    [
        (to_training, 1, [TrainingOptions]),
        (SampleBatch.to_training, 1, [TrainingOptions]),
        (Collator.__init__, 1, [TrainingOptions, CollatorOptions]),
    ],
    ids=["to_training", "SampleBatch.to_training", "Collator"],
)
def test_collate_signatures_equal_their_options(function, skip, options):
    expected = [item for option in options for item in fields(option)]
    assert keywords(function, skip) == expected
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)


def test_for_transformers_signature_equals_its_options():
    collator = dict(fields(CollatorOptions))
    expected = fields(TransformersOptions) + [
        (name, collator[name]) for name in TRANSFORMERS_COLLATOR_OPTIONS
    ]
    assert keywords(TransformersCollator.__init__, 3) == expected  # self, tokenizer, model
    assert Collator.for_transformers is TransformersCollator  # one signature, both spellings


@pytest.mark.parametrize(
    ("collator", "options", "name"),
    [
        (PreferenceCollator, PreferenceOptions, "for_preference"),
        (RolloutCollator, RolloutOptions, "for_rollouts"),
    ],
)
def test_post_training_signatures_equal_their_options(collator, options, name):
    collator_options = dict(fields(CollatorOptions))
    expected = fields(options) + [(key, collator_options[key]) for key in TRANSFORMERS_COLLATOR_OPTIONS]
    assert keywords(collator.__init__, 2) == expected
    assert getattr(Collator, name) is collator


@pytest.mark.parametrize(
    ("function", "skip", "overrides", "extra"),
    [
        (pack_flat, 1, {}, []),
        (FlatPacker.__init__, 1, {"buffer_size": 1024}, []),
        (
            PackedStream.__init__,
            2,
            {"buffer_size": 1024},
            [("rank", None), ("world_size", None), ("balance", None)],
        ),
    ],
    ids=["pack_flat", "FlatPacker", "PackedStream"],
)
def test_packing_signatures_equal_their_options(function, skip, overrides, extra):
    expected = [(name, overrides.get(name, default)) for name, default in fields(PackOptions)] + extra
    assert keywords(function, skip) == expected


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
