"""One planned rank: the real task, strategy, data split, step and optimizer, run as rank r of
the target world through the fake process group (fake_group.py), and what it holds and sends.

What is measured, not modelled: the bytes of every tensor this rank holds after a step
(parameters, gradients, optimizer state, buffers: the local shards of FSDP's DTensors), the
tensors one micro-batch's forward saves for the backward, the collectives a steady step starts
(kind, elements, dtype, group: collectives.py), the FLOPs of a step (torch's FlopCounterMode, as
the Trainer counts them), the state a snapshot holds, and this rank's share of the data (the
samplers' own arithmetic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..comm import DistContext
from ..data.batches import eval_batch_ranges, eval_shard
from ..data.sampling import StepSampler
from ..data.streams import is_stream
from ..errors import ConfigError
from ..observe.metrics import GradNorms, RankTimings
from ..observe.step_figures import step_figures
from ..observe.throughput import FlopCount
from ..optim import build_optimizer, build_schedule, run_steps
from ..parallel import make_strategy
from ..parallel.base import Strategy, find_blocks
from ..parts import build_batches
from ..random_states import capture_rng
from ..resilience.guard import NonFiniteGuard
from ..settings import RunConfig
from ..step import OptimizerStep
from ..tasks.protocol import Task
from . import snapshot_size
from .collectives import CollectiveCount
from .fake_group import as_rank, fake_tensors, plan_comm_hook
from .memory import LiveTensors, available_memory
from .progress import doing, now_planning
from .snapshot_size import local, saved_state, serialised, tensor_bytes


@dataclasses.dataclass
class Target:
    """The job's shape at the scale planned for."""

    world_size: int
    nproc_per_node: int
    device: str = "cuda"  # the ranks' device type (train's --device; auto: cuda): its optimizer's path is planned

    @property
    def nnodes(self) -> int:
        return self.world_size // self.nproc_per_node


@dataclasses.dataclass
class RankFigures:
    """What one rank of the target world holds, sends and trains on."""

    rank: int
    parameters: int  # elements of the parameters this rank holds
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: int  # tensors one micro-batch's forward saves for the backward
    gathered_bytes: int  # fsdp/hsdp: whole parameters in flight (the root unit, two blocks)
    snapshot_bytes: int  # this rank's part of a snapshot
    generator_bytes: int  # this rank's random generators' states (its part of a snapshot: it writes them)
    snapshot_whole_bytes: int  # the whole snapshot but the ranks' parts, by the sharding rule (_snapshot_whole)
    dcp_metadata_bytes: int  # DCP's .metadata among them (modelled; 0 for a file snapshot)
    dcp_plan_bytes: int  # this rank's DCP save plan, pickled (what DCP gathers to rank 0; 0: a file snapshot)
    log_every: int  # steps a step record covers (--log-every as the run resolves it)
    window_numbers: int  # numbers a closed window adds to the step records' sum (3 a step, a task's figures)
    flops_per_step: int
    collectives: dict[str, dict[str, int | str]]  # "all_reduce[21]": {kind, elements, dtype, bytes, count}
    steps_per_epoch: int | None  # None: a stream's epoch ends when it does
    train_samples: int | None  # this rank's samples in an epoch (None: a stream)
    stand_ins: int  # micro-batches an epoch in which this rank has no sample (weight 0)
    eval_samples: int | None  # this rank's share of the evaluation set (None: no evaluation set)
    eval_batches: int
    eval_repeats: int  # batches run only to keep FSDP's all-gathers matched
    allocated_peak_bytes: int  # measured: the most bytes of tensors held at once in a steady step (memory.py)
    steps_run: int  # the last one's collectives counted


def plan_rank(cfg: RunConfig, factory: Any, target: Target, rank: int, steps: int = 2,
              fake: bool = False) -> RankFigures:
    """Rank ``rank`` of ``target`` for ``steps`` optimizer steps, through the fake process group
    (``fake``: with fake tensors, fake_group.py)."""
    now_planning(rank)
    with as_rank(rank, target.world_size):
        ctx = DistContext(rank, target.world_size, rank % target.nproc_per_node, target.nproc_per_node,
                          torch.device("cpu"), "fake")
        return measure_rank(cfg, factory, ctx, steps, fake, target.device)


