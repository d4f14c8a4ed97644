"""A task of your own: `ddptrain train --task custom_task:sine_task` (run from this folder,
or with it on PYTHONPATH).

A task factory takes the resolved RunConfig and returns a ddptrain.Task. Build everything
from cfg.seed: every rank calls the factory and must get the same data and weights.
"""

import math

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import RunConfig, Task


def within_tenth(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A metric returns a SUM over the batch; ddptrain divides by the sample count."""
    return ((output - target).abs() < 0.1).sum()


def sine_task(cfg: RunConfig) -> Task:
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.rand(4096, 1, generator=generator) * 2 * math.pi
    y = torch.sin(x)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return Task(
        model=model,
        train_set=TensorDataset(x[:3584], y[:3584]),   # tensors in memory: the fast path
        eval_set=TensorDataset(x[3584:], y[3584:]),
        loss_fn=F.mse_loss,
        metrics={"within_0.1": within_tenth},
        defaults={"optimizer": "adamw", "lr": 1e-2},    # used unless --optimizer / --lr are given
        # make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),  # full control instead
    )
