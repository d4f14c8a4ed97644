"""The Trainer: the tutorial's ``_run_batch`` / ``_run_epoch`` / ``train`` shape, made real.

A step is step.py's ``OptimizerStep.run`` (the tutorial's ``_run_batch``); everything an epoch
does is in ``_run_epoch``, and what it counts is tally.py's ``EpochTally``; an evaluation is
evaluations.py's, the files a finished run leaves final_models.py's; ``__init__`` builds
every component in six phases (the model, where the run starts, the loop's parts, the
checkpointer, the measures, the step), each needing the ones before it; ``fit`` is: resume ->
epochs -> final evaluation -> model.pt. Read them top to bottom. Each component owns its state
(``state_dict()`` / ``load_state_dict()``); the checkpointer holds them as ``states`` and decides
when a snapshot is written and how a run resumes (snapshots/checkpointer.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .comm import DistContext, apply_step_timeout
from .config import OPTIMIZER_SETTINGS, RunConfig, unset_settings
from .console import say
from .data import EvalBatches, MicroBatch, StreamBatches, eval_subset, is_stream, training_batches
from .errors import ConfigError
from .evaluations import Evaluations
from .final_models import write_final_models
from .group_sync import GroupSync
from .observe.metrics import (
    EpochLosses,
    GradNorms,
    RankTimings,
    return_free_memory,
)
from .observe.ray_train import RayReports
from .observe.report import NullReporter, Reporter
from .observe.step_records import StepRecords, StepWindow
from .observe.throughput import FlopCount, StepProfiler, TrainingClock, device_peak_tflops
from .optim import ScalerState, SchedulerState, build_optimizer, build_schedule, describe_optimizer, run_steps
from .parallel import make_strategy
from .parallel.averaging import WeightAverage
from .parallel.base import ModelAndOptimizer, convert_sync_batchnorm
from .parallel.semi_sync import GroupOptimizers, SemiSync
from .progress import Action, Cadence, Progress
from .resilience.failures import STEP_NOTE
from .resilience.guard import NonFiniteGuard
from .resilience.replicas import ReplicaGroups, data_context
from .resilience.stop_signals import StopSignal
from .run_dir import RunDir
from .snapshots.best import BEST, best_model
from .snapshots.checkpointer import Checkpointer, OneTable
from .snapshots.files import list_snapshots, snapshot_dir, snapshot_estimate, space_warning
from .snapshots.init_from import load_into, read_weights
from .snapshots.restore import restore_point, resumed_config
from .snapshots.uploads import PREEMPTED_UPLOAD_WAIT_S, rank_uploader, upload_wait_s
from .step import OptimizerStep, share_buffers
from .tally import EpochTally
from .tasks.protocol import Task, check_task

LOSS_DISPLAY_EVERY = 20  # steps between progress-bar loss reads (each read syncs the device)


class Trainer:
    """Trains ``task`` on this rank of the job described by ``ctx`` (see docs/api.md)."""

    def __init__(self, task: Task, cfg: RunConfig, ctx: DistContext) -> None:
        check_task(task, cfg.task)
        self.task, self.ctx, self.device = task, ctx, ctx.device
        # config.json: where the task builds its own optimizer, the optimizer settings the user left unset
        # are null (its make_optimizer sees the factory's settings, from before Task.defaults fill them)
        self.unused = unset_settings(cfg, OPTIMIZER_SETTINGS) if task.make_optimizer else ()
        self.cfg = cfg.with_task_defaults(task.defaults).with_run_dir()  # lr, optimizer, ... the user left unset
        self.home = RunDir.of(self.cfg.run_dir)
        self.run_dir = self.home.local  # a run dir on a store: this machine's mirror of it
        self.watchdog = ctx.watchdog
        self._build_model()
        self.reporter = (Reporter(self.cfg, self.run_dir, self.uploads) if ctx.is_main
                         else NullReporter(self.cfg, self.run_dir))
        self._choose_start()
        self._build_loop()
        schedule = build_schedule(self.optimizer, self.cfg, self.steps_per_epoch, task.make_scheduler)
        self.built = describe_optimizer(self.optimizer, schedule)  # config.json: what really trains
        self._build_checkpointer(schedule)
        self._build_measures()
        self._build_step(schedule)

    def _build_model(self) -> None:
        """The strategy, the wrapped model, its optimizer, EMA and gradient scaler."""
        cfg, ctx, task = self.cfg, self.ctx, self.task
        self.strategy = make_strategy(cfg, ctx)
        # a run dir on a store: its files go up behind the training
        self.uploads = rank_uploader(self.home, cfg.keep, ctx,
                                     shards_in_files=self.strategy.snapshot_format == "dcp")
        self.module = task.model  # unwrapped: state_dict, evaluation, model.pt
        if cfg.sync_batchnorm:
            if self.device.type != "cuda":
                raise ConfigError("--sync-batchnorm needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs only); "
                                  "drop it on CPU, where each rank's BatchNorm normalises its own batch")
            self.module = convert_sync_batchnorm(task.model)
        with self.watchdog.waiting("start-up: wrapping the model (rank 0's weights reach every rank)"):
            self.model = self.strategy.wrap(self.module, task)
            # Small control messages (stop flags, RNG states) travel on CPU: gloo even on NCCL jobs.
            self.cpu_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else None
        apply_step_timeout(cfg.timeout)
        self.params = list(self.model.parameters())
        trained = [p for p in self.params if p.requires_grad]  # frozen ones (LoRA's base) need no optimizer state
        self.optimizer = task.make_optimizer(trained) if task.make_optimizer else build_optimizer(trained, cfg)
        self.average = WeightAverage(self.module, cfg.ema, cfg.ema_every) if cfg.ema else None  # --ema
        self.weights = ModelAndOptimizer(self.strategy, self.module, self.optimizer, self.average)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and self.device.type == "cuda")

    def _choose_start(self) -> None:
        """Where the run starts: a snapshot (chosen by rank 0, checked by all), else --init-from's
        weights, else the model as built. It decides the batch size (a resume on another world size
        keeps the snapshot's global batch), and the batch size the data, the epoch and the schedule."""
        # Checked before a fresh start moves an earlier run's files aside: --keep-best's evaluation
        # set and, where the run starts afresh, --init-from's weights (loaded now: every rank reads them).
        self.best = best_model(self.cfg, self.task)
        fresh = self.cfg.resume == "never" or not list_snapshots(snapshot_dir(self.run_dir))  # (a store's: not pulled)
        initialised = self._init_from() if fresh and self.cfg.init_from else None
        self.start = restore_point(self.cfg, self.ctx, self.home, self.module, self.weights.state_dict,
                                   self.watchdog)
        self.cfg = resumed_config(self.start, self.cfg, self.ctx.world_size, self.reporter.info)
        if self.start is None and self.cfg.init_from:  # weights only, before step 0
            self.reporter.info(initialised or self._init_from())
            if self.average is not None:
                self.average.restart()

    def _init_from(self) -> str:
        """--init-from's weights into the model; the line that says what was loaded."""
        return load_into(self.module, read_weights(self.cfg.init_from), self.cfg.init_from, self.cfg.init_from_partial)

    def _build_loop(self) -> None:
        """The batches, what a step and an epoch keep count of, and when things are due."""
        cfg, ctx, task = self.cfg, self.ctx, self.task
        if cfg.fault_tolerance == "torchft" and is_stream(task.train_set):
            raise ConfigError("--fault-tolerance torchft needs a map-style training set for now (a stream's "
                              "shares cannot move between replica groups); drop one of them")
        # (--fault-tolerance torchft: the data is shared over every replica group's ranks)
        self.batches = training_batches(task.train_set, cfg, data_context(cfg, ctx), task.collate_fn, self.cpu_group)
        self.steps_per_epoch = self.batches.steps_per_epoch  # None: a stream's epoch ends when it does
        self.progress = Progress(steps_per_epoch=self.steps_per_epoch)
        self.losses = EpochLosses(self.device, self.steps_per_epoch or 64, carries=ctx.is_main)
        self.grad_norms = GradNorms(self.device, self.steps_per_epoch or 64, carries=ctx.is_main,
                                    counts=self.strategy.counts_gradients)
        self.window = StepWindow(self.device, cfg.log_interval(run_steps(cfg, self.steps_per_epoch)))
        self.guard = NonFiniteGuard(cfg.skip_nonfinite)
        self.evaluations = self._build_evaluations()
        self.cadence = self._cadence()  # what is due after each step

    def _build_evaluations(self) -> Evaluations:
        """The held-out set's evaluations: over the whole set, or --eval-batches' subset with the
        whole set for the run's last (--final-eval full)."""
        cfg, ctx, task = self.cfg, self.ctx, self.task

        def batches(dataset: Any) -> EvalBatches:
            return EvalBatches(dataset, cfg.batch_size, ctx.rank, ctx.world_size, self.device, cfg.workers,
                               task.collate_fn, equal_counts=self.strategy.forward_syncs)

        evaluated = task.eval_set
        if evaluated is not None and cfg.eval_batches:
            evaluated = eval_subset(evaluated, cfg.eval_batches * cfg.batch_size, cfg.seed)
        subset = evaluated is not task.eval_set
        return Evaluations(
            task=task, ctx=ctx, strategy=self.strategy, module=self.module, model=self.model, average=self.average,
            batches=None if evaluated is None else batches(evaluated), subset=subset,
            whole=(lambda: batches(task.eval_set)) if subset and cfg.final_eval == "full" else None,
            best=self.best, run_dir=self.run_dir, uploads=self.uploads, share_buffers=self._share_buffers)

    def _build_checkpointer(self, schedule: Any) -> None:
        """The checkpointer, holding every component's state (``schedule``: the learning rate's
        scheduler, or None), and what may ask for a snapshot: Ray Train, torchft's replica
        groups, a stop signal."""
        cfg, ctx = self.cfg, self.ctx
        self.ray = RayReports(str(cfg.run_dir), ctx.is_main)  # inside a Ray Train worker: reports to Ray
        self.replicas = ReplicaGroups(cfg, ctx, lambda: self.checkpointer.state_dict(),
                                      lambda state: self.checkpointer.load_state_dict(state),
                                      self.reporter.info) if cfg.fault_tolerance == "torchft" else None
        # --sync local-sgd|diloco: the groups are this job's (a mesh of its ranks), or torchft's
        mesh = getattr(self.strategy, "replica_mesh", None)
        self.semi_sync = None if cfg.sync == "every-step" else SemiSync(
            cfg, self.params, self.watchdog, mesh=mesh, groups=self.replicas)
        self.checkpointer = Checkpointer(
            cfg, ctx, self.home, self.strategy, self.watchdog,
            weights=self.weights,
            states={"scheduler": SchedulerState(schedule), "scaler": ScalerState(self.scaler),
                    # one table in the snapshot format: where the run is, the epoch's loss so far, skips
                    "progress": OneTable(self.progress, self.losses, self.grad_norms, self.window, self.guard,
                                         *[part for part in (self.best, self.replicas) if part is not None]),
                    **({"semi_sync": self.semi_sync} if self.semi_sync is not None else {})},
            per_rank={**({"data": self.batches} if isinstance(self.batches, StreamBatches) else {}),
                      **({"group_optimizers": GroupOptimizers(self.optimizer, mesh, ctx)} if mesh is not None else {})},
            start=self.start, group=self.cpu_group, uploads=self.uploads,
            on_committed=self.ray.committed if self.ray.active else None)
        self.groups = GroupSync(self.replicas, self.semi_sync, self.reporter.waited)
        self.stop_signal = StopSignal(self.cpu_group, self.checkpointer.due_by_time if ctx.is_main else None,
                                      self.watchdog)

    def _build_measures(self) -> None:
        """Timings, FLOPs, the profiler, the epoch's tally (tally.py) and the first step's one-time checks."""
        self.timings = RankTimings(self.params)
        self.flops = FlopCount()  # this rank's FLOPs per step, counted on the first step
        self.clock = TrainingClock()  # rates count training alone (evaluations and snapshots are aside)
        self.profiler = StepProfiler(self.cfg.profile, self.run_dir, self.ctx.rank, self.device)
        if self.strategy.forward_syncs:  # the forward's own collective ends where the inner forward begins
            self.module.register_forward_pre_hook(lambda *_: self.watchdog.depart())
        self.records = StepRecords(  # --log-every
            self.window, self.ctx, self.progress, self.clock, self.flops, self.optimizer, self.task.tokens_per_sample,
            self.cfg.peak_tflops or device_peak_tflops(self.device), write=self.reporter.log_step)
        self.tally = EpochTally(
            ctx=self.ctx, progress=self.progress, losses=self.losses, grad_norms=self.grad_norms,
            timings=self.timings, flops=self.flops, guard=self.guard, params=self.params,
            optimizer=self.optimizer, average=self.average, newest_snapshot=self.checkpointer.newest_path,
            tokens_per_sample=self.task.tokens_per_sample,
            peak_tflops=self.cfg.peak_tflops or device_peak_tflops(self.device), records=self.records, clock=self.clock)

    def _build_step(self, schedule: Any) -> None:
        """The optimizer step (step.py): what it reads and changes (the schedule is its alone
        to step), and what it reports to."""
        self.step = OptimizerStep(
            task=self.task, ctx=self.ctx, strategy=self.strategy, model=self.model, module=self.module,
            params=self.params, optimizer=self.optimizer, scheduler=schedule, scaler=self.scaler,
            average=self.average, batches=self.batches, watchdog=self.watchdog, timings=self.timings,
            flops=self.flops, grad_norms=self.grad_norms, guard=self.guard,
            replicas=self.replicas if self.semi_sync is None else None,  # (--sync: they meet between steps)
            clip_grad=self.cfg.clip_grad)

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
            self.cfg = dataclasses.replace(self.cfg, max_epochs=max_epochs)
            self.cadence = self._cadence()
            self.step.scheduler = build_schedule(self.optimizer, self.cfg, self.steps_per_epoch,
                                                 self.task.make_scheduler)
            self.checkpointer.retarget(self.cfg, SchedulerState(self.step.scheduler))
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
        self.reporter.begin(self.cfg, resumed_at, self.ctx.world_size, built=self.built, unused=self.unused)
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
        while not self.cadence.done():
            try:
                ended_by = self._run_epoch(self.progress.epoch)
            except Exception as error:  # the failure report names the step it happened in
                error.add_note(f"{STEP_NOTE}{self.progress.global_step + 1}")
                raise
            if ended_by == "healed":  # the state is a live peer's: on from where it stands
                continue
            if ended_by == "preempted":
                self._save(last=True)
                self.checkpointer.commit()
                return "preempted"
        if self.best is not None and self.best.stopped:
            self.reporter.info(f"ddptrain: {self.best.stop_line(self.progress.global_step)}; best model: "
                               f"{self.run_dir / BEST / 'model.pt'}")
        self._finish(exiting)
        return "finished"

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

    def _share_buffers(self) -> None:
        share_buffers(self.strategy, self.module, self.watchdog, self.progress.global_step)

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
        """An evaluation's or a snapshot's time: the timeline's (goodput), and out of the rates."""
        with self.clock.aside(), self.reporter.timed(kind, self.progress.global_step):
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

    # --- state -----------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.cfg.global_batch(self.ctx.world_size)

    def state_dict(self) -> dict[str, Any]:
        """Everything that makes the next step exactly what it would have been: every
        component's state, as a snapshot holds it (the checkpointer's aggregate)."""
        return self.checkpointer.state_dict()

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
        """``whole``: the model and optimizer tensors are whole (as in a file snapshot), not
        this rank's shards."""
        self.checkpointer.load_state_dict(state, whole)

    def _cadence(self) -> Cadence:
        return Cadence(self.cfg, self.progress, self.task.eval_set is not None,
                       stopped_early=lambda: self.best is not None and self.best.stopped)
