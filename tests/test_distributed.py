"""Exact token normalization: global valid-token counts and the loss scale, in one process and under DDP.

The DDP checks launch ``torch.distributed.run --nproc_per_node=2`` (gloo on CPU, NCCL on GPUs) on
tests/dist_train_check.py and on examples/distributed_train.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import PackedRecords

from zephon_collate import Collator
from zephon_collate.parallel.distributed import (
    data_parallel_size,
    global_num_valid_tokens,
    is_distributed,
    normalize_loss,
)

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"return_labels": True, "return_num_valid_tokens": True}


def test_global_count_sums_every_kind_of_count():
    """Ints, 0-d and per-row tensors, and batch dicts, summed; no process group: nothing reduced."""
    assert not is_distributed() and data_parallel_size() == 1
    count = global_num_valid_tokens([3, torch.tensor(4), torch.tensor([1, 2]), {"num_valid_tokens": 5}])
    assert count.dtype == torch.int64 and count.shape == () and int(count) == 15
    assert int(global_num_valid_tokens(7)) == 7 and int(global_num_valid_tokens([])) == 0
    assert int(global_num_valid_tokens({"n": torch.tensor(2)}, key="n")) == 2
    assert global_num_valid_tokens([1], device="meta").device.type == "meta"


def test_global_count_from_collator_outputs_stays_on_device():
    """With python_scalars=False the count is a tensor: summing it needs no host sync."""
    data = PackedRecords(8)
    collate = Collator(python_scalars=False, **OPTIONS)
    micro = [collate([data[i] for i in range(j, j + 2)]) for j in range(0, 8, 2)]
    assert all(isinstance(batch["num_valid_tokens"], torch.Tensor) for batch in micro)
    whole = Collator(**OPTIONS)([data[i] for i in range(8)])
    assert int(global_num_valid_tokens(micro)) == whole["num_valid_tokens"]


@pytest.mark.parametrize("bad", [1.5, True, "3", torch.tensor(1.0), torch.tensor(True), None])
def test_global_count_rejects_non_integer_counts(bad):
    with pytest.raises(TypeError, match="count"):
        global_num_valid_tokens([bad])


def test_counts_and_losses_of_the_wrong_kind_are_named():
    with pytest.raises(
        ValueError, match=r"micro-batch 1 has no 'num_valid_tokens' .*return_num_valid_tokens=True"
    ):
        global_num_valid_tokens([{"num_valid_tokens": 3}, {"labels": 1}])
    with pytest.raises(TypeError, match=r"counts must be a count .* got NoneType"):
        global_num_valid_tokens(None)
    with pytest.raises(TypeError, match=r"loss_sum must be a tensor .* got float"):
        normalize_loss(3.0, 2)
    assert [int(global_num_valid_tokens(c)) for c in (np.int64(5), np.array(5), [np.int32(2), 3])] == [
        5,
        5,
        5,
    ]


def test_normalize_loss():
    assert float(normalize_loss(torch.tensor(6.0), torch.tensor(4))) == 1.5
    assert float(normalize_loss(torch.tensor(6.0), 4, world_size=4)) == 6.0
    assert float(normalize_loss(torch.tensor(0.0), torch.tensor(0))) == 0.0  # no valid token: 0, not NaN
    assert normalize_loss(torch.tensor(6.0, dtype=torch.bfloat16), 3).dtype == torch.float32
    assert normalize_loss(torch.tensor(6.0, dtype=torch.float64), 3).dtype == torch.float64
    for bad in (0, 1.0, True):
        with pytest.raises(ValueError, match="world_size"):
            normalize_loss(torch.tensor(1.0), 1, world_size=bad)


def test_accumulation_in_one_process_equals_the_whole_batch():
    """Micro-batches of unequal counts, each loss_sum * 1 / N: the summed gradient is the whole batch's mean."""
    data = PackedRecords(6, 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)).double()

    def loss_sum(batch):
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")

    collate = Collator(**OPTIONS)
    micro = [collate([data[i] for i in rows]) for rows in ([0], [1, 2], [3, 4, 5])]
    assert len({batch["num_valid_tokens"] for batch in micro}) == 3
    count = global_num_valid_tokens(micro)
    for batch in micro:
        normalize_loss(loss_sum(batch), count).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = collate([data[i] for i in range(6)])
    (loss_sum(whole) / whole["num_valid_tokens"]).backward()
    for got, want in zip(accumulated, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)


