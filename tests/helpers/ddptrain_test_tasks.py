"""Task factories the tests pass as ``--task ddptrain_test_tasks:FUNC``.

They run inside real ranks; tests steer them with environment variables (inherited by every
rank). None of them replaces a part of torch.distributed: they only fail, record or kill.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task
from ddptrain.tasks.regression import regression_task


def _step_counter(loss_fn, on_step):
    """Wrap a loss so ``on_step(step)`` runs before each step's loss (step counts from 1)."""
    calls = {"n": 0}

    def wrapped(output, target):
        calls["n"] += 1
        on_step(calls["n"])
        return loss_fn(output, target)
    return wrapped


def fail_on_rank(cfg) -> Task:
    """Rank FAIL_RANK raises at step FAIL_STEP."""
    task = regression_task(cfg)
    rank, step = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])

    def maybe_fail(n: int) -> None:
        if n == step and int(os.environ["RANK"]) == rank:
            raise RuntimeError(f"deliberate failure on rank {rank} at step {step}")
    task.loss_fn = _step_counter(task.loss_fn, maybe_fail)
    return task


def recording(cfg) -> Task:
    """Feature 0 of every sample is its index; each rank appends what it trains on to a file."""
    samples = int(os.environ.get("RECORD_SAMPLES", "200"))
    inputs = torch.zeros(samples, 4)
    inputs[:, 0] = torch.arange(samples, dtype=torch.float32)
    targets = torch.zeros(samples, 1)
    out = Path(os.environ["RECORD_DIR"])

    def loss(output, target, inputs_seen=None):
        return F.mse_loss(output, target)

    model = _Recorder(out)
    return Task(model=model, train_set=TensorDataset(inputs, targets), loss_fn=loss)


class _Recorder(torch.nn.Module):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.out / f"rank-{os.environ['RANK']}.jsonl", "a") as handle:
            handle.write(json.dumps(x[:, 0].long().tolist()) + "\n")
        return self.linear(x)


def kill_at_step(cfg) -> Task:
    """On the first attempt only, rank KILL_RANK SIGKILLs itself at step KILL_STEP
    (without KILL_RANK set, the plain regression task: what resuming such a run uses)."""
    task = regression_task(cfg)
    if "KILL_RANK" not in os.environ:
        return task
    rank, step = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    marker = Path(os.environ["KILL_MARKER"])

    def maybe_kill(n: int) -> None:
        if first_attempt and n == step and int(os.environ["RANK"]) == rank and not marker.exists():
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
    task.loss_fn = _step_counter(task.loss_fn, maybe_kill)
    return task


def not_a_task(cfg):
    return "not a task"


def kill_while_snapshotting(cfg) -> Task:
    """On the first attempt, rank 0 dies half-way through writing its KILL_SNAPSHOT-th snapshot:
    half the bytes are in the temporary file when SIGKILL arrives."""
    import io

    import ddptrain.snapshot as snapshot

    target = int(os.environ["KILL_SNAPSHOT"])
    marker = Path(os.environ["KILL_MARKER"])
    real_save = snapshot.atomic_save
    calls = {"n": 0}

    def dying_save(obj, path):
        if path.name.startswith("step-"):
            calls["n"] += 1
        if calls["n"] == target and not marker.exists():
            marker.write_text("killed")
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as handle:
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(obj, path)

    snapshot.atomic_save = dying_save
    return regression_task(cfg)


def mlp_regression(cfg) -> Task:
    """The regression data with another model: its snapshots do not fit Linear(20, 1)."""
    task = regression_task(cfg)
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return task


class _PlainDataset(torch.utils.data.Dataset):
    """The same samples without the TensorDataset type: forces the DataLoader path."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


def regression_via_dataloader(cfg) -> Task:
    task = regression_task(cfg)
    task.train_set = _PlainDataset(task.train_set)
    return task


class _HalfUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(20, 1)
        self.unused = torch.nn.Linear(20, 1)  # gets no gradient: DDP must be told

    def forward(self, x):
        return self.used(x)


def unused_parameters(cfg) -> Task:
    task = regression_task(cfg)
    task.model = _HalfUsed()
    return task
