"""Optimizer and learning-rate schedule from the resolved config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from .config import RunConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
    name, lr, decay = cfg.hparam("optimizer"), cfg.hparam("lr"), cfg.hparam("weight_decay")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.hparam("momentum"), weight_decay=decay)


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate before optimizer step ``step`` (0-based).

    Warm-up rises linearly to 1 over ``warmup_steps``; then ``cosine`` falls as
    0.5 * (1 + cos(pi * p)) and ``linear`` as 1 - p, where p runs from 0 to 1 over the
    remaining steps.
    """
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress
    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    factor = lr_factor(cfg.lr_schedule, cfg.warmup_steps, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
