"""The tutorial's job: 2048 random samples of 20 features -> 1 target, Linear(20, 1), MSE.

Two corrections to the tutorial: the data is drawn from a seeded generator, so every rank
holds the same samples, and the loss is mean squared error (``cross_entropy`` over a single
output is identically 0 and trains nothing). The targets are a noisy linear function of the
features, so there is something to learn and the loss visibly falls.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ..settings import RunConfig
from .protocol import Task

SAMPLES, FEATURES = 2048, 20


def regression_data(seed: int, samples: int = SAMPLES, features: int = FEATURES) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(samples, features, generator=generator)
    true_weights = torch.randn(features, 1, generator=generator)
    targets = inputs @ true_weights + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def regression_task(cfg: RunConfig) -> Task:
    return Task(
        model=torch.nn.Linear(FEATURES, 1),
        train_set=regression_data(cfg.seed),
        loss_fn=F.mse_loss,
        defaults={"lr": 1e-3, "optimizer": "sgd"},
    )
