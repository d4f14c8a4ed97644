"""Tasks whose step_fn returns figures of its own beside the loss (Task.step_figures): the tests
recompute each figure from the samples the sampler gives each rank, and compare with the step records."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import Task

SAMPLES = 35  # with 2 ranks x batch 4 x accumulation 2: a last step of 3 samples, where rank 1 has a stand-in
FIGURES = {"index_mean": "mean", "index_max": "max", "samples_seen": "sum"}


def indexed_data(samples: int = SAMPLES) -> TensorDataset:
    """(inputs, target, the sample's index): a step's figures say which samples it trained."""
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(samples, 3, generator=generator), torch.rand(samples, 1, generator=generator),
                         torch.arange(samples))


def step_with_figures(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    inputs, target, index = batch
    return {"loss": F.mse_loss(model(inputs), target), "index_mean": index.double().mean(),
            "index_max": index.max(), "samples_seen": float(len(inputs))}


def indexed(cfg) -> Task:
    torch.manual_seed(cfg.seed)
    return Task(model=torch.nn.Linear(3, 1), train_set=indexed_data(), step_fn=step_with_figures,
                step_figures=FIGURES, defaults={"lr": 0.05})


def regression_figures(cfg) -> Task:
    """The tutorial's regression job, its step_fn returning the three kinds of figure."""
    from ddptrain.tasks import regression_task

    task = regression_task(cfg)

    def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs, target = batch
        loss = F.mse_loss(model(inputs), target)
        return {"loss": loss, "index_mean": loss.detach(), "index_max": inputs.abs().max(), "samples_seen": len(inputs)}

    return Task(model=task.model, train_set=task.train_set, step_fn=step, step_figures=FIGURES,
                defaults=task.defaults)
