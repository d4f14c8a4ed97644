"""Optimizer and learning-rate schedule from the resolved config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .config import RunConfig
from .errors import ConfigError


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


def build_schedule(optimizer: torch.optim.Optimizer, cfg: RunConfig,
                   steps_per_epoch: int | None) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's learning-rate schedule (None: a constant rate, nothing to step). Its length is
    the run's in optimizer steps: --max-steps or the epochs' steps, the fewer; a stream's epoch
    has no known length, so a decaying schedule over epochs of a stream is refused."""
    if cfg.lr_schedule == "constant" and cfg.warmup_steps == 0:
        return None
    limits = [cfg.max_steps] if cfg.max_steps is not None else []
    if steps_per_epoch is not None and not math.isinf(cfg.epochs):
        limits.append(steps_per_epoch * int(cfg.epochs))
    if not limits and cfg.lr_schedule != "constant":
        raise ConfigError(f"--lr-schedule {cfg.lr_schedule} needs the run's length, and an iterable "
                          "training set's epoch has no known length; give --max-steps")
    return build_scheduler(optimizer, cfg, min(limits) if limits else 1)


class SchedulerState:
    """The schedule's state in a snapshot: ``{}`` when there is none (a constant rate)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)


class ScalerState:
    """fp16's grad scaler in a snapshot: ``{}`` when it is off (no fp16, or not on CUDA)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
