"""The run's parts on one rank, built from the settings and composed into one typed object,
``RunParts``, which the Trainer (trainer.py) is given.

``build_parts`` reads top to bottom: each line builds one part from its own section of the
settings (``cfg.parallel`` the strategy, ``cfg.snapshots`` the checkpointer, ``cfg.observe``
the reporter, ...) and the parts it needs, named at the call. Each builder is a function of what
it is given, so a test builds one part without the rest (tests/unit/test_parts.py). Parts that
own state (``state_dict()`` / ``load_state_dict()``) are handed to the checkpointer, which
decides when a snapshot is written and how a run resumes (snapshots/checkpointer.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import schedules
from .comm import CollectiveMarks, DistContext, apply_step_timeout
from .data import EvalBatches, StreamBatches, TrainBatches, eval_subset, is_stream, training_batches
from .errors import ConfigError
from .evaluations import Evaluations
from .group_sync import GroupSync
from .observe.metrics import EpochLosses, GradNorms, RankTimings
from .observe.ray_train import RayReports
from .observe.report import NullReporter, Reporter
from .observe.step_figures import step_figures
from .observe.step_records import StepRecords, StepWindow
from .observe.throughput import FlopCount, StepProfiler, TrainingClock, device_peak_tflops
from .optim import ScalerState, SchedulerState, build_optimizer, build_schedule, describe_optimizer, run_steps
from .parallel import make_strategy
from .parallel.averaging import WeightAverage
from .parallel.base import ModelAndOptimizer, Strategy, convert_sync_batchnorm
from .parallel.semi_sync import GroupOptimizers, SemiSync
from .progress import Cadence, Progress
from .resilience.guard import NonFiniteGuard
from .resilience.replicas import ReplicaGroups, data_context
from .resilience.stop_signals import StopSignal
from .run_dir import RunDir
from .settings import OPTIMIZER_SETTINGS, RunConfig, unset_settings
from .snapshots.best import BestModel, best_model
from .snapshots.checkpointer import Checkpointer, OneTable
from .snapshots.files import list_snapshots, snapshot_dir
from .snapshots.init_from import load_into, load_training_state, read_weights
from .snapshots.restore import (
    TASK_SCHEDULE_LENGTH,
    Snapshot,
    TaskSchedule,
    restore_point,
    resumed_config,
    task_schedule_length,
)
from .snapshots.uploads import Uploader, rank_uploader
from .step import OptimizerStep, share_buffers
from .tally import EpochTally
from .tasks.protocol import Task, check_task


@dataclasses.dataclass
class RunParts:
    """Every part of a training run on this rank, by what it serves (``build_parts`` makes it)."""

    # what is trained, with which settings, where
    task: Task
    cfg: RunConfig  # as resolved: the task's defaults, the run dir, a resume's batch size
    ctx: DistContext
    home: RunDir  # the run dir (on a store: worked in through a local mirror)
    unused: tuple[str, ...]  # optimizer settings the task's own optimizer leaves unused (null in config.json)
    # the model, wrapped by the strategy, its optimizer and the weights' average
    strategy: Strategy
    uploads: Uploader | None  # a run dir on a store: its files go up behind the training
    module: torch.nn.Module  # unwrapped: state_dict, evaluation, model.pt
    model: torch.nn.Module  # wrapped (DDP, FSDP2)
    cpu_group: Any  # small control messages (stop flags, RNG states) on CPU: gloo even on NCCL jobs (None: the default)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    average: WeightAverage | None  # --ema
    scaler: torch.amp.GradScaler
    reporter: Reporter  # rank 0's writes metrics.jsonl, the console and the trackers; the others' a NullReporter
    # where the run starts, and its limits
    best: BestModel | None  # --keep-best's judge
    start: Snapshot | None  # the snapshot resumed from (None: a fresh start)
    batches: TrainBatches | StreamBatches
    progress: Progress  # where the run is: epoch, step, samples
    cadence: Cadence  # what is due after each step
    # what a step and an epoch keep count of
    losses: EpochLosses
    grad_norms: GradNorms
    guard: NonFiniteGuard
    timings: RankTimings
    flops: FlopCount
    clock: TrainingClock  # rates count training alone
    profiler: StepProfiler
    records: StepRecords  # --log-every
    tally: EpochTally  # the epoch's one all-reduce and record
    evaluations: Evaluations
    # snapshots, and what may ask for one
    built: dict[str, Any]  # config.json: the optimizer and schedule as built
    replicas: ReplicaGroups | None  # --fault-tolerance torchft
    semi_sync: SemiSync | None  # --sync local-sgd|diloco
    checkpointer: Checkpointer
    groups: GroupSync  # where the replica groups meet, as the loop sees it
    stop_signal: StopSignal
    ray: RayReports
    # the optimizer step
    step: OptimizerStep

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def watchdog(self) -> CollectiveMarks:
        return self.ctx.watchdog

    @property
    def run_dir(self) -> Path:
        """This machine's folder of the run dir (a store's: its mirror)."""
        return self.home.local

    @property
    def steps_per_epoch(self) -> int | None:
        """None: a stream's epoch ends when it does."""
        return self.batches.steps_per_epoch

    @property
    def global_batch(self) -> int:
        return self.cfg.global_batch(self.cfg.data_ranks(self.ctx.world_size))

    @property
    def run_steps(self) -> int | None:
        """The run's length in optimizer steps (None: unknown, epochs of a stream)."""
        return run_steps(self.cfg.training, self.steps_per_epoch)

    def share_buffers(self) -> None:
        share_buffers(self.strategy, self.module, self.watchdog, self.progress.global_step)