def measure_rank(cfg: RunConfig, factory: Any, ctx: DistContext, steps: int = 2, fake: bool = False,
                 device: str = "cpu") -> RankFigures:
    """What this rank of the process group it is in (the fake one, or a real one to check the
    plan by) holds and sends over ``steps`` optimizer steps (the last one's collectives counted),
    its optimizer stepping as it would on ``device`` (``as_on_device``)."""
    run = _Run(cfg, factory, ctx, steps, fake, device)
    doing("measuring what it holds and writes")
    module, optimizer, strategy = run.module, run.step.optimizer, run.strategy
    generators = serialised(capture_rng())  # (random_states.py)
    saved = saved_state(strategy, module, optimizer)
    whole, metadata = snapshot_size.whole(saved, strategy)
    figures = RankFigures(
        rank=ctx.rank, parameters=sum(local(p).numel() for p in module.parameters()),
        parameter_bytes=sum(tensor_bytes(p) for p in module.parameters()),
        gradient_bytes=sum(tensor_bytes(p.grad) for p in module.parameters() if p.grad is not None),
        optimizer_bytes=_state_bytes(optimizer),
        buffer_bytes=sum(tensor_bytes(b) for b in module.buffers()),
        activation_bytes=run.activations.bytes,
        gathered_bytes=_gathered_bytes(strategy, module, run.task, run.cfg.precision),
        snapshot_bytes=snapshot_size.rank_part(saved, strategy, ctx) + generators,  # (and its own part)
        generator_bytes=generators, snapshot_whole_bytes=whole, dcp_metadata_bytes=metadata,
        dcp_plan_bytes=snapshot_size.dcp_plan_bytes(saved, strategy, ctx), **_step_records(run, ctx),
        flops_per_step=run.step.flops.per_step or 0, collectives=run.collectives.table(),
        allocated_peak_bytes=run.peak_bytes(), steps_run=run.steps,
        **_data_shares(run.task, run.cfg, ctx, strategy, run.step.batches.steps_per_epoch))
    doing("done")
    return figures


class _Run:
    """The rank built (the task, the strategy's model, the Trainer's step) and ``steps`` steps run:
    the first micro-batch's activations probed, the last step's collectives counted."""

    def __init__(self, cfg: RunConfig, factory: Any, ctx: DistContext, steps: int, fake: bool,
                 device: str = "cpu") -> None:
        from .. import tasks

        # fake tensors: the task's, and under FSDP those its steps make (its gathered parameters).
        # Not the batches (a sampler's order, a data set's __getitem__ may read values), nor
        # DDP's, whose checks of the ranks' shapes and bucket order read their data (its reducer's
        # buckets, the gradients' size, are real memory then), nor a stream's (its steps agree
        # on their counts)
        tensors = fake_tensors() if fake else contextlib.nullcontext()
        doing("building the task")
        with tensors:
            self.task = tasks.build(cfg, factory)
        self.cfg = cfg = cfg.with_task_defaults(self.task.defaults)
        # (compiling would only slow the plan: what a rank holds and sends is the same)
        parallel = dataclasses.replace(cfg.parallel, comm_hook="none" if ctx.backend == "fake" else cfg.comm_hook,
                                       compile=False)
        self.strategy = make_strategy(parallel, ctx, cfg.precision)
        self.module = self.task.model
        if fake and cfg.strategy == "ddp":
            _check_ddp_buckets_fit(self.module)
        doing(f"wrapping the model (--strategy {cfg.strategy})")
        model = self.strategy.wrap(self.module, self.task)
        ddp = isinstance(model, DistributedDataParallel)
        if ctx.backend == "fake" and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, plan_comm_hook(cfg.comm_hook))
        doing("building the optimizer and the batches")
        self.step = _step(self.task, cfg, ctx, self.strategy, model, self.module)
        as_on_device(self.step.optimizer, device)
        stream = is_stream(self.task.train_set)
        if stream:  # its first step also agrees on a stand-in batch (W + 2 numbers)
            steps = max(steps, 2)
        self.steps, self.first_step_counted = steps, steps == 1
        self._run_steps(contextlib.nullcontext() if ddp or stream else tensors)

    def _run_steps(self, tensors: contextlib.AbstractContextManager[Any]) -> None:
        self.activations = ActivationProbe(self.module)
        self.collectives = CollectiveCount(self.step.ctx.local_world_size)
        groups = _epochs(self.step.batches, self.step.ctx.rank, self.step.ctx.world_size)
        for index in range(self.steps - 1):
            doing(f"at step {index + 1} of {self.steps}")
            group = next(groups)
            with tensors, self.activations if index == 0 else contextlib.nullcontext():
                self.step.run(group, index)
        self.memory = LiveTensors(self._held())
        hook = self.step.optimizer.register_step_pre_hook(self.memory.optimizer_begins)
        doing(f"at step {self.steps} of {self.steps}, measured")
        with self.collectives, self.memory:  # (a stream's batches start the step's agreement on its count)
            group = next(groups)
            with tensors, self.activations if self.steps == 1 else contextlib.nullcontext():
                self.step.run(group, self.steps - 1)
        hook.remove()

    def _held(self) -> Iterator[torch.Tensor]:
        """What the rank holds between two steps: parameters, gradients, buffers, optimizer state."""
        for param in self.module.parameters():
            yield param
            if param.grad is not None:
                yield param.grad
        yield from self.module.buffers()
        for state in self.step.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def peak_bytes(self) -> int:
        """The counted step's peak; when that was the first, its forward and backward held no
        optimizer state yet, which every later one holds beside the same activations."""
        before = self.memory.before_optimizer
        if not self.first_step_counted or before is None:
            return self.memory.peak
        return max(self.memory.peak, before + _state_bytes(self.step.optimizer))


