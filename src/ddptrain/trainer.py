"""The Trainer: the tutorial's ``_run_batch`` / ``_run_epoch`` / ``train`` shape, made real.

A step is step.py's ``OptimizerStep.run`` (the tutorial's ``_run_batch``); everything an epoch
does is in ``_run_epoch``, and what it counts is tally.py's ``EpochTally``; an evaluation is
evaluations.py's, the files a finished run leaves final_models.py's. The parts it runs are built
by assembly.py's ``Assembly``, its base class, from the settings' sections; ``fit`` is: resume ->
epochs -> final evaluation -> model.pt. Read it top to bottom.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .assembly import Assembly
from .console import say
from .data import MicroBatch, StreamBatches
from .errors import ConfigError
from .final_models import write_final_models
from .observe.metrics import return_free_memory
from .optim import SchedulerState, build_schedule
from .progress import Action
from .resilience.failures import STEP_NOTE
from .snapshots.best import BEST
from .snapshots.files import snapshot_estimate, space_warning
from .snapshots.uploads import PREEMPTED_UPLOAD_WAIT_S, upload_wait_s

LOSS_DISPLAY_EVERY = 20  # steps between progress-bar loss reads (each read syncs the device)


class Trainer(Assembly):
    """Trains ``task`` on this rank of the job described by ``ctx`` (see docs/api.md)."""

    # --- the loop ------------------------------------------------------------------------------
    def fit(self, *, exiting: bool = False) -> str:
        """Train to ``max_epochs`` or ``max_steps``: ``"finished"``, ``"preempted"`` after a stop
        signal, ``"already_finished"`` when the run dir holds a run that ended there, or
        ``"ended_elsewhere"``: torchft's other replica groups finished the job without this one.
        ``exiting``: the process ends after this call (``ddptrain train``'s ranks), so the
        optimizer's state, once in the last snapshot, is freed before model.pt is gathered."""
        self.stop_signal.listen()
        self.profiler.start()
        try:
            outcome = self._fit(exiting)
        except BaseException:
            # A peer may never answer: leave at once. A rank process that ends after this keeps
            # its SIGTERM handler: the launcher stops every rank once one has failed.
            self.stop_signal.close(wait=False, restore=not exiting)
            self.checkpointer.close(wait=False)
            self.reporter.close("failed")
            if self.uploads is not None:
                self.uploads.close(wait_s=0, at_end=False)  # what is left: named in the mirror's ledger
            raise
        finally:
            self.profiler.close()
            if self.replicas is not None:
                self.replicas.close()
        if outcome == "preempted":
            self.reporter.close("stopped")
        self.stop_signal.close()
        self.checkpointer.close()
        if self.uploads is not None:  # bounded; a store still down is one line (StoreBehind), exit 1
            preempted = outcome == "preempted"  # the grace period is short: the next start syncs the rest
            self.uploads.close(wait_s=min(upload_wait_s(), PREEMPTED_UPLOAD_WAIT_S) if preempted else None,
                               at_end=not preempted)
        self.reporter.closed()  # after the trackers' and the uploads' waits: goodput's end counts them
        return outcome

    def train(self, max_epochs: int | None = None) -> str:
        """The tutorial's name for ``fit``; ``max_epochs`` replaces the config's (and so the schedule's length)."""
        if max_epochs is not None and max_epochs != self.cfg.epochs:
            self.cfg = self.cfg.replace(max_epochs=max_epochs)
            self.cadence = self._cadence()
            self.step.scheduler = build_schedule(self.optimizer, self.cfg.optim, self.run_steps,
                                                 self.task.make_scheduler)
            self.checkpointer.retarget(self.recorded(), SchedulerState(self.step.scheduler))
        return self.fit()

    def _fit(self, exiting: bool) -> str:
        if self.checkpointer.resume():
            if self.cadence.done() and self.cfg.epochs > 0:
                self.reporter.catch_up()
                return "already_finished"
            where = f"epoch {self.progress.epoch}, step {self.progress.global_step}"
            self.reporter.info(f"resumed from {self.checkpointer.start.path}: {where}")  # type: ignore[union-attr]  # resume() found a start
            if isinstance(self.batches, StreamBatches) and not self.batches.stateful and self.progress.step_in_epoch:
                self.reporter.info(f"the training stream has no state_dict(): reading epoch {self.progress.epoch} again"
                                   f" up to step {self.progress.step_in_epoch} (slower, still exact; docs/data.md)")
        if self.replicas is not None and self.replicas.ended_without_us(  # (torchft: map-style sets)
                self.progress.global_step, self.cadence.last_step(self.steps_per_epoch or 0)):
            return "ended_elsewhere"
        resumed_at = None if self.start is None else (self.progress.global_step, self.progress.epoch)
        self.reporter.begin(self.cfg.settings(), resumed_at, self.ctx.world_size, built=self.built, unused=self.unused)
        if self.ctx.rank == 0 and self.cfg.keep > 0:
            low = space_warning(self.run_dir, snapshot_estimate(self.module, self.optimizer, self.average is not None),
                                self.cfg.keep)
            if low:
                self.reporter.info(f"ddptrain: {low}")
        if self.start is None:
            self.reporter.info(f"training {self.cfg.task} on {self.ctx.world_size} rank(s), "
                               f"{self.device.type}/{self.ctx.backend}, global batch {self.global_batch}, "
                               f"{self.steps_per_epoch or 'as many as the stream gives'} steps per epoch")
        if self.cfg.epochs == 0:  # the initial model's evaluation, before epoch 0
            self.reporter.log(self._evaluation(0, final=True))
        self.groups.start(self.progress.global_step)  # torchft's --sync groups meet (a restarted one heals)
        self.records.start()
        # (a one-rank job alone: standing still in the loop is a hang; torchft's groups are not alone)
        self.watchdog.training_begins(alone=self.replicas is None)
        try:
            ended_by = self._run_epochs()
        finally:
            self.watchdog.training_ends()  # (the end's writes and waits take what they take)
        if ended_by == "preempted":
            self._save(last=True)
            self.checkpointer.commit()
            return "preempted"
        if self.best is not None and self.best.stopped:
            self.reporter.info(f"ddptrain: {self.best.stop_line(self.progress.global_step)}; best model: "
                               f"{self.run_dir / BEST / 'model.pt'}")
        self._finish(exiting)
        return "finished"

    def _run_epochs(self) -> str:
        """Epochs until the cadence says the run is done (``"done"``) or a stop signal came (``"preempted"``)."""
        while not self.cadence.done():
            try:
                ended_by = self._run_epoch(self.progress.epoch)
            except Exception as error:  # the failure report names the step it happened in
                error.add_note(f"{STEP_NOTE}{self.progress.global_step + 1}")
                raise
            if ended_by == "preempted":
                return ended_by
            # (ended_by "healed": the state is a live peer's, on from where it stands)
        return "done"

    def _run_epoch(self, epoch: int) -> str:
        """One pass over this rank's shard: ``"done"``, or ``"preempted"`` after a stop signal.
        After each step the cadence says what is due (progress.py): an evaluation, a snapshot,
        leaving the epoch. ``--max-steps`` or ``--early-stop`` may end the run inside an epoch:
        its record then says ``"partial": true``."""
        self.batches.set_epoch(epoch, start_step=self.progress.step_in_epoch)
        # Training mode, whatever mode the factory left (from_pretrained returns eval mode: a
        # LoRA model's base would train without dropout until the first evaluation switched it,
        # and a resume would differ from the run it continues).
        self.model.train()
        self.groups.epoch_started()
        if self.cfg.log_ranks:  # the tutorial's per-rank line (Steps: optimizer steps)
            say(f"{self.ctx.tag} Epoch:{epoch}|Batchsize:{self.cfg.batch_size}|Steps:{self.steps_per_epoch or '?'}")
        self.reporter.epoch_started(epoch, self.steps_per_epoch, self.progress.step_in_epoch)
        since = self.tally.epoch_began()
        action, steps = Action(), self.batches.steps()
        while not action.leaves_epoch and self._train_step(steps):
            action = self.cadence.after_step(*self.stop_signal.check())
            if self.stop_signal.checked:  # every rank's same steps, about twice a second
                self.records.launch()
            if action.evaluate:  # before this step's snapshot: it holds the verdict
                record = self._evaluation(epoch)
                action = self.cadence.judged(action)
                if not self.cadence.epoch_record_follows(epoch, action):  # else the epoch's record carries it
                    self.reporter.log(record)
            if action.save_now:
                self._save()
        self.reporter.epoch_finished()
        if self.groups.healed or action.stop:  # no epoch record next, whose reduction would carry them
            self.records.flush()
        if self.groups.healed:
            return "healed"
        ran_out = not action.leaves_epoch
        if ran_out and self.progress.step_in_epoch == 0:  # (a map-style set is never empty: checked)
            raise ConfigError(f"the training stream gave no sample in epoch {epoch}, on any rank; check its "
                              "source (an empty folder or file list?)")
        if ran_out or self.progress.epoch_over:
            self._end_epoch(epoch, since)
            if action.save_after_record:
                self._save()
        elif action.end:
            self._end_epoch(epoch, since, partial="--max-steps" if self.cadence.steps_reached() else "--early-stop")
        return "preempted" if action.stop else "done"

    def _train_step(self, steps: Iterator[list[tuple[Any, MicroBatch]]]) -> bool:
        """The epoch's next step, if it has one (False: the epoch's data is over, or this replica
        group healed from a peer and the epoch goes on where the peer's state stands)."""
        if self.groups.before_step(self.progress.global_step):  # torchft's every-step quorum: healed
            return False  # this step goes on from the peer's position (its quorum is held)
        fetching = time.perf_counter()
        group = next(steps, None)
        if group is None:  # (a quorum joined here is the next epoch's first step's)
            return False
        stepping = time.perf_counter()
        loss, step_samples = self.step.run(group, self.progress.global_step + 1)
        if step_samples == 0:  # a stream's steps agreed it was over: no rank had a sample
            return False
        self.timings.add_step(stepping - fetching, time.perf_counter() - stepping)
        if self.replicas is not None and not self.replicas.committed:  # nobody took it: a failure's time
            self.reporter.waited(time.perf_counter() - stepping)
        self.progress.step_done(step_samples)
        self.tally.step_done(loss)
        self.records.step_done(loss, self.grad_norms.last(), step_samples)  # (no collective)
        self.records.finish()  # the records launched at the last agreement: their sum ran during this step
        # (--sync local-sgd|diloco: the groups meet inside the step they end, as a profile shows it)
        synced = self.groups.after_step(self.progress.global_step, step_samples)
        self.profiler.step_done()
        shown = loss is not None and self.progress.global_step % LOSS_DISPLAY_EVERY == 0
        self.reporter.step_done(self.progress.global_step,  # the loss shown: rank 0's mean
                               loss * self.ctx.world_size if shown and loss is not None else None)
        if self.groups.healed:  # (in a meeting: the run stands where the peer's does)
            return False
        if synced and self.groups.save_at_sync:  # the snapshot asked for since the last sync
            self._save()
        return True

    # --- epoch ends, evaluation, the end -------------------------------------------------------
    def _end_epoch(self, epoch: int, since: tuple[float, float, int, int], partial: str | None = None) -> None:
        """The epoch's record (tally.py), with its evaluation when one is due. ``partial``: the
        limit that ends the run inside the epoch, which stays where it is."""
        also = {} if self.replicas is None else {"samples_skipped": self.replicas.samples_skipped}  # torchft's
        record = self.tally.epoch_record(epoch, since, self._epoch_samples(partial is not None), partial, **also)
        if self.cadence.evaluate_at_epoch_end(epoch, partial is not None):
            self.groups.now(self.progress.global_step)
            with self._aside("eval"):
                self.evaluations.add_to(record, final=self.cadence.final_evaluation(epoch, partial is not None))
        self.reporter.log(record)
        if partial is None:
            self.tally.next_epoch()

    def _epoch_samples(self, partial: bool) -> int:
        """A whole epoch of a map-style set trains every sample once (so snapshots of 0.3, which
        did not count, resume to the right figure); otherwise, what was counted."""
        if partial or self.steps_per_epoch is None:
            return self.progress.epoch_samples
        return self.batches.epoch_samples  # type: ignore[union-attr]  # map-style here: TrainBatches

    def _evaluation(self, epoch: int, final: bool = False) -> dict[str, Any]:
        """An evaluation record of its own (at the start, or every --eval-every-steps), judged.
        ``final``: the run's last (--max-epochs 0's), over the whole set unless --final-eval same."""
        record = {"kind": "eval", "epoch": epoch, "step": self.progress.global_step}
        self.groups.now(self.progress.global_step)
        with self._aside("eval"):
            self.evaluations.add_to(record, final=final)
        return record

    @contextlib.contextmanager
    def _aside(self, kind: str) -> Iterator[None]:
        """An evaluation's or a snapshot's time: the timeline's (goodput), out of the rates, and not a
        one-rank job's stall (resilience/stall.py)."""
        with self.clock.aside(), self.reporter.timed(kind, self.progress.global_step), self.watchdog.aside():
            yield

    def _save(self, last: bool = False) -> None:
        """A snapshot after the current step, if the checkpointer wants one (every rank calls
        it): the guard checks first, and the epoch's loss so far goes in, reduced over every rank.
        ``last``: the checkpointer's commit follows before anything changes the state."""
        if not self.checkpointer.wants(self.progress.global_step):
            return
        if self.groups.snapshot_waits(self.progress.global_step, last):  # --sync: the groups' weights differ
            return
        with self._aside("snapshot"):
            self.tally.before_snapshot()
            self._share_buffers()
            self.checkpointer.save(self.progress.global_step, last=last)

    def _finish(self, exiting: bool) -> None:
        self.groups.now(self.progress.global_step)
        self._save(last=True)
        self.checkpointer.commit()
        self._share_buffers()  # (a no-op when _save just did it: rare)
        # Spent: their room is model.pt's, gathered whole on rank 0 (under fsdp, without this
        # the end of a run peaked above training: rank 0 held its shards, their Adam moments
        # and the whole model at once). The optimizer's state is in the snapshot just committed.
        self.optimizer.zero_grad(set_to_none=True)
        if exiting:
            self.optimizer.state.clear()
            return_free_memory()  # the moments' blocks are shards: the whole tensors cannot reuse them
        write_final_models(self.strategy, self.module, self.average, self.run_dir, self.uploads)
        with self.watchdog.waiting("the end: waiting for model.pt"):
            dist.barrier()  # model.pt is complete before any rank reports success
        self.reporter.finish(self.progress.global_step)
