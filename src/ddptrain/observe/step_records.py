"""Step records (--log-every N): every N optimizer steps, the mean training loss over them (every
rank's part of each step, as the optimizer saw it), the gradient norm, the rate, and the
throughput of training alone, as nanoGPT's ``iter N: loss`` line and Lightning's
``log_every_n_steps`` give them.

Each step's loss part and gradient norm stay on the device (a copy, no host sync). When a window
of N steps closes, its rows wait: summing them over the ranks is one all-reduce, and one every 10
steps cost 5-9% of the tutorial job's 2 ms steps on 2 CPU ranks (measured, `ddptrain bench`), as
much as a step. So the closed windows are summed together in one asynchronous all-reduce at the
stop agreement's steps (resilience/stop_signals.py: every rank at the same steps, about twice a
second), read at the next step, or with the epoch's or a snapshot's own reduction, whichever
comes first: a record is written within about half a second of its step, at the same steps on
every run. A snapshot holds the open window's figures so far (``StepWindow.fold``), so a run
resumed inside a window writes the record the uninterrupted run writes. What a record's figures
are, and how ranks and steps combine them, step_figures.py declares (a task's own among them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import DistContext
from ..progress import Progress
from .step_figures import PER_STEP, StepFigure, WindowFigures
from .throughput import FlopCount, TrainingClock, throughput_record


class StepWindow:
    """The steps since the last step record (--log-every N): each step's loss (this rank's part)
    and gradient norm (GradNorms', this rank's), kept on the device, the per-window figures'
    running values, and the samples and steps this process trained in it. A step record ``take``s them
    (their sum over the ranks is the record's); a snapshot's reduction ``fold``s them into the
    window's figures so far, which the snapshot holds, so that a run resumed inside a window
    writes the record the uninterrupted run writes."""

    def __init__(self, device: torch.device, every: int, figures: tuple[StepFigure, ...] = (), rank: int = 0,
                 world_size: int = 1) -> None:
        self.device, self.every, self.figures, self.rank, self.world_size = device, every, figures, rank, world_size
        self.slots = torch.zeros(max(1, every), len(PER_STEP), dtype=torch.float64, device=device)  # a row a step
        self.reset()

    def reset(self, carried: WindowFigures | None = None) -> None:
        """``carried``: the window's figures over every rank for its steps before a snapshot."""
        self.count, self.carried = 0, carried or WindowFigures()
        self.running = {figure.name: figure.start(self.device) for figure in self.figures}
        self.samples = self.steps = 0  # trained by this process in the window (a resumed one: since the resume)

    def add(self, loss: torch.Tensor | None, grad_norm: torch.Tensor,
            figures: dict[str, torch.Tensor] | None = None) -> None:
        """A step's loss part (None: a skipped step, which has none), this rank's gradient norm, and
        this rank's values of the task's figures (those it had); ddptrain's own are measured here."""
        if self.every == 0:  # --log-every 0: no step records
            return
        if self.count == len(self.slots):  # (a logging step missed: a torchft group healed in it)
            self.slots = torch.cat([self.slots, torch.zeros_like(self.slots)])
        row = self.slots[self.count]
        if loss is not None:
            row[0] = loss.detach()  # no host sync: copies on the device
            row[2] = 1.0
        row[1] = grad_norm
        self.count += 1
        for figure in self.figures:
            if figure.measure is not None:
                figure.add(self.running[figure.name], torch.tensor(figure.measure(), dtype=torch.float64,
                                                                   device=self.device))
            elif figures and figure.name in figures:
                figure.add(self.running[figure.name], figures[figure.name])

    def trained(self, samples: int) -> None:
        """A step of ``samples`` (over every rank) trained by this process."""
        self.samples, self.steps = self.samples + samples, self.steps + 1

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def local_part(self) -> torch.Tensor:
        """The window since the last fold, for a sum over the ranks: its steps' rows (loss part,
        gradient norm squared, has a loss), then the task figures' columns."""
        rows = self.slots[:self.count].clone()
        rows[:, 1] = rows[:, 1].square()
        tail = [figure.local(self.running[figure.name], self.rank, self.world_size) for figure in self.figures]
        return torch.cat([rows.reshape(-1), *tail])

    def with_part(self, carried: WindowFigures, summed: torch.Tensor) -> WindowFigures:
        """``carried`` with ``summed`` (a ``local_part()`` summed over the ranks) added."""
        steps = (len(summed) - sum(f.width(self.world_size) for f in self.figures)) // len(PER_STEP)
        rows = summed[:steps * len(PER_STEP)].reshape(steps, len(PER_STEP))
        return carried.plus(rows, summed[steps * len(PER_STEP):], self.figures, self.world_size)

    def fold(self, summed: torch.Tensor) -> None:
        """``summed``: ``local_part()`` summed over the ranks, added to the window's figures so far
        (kept for the next snapshot and the record); the slots are free again."""
        self.carried = self.with_part(self.carried, summed)
        self.count = 0
        self.slots.zero_()
        self.running = {figure.name: figure.start(self.device) for figure in self.figures}

    def take(self) -> tuple[torch.Tensor, WindowFigures, int, int]:
        """The window for its record: (its part since the last fold, its figures so far, the samples
        and steps this process trained in it); a new window begins."""
        taken = (self.local_part(), self.carried, self.samples, self.steps)
        self.slots.zero_()
        self.reset()
        return taken

    # In a snapshot: the window's figures so far over every rank (folded just before saving).
    def state_dict(self) -> dict[str, Any]:
        return self.carried.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(WindowFigures.from_state(state))


@dataclasses.dataclass
class ClosedWindow:
    """A window whose N steps are done, its record waiting for the sum over the ranks: its part
    (this rank's), its figures before it (a snapshot's fold), where it ended (epoch, step, rate,
    time) and this process's training in it (samples, steps, seconds)."""

    part: torch.Tensor
    carried: WindowFigures
    place: dict[str, Any]
    samples: int
    steps: int
    seconds: float


class StepRecords:
    """The run's step records: ``step_done`` after every step (a window closes every N), ``launch``
    at the stop agreement's steps, ``finish`` at the next step, ``flush`` where a run stops
    between; ``parts``/``write_summed`` let another reduction carry the closed windows. Every rank
    calls them at the same steps; ``write`` (rank 0's reporter) takes each record."""

    def __init__(self, window: StepWindow, ctx: DistContext, progress: Progress, clock: TrainingClock,
                 flops: FlopCount, optimizer: torch.optim.Optimizer, *, tokens_per_sample: int | None,
                 peak_tflops: float | None, write: Callable[[dict[str, Any]], None]) -> None:
        self.window, self.ctx, self.progress, self.clock, self.flops = window, ctx, progress, clock, flops
        self.optimizer, self.tokens_per_sample, self.peak_tflops, self.write = (optimizer, tokens_per_sample,
                                                                                peak_tflops, write)
        self.closed: list[ClosedWindow] = []
        self.pending: tuple[Any, torch.Tensor, list[ClosedWindow]] | None = None  # (work, its tensor, its windows)
        self.began = 0.0  # the training clock when this process began the open window

    def start(self) -> None:
        """Training (re)starts here: the open window's time counts from now."""
        self.began = self.clock.now()

    def step_done(self, loss: torch.Tensor | None, grad_norm: torch.Tensor, samples: int,
                  figures: dict[str, torch.Tensor] | None = None) -> None:
        """A step's loss part (None: skipped as not finite), this rank's gradient norm, the step's
        samples over every rank and this rank's task figures; at every N-th step the window closes
        (no collective)."""
        self.window.add(loss, grad_norm, figures)
        self.window.trained(samples)
        if not self.window.due(self.progress.global_step):
            return
        now = self.clock.now()
        part, carried, samples, steps = self.window.take()
        place = {"epoch": self.progress.epoch, "step": self.progress.global_step,
                 "lr": self.optimizer.param_groups[0]["lr"], "time": round(time.time(), 3)}
        self.closed.append(ClosedWindow(part, carried, place, samples, steps, now - self.began))
        self.began = now

    def launch(self) -> None:
        """At a stop agreement's step (every rank's same): the closed windows' sum over the ranks
        starts, with the job's FLOPs per step; ``finish`` writes their records."""
        if not self.closed or self.pending is not None:
            return
        flat = self.parts()
        assert flat is not None
        work = dist.all_reduce(flat, async_op=True) if self.ctx.world_size > 1 else None
        self.pending, self.closed = (work, flat, self.closed), []

    def finish(self) -> None:
        """The launched windows' records, once their all-reduce is done (it ran during a step)."""
        if self.pending is None:
            return
        work, flat, windows = self.pending
        self.pending = None
        if work is not None:
            with self.ctx.watchdog.waiting("summing the logged steps' loss over the ranks", self.progress.global_step):
                work.wait()
        self._write(flat.cpu(), windows)

    def flush(self) -> None:
        """Every record of a closed window written now (a run that stops between epoch ends)."""
        self.finish()
        self.launch()
        self.finish()

    def parts(self) -> torch.Tensor | None:
        """The closed windows' parts and the FLOPs per step, as one tensor for a reduction to carry
        (None: no window waits); ``write_summed`` writes their records from its sum."""
        if not self.closed:
            return None
        flops = torch.tensor([float(self.flops.per_step or 0)], dtype=torch.float64, device=self.closed[0].part.device)
        return torch.cat([*(window.part for window in self.closed), flops])

    def write_summed(self, summed: torch.Tensor) -> None:
        """``parts()`` summed over the ranks, by another reduction: the closed windows' records."""
        windows, self.closed = self.closed, []
        self._write(summed.cpu(), windows)

    def _write(self, summed: torch.Tensor, windows: list[ClosedWindow]) -> None:
        job_flops, start = float(summed[-1]), 0
        for window in windows:
            part = summed[start:start + window.part.numel()]
            start += window.part.numel()
            seconds, samples, place = window.seconds, window.samples, window.place
            self.write({
                "kind": "step", "epoch": place["epoch"], "step": place["step"],
                **self.window.with_part(window.carried, part).record(self.window.figures), "lr": place["lr"],
                "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None,
                **throughput_record(samples, seconds, window.steps, job_flops, self.tokens_per_sample,
                                    self.peak_tflops, self.ctx.world_size),
                "time": place["time"]})