def _check_ddp_buckets_fit(module: torch.nn.Module) -> None:
    """--fake-tensors under DDP: DDP's reducer allocates its gradient buckets, as large as the
    trained parameters, in real memory when it wraps the model, whatever tensors the model holds
    (it reads them to check the ranks' shapes and to lay the buckets out): ConfigError (one line)
    where they would not fit here, where they were an allocation's traceback."""
    buckets = sum(tensor_bytes(p) for p in module.parameters() if p.requires_grad)
    available = available_memory()
    if available is not None and buckets > available:
        raise ConfigError(f"--fake-tensors under --strategy ddp: DDP allocates its gradient buckets in real memory "
                          f"when it wraps the model ({buckets / 1e9:,.1f} GB for this one), above this machine's "
                          f"{available / 1e9:.0f} GB available; plan it under --strategy fsdp (whose shards are "
                          "fake), or on a machine with that memory")


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of the optimizer's state (its shards under FSDP)."""
    return sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _epochs(batches: Any, rank: int, world_size: int) -> Iterator[list[Any]]:
    """The optimizer steps' micro-batches, epoch after epoch (a plan may outlast a small set's epoch).
    A rank whose share of a stream is empty finds no step in an epoch (the fake group's agreement
    on a step's count is its own count alone): ConfigError, where it looped over empty epochs."""
    for epoch in itertools.count():
        batches.set_epoch(epoch)
        stepped = False
        for group in batches.steps():
            stepped = True
            yield group
        if not stepped:
            raise ConfigError(f"rank {rank:,} has no training sample in an epoch: its share of the stream is empty "
                              f"on {world_size:,} ranks (a rank without one only runs stand-ins); use fewer ranks, "
                              "or a stream with more samples or shards")


def _step(task: Task, cfg: RunConfig, ctx: DistContext, strategy: Strategy, model: torch.nn.Module,
          module: torch.nn.Module) -> OptimizerStep:
    """The Trainer's own step (step.py) over this rank's batches, with nothing beside it that
    would write: no reporter, no watchdog, no snapshots."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    optimizer = task.make_optimizer(trained) if task.make_optimizer else build_optimizer(trained, cfg.optim)
    batches = build_batches(task, cfg, strategy.data_context(ctx), None)  # (--tp: its group's share)
    # the Trainer's own schedule, so that a schedule train refuses (a decay over a stream's unknown
    # length) is refused here too, in the same line
    schedule = build_schedule(optimizer, cfg.optim, run_steps(cfg.training, batches.steps_per_epoch),
                              task.make_scheduler)
    return OptimizerStep(
        task=task, ctx=ctx, strategy=strategy, model=model, module=module, params=params, optimizer=optimizer,
        scheduler=schedule, scaler=torch.amp.GradScaler("cuda", enabled=False), average=None, batches=batches,
        watchdog=ctx.watchdog, timings=RankTimings(params), flops=FlopCount(),
        grad_norms=GradNorms(ctx.device, 64, strategy.counted_gradients, carries=ctx.is_main),
        guard=NonFiniteGuard(cfg.skip_nonfinite), replicas=None, clip_grad=cfg.clip_grad)


def as_on_device(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Step ``optimizer`` (built on this machine's CPU) by the code path torch would pick on
    ``device``: where its groups leave ``foreach`` and ``fused`` unset, torch's optimizers take
    the foreach path on CUDA (``_default_to_fused_or_foreach``: one op over every tensor of a
    group, whose temporaries are the size of the group's state: +17% at a 30M MLP's peak, which
    is its optimizer step) and a per-tensor loop on the CPU. torch's CPU runs the foreach ops
    too (a loop inside each), allocating what CUDA's kernels do, so the plan counts them here."""
    if device == "cpu":
        return
    for group in optimizer.param_groups:
        if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
            continue  # the optimizer's own choice, or one without a foreach path
        if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
            continue  # (torch keeps the loop for a tensor learning rate that is not capturable)
        group["foreach"] = True


