"""Task factories for watching a run (tests/integration/test_watching.py): every loss a rank
computes written down, a rank killed after a given snapshot, an evaluation that sleeps, a task
that builds its own optimizer and schedule. Tests steer them with environment variables."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task
from ddptrain.tasks import digits_task, regression_task

from kills import _first_attempt, _on_step, _rank


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _with_kill(task: Task) -> Task:
    """KILL_RANK SIGKILLs itself at its KILL_STEP-th loss of the first attempt, once the snapshot
    of global step KILL_AFTER_SNAPSHOT is committed (so the resume starts there, inside a window)."""
    if "KILL_RANK" not in os.environ:
        return task
    rank, step, marker = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"]), Path(os.environ["KILL_MARKER"])
    snapshot = Path(os.environ["RUN_DIR"]) / "snapshots" / f"step-{int(os.environ['KILL_AFTER_SNAPSHOT']):09d}.pt"

    def maybe_kill(n: int) -> None:
        if n == step and _rank() == rank and _first_attempt(marker):
            deadline = time.monotonic() + 60
            while not snapshot.is_file() and time.monotonic() < deadline:
                time.sleep(0.01)
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
    return _on_step(task, maybe_kill)


def logged_losses(cfg) -> Task:
    """A small MLP on the tutorial's data; each rank appends every loss it computes to
    LOSS_DIR/rank-R-attempt-A.txt; killable (``_with_kill``)."""
    task = regression_task(cfg)
    task.model = _mlp()
    folder = Path(os.environ["LOSS_DIR"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def loss_fn(output, target):
        loss = F.mse_loss(output, target)
        with open(folder / f"rank-{_rank()}-attempt-{attempt}.txt", "a") as handle:
            handle.write(f"{loss.item()!r}\n")
        return loss
    task.loss_fn = loss_fn
    return _with_kill(task)


def sleepy_evaluation(cfg) -> Task:
    """Steps of about 20 ms (a sleep in the loss) and an evaluation that sleeps 0.3 s: a rate that
    counted evaluations would fall to a fraction."""
    task = regression_task(cfg)
    data = task.train_set

    def loss_fn(output, target):
        time.sleep(0.02)
        return F.mse_loss(output, target)

    def metric(output, target):
        time.sleep(0.3 / 4)  # four batches an evaluation
        return ((output - target) ** 2).sum()
    task.loss_fn = loss_fn
    task.eval_set = TensorDataset(*(t[:4 * cfg.batch_size * 2] for t in data.tensors))
    task.metrics = {"sq": metric}
    return task


def own_optimizer_and_schedule(cfg) -> Task:
    """AdamW in two groups (weights decayed, biases not) and a cosine schedule to 1e-4 of the
    task's own (nanoGPT's pattern); killable."""
    task = regression_task(cfg)
    task.model = _mlp()

    def make_optimizer(params):
        params = list(params)
        decayed = [p for p in params if p.dim() >= 2]
        kept = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": kept, "weight_decay": 0.0}],
                                 lr=3e-3, betas=(0.9, 0.95), eps=1e-7)

    def make_scheduler(optimizer, total_steps):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=1e-4)
    task.make_optimizer, task.make_scheduler = make_optimizer, make_scheduler
    return _with_kill(task)


def killable_mlp(cfg) -> Task:
    task = regression_task(cfg)
    task.model = _mlp()
    return _with_kill(task)


def digits(cfg) -> Task:
    return digits_task(cfg)
