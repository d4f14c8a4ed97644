"""The optimizer and its learning-rate schedule, from the optimizer settings (as the task's defaults resolved them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import ConfigError
from .schedules import lr_factor
from .settings import OptimizerSettings, TrainingSettings
from .tasks.protocol import SchedulerFactory


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimizerSettings) -> torch.optim.Optimizer:
    name, lr, decay = optim.hparam("optimizer"), optim.hparam("lr"), optim.hparam("weight_decay")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay, betas=optim.adam_betas, eps=optim.eps)
    return torch.optim.SGD(params, lr=lr, momentum=optim.hparam("momentum"), weight_decay=decay)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimizerSettings,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """--lr-schedule over ``total_steps``: every parameter group's rate decays to the same fraction
    of its own, --min-lr / --lr (one group at --lr: to --min-lr exactly)."""
    base = optim.hparam("lr")
    floor = optim.min_lr / base if base > 0 else 0.0
    factor = lr_factor(optim.lr_schedule, optim.warmup_steps, total_steps, floor, optim.decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def nanogpt_schedule(warmup_iters: int, lr_decay_iters: int, min_lr: float) -> SchedulerFactory:
    """nanoGPT's ``get_lr`` (train.py) as a ``Task.make_scheduler``: before its optimizer step
    ``it`` (0-based) a rate rising as ``lr * (it + 1) / (warmup_iters + 1)``, then falling by a
    cosine to ``min_lr`` at ``lr_decay_iters``, ``min_lr`` after; whatever the run's length (give
    ``--max-steps max_iters + 1``: nanoGPT steps at iterations 0 to max_iters). ``lr`` is each
    parameter group's own (nanoGPT's groups share ``learning_rate``). --warmup-steps W rises as
    (it + 1) / W instead, and --lr-schedule cosine decays over the run."""
    def make(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        def factor_of(base: float) -> Callable[[int], float]:
            def factor(it: int) -> float:
                if it < warmup_iters:
                    return (it + 1) / (warmup_iters + 1)
                if it > lr_decay_iters or base == 0:
                    return min_lr / base if base else 0.0
                decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
                coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
                return (min_lr + coeff * (base - min_lr)) / base
            return factor
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor_of(g["lr"]) for g in optimizer.param_groups])
    return make


def run_steps(training: TrainingSettings, steps_per_epoch: int | None) -> int | None:
    """The run's length in optimizer steps: --max-steps or the epochs' steps, the fewer (None:
    unknown, epochs of a stream)."""
    limits = [training.max_steps] if training.max_steps is not None else []
    if steps_per_epoch is not None and not math.isinf(training.epochs):
        limits.append(steps_per_epoch * int(training.epochs))
    return min(limits) if limits else None


def build_schedule(optimizer: torch.optim.Optimizer, optim: OptimizerSettings, total: int | None,
                   make: SchedulerFactory | None = None) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's learning-rate schedule (None: a constant rate, nothing to step): the task's
    ``make``, else --lr-schedule's. Its length, ``total``, is the run's in optimizer steps
    (``run_steps``); a stream's epoch has no known length (None), so a decaying schedule over
    epochs of a stream is refused."""
    if make is not None:
        if optim.lr_schedule != "constant" or optim.warmup_steps or optim.min_lr:
            raise ConfigError("the task builds its own schedule (Task.make_scheduler); drop --lr-schedule, "
                              "--warmup-steps and --min-lr, or the task's make_scheduler")
        if total is None:
            raise ConfigError("Task.make_scheduler needs the run's length, and an iterable training set's epoch "
                              "has no known length; give --max-steps")
        return make(optimizer, total)
    if optim.lr_schedule == "constant" and optim.warmup_steps == 0:
        return None
    if total is None and optim.lr_schedule != "constant":
        raise ConfigError(f"--lr-schedule {optim.lr_schedule} needs the run's length, and an iterable "
                          "training set's epoch has no known length; give --max-steps")
    return build_scheduler(optimizer, optim, total or 1)


def describe_optimizer(optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """What was built, for config.json: the optimizer's class and every parameter group's
    hyper-parameters (the tensors counted, not listed), and the schedule's class."""
    def plain(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, torch.Tensor):
            return value.item() if value.numel() == 1 else f"tensor{tuple(value.shape)}"
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)

    groups = [{"params": len(group["params"]), "parameters": sum(p.numel() for p in group["params"]),
               **{k: plain(v) for k, v in group.items() if k not in ("params", "initial_lr")},
               **({"lr": plain(group["initial_lr"])} if "initial_lr" in group else {})}  # (a schedule's base)
              for group in optimizer.param_groups]
    return {"optimizer": {"class": type(optimizer).__name__, "param_groups": groups},
            "scheduler": None if scheduler is None else {"class": type(scheduler).__name__}}


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
