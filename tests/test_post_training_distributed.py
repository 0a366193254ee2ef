"""aggregate_loss across data-parallel ranks: torchrun, 2 ranks (gloo on CPU), every mode exact."""

from __future__ import annotations

import json
from pathlib import Path

from test_distributed import torchrun

from zephon_collate.losses import MODES

ROOT = Path(__file__).resolve().parent.parent


def test_every_mode_gives_one_process_exact_gradient_under_ddp(tmp_path):
    """Two micro-batches per rank, uneven rollout counts on each, shared prompts and padding: the DDP
    gradient equals the whole step's loss computed rollout by rollout in one process, in every mode,
    where the naive per-micro-batch mean does not."""
    report_path = tmp_path / "report.json"
    result = torchrun(ROOT / "tests" / "dist_post_training_check.py", "--report", str(report_path))
    assert "rank 0: OK" in result.stdout and "rank 1: OK" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2
    for mode in MODES:
        assert max(report[mode]["grad_errors"]) < 1e-10, mode
        assert min(report[mode]["naive_errors"]) > 1e-6, mode
