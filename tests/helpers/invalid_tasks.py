"""Tasks that cannot be trained, each wrong in one field: the tests pass them as
``--task invalid_tasks:FUNC`` and expect a one-line error naming that field (test_cli_bad_input.py)."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task
from ddptrain.tasks import digits_task, regression_task


def not_a_task(cfg):
    return "not a task"


def both_loss_and_step(cfg) -> Task:
    task = regression_task(cfg)
    task.step_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])
    return task


def neither_loss_nor_step(cfg) -> Task:
    task = regression_task(cfg)
    task.loss_fn = None
    return task


def non_scalar_step(cfg) -> Task:
    task = regression_task(cfg)
    task.loss_fn = None
    task.step_fn = lambda model, batch: F.mse_loss(model(batch[0]), batch[1], reduction="none")
    return task


def integer_step(cfg) -> Task:
    task = regression_task(cfg)
    task.loss_fn = None
    task.step_fn = lambda model, batch: (model(batch[0]) > 0).sum()
    return task


def detached_step(cfg) -> Task:
    task = regression_task(cfg)
    task.loss_fn = None
    task.step_fn = lambda model, batch: torch.tensor(F.mse_loss(model(batch[0]), batch[1]).item())
    return task


def empty_eval_set(cfg) -> Task:
    task = regression_task(cfg)
    task.eval_set = TensorDataset(torch.zeros(0, 20), torch.zeros(0, 1))
    return task


def eval_without_samples(cfg) -> Task:
    task = digits_task(cfg)
    task.loss_fn, task.metrics = None, {}
    task.step_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])
    task.eval_fn = lambda model, batch: {"loss": F.cross_entropy(model(batch[0]), batch[1], reduction="sum")}
    return task
