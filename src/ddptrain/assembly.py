"""The run's parts, built from the settings: ``Assembly``, the base of trainer.py's ``Trainer``.

``__init__`` builds every component in six phases (the model, where the run starts, the loop's
parts, the checkpointer, the measures, the step), each needing the ones before it, and each from
its own section of the settings (``cfg.parallel`` the strategy, ``cfg.snapshots`` the
checkpointer, ``cfg.observe`` the reporter, ...) plus the few facts it needs from others, passed
by name. Each component owns its state (``state_dict()`` / ``load_state_dict()``); the
checkpointer holds them as ``states`` and decides when a snapshot is written and how a run
resumes (snapshots/checkpointer.py). The loop that runs them is trainer.py's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .comm import DistContext, apply_step_timeout
from .data import EvalBatches, StreamBatches, eval_subset, is_stream, training_batches
from .errors import ConfigError
from .evaluations import Evaluations
from .group_sync import GroupSync
from .observe.metrics import EpochLosses, GradNorms, RankTimings
from .observe.ray_train import RayReports
from .observe.report import NullReporter, Reporter
from .observe.step_records import StepRecords, StepWindow
from .observe.throughput import FlopCount, StepProfiler, TrainingClock, device_peak_tflops
from .optim import ScalerState, SchedulerState, build_optimizer, build_schedule, describe_optimizer, run_steps
from .parallel import make_strategy
from .parallel.averaging import WeightAverage
from .parallel.base import ModelAndOptimizer, convert_sync_batchnorm
from .parallel.semi_sync import GroupOptimizers, SemiSync
from .progress import Cadence, Progress
from .resilience.guard import NonFiniteGuard
from .resilience.replicas import ReplicaGroups, data_context
from .resilience.stop_signals import StopSignal
from .run_dir import RunDir
from .settings import OPTIMIZER_SETTINGS, RunConfig, unset_settings
from .snapshots.best import best_model
from .snapshots.checkpointer import Checkpointer, OneTable
from .snapshots.files import list_snapshots, snapshot_dir
from .snapshots.init_from import load_into, read_weights
from .snapshots.restore import restore_point, resumed_config
from .snapshots.uploads import rank_uploader
from .step import OptimizerStep, share_buffers
from .tally import EpochTally
from .tasks.protocol import Task, check_task


class Assembly:
    """Every part of a training run on this rank, built from ``task``, ``cfg`` and ``ctx``;
    the state a snapshot holds."""

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
        self.reporter = (Reporter(self.cfg.observe, self.run_dir, self.uploads) if ctx.is_main
                         else NullReporter(self.cfg.observe, self.run_dir))
        self._choose_start()
        self._build_loop()
        schedule = build_schedule(self.optimizer, self.cfg.optim, self.run_steps, task.make_scheduler)
        self.built = describe_optimizer(self.optimizer, schedule)  # config.json: what really trains
        self._build_checkpointer(schedule)
        self._build_measures()
        self._build_step(schedule)

    def _build_model(self) -> None:
        """The strategy, the wrapped model, its optimizer, EMA and gradient scaler."""
        cfg, ctx, task = self.cfg, self.ctx, self.task
        self.strategy = make_strategy(cfg.parallel, ctx, cfg.precision, torchft=cfg.fault_tolerance == "torchft")
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
        self.optimizer = task.make_optimizer(trained) if task.make_optimizer else build_optimizer(trained, cfg.optim)
        self.average = WeightAverage(self.module, cfg.ema, cfg.ema_every) if cfg.ema else None  # --ema
        self.weights = ModelAndOptimizer(self.strategy, self.module, self.optimizer, self.average)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and self.device.type == "cuda")

    def _choose_start(self) -> None:
        """Where the run starts: a snapshot (chosen by rank 0, checked by all), else --init-from's
        weights, else the model as built. It decides the batch size (a resume on another world size
        keeps the snapshot's global batch), and the batch size the data, the epoch and the schedule."""
        # Checked before a fresh start moves an earlier run's files aside: --keep-best's evaluation
        # set and, where the run starts afresh, --init-from's weights (loaded now: every rank reads them).
        self.best = best_model(self.cfg.evaluation, self.task, self.cfg.task)
        fresh = self.cfg.resume == "never" or not list_snapshots(snapshot_dir(self.run_dir))  # (a store's: not pulled)
        initialised = self._init_from() if fresh and self.cfg.init_from else None
        self.start = restore_point(self.cfg.snapshots, self.ctx, self.home, self.module, self.weights.state_dict,
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
        self.batches = training_batches(task.train_set, cfg.training, data_context(cfg.resilience, ctx),
                                        task.collate_fn, self.cpu_group)
        self.steps_per_epoch = self.batches.steps_per_epoch  # None: a stream's epoch ends when it does
        self.progress = Progress(steps_per_epoch=self.steps_per_epoch)
        self.losses = EpochLosses(self.device, self.steps_per_epoch or 64, carries=ctx.is_main)
        self.grad_norms = GradNorms(self.device, self.steps_per_epoch or 64, carries=ctx.is_main,
                                    counts=self.strategy.counts_gradients)
        self.window = StepWindow(self.device, cfg.observe.log_interval(self.run_steps))
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
        self.ray = RayReports(str(cfg.run_dir), ctx.is_main, self.run_dir)  # inside a Ray Train worker: reports to Ray
        self.replicas = ReplicaGroups(cfg.resilience, cfg.math_fingerprint(ctx.world_size), self.run_dir, ctx,
                                      lambda: self.checkpointer.state_dict(),
                                      lambda state: self.checkpointer.load_state_dict(state),
                                      self.reporter.info) if cfg.fault_tolerance == "torchft" else None
        # --sync local-sgd|diloco: the groups are this job's (a mesh of its ranks), or torchft's
        mesh = getattr(self.strategy, "replica_mesh", None)
        self.semi_sync = None if cfg.sync == "every-step" else SemiSync(
            cfg.parallel, self.params, self.watchdog, mesh=mesh, groups=self.replicas)
        self.checkpointer = Checkpointer(
            cfg.snapshots, self.recorded(), ctx, self.home, self.strategy, self.watchdog,
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

    def _share_buffers(self) -> None:
        share_buffers(self.strategy, self.module, self.watchdog, self.progress.global_step)

    # --- state -----------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.cfg.global_batch(self.ctx.world_size)

    @property
    def run_steps(self) -> int | None:
        """The run's length in optimizer steps (None: unknown, epochs of a stream)."""
        return run_steps(self.cfg.training, self.steps_per_epoch)

    def recorded(self) -> dict[str, Any]:
        """What every snapshot holds of the settings, for a run that resumes it to compare (restore.py)."""
        return {"batch_size": self.cfg.batch_size, "global_batch": self.global_batch,
                "fingerprint": self.cfg.math_fingerprint(self.ctx.world_size)}

    def state_dict(self) -> dict[str, Any]:
        """Everything that makes the next step exactly what it would have been: every
        component's state, as a snapshot holds it (the checkpointer's aggregate)."""
        return self.checkpointer.state_dict()

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
        """``whole``: the model and optimizer tensors are whole (as in a file snapshot), not
        this rank's shards."""
        self.checkpointer.load_state_dict(state, whole)

    def _cadence(self) -> Cadence:
        return Cadence(self.cfg.training, self.cfg.evaluation, self.cfg.save_every, self.progress,
                       self.task.eval_set is not None,
                       stopped_early=lambda: self.best is not None and self.best.stopped)