class ActivationProbe:
    """Bytes of the tensors the model's first forward in the block saves for its backward, as
    they stand when that forward ends: each storage once; the parameters are not counted (they
    are held anyway), nor FSDP's gathered parameters (freed when a block's forward ends)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.bytes = module, 0
        self.saved: dict[int, torch.UntypedStorage] = {}  # by the storage's C++ address (a fake one has no data's)
        self.counting = self.done = False

    def __enter__(self) -> ActivationProbe:
        self.handles = [self.module.register_forward_pre_hook(self._begin),
                        self.module.register_forward_hook(self._end)]
        self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.saving.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.saving.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def _begin(self, *_: Any) -> None:
        self.counting = not self.done

    def _end(self, *_: Any) -> None:
        if self.counting:  # (the parameters as they stand now: FSDP's first forward replaces them)
            held = {local(p).untyped_storage()._cdata for p in self.module.parameters()}
            self.bytes = sum(storage.nbytes() for key, storage in self.saved.items() if key not in held)
            self.saved.clear()
            self.counting, self.done = False, True

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.counting:
            storage = tensor.untyped_storage()
            self.saved[storage._cdata] = storage
        return tensor


def _gathered_bytes(strategy: Strategy, module: torch.nn.Module, task: Task, precision: str) -> int:
    """FSDP's whole parameters in flight at once: the root unit's (gathered from forward to
    backward) and two blocks' (the one running and the next, prefetched), in the dtype the
    all-gather sends (--precision's). Nothing for a replicated model."""
    if strategy.snapshot_format != "dcp":
        return 0
    size = 2 if precision in ("bf16", "fp16") else 4
    blocks = find_blocks(module, task)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    whole = sorted((sum(_gathered_numel(p) for p in block.parameters()) for block in blocks), reverse=True)
    root = sum(_gathered_numel(p) for p in module.parameters() if id(p) not in in_blocks)
    return (root + sum(whole[:2])) * size


def _gathered_numel(param: Any) -> int:
    """A parameter's elements as FSDP's all-gather makes it whole: each rank's shard padded to
    ceil(rows / N) rows of the N ranks it is sharded over, so dim 0 to a multiple of N (a
    768-row matrix over 16,384 ranks gathers 16,384 rows, 21 times its own); under --tp, of its
    tensor-parallel group's part (the split dimension over --tp)."""
    if not hasattr(param, "placements") or param.dim() == 0:
        return param.numel()
    shape, shards = list(param.shape), 1
    names = param.device_mesh.mesh_dim_names or ()
    for dim, placement in enumerate(param.placements):
        if not placement.is_shard():
            continue
        if dim < len(names) and names[dim] == "tp":  # --tp's split stays split: FSDP gathers a group's part
            shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(dim))
        else:
            shards *= param.device_mesh.size(dim)
    return -(-shape[0] // shards) * shards * math.prod(shape[1:])


def _step_records(run: _Run, ctx: DistContext) -> dict[str, int]:
    """The step records' share of the agreement's collectives (observe/step_records.py): a window
    of --log-every steps, 3 numbers a step, and a task's own figures (a max's: 1 + 1 a rank)."""
    log_every = run.cfg.observe.log_interval(run_steps(run.cfg.training, run.step.batches.steps_per_epoch))
    figures = sum(f.width(ctx.world_size) for f in step_figures(run.task.step_figures))
    return {"log_every": log_every, "window_numbers": 3 * log_every + figures}


def _data_shares(task: Task, cfg: RunConfig, ctx: DistContext, strategy: Strategy,
                 steps_per_epoch: int | None) -> dict[str, Any]:
    """This rank's share of an epoch's training samples and of the evaluation set (--tp: its group's)."""
    ctx = strategy.data_context(ctx)
    shares: dict[str, Any] = {"steps_per_epoch": steps_per_epoch, "train_samples": None, "stand_ins": 0}
    if not is_stream(task.train_set):
        sampler = StepSampler(len(task.train_set), ctx.world_size, ctx.rank,  # type: ignore[arg-type]  # map-style
                              cfg.batch_size, cfg.grad_accum, cfg.seed, shuffle=False)
        full = sampler.dataset_len // sampler.global_batch  # full steps; then the short one's micro-batches
        tail = list(sampler.micro_batches(torch.arange(sampler.dataset_len), start_step=full))
        shares["train_samples"] = full * cfg.batch_size * cfg.grad_accum + sum(m.samples for m in tail)
        shares["stand_ins"] = sum(1 for m in tail if m.samples == 0)
    shares.update(eval_samples=None, eval_batches=0, eval_repeats=0)
    if task.eval_set is not None:
        size = len(task.eval_set)  # type: ignore[arg-type]  # map-style (check_task)
        if cfg.eval_batches:
            size = min(size, cfg.eval_batches * cfg.batch_size)
        ranges = eval_batch_ranges(size, cfg.batch_size)
        mine = eval_shard(len(ranges), ctx.rank, ctx.world_size)
        shares.update(eval_samples=sum(len(ranges[b]) for b in mine), eval_batches=len(mine),
                      eval_repeats=(math.ceil(len(ranges) / ctx.world_size) - len(mine)) if strategy.forward_syncs
                      else 0)
    return shares
