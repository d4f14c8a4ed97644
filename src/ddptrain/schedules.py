"""The learning-rate schedules' arithmetic: the factor of the base rate before each optimizer step,
where a warmup-stable-decay's decay begins, and whether two lengths of a run agree on the rates
so far (a resume with another --max-steps is exact only then: snapshots/restore.py). Pure
functions of the settings; the torch schedulers that apply them are optim.py's."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .settings import OptimizerSettings


def lr_factor(schedule: str, warmup_steps: int, total_steps: int, floor: float = 0.0,
              decay_fraction: float | None = None) -> Callable[[int], float]:
    """Multiplier of the base learning rate before optimizer step ``step`` (0-based).

    Warm-up rises linearly to 1 over ``warmup_steps``; then ``cosine`` falls as
    0.5 * (1 + cos(pi * p)) and ``linear`` as 1 - p, where p runs from 0 to 1 over the decay's
    steps, from 1 to ``floor`` (--min-lr over --lr) rather than to 0. The decay spans every step
    after the warm-up, or with ``decay_fraction`` F only the run's last F (warmup-stable-decay:
    the rate holds at 1 until ``decay_start``, so a longer run goes on from before it exactly).
    """
    start = decay_start(warmup_steps, total_steps, decay_fraction)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, max(0, step - start) / max(1, total_steps - start))
        if schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress)
    return factor


def decay_start(warmup_steps: int, total_steps: int, decay_fraction: float | None) -> int:
    """The first step whose rate decays: right after the warm-up, or (``decay_fraction`` F) the
    run's last F of ``total_steps`` (rounded to the nearest step), never inside the warm-up."""
    if decay_fraction is None:
        return warmup_steps
    return max(warmup_steps, total_steps - math.floor(decay_fraction * total_steps + 0.5))


def stable_end(optim: OptimizerSettings, total_steps: int | None) -> int | None:
    """A warmup-stable-decay's (--decay-fraction) first decayed step in a run of ``total_steps``
    (None: not counted in steps): the step whose snapshot a longer run goes on from exactly, kept
    whatever --keep says. None where the run has no such step."""
    if optim.decay_fraction is None or optim.lr_schedule == "constant" or total_steps is None:
        return None
    start = decay_start(optim.warmup_steps, total_steps, optim.decay_fraction)
    return start if 0 < start < total_steps else None


def schedule_agrees(optim: OptimizerSettings, saved_total: int, total: int, through_step: int) -> bool:
    """Whether --lr-schedule over ``total`` steps gives every step up to ``through_step`` (a
    snapshot's next) the rate it had over ``saved_total``: a longer or shorter run that resumes
    there is then the run it would have been from the start (a constant rate; a warmup-stable-decay
    whose decay begins after it under both lengths)."""
    if optim.lr_schedule == "constant":
        return True
    def factors(steps: int) -> list[float]:
        factor = lr_factor(optim.lr_schedule, optim.warmup_steps, steps, 0.0, optim.decay_fraction)
        return [factor(step) for step in range(through_step + 1)]
    return factors(saved_total) == factors(total)


def task_schedule_agrees(make: Callable[[torch.optim.Optimizer, int], Any], group_rates: Sequence[float],
                         saved_total: int, total: int, through_step: int) -> bool:
    """schedule_agrees for a task's own schedule (``Task.make_scheduler``), tried as it is: on a
    stand-in optimizer with the run's parameter groups' rates, over either length, the rate of
    every group before every step up to ``through_step``."""
    def rates(steps: int) -> list[list[float]]:
        stand_in = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": rate}
                                    for rate in group_rates])
        scheduler, seen = make(stand_in, steps), []
        for _ in range(through_step + 1):
            seen.append([group["lr"] for group in stand_in.param_groups])
            stand_in.step()
            scheduler.step()
        return seen
    return rates(saved_total) == rates(total)
