"""The examples and the README's code run, and say what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout


def test_training_example_learns_through_dataloader_workers():
    out = run_example("train_dataloader.py", "--steps", "40", "--workers", "2")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first * 0.5


def test_quickstart_example_prints_training_tensors():
    out = run_example("quickstart.py")
    assert "labels: [[10, 2, -100, 11, 12, 2, -100], [-100, 21, 22, 2, -100, -100, -100]]" in out


def test_readme_quick_start_block_runs_and_matches_its_comments():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out["labels"].tolist() == [[10, 2, -100, 11, 2, -100]]
    assert out["num_valid_tokens"] == 4
    assert out["cu_seqlens"].tolist() == [[0, 3, 6]]


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_python_block_runs():
    blocks = _readme_blocks()
    assert len(blocks) >= 4
    for index, block in enumerate(blocks):
        namespace: dict = {"__name__": f"readme_block_{index}"}
        exec(compile(block, f"README.md block {index}", "exec"), namespace)


def test_hf_trainer_example_learns_and_both_layouts_train_the_same_tokens():
    out = run_example("hf_trainer.py", "--steps", "40")
    assert "trained: . . . . . . . . . . . . w9 w21" in out  # the prompt is not trained
    padded = re.search(r"padded: loss ([\d.]+) -> ([\d.]+) over 40 steps\n  every 10 steps: (.*)\n", out)
    flat = re.search(r"padding-free: loss ([\d.]+) -> ([\d.]+) over 40 steps\n  every 10 steps: (.*)\n", out)
    assert float(padded.group(2)) < float(padded.group(1)) - 0.4
    assert padded.group(3) == flat.group(3)


def test_columnar_trainer_example_trains_the_same_tokens_from_columns():
    out = run_example("columnar_trainer.py", "--steps", "20")
    assert "one batch: ColumnBatch(input_ids, attention_mask, assistant_masks), 2 rows" in out
    assert "same losses: True" in out


def test_readme_hugging_face_block_matches_its_comments():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Coming from Hugging Face\n.*?```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    padded, flat = namespace["padded"], namespace["flat"]
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 3, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert padded["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 3, -100]]
    assert flat["labels"].tolist() == [[-100, -100, 7, 8, -100, 10, 3]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert flat["cu_seq_lens_q"].tolist() == [0, 4, 7] and flat["max_length_q"] == 4
