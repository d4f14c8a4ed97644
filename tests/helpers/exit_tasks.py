"""Task factories for what ends or stalls a rank (``--task exit_tasks:FUNC``): a snapshot write in
flight when a peer fails (resilience/failures.hard_exit waits for it), an evaluation longer than
--timeout (not a stall: resilience/stall.py). Steered by environment variables, as
ddptrain_test_tasks' are."""

from __future__ import annotations

import os
import time

import torch

from ddptrain import Task
from ddptrain.tasks import regression_task

from ddptrain_test_tasks import fail_on_rank


def peer_fails_while_saving(cfg) -> Task:
    """fail_on_rank, and every snapshot file takes SAVE_SLEEP seconds more to write (rank 0's)."""
    import ddptrain.snapshots.files as files

    real_save = files.atomic_save

    def slow_save(obj, path):
        if path.name.startswith("step-"):
            time.sleep(float(os.environ.get("SAVE_SLEEP", "0")))
        real_save(obj, path)

    files.atomic_save = slow_save
    return fail_on_rank(cfg)


class _SleepsOnce(torch.utils.data.Dataset):
    """``inner``'s samples; the first one read in this process first sleeps EVAL_SLEEP seconds."""

    def __init__(self, inner):
        self.inner, self.slept = inner, False

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if not self.slept:
            self.slept = True
            time.sleep(float(os.environ.get("EVAL_SLEEP", "0")))
        return self.inner[index]


def slow_evaluation(cfg) -> Task:
    """The regression task with an evaluation set (its first 256 samples) whose first evaluation
    sleeps EVAL_SLEEP seconds."""
    task = regression_task(cfg)
    task.eval_set = _SleepsOnce(torch.utils.data.Subset(task.train_set, range(256)))
    return task
