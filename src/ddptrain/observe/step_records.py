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
resumed inside a window writes the record the uninterrupted run writes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import DistContext
from ..progress import Progress
from .throughput import FlopCount, TrainingClock, throughput_record

Figures = tuple[float, int, float, int]  # (loss sum, its steps, gradient norm sum, its steps), over every rank


class StepWindow:
    """The steps since the last step record (--log-every N): each step's loss (this rank's part)
    and gradient norm (GradNorms', this rank's), kept on the device, and the samples and steps this
    process trained in it. A step record ``take``s them (their sum over the ranks is the record's);
    a snapshot's reduction ``fold``s them into the window's figures so far, which the snapshot
    holds, so that a run resumed inside a window writes the record the uninterrupted run writes."""

    def __init__(self, device: torch.device, every: int) -> None:
        self.device, self.every = device, every
        # a row a step: (loss part, gradient norm, 1 where the step has a loss: not skipped as non-finite)
        self.slots = torch.zeros(max(1, every), 3, dtype=torch.float64, device=device)
        self.reset()

    def reset(self, carried: Figures = (0.0, 0, 0.0, 0)) -> None:
        """``carried``: (loss sum, its steps, gradient norm sum, its steps) over every rank, for the
        window's steps before a snapshot."""
        self.count, self.carried = 0, carried
        self.samples = self.steps = 0  # trained by this process in the window (a resumed one: since the resume)

    def add(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        """A step's loss part (None: a skipped step, which has none) and this rank's gradient norm."""
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

    def trained(self, samples: int) -> None:
        """A step of ``samples`` (over every rank) trained by this process."""
        self.samples, self.steps = self.samples + samples, self.steps + 1

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def local_rows(self) -> torch.Tensor:
        """The window's steps since the last fold: (loss part, gradient norm squared, has a loss)."""
        rows = self.slots[:self.count].clone()
        rows[:, 1] = rows[:, 1].square()
        return rows

    def fold(self, summed: torch.Tensor) -> None:
        """``summed``: ``local_rows()`` summed over the ranks, added to the window's figures so far
        (kept for the next snapshot and the record); the slots are free again."""
        self.carried = add_rows(self.carried, summed)
        self.count = 0
        self.slots.zero_()

    def take(self) -> tuple[torch.Tensor, Figures, int, int]:
        """The window for its record: (its rows since the last fold, its figures so far, the samples
        and steps this process trained in it); a new window begins."""
        taken = (self.local_rows(), self.carried, self.samples, self.steps)
        self.slots.zero_()
        self.reset()
        return taken

    # In a snapshot: the window's figures so far over every rank (folded just before saving).
    def state_dict(self) -> dict[str, Any]:
        total, steps, norm_total, norm_steps = self.carried
        return {"window_loss_total": total, "window_loss_steps": steps,
                "window_grad_norm_total": norm_total, "window_grad_norm_steps": norm_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset((state.get("window_loss_total", 0.0), state.get("window_loss_steps", 0),
                    state.get("window_grad_norm_total", 0.0), state.get("window_grad_norm_steps", 0)))


def add_rows(carried: Figures, summed: torch.Tensor) -> Figures:
    """A window's figures so far (loss sum, its steps, gradient norm sum, its steps) with the steps of
    ``summed`` (StepWindow rows summed over the ranks) added: a loss that is not finite included
    (the record shows it), a skipped step's left out."""
    counted = summed[:, 2] > 0
    losses, norms = summed[counted, 0], summed[counted, 1].sqrt()
    norms = norms[torch.isfinite(norms)]
    total, steps, norm_total, norm_steps = carried
    return (total + float(losses.sum()), steps + len(losses), norm_total + float(norms.sum()), norm_steps + len(norms))


def window_figures(carried: Figures) -> dict[str, float]:
    """A step record's mean training loss and gradient norm over its window's steps (those that had one)."""
    total, steps, norm_total, norm_steps = carried
    figures = {"train_loss": total / steps if steps else math.nan}
    if norm_steps and norm_total > 0:  # (a strategy that does not measure them: none)
        figures["grad_norm"] = norm_total / norm_steps
    return figures


@dataclasses.dataclass
class ClosedWindow:
    """A window whose N steps are done, its record waiting for the sum over the ranks: its rows
    (this rank's), its figures before them (a snapshot's fold), where it ended (epoch, step, rate,
    time) and this process's training in it (samples, steps, seconds)."""

    rows: torch.Tensor
    carried: Figures
    place: dict[str, Any]
    samples: int
    steps: int
    seconds: float


class StepRecords:
    """The run's step records: ``step_done`` after every step (a window closes every N), ``launch``
    at the stop agreement's steps, ``finish`` at the next step, ``flush`` where a run stops
    between; ``rows``/``write_summed`` let another reduction carry the closed windows. Every rank
    calls them at the same steps; ``write`` (rank 0's reporter) takes each record."""

    def __init__(self, window: StepWindow, ctx: DistContext, progress: Progress, clock: TrainingClock,
                 flops: FlopCount, optimizer: torch.optim.Optimizer, tokens_per_sample: int | None,
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

    def step_done(self, loss: torch.Tensor | None, grad_norm: torch.Tensor, samples: int) -> None:
        """A step's loss part (None: skipped as not finite), this rank's gradient norm and the step's
        samples over every rank; at every N-th step the window closes (no collective)."""
        self.window.add(loss, grad_norm)
        self.window.trained(samples)
        if not self.window.due(self.progress.global_step):
            return
        now = self.clock.now()
        rows, carried, samples, steps = self.window.take()
        place = {"epoch": self.progress.epoch, "step": self.progress.global_step,
                 "lr": self.optimizer.param_groups[0]["lr"], "time": round(time.time(), 3)}
        self.closed.append(ClosedWindow(rows, carried, place, samples, steps, now - self.began))
        self.began = now

    def launch(self) -> None:
        """At a stop agreement's step (every rank's same): the closed windows' sum over the ranks
        starts, with the job's FLOPs per step; ``finish`` writes their records."""
        if not self.closed or self.pending is not None:
            return
        flat = self.rows()
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

    def rows(self) -> torch.Tensor | None:
        """The closed windows' rows and the FLOPs per step, as one tensor for a reduction to carry
        (None: no window waits); ``write_summed`` writes their records from its sum."""
        if not self.closed:
            return None
        flops = torch.tensor([float(self.flops.per_step or 0)], dtype=torch.float64, device=self.closed[0].rows.device)
        return torch.cat([*(window.rows.reshape(-1) for window in self.closed), flops])

    def write_summed(self, summed: torch.Tensor) -> None:
        """``rows()`` summed over the ranks, by another reduction: the closed windows' records."""
        windows, self.closed = self.closed, []
        self._write(summed.cpu(), windows)

    def _write(self, summed: torch.Tensor, windows: list[ClosedWindow]) -> None:
        job_flops, start = float(summed[-1]), 0
        for window in windows:
            rows = summed[start:start + window.rows.numel()].reshape(-1, 3)
            start += window.rows.numel()
            seconds, samples, place = window.seconds, window.samples, window.place
            self.write({
                "kind": "step", "epoch": place["epoch"], "step": place["step"],
                **window_figures(add_rows(window.carried, rows)), "lr": place["lr"],
                "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None,
                **throughput_record(samples, seconds, window.steps, job_flops, self.tokens_per_sample,
                                    self.peak_tflops, self.ctx.world_size),
                "time": place["time"]})
