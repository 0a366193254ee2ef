"""The examples and the code of the README and the docs pages run, and say what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    """The example's output, run on this tree's package (as the torchrun tests run theirs)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONPATH": path},
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
    block = re.search(r"### Packed records: .*?```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out["labels"].tolist() == [[10, 2, -100, 11, 2, -100]]
    assert out["num_valid_tokens"] == 4
    assert out["cu_seqlens"].tolist() == [[0, 3, 6]]
    assert next(iter(namespace["loader"]))["labels"].tolist() == [[10, 2, -100, 11, 2, -100]] * 2


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_python_block_runs():
    blocks = _readme_blocks()
    assert len(blocks) >= 3
    for index, block in enumerate(blocks):
        namespace: dict = {"__name__": f"readme_block_{index}"}
        exec(compile(block, f"README.md block {index}", "exec"), namespace)


# The topic pages under docs/ whose python blocks run here (docs/packed_attention.md runs in
# tests/test_attention.py). A page's blocks run in order in one namespace, as a reader would run them;
# a block opening with "# Sketch" (a recipe over names of your training script) or "# Needs" (a package
# or device the suite does not have) is shown, not run.
DOC_PAGES = [
    "transforms.md",
    "packing.md",
    "training_loop.md",
    "hugging_face.md",
    "post_training.md",
    "columns.md",
    "distributed.md",
    "tensor_fields.md",
    "vision_language.md",
    "trees.md",
    "engines.md",
]


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_docs_page_python_block_runs(page):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)
    runnable = [block for block in blocks if not block.startswith(("# Sketch", "# Needs"))]
    assert runnable, f"docs/{page} has no python block to run"
    namespace: dict = {"__name__": f"docs_{page.removesuffix('.md')}"}
    for index, block in enumerate(runnable):
        exec(compile(block, f"docs/{page} block {index}", "exec"), namespace)


def test_hf_trainer_example_learns_and_both_layouts_train_the_same_tokens():
    out = run_example("hf_trainer.py", "--steps", "40", "--sft-steps", "20")
    assert "trained: . . . . . . . . . . . . w9 w21" in out  # the prompt is not trained
    padded = re.search(r"padded: loss ([\d.]+) -> ([\d.]+) over 40 steps\n  every 10 steps: (.*)\n", out)
    flat = re.search(r"padding-free: loss ([\d.]+) -> ([\d.]+) over 40 steps\n  every 10 steps: (.*)\n", out)
    assert float(padded.group(2)) < float(padded.group(1)) - 0.4
    assert padded.group(3) == flat.group(3)
    # TRL's SFTTrainer on bfd-packed rows: TRL's own batch, documents kept apart, learning
    assert "batch equal to TRL's DataCollatorForLanguageModeling(padding_free=True): True" in out
    packed, alone = re.search(r"packed loss ([\d.]+), documents one at a time ([\d.]+)", out).groups()
    assert packed == alone
    first, last = map(
        float, re.search(r"SFTTrainer packed padding-free: loss ([\d.]+) -> ([\d.]+)", out).groups()
    )
    assert last < first


def test_columnar_trainer_example_trains_the_same_tokens_from_columns():
    out = run_example("columnar_trainer.py", "--steps", "20")
    assert "one batch: ColumnBatch(input_ids, attention_mask, assistant_masks), 2 rows" in out
    assert "same losses: True" in out


