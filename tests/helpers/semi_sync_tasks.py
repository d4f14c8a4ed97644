"""Tasks for ``--sync local-sgd|diloco``: the tutorial's job, its weights recorded by every rank
before each training step (WEIGHTS_LOG: a folder), so a test sees when the groups agree."""

from __future__ import annotations

import os
from pathlib import Path

from ddptrain import Task
from ddptrain.tasks import regression_task

from data_tasks import stream
from kills import _rank, killable


def logged_weights(cfg) -> Task:
    """Each rank appends "N WEIGHTS" before its N-th training loss (N from 1), the weights as
    exact hex floats: ``WEIGHTS_LOG/rank-R.txt``."""
    task = regression_task(cfg)
    model, loss_fn, log = task.model, task.loss_fn, Path(os.environ["WEIGHTS_LOG"])
    calls = {"n": 0}

    def recorded(output, target):
        if model.training:
            calls["n"] += 1
            weights = " ".join(x.hex() for p in model.parameters() for x in p.detach().flatten().tolist())
            with open(log / f"rank-{_rank()}.txt", "a") as file:
                file.write(f"{calls['n']} {weights}\n")
        return loss_fn(output, target)
    task.loss_fn = recorded
    return task


killed_stream = killable(stream)  # a stream of STREAM_SAMPLES samples, whose rank KILL_RANK SIGKILLs itself once
