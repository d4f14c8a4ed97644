"""The Trainer: the tutorial's ``_run_batch`` / ``_run_epoch`` / ``train`` shape, made real.

The Trainer is given the run's parts (parts.py's ``RunParts``, built from the settings by
``build_parts``) and runs them: ``fit`` is resume -> epochs -> final evaluation -> model.pt. A
step is step.py's ``OptimizerStep.run`` (the tutorial's ``_run_batch``); everything an epoch
does is in ``_run_epoch``, and what it counts is tally.py's ``EpochTally``; an evaluation is
evaluations.py's, the files a finished run leaves final_models.py's. Read it top to bottom.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .comm import DistContext
from .console import say
from .data import MicroBatch, StreamBatches
from .errors import ConfigError
from .final_models import write_final_models
from .observe.metrics import return_free_memory
from .optim import SchedulerState, build_schedule
from .parts import RunParts, build_parts, make_cadence, recorded
from .progress import Action, Progress
from .resilience.failures import STEP_NOTE
from .settings import RunConfig
from .snapshots.best import BEST
from .snapshots.files import snapshot_estimate, space_warning
from .snapshots.uploads import PREEMPTED_UPLOAD_WAIT_S, upload_wait_s
from .tasks.protocol import Task

LOSS_DISPLAY_EVERY = 20  # steps between progress-bar loss reads (each read syncs the device)


class Trainer:
    """Trains ``task`` on this rank of the job described by ``ctx`` (see docs/api.md)."""

    def __init__(self, task: Task, cfg: RunConfig, ctx: DistContext) -> None:
        self.parts: RunParts = build_parts(task, cfg, ctx)

    # what a script reads (docs/api.md)
    @property
    def cfg(self) -> RunConfig:
        return self.parts.cfg

    @property
    def ctx(self) -> DistContext:
        return self.parts.ctx

    @property
    def model(self) -> torch.nn.Module:
        """The model as wrapped (DDP, FSDP2)."""
        return self.parts.model

    @property
    def module(self) -> torch.nn.Module:
        """The model unwrapped."""
        return self.parts.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.optimizer

    @property
    def progress(self) -> Progress:
        return self.parts.progress

    def state_dict(self) -> dict[str, Any]:
        """Everything that makes the next step exactly what it would have been: every part's
        state, as a snapshot holds it (the checkpointer's aggregate)."""
        return self.parts.checkpointer.state_dict()

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
        """``whole``: the model and optimizer tensors are whole (as in a file snapshot), not this rank's shards."""
        self.parts.checkpointer.load_state_dict(state, whole)

    # --- the loop ------------------------------------------------------------------------------
    def fit(self, *, exiting: bool = False) -> str:
        """Train to ``max_epochs`` or ``max_steps``: ``"finished"``, ``"preempted"`` after a stop
        signal, ``"already_finished"`` when the run dir holds a run that ended there, or
        ``"ended_elsewhere"``: torchft's other replica groups finished the job without this one.
        ``exiting``: the process ends after this call (``ddptrain train``'s ranks), so the
        optimizer's state, once in the last snapshot, is freed before model.pt is gathered."""
        parts = self.parts
        parts.stop_signal.listen()
        parts.profiler.start()
        try:
            outcome = self._fit(exiting)
        except BaseException:
            # A peer may never answer: leave at once. A rank process that ends after this keeps
            # its SIGTERM handler: the launcher stops every rank once one has failed.
            parts.stop_signal.close(wait=False, restore=not exiting)
            parts.checkpointer.close(wait=False)
            parts.reporter.close("failed")
            if parts.uploads is not None:
                parts.uploads.close(wait_s=0, at_end=False)  # what is left: named in the mirror's ledger
            raise
        finally:
            parts.profiler.close()
            if parts.replicas is not None:
                parts.replicas.close()
        if outcome == "preempted":
            parts.reporter.close("stopped")
        parts.stop_signal.close()
        parts.checkpointer.close()
        if parts.uploads is not None:  # bounded; a store still down is one line (StoreBehind), exit 1
            preempted = outcome == "preempted"  # the grace period is short: the next start syncs the rest
            parts.uploads.close(wait_s=min(upload_wait_s(), PREEMPTED_UPLOAD_WAIT_S) if preempted else None,
                                at_end=not preempted)
        parts.reporter.closed()  # after the trackers' and the uploads' waits: goodput's end counts them
        return outcome

    def train(self, max_epochs: int | None = None) -> str:
        """The tutorial's name for ``fit``; ``max_epochs`` replaces the config's (and so the schedule's length)."""
        parts = self.parts
        if max_epochs is not None and max_epochs != parts.cfg.epochs:
            parts.cfg = parts.cfg.replace(max_epochs=max_epochs)
            parts.cadence = make_cadence(parts.cfg, parts.progress, parts.task.eval_set is not None, parts.best)
            parts.step.scheduler = build_schedule(parts.optimizer, parts.cfg.optim, parts.run_steps,
                                                  parts.task.make_scheduler)
            parts.checkpointer.retarget(recorded(parts.cfg, parts.ctx.world_size, parts.task),
                                        SchedulerState(parts.step.scheduler),
                                        parts.cadence.save_at)
        return self.fit()

    def _fit(self, exiting: bool) -> str:
        parts, progress, reporter = self.parts, self.parts.progress, self.parts.reporter
        if parts.checkpointer.resume():
            if parts.cadence.done() and parts.cfg.epochs > 0:
                reporter.catch_up()
                return "already_finished"
            where = f"epoch {progress.epoch}, step {progress.global_step}"
            reporter.info(f"resumed from {parts.checkpointer.start.path}: {where}")  # type: ignore[union-attr]  # resume() found a start
            if isinstance(parts.batches, StreamBatches) and not parts.batches.stateful and progress.step_in_epoch:
                reporter.info(f"the training stream has no state_dict(): reading epoch {progress.epoch} again"
                              f" up to step {progress.step_in_epoch} (slower, still exact; docs/data.md)")
        if parts.replicas is not None and parts.replicas.ended_without_us(  # (torchft: map-style sets)
                progress.global_step, parts.cadence.last_step(parts.steps_per_epoch or 0)):
            return "ended_elsewhere"
        resumed_at = None if parts.start is None else (progress.global_step, progress.epoch)
        reporter.begin(parts.cfg.settings(), resumed_at, parts.ctx.world_size, built=parts.built, unused=parts.unused)
        if parts.ctx.rank == 0 and parts.cfg.keep > 0:
            low = space_warning(parts.run_dir, snapshot_estimate(parts.module, parts.optimizer,
                                                                 parts.average is not None), parts.cfg.keep)
            if low:
                reporter.info(f"ddptrain: {low}")
        if parts.start is None:
            reporter.info(f"training {parts.cfg.task} on {parts.ctx.world_size} rank(s), "
                          f"{parts.device.type}/{parts.ctx.backend}, global batch {parts.global_batch}, "
                          f"{parts.steps_per_epoch or 'as many as the stream gives'} steps per epoch")
        if parts.cfg.epochs == 0:  # the initial model's evaluation, before epoch 0
            reporter.log(self._evaluation(0, final=True))
        elif parts.cfg.eval_at_start and parts.start is None:
            reporter.log(self._evaluation(0))
        parts.groups.start(progress.global_step)  # torchft's --sync groups meet (a restarted one heals)
        parts.records.start()
        # (a one-rank job alone: standing still in the loop is a hang; torchft's groups are not alone)
        parts.watchdog.training_begins(alone=parts.replicas is None)
        try:
            ended_by = self._run_epochs()
        finally:
            parts.watchdog.training_ends()  # (the end's writes and waits take what they take)
        if ended_by == "preempted":
            self._save(last=True)
            parts.checkpointer.commit()
            return "preempted"
        if parts.best is not None and parts.best.stopped:
            reporter.info(f"ddptrain: {parts.best.stop_line(progress.global_step)}; best model: "
                          f"{parts.run_dir / BEST / 'model.pt'}")
        self._finish(exiting)
        return "finished"

    def _run_epochs(self) -> str:
        """Epochs until the cadence says the run is done (``"done"``) or a stop signal came (``"preempted"``)."""
        while not self.parts.cadence.done():
            try:
                ended_by = self._run_epoch(self.parts.progress.epoch)
            except Exception as error:  # the failure report names the step it happened in
                error.add_note(f"{STEP_NOTE}{self.parts.progress.global_step + 1}")
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
        parts, progress = self.parts, self.parts.progress
        parts.batches.set_epoch(epoch, start_step=progress.step_in_epoch)
        # Training mode, whatever mode the factory left (from_pretrained returns eval mode: a
        # LoRA model's base would train without dropout until the first evaluation switched it,
        # and a resume would differ from the run it continues).
        parts.model.train()
        parts.groups.epoch_started()
        if parts.cfg.log_ranks:  # the tutorial's per-rank line (Steps: optimizer steps)
            say(f"{parts.ctx.tag} Epoch:{epoch}|Batchsize:{parts.cfg.batch_size}|Steps:{parts.steps_per_epoch or '?'}")
        parts.reporter.epoch_started(epoch, parts.steps_per_epoch, progress.step_in_epoch)
        since = parts.tally.epoch_began()
        action, steps = Action(), parts.batches.steps()
        while not action.leaves_epoch and self._train_step(steps):
            action = parts.cadence.after_step(*parts.stop_signal.check())
            if parts.stop_signal.checked:  # every rank's same steps, about twice a second
                parts.records.launch()
            if action.evaluate:  # before this step's snapshot: it holds the verdict
                record = self._evaluation(epoch)
                action = parts.cadence.judged(action)
                if not parts.cadence.epoch_record_follows(epoch, action):  # else the epoch's record carries it
                    parts.reporter.log(record)
            if action.save_now:
                self._save()
        parts.reporter.epoch_finished()
        if parts.groups.healed or action.stop:  # no epoch record next, whose reduction would carry them
            parts.records.flush()
        if parts.groups.healed:
            return "healed"
        ran_out = not action.leaves_epoch
        if ran_out and progress.step_in_epoch == 0:  # (a map-style set is never empty: checked)
            raise ConfigError(f"the training stream gave no sample in epoch {epoch}, on any rank; check its "
                              "source (an empty folder or file list?)")
        if ran_out or progress.epoch_over:
            self._end_epoch(epoch, since)
            if action.save_after_record:
                self._save()
        elif action.end:
            self._end_epoch(epoch, since, partial="--max-steps" if parts.cadence.steps_reached() else "--early-stop")
        return "preempted" if action.stop else "done"

    def _train_step(self, steps: Iterator[list[tuple[Any, MicroBatch]]]) -> bool:
        """The epoch's next step, if it has one (False: the epoch's data is over, or this replica
        group healed from a peer and the epoch goes on where the peer's state stands)."""
        parts, progress = self.parts, self.parts.progress
        if parts.groups.before_step(progress.global_step):  # torchft's every-step quorum: healed
            return False  # this step goes on from the peer's position (its quorum is held)
        fetching = time.perf_counter()
        group = next(steps, None)
        if group is None:  # (a quorum joined here is the next epoch's first step's)
            return False
        stepping = time.perf_counter()
        loss, step_samples = parts.step.run(group, progress.global_step + 1)
        if step_samples == 0:  # a stream's steps agreed it was over: no rank had a sample
            return False
        parts.timings.add_step(stepping - fetching, time.perf_counter() - stepping)
        if parts.replicas is not None and not parts.replicas.committed:  # nobody took it: a failure's time
            parts.reporter.waited(time.perf_counter() - stepping)
        progress.step_done(step_samples)
        parts.tally.step_done(loss)
        parts.records.step_done(loss, parts.grad_norms.last(), step_samples, parts.step.figures)  # (no collective)
        parts.records.finish()  # the records launched at the last agreement: their sum ran during this step
        # (--sync local-sgd|diloco: the groups meet inside the step they end, as a profile shows it)
        synced = parts.groups.after_step(progress.global_step, step_samples)
        parts.profiler.step_done()
        shown = loss is not None and progress.global_step % LOSS_DISPLAY_EVERY == 0
        parts.reporter.step_done(progress.global_step,  # the loss shown: rank 0's mean
                                 loss * parts.ctx.world_size if shown and loss is not None else None)
        if parts.groups.healed:  # (in a meeting: the run stands where the peer's does)
            return False
        if synced and parts.groups.save_at_sync:  # the snapshot asked for since the last sync
            self._save()
        return True

    # --- epoch ends, evaluation, the end -------------------------------------------------------
    def _end_epoch(self, epoch: int, since: tuple[float, float, int, int], partial: str | None = None) -> None:
        """The epoch's record (tally.py), with its evaluation when one is due. ``partial``: the
        limit that ends the run inside the epoch, which stays where it is."""
        parts = self.parts
        also = {} if parts.replicas is None else {"samples_skipped": parts.replicas.samples_skipped}  # torchft's
        record = parts.tally.epoch_record(epoch, since, self._epoch_samples(partial is not None), partial, **also)
        if parts.cadence.evaluate_at_epoch_end(epoch, partial is not None):
            parts.groups.now(parts.progress.global_step)
            with self._aside("eval"):
                parts.evaluations.add_to(record, final=parts.cadence.final_evaluation(epoch, partial is not None))
        parts.reporter.log(record)
        if partial is None:
            parts.tally.next_epoch()

    def _epoch_samples(self, partial: bool) -> int:
        """A whole epoch of a map-style set trains every sample once (so snapshots of 0.3, which
        did not count, resume to the right figure); otherwise, what was counted."""
        if partial or self.parts.steps_per_epoch is None:
            return self.parts.progress.epoch_samples
        return self.parts.batches.epoch_samples  # type: ignore[union-attr]  # map-style here: TrainBatches

    def _evaluation(self, epoch: int, final: bool = False) -> dict[str, Any]:
        """An evaluation record of its own (at the start, or every --eval-every-steps), judged.
        ``final``: the run's last (--max-epochs 0's), over the whole set unless --final-eval same."""
        record = {"kind": "eval", "epoch": epoch, "step": self.parts.progress.global_step}
        self.parts.groups.now(self.parts.progress.global_step)
        with self._aside("eval"):
            self.parts.evaluations.add_to(record, final=final)
        return record

    @contextlib.contextmanager
    def _aside(self, kind: str) -> Iterator[None]:
        """An evaluation's or a snapshot's time: the timeline's (goodput), out of the rates, and not a
        one-rank job's stall (resilience/stall.py)."""
        parts = self.parts
        with parts.clock.aside(), parts.reporter.timed(kind, parts.progress.global_step), parts.watchdog.aside():
            yield

    def _save(self, last: bool = False) -> None:
        """A snapshot after the current step, if the checkpointer wants one (every rank calls
        it): the guard checks first, and the epoch's loss so far goes in, reduced over every rank.
        ``last``: the checkpointer's commit follows before anything changes the state."""
        parts, step = self.parts, self.parts.progress.global_step
        if not parts.checkpointer.wants(step):
            return
        if parts.groups.snapshot_waits(step, last):  # --sync: the groups' weights differ
            return
        with self._aside("snapshot"):
            parts.tally.before_snapshot()
            parts.share_buffers()
            parts.checkpointer.save(step, last=last)

    def _finish(self, exiting: bool) -> None:
        parts = self.parts
        parts.groups.now(parts.progress.global_step)
        self._save(last=True)
        parts.checkpointer.commit()
        parts.share_buffers()  # (a no-op when _save just did it: rare)
        # Spent: their room is model.pt's, gathered whole on rank 0 (under fsdp, without this
        # the end of a run peaked above training: rank 0 held its shards, their Adam moments
        # and the whole model at once). The optimizer's state is in the snapshot just committed.
        parts.optimizer.zero_grad(set_to_none=True)
        if exiting:
            parts.optimizer.state.clear()
            return_free_memory()  # the moments' blocks are shards: the whole tensors cannot reuse them
        write_final_models(parts.strategy, parts.module, parts.average, parts.run_dir, parts.uploads)
        with parts.watchdog.waiting("the end: waiting for model.pt"):
            dist.barrier()  # model.pt is complete before any rank reports success
        parts.reporter.finish(parts.progress.global_step)