def build_parts(task: Task, cfg: RunConfig, ctx: DistContext) -> RunParts:
    """Every part of the run on this rank, each from its settings and the parts it needs."""
    check_task(task, cfg.task)
    # config.json: where the task builds its own optimizer, the optimizer settings the user left unset
    # are null (its make_optimizer sees the factory's settings, from before Task.defaults fill them)
    unused = unset_settings(cfg, OPTIMIZER_SETTINGS) if task.make_optimizer else ()
    cfg = cfg.with_task_defaults(task.defaults).with_run_dir()  # lr, optimizer, ... the user left unset
    home = RunDir.of(cfg.run_dir)
    strategy = make_strategy(cfg.parallel, ctx, cfg.precision, torchft=cfg.fault_tolerance == "torchft")
    uploads = rank_uploader(home, cfg.keep, ctx)
    module, model, cpu_group = wrap_model(task, cfg, ctx, strategy)
    params = list(model.parameters())
    optimizer, average, scaler = build_optimizing(task, cfg, ctx, module, params)
    weights = ModelAndOptimizer(strategy, module, optimizer, average)
    reporter = (Reporter(cfg.observe, home.local, uploads, step_figures=tuple(task.step_figures)) if ctx.is_main
                else NullReporter(cfg.observe, home.local))
    best = best_model(cfg.evaluation, task, cfg.task)  # (checked before a fresh start moves earlier files aside)
    start, cfg = choose_start(task, cfg, ctx, home, module, weights, average, reporter)

    batches = build_batches(task, cfg, strategy.data_context(ctx), cpu_group)
    steps = batches.steps_per_epoch  # None: a stream's epoch ends when it does
    progress = Progress(steps_per_epoch=steps)
    losses = EpochLosses(ctx.device, steps or 64, carries=ctx.is_main)
    grad_norms = GradNorms(ctx.device, steps or 64, strategy.counted_gradients, carries=ctx.is_main)
    window = StepWindow(ctx.device, cfg.observe.log_interval(run_steps(cfg.training, steps)),
                        step_figures(task.step_figures), ctx.rank, ctx.world_size)
    guard = NonFiniteGuard(cfg.skip_nonfinite)
    cadence = make_cadence(cfg, progress, task.eval_set is not None, best)
    evaluations = build_evaluations(task, cfg, ctx, strategy, module, model, average, best, home, uploads,
                                    lambda: share_buffers(strategy, module, ctx.watchdog, progress.global_step))
    schedule = build_schedule(optimizer, cfg.optim, run_steps(cfg.training, steps), task.make_scheduler)

    ray = RayReports(str(cfg.run_dir), ctx.is_main, home.local)  # inside a Ray Train worker: reports to Ray
    checkpointer: Checkpointer | None = None  # (built below: torchft's groups read and load its state)
    replicas = ReplicaGroups(cfg.resilience, cfg.math_fingerprint(ctx.world_size), home.local, ctx,
                             lambda: checkpointer.state_dict(),  # type: ignore[union-attr]  # built by then
                             lambda state: checkpointer.load_state_dict(state),  # type: ignore[union-attr]
                             reporter.info) if cfg.fault_tolerance == "torchft" else None
    mesh = getattr(strategy, "replica_mesh", None)  # --sync's groups: this job's (a mesh of its ranks), or torchft's
    semi_sync = None if cfg.sync == "every-step" else SemiSync(cfg.parallel, params, ctx.watchdog, mesh=mesh,
                                                               groups=replicas)
    timings, flops, clock = RankTimings(params), FlopCount(ctx.world_size), TrainingClock()
    checkpointer = Checkpointer(
        cfg.snapshots, recorded(cfg, ctx.world_size, task), ctx, home, strategy, ctx.watchdog, weights=weights,
        states={"scheduler": SchedulerState(schedule), "scaler": ScalerState(scaler),
                # one table in the snapshot format: where the run is, the epoch's loss so far, skips
                "progress": OneTable(progress, losses, grad_norms, window, guard,
                                     *[part for part in (best, replicas) if part is not None]),
                **({"semi_sync": semi_sync} if semi_sync is not None else {})},
        per_rank={"flops": flops, **({"data": batches} if isinstance(batches, StreamBatches) else {}),
                  **({"group_optimizers": GroupOptimizers(optimizer, mesh, ctx)} if mesh is not None else {})},
        start=start, group=cpu_group, uploads=uploads, on_committed=ray.committed if ray.active else None,
        spare_step=cadence.save_at)
    stop_signal = StopSignal(cpu_group, checkpointer.due_by_time if ctx.is_main else None, ctx.watchdog)

    peak_tflops = cfg.peak_tflops or device_peak_tflops(ctx.device)
    records = StepRecords(window, ctx, progress, clock, flops, optimizer, tokens_per_sample=task.tokens_per_sample,
                          peak_tflops=peak_tflops, write=reporter.log_step)
    tally = EpochTally(ctx=ctx, progress=progress, losses=losses, grad_norms=grad_norms, timings=timings, flops=flops,
                       guard=guard, params=params, optimizer=optimizer, average=average,
                       newest_snapshot=checkpointer.newest_path, tokens_per_sample=task.tokens_per_sample,
                       peak_tflops=peak_tflops, records=records, clock=clock)
    if strategy.forward_syncs:  # the forward's own collective ends where the inner forward begins
        module.register_forward_pre_hook(lambda *_: ctx.watchdog.depart())
    step = OptimizerStep(
        task=task, ctx=ctx, strategy=strategy, model=model, module=module, params=params, optimizer=optimizer,
        scheduler=schedule, scaler=scaler, average=average, batches=batches, watchdog=ctx.watchdog, timings=timings,
        flops=flops, grad_norms=grad_norms, guard=guard, clip_grad=cfg.clip_grad,
        replicas=replicas if semi_sync is None else None)  # (--sync: the groups meet between steps)
    return RunParts(
        task=task, cfg=cfg, ctx=ctx, home=home, unused=unused, strategy=strategy, uploads=uploads, module=module,
        model=model, cpu_group=cpu_group, params=params, optimizer=optimizer, average=average, scaler=scaler,
        reporter=reporter, best=best, start=start, batches=batches, progress=progress, cadence=cadence,
        losses=losses, grad_norms=grad_norms, guard=guard, timings=timings, flops=flops, clock=clock,
        profiler=StepProfiler(cfg.profile, home.local, ctx.rank, ctx.device), records=records, tally=tally,
        evaluations=evaluations, built=describe_optimizer(optimizer, schedule), replicas=replicas,
        semi_sync=semi_sync, checkpointer=checkpointer, groups=GroupSync(replicas, semi_sync, reporter.waited),
        stop_signal=stop_signal, ray=ray, step=step)


