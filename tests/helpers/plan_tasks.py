"""Tasks for ddptrain plan's tests (tests/integration/test_plan.py)."""

from __future__ import annotations

import torch

from ddptrain import Task
from ddptrain.tasks.regression import regression_task


def wide_mlp(cfg) -> Task:
    """The regression data through blocks with more rows than a 1,024-rank world has ranks (and one
    with fewer: its rows go to the first ranks only)."""
    task = regression_task(cfg)
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 3000), torch.nn.Tanh(), torch.nn.Linear(3000, 2048),
                                     torch.nn.Tanh(), torch.nn.Linear(2048, 1))
    return task


def huge_mlp(cfg) -> Task:
    """The regression data through 10 billion parameters (40 GB of float32: more than this
    machine's memory, once, let alone with gradients and AdamW's moments)."""
    task = regression_task(cfg)
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 100_000), torch.nn.Tanh(),
                                     torch.nn.Linear(100_000, 100_000), torch.nn.Tanh(), torch.nn.Linear(100_000, 1))
    return task