@pytest.mark.parametrize(
    ("page", "heading"),
    [("README.md", "### Hugging Face models: "), ("docs/hugging_face.md", "# Coming from Hugging Face\n")],
)
def test_readme_hugging_face_block_matches_its_comments(page, heading):
    text = (ROOT / page).read_text()
    block = re.search(re.escape(heading) + r".*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, page, "exec"), namespace)
    padded, flat = namespace["padded"], namespace["flat"]
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 3, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert padded["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 3, -100]]
    assert flat["labels"].tolist() == [[-100, -100, 7, 8, -100, 10, 3]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert flat["cu_seq_lens_q"].tolist() == [0, 4, 7] and flat["max_length_q"] == 4


def test_attributes_the_docs_name_exist():
    """Every `stacked.<name>` the docs and README tell users to read is an attribute of StackedBatch."""
    from zephon_collate import Collator

    stacked = Collator().stack([{"input_ids": [1, 2]}])
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {name for page in pages for name in re.findall(r"\bstacked\.([A-Za-z_]\w*)", page.read_text())}
    assert named and all(hasattr(stacked, name) for name in named), sorted(named)


def test_every_benchmark_imports_and_the_floor_check_holds():
    """Benchmarks are not run in CI, but each must import against the package as it is (a renamed
    module breaks `make bench`), and bench_floor's hand-written NumPy passes must equal to_training."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        for path in sorted((ROOT / "benchmarks").glob("*.py")):
            importlib.import_module(path.stem)
        floor = importlib.import_module("bench_floor")
        from common import packed_rows, to_records

        from zephon_collate import SampleBatch

        floor.check_equal(SampleBatch(to_records(packed_rows(length=81))))
        # bench_balance's mirrors of the packer's placement: they must place as the row engine does
        balance = importlib.import_module("bench_balance")
        lengths = np.random.default_rng(0).integers(1, 513, 400)  # each fits a row, as in the benchmark
        balance.check_row_mirrors(lengths, 512)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_dpo_example_learns_on_packed_pairs_with_shared_prompts():
    out = run_example("dpo_packed.py", "--steps", "20")
    first, last = map(float, re.search(r"DPO loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.1
    assert float(re.search(r"\(([\d.]+)% of the padded tokens saved\)", out).group(1)) > 30
    shared = re.search(
        r"shared prompts: ([\d,]+) prompt tokens no longer computed twice \(of ([\d,]+)\)", out
    )
    assert shared.group(1) == shared.group(2)  # every pair's prompt computed once


def test_grpo_example_learns_on_packed_rollouts_with_shared_prompts():
    out = run_example("grpo_packed.py", "--iterations", "4")
    first, last = map(float, re.search(r"clipped loss \(token-mean\) (-?[\d.]+) -> (-?[\d.]+)", out).groups())
    assert last < first
    before, after = map(float, re.search(r"reward ([\d.]+) -> ([\d.]+)", out).groups())
    assert after > before
    assert float(re.search(r"\(([\d.]+)% of the padded tokens saved\)", out).group(1)) > 30
    assert int(re.search(r"shared prompts: ([\d,]+) prompt tokens", out).group(1).replace(",", "")) > 0


def test_trl_dpo_example_trains_as_stock_trl():
    pytest.importorskip("trl")
    out = run_example("trl_dpo.py", "--steps", "4")
    steps = re.findall(r"loss ([\d.]+) \(DPOTrainer\)\s+([\d.]+) \(PackedDPOTrainer\)", out)
    assert len(steps) == 4 and all(stock == packed for stock, packed in steps)
    assert float(re.search(r"largest weight difference after 4 steps: (\S+)", out).group(1)) < 1e-6
    assert float(re.search(r"\(([\d.]+)x fewer\)", out).group(1)) > 1.2


def test_trl_grpo_example_trains_as_stock_trl():
    pytest.importorskip("trl")
    out = run_example("trl_grpo.py", "--steps", "3")
    steps = re.findall(
        r"loss (\S+) reward (\S+) \(GRPOTrainer\)\s+loss (\S+) reward (\S+) \(PackedGRPOTrainer\)", out
    )
    assert len(steps) == 3 and all(a == c and b == d for a, b, c, d in steps)
    assert float(re.search(r"largest weight difference after 3 steps: (\S+)", out).group(1)) < 1e-6


def test_distillation_example_is_exact_packed_and_learns():
    out = run_example("distill_topk.py", "--steps", "30")
    assert float(re.search(r"max difference ([\d.e+-]+)", out).group(1)) <= 1e-5
    first, last = map(float, re.search(r"distillation loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first * 0.5
    exact = run_example("distill_topk.py", "--steps", "1", "--dtype", "float64")
    assert float(re.search(r"max difference ([\d.e+-]+)", exact).group(1)) <= 1e-12


def test_vision_language_example_is_exact_packed_and_learns_from_the_images():
    out = run_example("vlm_sft.py", "--steps", "60")
    assert float(re.search(r"max difference ([\d.e+-]+)", out).group(1)) <= 1e-5
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < np.log(4) * 0.5 < first  # below naming a pattern blind: it reads the images


def test_agentic_grpo_example_trains_trees_as_their_flat_paths():
    out = run_example("agentic_grpo.py", "--iterations", "6")
    tree, flat = map(int, re.search(r"tokens: ([\d,]+) as trees, ([\d,]+) as flat paths", out).group(1, 2))
    assert flat >= 1.9 * tree  # the prompt and the first turn once for four paths, the second for two
    a, b, gap = re.search(
        r"trees (-?[\d.]+), flat paths (-?[\d.]+) \(gradient max difference ([\d.e+-]+)\)", out
    ).groups()
    assert abs(float(a) - float(b)) < 1e-6 and float(gap) < 1e-6 and float(a) != 0
    first, last = map(
        float, re.search(r"clipped loss \(seq-mean-token-mean\) (-?[\d.]+) -> (-?[\d.]+)", out).groups()
    )
    assert last < first
    before, after = map(float, re.search(r"reward ([\d.]+) -> ([\d.]+)", out).groups())
    assert after > before


def test_sft_history_example_computes_each_history_once():
    out = run_example("sft_history.py", "--steps", "20")
    tree, flat = (
        int(x.replace(",", ""))
        for x in re.search(r"tokens: ([\d,]+) as trees, ([\d,]+) as flat", out).groups()
    )
    assert flat >= 2 * tree
    a, b, gap = re.search(
        r"trees ([\d.]+), flat examples ([\d.]+) \(gradient max difference ([\d.e+-]+)\)", out
    ).groups()
    assert abs(float(a) - float(b)) < 1e-6 and float(gap) < 1e-6
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0


def test_grain_loop_resumes_its_training_exactly_with_two_workers():
    pytest.importorskip("grain")
    out = run_example("grain_loop.py", "--steps", "6", "--workers", "2")
    assert "step 5: loss" in out
    assert "resumed at step 3: losses equal to the uninterrupted run: True" in out


def test_ray_balanced_example_trains_two_ranks_and_resumes_the_plan():
    pytest.importorskip("ray")
    from test_distributed import torchrun

    result = torchrun(ROOT / "examples" / "ray_balanced.py", "--steps", "4", timeout=400)
    assert "step 3: loss" in result.stdout
    for rank in range(2):
        assert f"rank {rank}: resumed plan matches (4 micro-batches): True" in result.stdout