def wrap_model(task: Task, cfg: RunConfig, ctx: DistContext,
               strategy: Strategy) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """The task's model (SyncBatchNorm's where asked), wrapped by ``strategy`` with rank 0's weights
    on every rank; and the gloo group for small control messages on an NCCL job (else None)."""
    module = task.model
    if cfg.sync_batchnorm:
        if ctx.device.type != "cuda":
            raise ConfigError("--sync-batchnorm needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs only); "
                              "drop it on CPU, where each rank's BatchNorm normalises its own batch")
        module = convert_sync_batchnorm(task.model)
    with ctx.watchdog.waiting("start-up: wrapping the model (rank 0's weights reach every rank)"):
        model = strategy.wrap(module, task)
        cpu_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else None
    apply_step_timeout(cfg.timeout)
    return module, model, cpu_group


def build_optimizing(task: Task, cfg: RunConfig, ctx: DistContext, module: torch.nn.Module,
                     params: list[torch.nn.Parameter]
                     ) -> tuple[torch.optim.Optimizer, WeightAverage | None, torch.amp.GradScaler]:
    """The optimizer of the trained parameters (the task's, else --optimizer's), the weights'
    average (--ema) and fp16's gradient scaler (on CUDA)."""
    trained = [p for p in params if p.requires_grad]  # frozen ones (LoRA's base) need no optimizer state
    optimizer = task.make_optimizer(trained) if task.make_optimizer else build_optimizer(trained, cfg.optim)
    average = WeightAverage(module, cfg.ema, cfg.ema_every) if cfg.ema else None
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and ctx.device.type == "cuda")
    return optimizer, average, scaler


