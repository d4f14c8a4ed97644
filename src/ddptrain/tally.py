"""What an epoch keeps count of on every rank (the tutorial printed none of it): the loss, the
gradient norms, the timings, memory and FLOPs, summed over the ranks in one all-reduce at each
snapshot (the epoch's loss so far goes in) and at the epoch's end, where they become its record
in metrics.jsonl. The same all-reduce carries the guard's question: is every rank's loss and
every weight finite? The Trainer (trainer.py) decides when; this module decides what is counted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from .comm import DistContext, sum_over_ranks
from .observe.metrics import (
    EpochLosses,
    GradNorms,
    RankTimings,
    memory_record,
    model_state_mb,
    peak_rss_mb,
    timing_record,
)
from .observe.step_records import StepRecords
from .observe.throughput import FlopCount, TrainingClock, throughput_record
from .parallel.averaging import WeightAverage
from .progress import Progress
from .resilience.guard import NonFiniteGuard, local_all_finite


@dataclasses.dataclass
class EpochTally:
    """The epoch's counters (``losses``, ``grad_norms``, ``timings``, ``flops``) and what a
    record reads beside them: where the run stands, the optimizer (its rate; its state's size),
    the parameters (finite?), the weight average's size. ``newest_snapshot``: where a run whose
    weights went bad can go back to (the guard names it)."""

    ctx: DistContext
    progress: Progress
    losses: EpochLosses
    grad_norms: GradNorms
    timings: RankTimings
    flops: FlopCount
    guard: NonFiniteGuard
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    average: WeightAverage | None
    newest_snapshot: Callable[[], str | None]
    tokens_per_sample: int | None
    peak_tflops: float | None
    records: StepRecords  # --log-every's step records: the open window is summed here too, and closed ones carried
    clock: TrainingClock  # training time alone: rates leave evaluations and snapshots out
    first_step_at: float | None = None  # wall clock of the first step (start-up benchmarks)
    first_step_reported: bool = False

    def step_done(self, loss: torch.Tensor | None) -> None:
        """A step's loss (None: skipped as not finite, --skip-nonfinite)."""
        if loss is None:
            self.guard.skip(self.progress.global_step)
        else:
            self.losses.add(loss)
        self.first_step_at = self.first_step_at or time.time()

    def before_snapshot(self) -> None:
        """The epoch's (and the step window's) loss and gradient norms so far, summed over the
        ranks: a resume mid-epoch writes the same records. The guard checks first: nothing
        non-finite is saved."""
        reduced = self.reduce()
        self.losses.note_reduced(float(reduced["loss_total"]), int(reduced["loss_steps"]))
        self.grad_norms.figures(reduced["grad_squares"])  # (kept for the snapshot)

    def epoch_began(self) -> tuple[float, float, int, int]:
        """Where this process began the epoch: the wall clock, the training clock, the step and the samples."""
        return time.perf_counter(), self.clock.now(), self.progress.step_in_epoch, self.progress.epoch_samples

    def epoch_record(self, epoch: int, since: tuple[float, float, int, int], samples: int,
                     partial: str | None = None, **also: Any) -> dict[str, Any]:
        """The epoch's record (``samples``: trained in the epoch over every rank; the rates: this
        process's training alone, evaluations and snapshots left out, since ``since``, from
        ``epoch_began``). ``partial``: the limit that ends the run inside the epoch. ``also``: the
        caller's figures (torchft's skipped samples), placed before the skipped steps."""
        wall, seconds = time.perf_counter() - since[0], self.clock.now() - since[1]
        steps, trained = self.progress.step_in_epoch - since[2], self.progress.epoch_samples - since[3]
        reduced = self.reduce(with_figures=True)
        loss_steps = int(reduced["loss_steps"])
        per_rank = reduced["figures"].tolist()  # each rank's row: 3 timings, 2 memory figures, FLOPs per step
        job_flops = sum(row[5] for row in per_rank)
        record: dict[str, Any] = {
            "kind": "epoch", "epoch": epoch, "step": self.progress.global_step,
            "train_loss": float(reduced["loss_total"]) / loss_steps if loss_steps else float("nan"),
            "lr": self.optimizer.param_groups[0]["lr"], **self.grad_norms.figures(reduced["grad_squares"]),
            "samples_per_s": round(trained / seconds, 1) if seconds > 0 else None,
            "epoch_time_s": round(wall, 3), "samples": samples, "time": round(time.time(), 3),
            **throughput_record(trained, seconds, steps, job_flops, self.tokens_per_sample, self.peak_tflops,
                                self.ctx.world_size),
            **timing_record([row[:3] for row in per_rank]),
            "memory_mb": memory_record([row[3:5] for row in per_rank]),
        }
        if partial:
            record["partial"], record["ended_by"] = True, partial
        record.update(also)
        skipped = self.guard.skipped_after(self.progress.global_step - self.progress.step_in_epoch)
        if skipped:
            record["skipped_steps"] = skipped
        if not self.first_step_reported and self.first_step_at is not None:
            record["first_step_at"] = self.first_step_at
            self.first_step_reported = True
        return record

    def next_epoch(self) -> None:
        self.progress.next_epoch()
        self.losses.reset(first_step=self.progress.global_step)
        self.grad_norms.reset()

    def reduce(self, with_figures: bool = False) -> dict[str, torch.Tensor]:
        """One all-reduce: the epoch's loss sums, whether every rank's losses and weights are
        finite, and (at epoch ends) every rank's timings, memory and FLOPs per step, a row per rank. Raises
        NonFiniteError, before anything is saved or evaluated, when a loss or a weight is not finite."""
        self.records.finish()  # (the step records launched: theirs first)
        waiting = self.records.parts()  # closed windows' parts: their records' sums come with this reduction
        world, rank, device = self.ctx.world_size, self.ctx.rank, self.ctx.device
        first_bad_step = torch.zeros(world, dtype=torch.float64, device=device)
        figures = torch.zeros(world, 6, dtype=torch.float64, device=device)
        first_bad_step[rank] = self.losses.first_nonfinite_step()
        if with_figures:
            figures[rank] = torch.tensor([*self.timings.take(self.ctx.watchdog.take_waited()), peak_rss_mb(),
                                          model_state_mb(self.params, self.optimizer,
                                                         self.average.local_bytes() if self.average else 0),
                                          self.flops.per_step or 0])
        reduced = sum_over_ranks({
            "loss_total": self.losses.local_sum(),
            # the ranks' parts add up to a step's loss: rank 0 alone counts the steps
            "loss_steps": torch.tensor(self.losses.local_steps() if self.ctx.is_main else 0),
            "bad_weights": ~local_all_finite(self.params),  # ranks whose weights are not finite
            "first_bad_step": first_bad_step, "figures": figures, "grad_squares": self.grad_norms.local_squares(),
            "window": self.records.window.local_part(), **({"records": waiting} if waiting is not None else {}),
        }, self.ctx.watchdog, "summing the loss over the ranks", self.progress.global_step)
        self.records.window.fold(reduced["window"])  # (a snapshot holds the open window's figures so far)
        if waiting is not None:
            self.records.write_summed(reduced["records"])
        self.guard.check([int(s) for s in reduced["first_bad_step"].tolist()], int(reduced["bad_weights"]) == 0,
                         self.progress.global_step, self.progress.epoch, self.newest_snapshot())
        return reduced