def test_all_reduce_path_in_a_one_rank_group(tmp_path):
    """With a process group initialised, the count goes through all_reduce (gloo, one rank)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert is_distributed() and data_parallel_size() == 1
        assert int(global_num_valid_tokens([2, torch.tensor([3, 4])])) == 9
        assert float(normalize_loss(torch.tensor(9.0), torch.tensor(9))) == 1.0
    finally:
        dist.destroy_process_group()
    assert not is_distributed()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node=2 script args`` on a free local port."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    # A session of its own: on a timeout the whole group (torchrun and its ranks) is killed, so no
    # rank outlives the test.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"torchrun timed out after {timeout} s\n{stdout[-4000:]}\n{stderr[-8000:]}"
        ) from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result


def test_ddp_gradients_equal_one_process_over_the_whole_batch(tmp_path):
    """torchrun, 2 ranks, DistributedSampler + Collator, 2 micro-batches of unequal counts per step: the DDP
    gradients (with and without no_sync) and parameters equal a single-process run over the whole batch."""
    report_path = tmp_path / "report.json"
    result = torchrun(ROOT / "tests" / "dist_train_check.py", "--report", str(report_path))
    assert "rank 0: OK" in result.stdout and "rank 1: OK" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2
    assert report["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    for mode in ("no_sync", "sync_every_micro_batch"):
        run = report[mode]
        assert max(run["grad_errors"]) < 1e-10
        assert min(run["naive_errors"]) > 1e-4  # averaging micro-batch means is measurably wrong here
        assert all(len(set(counts)) > 1 for counts in run["counts"])


def test_example_runs_under_torchrun():
    result = torchrun(ROOT / "examples" / "distributed_train.py", "--steps", "4")
    assert "step 3: loss" in result.stdout
    assert "rank 0: resumed data stream matches" in result.stdout
    assert "rank 1: resumed data stream matches" in result.stdout


def test_even_batches_give_every_rank_the_same_steps(tmp_path):
    """torchrun, 2 ranks with uneven shards of a finite PackedStream (0 and 2 workers): the plain loaders
    give different batch counts; through EvenBatches both ranks step the shorter count, each step a
    collective, and the longer rank counts what it dropped."""
    report_path = tmp_path / "even.json"
    result = torchrun(ROOT / "tests" / "dist_even_check.py", "--report", str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    for workers in ("0", "2"):
        long_rank, short_rank = report[workers]
        assert long_rank["plain"] > short_rank["plain"], report  # the trap is there
        assert long_rank["steps"] == short_rank["steps"] == short_rank["plain"]
        assert long_rank["dropped"] == long_rank["plain"] - short_rank["plain"] and short_rank["dropped"] == 0


def test_even_batches_in_one_process_yield_everything():
    from zephon_collate.parallel.even import EvenBatches

    even = EvenBatches([1, 2, 3])
    assert list(even) == [1, 2, 3] and even.dropped == 0 and len(even) == 3
    with pytest.raises(TypeError, match="EvenBatches: loader must be an iterable of batches, got int"):
        EvenBatches(3)


def test_even_batches_len_and_device_errors_name_the_fix():
    from zephon_collate.parallel.even import EvenBatches

    even = EvenBatches(x for x in range(3))
    with pytest.raises(TypeError, match=r"EvenBatches: its loader \(generator\) has no length"):
        len(even)

    class Endless(torch.utils.data.Sampler[list[int]]):  # a batch sampler without a length
        def __iter__(self):
            yield [0]

    loader = torch.utils.data.DataLoader([1, 2], batch_sampler=Endless())
    with pytest.raises(TypeError, match=r"EvenBatches: its loader \(DataLoader\) has no length"):
        len(EvenBatches(loader))
    assert list(even) == [0, 1, 2]  # a generator still iterates
    with pytest.raises(ValueError, match="EvenBatches: device 'nonsense' is not a device name such as 'cpu'"):
        EvenBatches([1], device="nonsense")
    with pytest.raises(TypeError, match="EvenBatches: device must be None, a str"):
        EvenBatches([1], device=3)