def choose_start(task: Task, cfg: RunConfig, ctx: DistContext, home: RunDir, module: torch.nn.Module,
                 weights: ModelAndOptimizer, average: WeightAverage | None,
                 reporter: Reporter) -> tuple[Snapshot | None, RunConfig]:
    """Where the run starts: a snapshot (chosen by rank 0, checked by all), else --init-from's
    weights (loaded into ``module``), else the model as built; and the settings it continues with
    (a resume on another world size keeps the snapshot's global batch)."""
    def init_from() -> str:
        if cfg.init_optimizer:
            return load_training_state(weights, cfg.init_from)
        return load_into(module, read_weights(cfg.init_from), cfg.init_from, cfg.init_from_partial)

    # --init-from is read before a fresh start moves an earlier run's files aside (it may be one of them)
    fresh = cfg.resume == "never" or not list_snapshots(snapshot_dir(home.local))  # (a store's: not pulled)
    initialised = init_from() if fresh and cfg.init_from else None
    start = restore_point(cfg.snapshots, ctx, home, module, weights.state_dict, ctx.watchdog)
    own_schedule = TaskSchedule(task.make_scheduler, [group["lr"] for group in weights.optimizer.param_groups]) \
        if task.make_scheduler is not None else None
    cfg = resumed_config(start, cfg, ctx.world_size, reporter.info, own_schedule)
    if start is None and cfg.init_from:  # weights only, before step 0
        reporter.info(initialised or init_from())
        if average is not None:
            average.restart()
    return start, cfg


