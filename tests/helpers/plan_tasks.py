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


def deep_mlp(cfg) -> Task:
    """The regression data through 12 blocks of 256 x 256: AdamW's foreach path (CUDA's default)
    makes temporaries the size of all 12 blocks' state, its per-tensor loop (the CPU's) one block's."""
    task = regression_task(cfg)
    blocks = [layer for _ in range(12) for layer in (torch.nn.Linear(256, 256), torch.nn.Tanh())]
    task.model = torch.nn.Sequential(torch.nn.Linear(20, 256), *blocks, torch.nn.Linear(256, 1))
    return task


def deep_mlp_foreach(cfg) -> Task:
    """deep_mlp with AdamW told to take its foreach path, on any device."""
    task = deep_mlp(cfg)
    task.make_optimizer = lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)  # (what it holds: any lr)
    return task
