"""The figures of a step record (--log-every), declared: what a rank keeps of each step, and how
the ranks and the window's steps combine it into the record's value. The window (step_records.py),
the epoch's tally (tally.py: its all-reduce carries the windows' parts) and the record's writer
read these declarations; no offset into the summed tensor is written by hand.

Two kinds, both summed over the ranks in the step records' one all-reduce (no collective of their own):

- **per step** (``PER_STEP``): the training loss (the ranks' parts add up to each step's loss;
  the record holds the mean over the window's steps that had one) and the gradient norm (the
  root of the ranks' summed squares, each step's; the mean over the steps where it is finite).
  A root is not linear, so these keep a row per step.
- **per window** (``StepFigure``): a figure combined over the ranks and the window's steps by
  ``mean``, ``sum`` or ``max`` (with the rank that had it): a task's own (``Task.step_figures``:
  step_fn returns them beside its loss), and ddptrain's own (``BUILT_IN``: each with ``measure``,
  how a rank computes its value after a step; none yet). Each rank keeps a running (value, count)
  on the device, so a window costs a few numbers however long it is; ``max`` lays one number per
  rank into the sum (every rank's own, read back exact), so its cost grows with the world: one
  float64 a rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

# A step row's columns: this rank's part of the step's loss, its gradient norm (squared when summed),
# and 1 where the step has a loss (a step skipped as not finite has none).
PER_STEP = ("loss_part", "grad_norm", "has_loss")


@dataclasses.dataclass(frozen=True)
class StepFigure:
    """A figure of the step records: its name, how the ranks and steps combine it, and (ddptrain's
    own) how a rank measures it after each step; a task's come from its step_fn instead."""

    name: str
    combine: str  # "mean", "sum" or "max"
    measure: Callable[[], float] | None = None

    def width(self, world_size: int) -> int:
        """Its columns in a window's summed part: (total, count), or (count, one per rank) for max."""
        return 1 + world_size if self.combine == "max" else 2

    def start(self, device: torch.device) -> torch.Tensor:
        """A rank's running (value, count) before the window's first step."""
        return torch.tensor([-math.inf if self.combine == "max" else 0.0, 0.0], dtype=torch.float64, device=device)

    def add(self, running: torch.Tensor, value: torch.Tensor) -> None:
        """One step's value (this rank's) into its running (value, count), on the device."""
        if self.combine == "max":
            torch.maximum(running[0], value, out=running[0])
        else:
            running[0] += value
        running[1] += 1

    def local(self, running: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """This rank's columns: summed over the ranks they give the window's (total, count), or
        the count and every rank's largest value in its own column (0 is exact in a sum)."""
        if self.combine != "max":
            return running.clone()
        columns = torch.zeros(1 + world_size, dtype=torch.float64, device=running.device)
        columns[0] = running[1]
        columns[1 + rank] = running[0]  # (-inf where this rank had none)
        return columns

    def fold(self, carried: tuple[float, float, int], summed: torch.Tensor) -> tuple[float, float, int]:
        """``summed`` (its columns summed over the ranks) into the window's (value, count, rank) so far."""
        value, count, rank = carried
        if self.combine != "max":
            return value + float(summed[0]), count + float(summed[1]), -1
        if float(summed[0]) == 0:
            return carried
        best = int(torch.argmax(summed[1:]))
        if float(summed[1 + best]) > value or not count:
            value, rank = float(summed[1 + best]), best
        return value, count + float(summed[0]), rank

    def figures(self, carried: tuple[float, float, int]) -> dict[str, Any]:
        """The record's entries: ``name`` (and ``name_rank`` for max); none when no rank had a value."""
        value, count, rank = carried
        if not count:
            return {}
        if self.combine == "max":
            return {self.name: value, f"{self.name}_rank": rank}
        return {self.name: value / count if self.combine == "mean" else value}

    @staticmethod
    def nothing() -> tuple[float, float, int]:
        return (0.0, 0.0, -1)


# ddptrain's own per-window figures, in every step record: e.g. a rank's peak memory would be
# StepFigure("peak_memory_mb", "max", measure=peak_rss_mb) (docs/development.md's recipe).
BUILT_IN: tuple[StepFigure, ...] = ()


def step_figures(declared: dict[str, str]) -> tuple[StepFigure, ...]:
    """ddptrain's own per-window figures, then ``Task.step_figures`` as declarations (checked by
    tasks.protocol.check_step_figures)."""
    return BUILT_IN + tuple(StepFigure(name, combine) for name, combine in declared.items())


@dataclasses.dataclass
class WindowFigures:
    """A window's figures so far over every rank: what a record reports and a snapshot holds."""

    loss_total: float = 0.0
    loss_steps: int = 0
    norm_total: float = 0.0
    norm_steps: int = 0
    windowed: dict[str, tuple[float, float, int]] = dataclasses.field(default_factory=dict)  # by name

    def plus(self, rows: torch.Tensor, tail: torch.Tensor, figures: tuple[StepFigure, ...],
             world_size: int) -> WindowFigures:
        """These figures with a window part's added: ``rows`` (its steps' PER_STEP rows, summed over
        the ranks) and ``tail`` (the per-window figures' columns, summed): a loss that is not finite
        included (the record shows it), a skipped step's left out."""
        counted = rows[:, 2] > 0
        losses, norms = rows[counted, 0], rows[counted, 1].sqrt()
        norms = norms[torch.isfinite(norms)]
        windowed, start = dict(self.windowed), 0
        for figure in figures:
            width = figure.width(world_size)
            windowed[figure.name] = figure.fold(windowed.get(figure.name, StepFigure.nothing()),
                                                tail[start:start + width])
            start += width
        return WindowFigures(self.loss_total + float(losses.sum()), self.loss_steps + len(losses),
                             self.norm_total + float(norms.sum()), self.norm_steps + len(norms), windowed)

    def record(self, figures: tuple[StepFigure, ...]) -> dict[str, Any]:
        """A step record's figures: the mean training loss and gradient norm over the window's steps
        (those that had one), then the per-window figures."""
        entries: dict[str, Any] = {"train_loss": self.loss_total / self.loss_steps if self.loss_steps else math.nan}
        if self.norm_steps and self.norm_total > 0:  # (a strategy that does not measure them: none)
            entries["grad_norm"] = self.norm_total / self.norm_steps
        for figure in figures:
            entries.update(figure.figures(self.windowed.get(figure.name, StepFigure.nothing())))
        return entries

    # In a snapshot (0.6's keys for the loss and norm, so its snapshots resume into the same records)
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"window_loss_total": self.loss_total, "window_loss_steps": self.loss_steps,
                                 "window_grad_norm_total": self.norm_total, "window_grad_norm_steps": self.norm_steps}
        if self.windowed:  # (a run without per-window figures: the table 0.6 wrote)
            state["window_figures"] = {name: list(value) for name, value in self.windowed.items()}
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WindowFigures:
        return cls(state.get("window_loss_total", 0.0), state.get("window_loss_steps", 0),
                   state.get("window_grad_norm_total", 0.0), state.get("window_grad_norm_steps", 0),
                   {name: (float(v[0]), float(v[1]), int(v[2]))
                    for name, v in state.get("window_figures", {}).items()})