def build_batches(task: Task, cfg: RunConfig, ctx: DistContext, cpu_group: Any) -> TrainBatches | StreamBatches:
    """The training batches: each data-parallel rank's share of every step (``ctx``: the strategy's
    data context, a tensor-parallel group's under --tp; under --fault-tolerance torchft, of every
    replica group's ranks)."""
    if cfg.fault_tolerance == "torchft" and is_stream(task.train_set):
        raise ConfigError("--fault-tolerance torchft needs a map-style training set for now (a stream's "
                          "shares cannot move between replica groups); drop one of them")
    if cfg.tp > 1 and is_stream(task.train_set):
        raise ConfigError(f"--tp {cfg.tp} needs a map-style training set for now (a stream's reading is agreed over "
                          "every rank, a group's ranks count once); drop one of them")
    return training_batches(task.train_set, cfg.training, data_context(cfg.resilience, ctx), task.collate_fn,
                            cpu_group)


def make_cadence(cfg: RunConfig, progress: Progress, evaluates: bool, best: BestModel | None) -> Cadence:
    """What is due after each step: evaluations, --save-every's snapshots (and, in a run counted
    in steps, the one where a warmup-stable-decay's decay begins: schedules.stable_end), the run's end."""
    by_steps = run_steps(cfg.training, progress.steps_per_epoch) if cfg.epochs == math.inf else None
    return Cadence(cfg.training, cfg.evaluation, cfg.save_every, progress, evaluates,
                   stopped_early=lambda: best is not None and best.stopped,
                   save_at=schedules.stable_end(cfg.optim, by_steps))


def build_evaluations(task: Task, cfg: RunConfig, ctx: DistContext, strategy: Strategy, module: torch.nn.Module,
                      model: torch.nn.Module, average: WeightAverage | None, best: BestModel | None, home: RunDir,
                      uploads: Uploader | None, share_buffers: Callable[[], None]) -> Evaluations:
    """The held-out set's evaluations: over the whole set, or --eval-batches' subset with the
    whole set for the run's last (--final-eval full)."""
    data = strategy.data_context(ctx)  # (--tp: a group's ranks evaluate the same batches)

    def batches(dataset: Any) -> EvalBatches:
        return EvalBatches(dataset, cfg.batch_size, data.rank, data.world_size, ctx.device, cfg.workers,
                           task.collate_fn, equal_counts=strategy.forward_syncs)

    evaluated = task.eval_set
    if evaluated is None and cfg.eval_at_start:
        raise ConfigError(f"--eval-at-start: the task {cfg.task} has no evaluation set (Task.eval_set) to evaluate; "
                          "drop --eval-at-start")
    if evaluated is not None and cfg.eval_batches:
        evaluated = eval_subset(evaluated, cfg.eval_batches * cfg.batch_size, cfg.seed)
    subset = evaluated is not task.eval_set
    return Evaluations(
        task=task, ctx=ctx, strategy=strategy, module=module, model=model, average=average,
        batches=None if evaluated is None else batches(evaluated), subset=subset,
        whole=(lambda: batches(task.eval_set)) if subset and cfg.final_eval == "full" else None,
        best=best, run_dir=home.local, uploads=uploads, share_buffers=share_buffers)


def recorded(cfg: RunConfig, world_size: int, task: Task) -> dict[str, Any]:
    """What every snapshot holds of the settings, for a run that resumes it to compare (restore.py):
    with a task's own schedule, the run's length it was given too."""
    ranks = cfg.data_ranks(world_size)
    fingerprint = cfg.math_fingerprint(ranks)
    if task.make_scheduler is not None:
        fingerprint[TASK_SCHEDULE_LENGTH] = task_schedule_length(cfg)
    return {"batch_size": cfg.batch_size, "global_batch": cfg.global_batch(ranks), "fingerprint": fingerprint,
            "data_world": ranks}
