"""The task protocol: what a task factory returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A metric returns the *sum* of its per-sample values over the batch (e.g. the number of
# correct predictions); ddptrain adds the sums of every rank and divides by the count, so
# distributed evaluation equals single-process evaluation.
MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Task:
    """Everything a run trains: build it the same way on every rank (same seed, same data)."""

    model: torch.nn.Module
    train_set: Dataset
    loss_fn: LossFn
    eval_set: Dataset | None = None
    metrics: dict[str, MetricFn] = field(default_factory=dict)
    make_optimizer: OptimizerFactory | None = None
    # Defaults for hyper-parameters the user did not set (keys of config.GLOBAL_DEFAULTS).
    defaults: dict[str, Any] = field(default_factory=dict)


TaskFactory = Callable[[Any], Task]
