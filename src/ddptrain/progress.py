"""Where a run is (``Progress``) and what is due after each step (``Cadence``).

The training loop asks the cadence once per step and acts on the ``Action`` it returns, so every
rule about limits and intervals (--max-epochs, --max-steps, --save-every, --eval-every(-steps),
a stop signal, --early-stop) lives here and is unit-tested without ranks (tests/unit/test_cadence.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import EvaluationSettings, TrainingSettings


@dataclass
class Progress:
    """Where the run is; also the data position: the epoch's permutation and the step in it
    say which samples come next (data.StepSampler)."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    epoch_samples: int = 0  # trained this epoch, over every rank
    steps_per_epoch: int | None = field(default=None, compare=False)  # the data's, not state (None: a stream)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                "epoch_samples": self.epoch_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        self.epoch_samples = state.get("epoch_samples", 0)
        # Snapshots by version 0.2 could stop at an epoch's last step, before its record: the
        # epoch then ends at once (its record logged) and the next one starts.
        if self.steps_per_epoch:
            self.step_in_epoch = min(self.step_in_epoch, self.steps_per_epoch)

    def step_done(self, samples: int) -> None:
        self.epoch_samples += samples
        self.step_in_epoch += 1
        self.global_step += 1

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch, self.epoch_samples = self.epoch + 1, 0, 0

    @property
    def epoch_over(self) -> bool:
        """A map-style epoch has no steps left (a stream's end is known only when it comes)."""
        return self.steps_per_epoch is not None and self.step_in_epoch >= self.steps_per_epoch


@dataclass(frozen=True)
class Action:
    """What is due after a step. The loop evaluates first (a snapshot then holds the verdict),
    then saves, then leaves the epoch on ``stop`` or ``end``."""

    stop: bool = False  # a stop signal: leave now; the snapshot is written outside the epoch
    end: bool = False  # the run's last step: --max-steps, or --early-stop after this step's evaluation
    evaluate: bool = False  # --eval-every-steps
    save: bool = False  # a snapshot after this step: --save-every, or rank 0's --save-seconds clock
    epoch_over: bool = False  # a map-style epoch's last step

    @property
    def save_now(self) -> bool:
        """Inside the epoch. At its last step the snapshot waits for the epoch's record (so it
        resumes at the next epoch's start); at the run's last step the final snapshot covers it."""
        return self.save and not (self.stop or self.end or self.epoch_over)

    @property
    def save_after_record(self) -> bool:
        return self.save and self.epoch_over and not self.stop

    @property
    def leaves_epoch(self) -> bool:
        return self.stop or self.end


class Cadence:
    """The run's limits (``training``), evaluations (``evaluation``) and --save-every, read against
    ``progress``. ``stopped_early``: whether --early-stop has ended the run (the best-model
    judge's verdict, the same on every rank)."""

    def __init__(self, training: TrainingSettings, evaluation: EvaluationSettings, save_every: int,
                 progress: Progress, evaluates: bool, stopped_early: Callable[[], bool] = lambda: False,
                 save_at: int | None = None) -> None:
        """``save_at``: a step whose snapshot is also due (a warmup-stable-decay's last before the decay)."""
        self.max_epochs, self.max_steps = training.epochs, training.max_steps
        self.eval_every, self.eval_every_steps = evaluation.eval_every, evaluation.eval_every_steps
        self.save_every, self.save_at = save_every, save_at
        self.progress, self.evaluates, self.stopped_early = progress, evaluates, stopped_early

    def after_step(self, stop_requested: bool = False, snapshot_requested: bool = False) -> Action:
        """``stop_requested`` / ``snapshot_requested``: the stop signal's decision, agreed by
        every rank. A stop at the run's last step is no stop: the run ends there anyway."""
        step, end = self.progress.global_step, self.steps_reached()
        stop = stop_requested and not end
        every = self.eval_every_steps
        return Action(stop=stop, end=end,
                      evaluate=not (stop or end) and self.evaluates and every > 0 and step % every == 0,
                      save=snapshot_requested or step == self.save_at or
                      (self.save_every > 0 and step % self.save_every == 0),
                      epoch_over=self.progress.epoch_over)

    def judged(self, action: Action) -> Action:
        """After the step's evaluation: --early-stop may end the run here."""
        return dataclasses.replace(action, end=action.end or self.stopped_early())

    def epoch_record_follows(self, epoch: int, action: Action) -> bool:
        """Whether the epoch's record, with an evaluation, is written at this step (after which
        this step's evaluation needs no record of its own): its last step, or the run's."""
        if action.epoch_over:
            return self.evaluate_at_epoch_end(epoch, partial=False)
        return action.end and self.evaluate_at_epoch_end(epoch, partial=True)

    def last_step(self, steps_per_epoch: int) -> int:
        """The run's last global step (a map-style set's: its epochs have ``steps_per_epoch``)."""
        by_epochs = self.max_epochs * steps_per_epoch  # (infinite: a run counted in steps alone)
        return int(by_epochs if self.max_steps is None else min(by_epochs, self.max_steps))

    def steps_reached(self) -> bool:
        return self.max_steps is not None and self.progress.global_step >= self.max_steps

    def done(self) -> bool:
        """Whether the run has reached its end: --max-epochs, --max-steps or --early-stop, the first."""
        return self.progress.epoch >= self.max_epochs or self.steps_reached() or self.stopped_early()

    def final_evaluation(self, epoch: int, partial: bool) -> bool:
        """Whether an evaluation at the end of ``epoch`` is the run's last."""
        return partial or epoch + 1 >= self.max_epochs or self.steps_reached()

    def evaluate_at_epoch_end(self, epoch: int, partial: bool) -> bool:
        """Every --eval-every epochs, and always at the run's end (a partial epoch is one)."""
        if not self.evaluates:
            return False
        return self.final_evaluation(epoch, partial) or (self.eval_every > 0 and (epoch + 1) % self.eval_every == 0)


def best_interval_s(job_mttf_s: float, snapshot_s: float, write_s: float = 0.0) -> float:
    """The snapshot interval that maximises the goodput of a job that restarts from its newest
    snapshot (Young 1974, Daly 2006): sqrt(2 * a snapshot's blocking time * the job's MTTF), but no
    shorter than ``write_s``: a snapshot's write, behind the training, ends before the next.
    (observe/goodput.restart_goodput is the model; --mttf-hours times snapshots by it.)"""
    return max(math.sqrt(2 * snapshot_s * job_mttf_s), write_s)
