"""One optimizer step: the tutorial's ``_run_batch``, made exact and cheap.

``OptimizerStep.run`` takes a step's micro-batches (``--grad-accum`` of them), runs each
forward and backward with the gradients synchronised in the last backward only, scales the
gradients to the mean over the samples really in the step, and steps the optimizer unless the
non-finite guard or a failed torchft quorum says otherwise. The Trainer (trainer.py) decides
which steps run; this module decides what a step computes and what it communicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .comm import CollectiveMarks, DistContext
from .data import MicroBatch, StreamBatches, TrainBatches
from .errors import ConfigError
from .observe.metrics import GradNorms, RankTimings
from .observe.throughput import FlopCount
from .parallel.averaging import WeightAverage
from .parallel.base import Strategy, leaves_no_trace
from .resilience.guard import NonFiniteGuard
from .resilience.replicas import ReplicaGroups
from .tasks.protocol import Task, check_pair, split_figures, split_loss

GRADIENT_SYNC = "the gradient all-reduce"
FORWARD_SYNC = "the forward pass's collective (FSDP's parameter all-gather)"
BUFFER_SYNC = "the broadcast of rank 0's buffers (BatchNorm's running statistics)"
COUNT_SYNC = "summing the step's loss counts over the ranks (step_fn returned (sum, count))"


def share_buffers(strategy: Strategy, module: torch.nn.Module, watchdog: CollectiveMarks, step: int) -> None:
    """Every rank takes rank 0's buffers (BatchNorm's running statistics): before each step,
    each evaluation and each save. One rule for DDP and FSDP: rank 0's buffers follow its
    own batches only, so they are what model.pt holds and a resume is exact at any step."""
    if strategy.shares_buffers:
        with watchdog.waiting(BUFFER_SYNC, step):
            strategy.broadcast_buffers(module)


@dataclasses.dataclass
class OptimizerStep:
    """What a step reads and changes: the model (``model`` wrapped by ``strategy``, ``module``
    unwrapped), its optimizer, scheduler and scaler, the weight average (--ema), the batches (a
    stream agrees on its count here), and what a step reports to: timings, FLOPs, gradient
    norms, the guard, torchft's replica groups."""

    task: Task
    ctx: DistContext
    strategy: Strategy
    model: torch.nn.Module
    module: torch.nn.Module
    params: list[torch.nn.Parameter]  # the wrapped model's, as the Trainer listed them
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler, or None (a constant rate); the Trainer replaces it on train(max_epochs)
    scaler: torch.amp.GradScaler
    average: WeightAverage | None
    batches: TrainBatches | StreamBatches
    watchdog: CollectiveMarks
    timings: RankTimings
    flops: FlopCount
    grad_norms: GradNorms
    guard: NonFiniteGuard
    replicas: ReplicaGroups | None
    clip_grad: float | None
    figures: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the last step's task figures
    loss_checked: bool = False  # the first loss's type and shape are checked once
    gradients_checked: bool = False  # the strategy checks the first step's gradients (DDP: unused parameters)
    buckets_settled: bool = False  # this process's DDP buckets are laid out as the run's (_settle_buckets)

    def run(self, group: list[tuple[Any, MicroBatch]], step: int) -> tuple[torch.Tensor | None, int]:
        """Global step ``step`` over ``group``. Returns this rank's part of the step's mean loss
        (the ranks' parts add up to it), or None when the step was skipped as not finite; and the
        step's samples over every rank (0: a stream's step that no rank had a sample for, so
        nothing was stepped).

        Each micro-batch's mean loss is weighted by its share of the step's samples
        (``MicroBatch.weight``), so the gradient is the mean over the samples really in the
        step, however short the epoch's last step is. (A stream's micro-batches are weighted
        as parts of a full step, and a short step's gradients scaled once its count is known.)
        A loss returned as ``(sum, count)`` is divided by the step's count over every rank
        instead (``_divide_by_count``)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.watchdog.phase(f"step {step}")
        share_buffers(self.strategy, self.module, self.watchdog, step)
        if not self.buckets_settled:
            self._settle_buckets(group, step)
        with self.flops.first_step():  # FlopCounterMode around the first step's work, once
            total, count = self._forward_backward(group, step)
        planned = group[0][1].step_samples
        agreed = self.batches.agreed_samples()  # a stream's count, known only now (None: ``planned`` is it)
        step_samples = planned if agreed is None else agreed
        if step_samples == 0:
            return None, 0
        if count is None and step_samples != planned:  # a stream's short step
            self._scale_gradients(planned / step_samples)
            total = total * (planned / step_samples)
        if self.replicas is not None:  # the other replica groups' gradients and losses
            total = self.replicas.average(self.gradients(), total, step)
        total = total / self.ctx.world_size if count is None else self._divide_by_count(total, count, step)
        if self.scaler.is_enabled():  # fp16: the norm, the guard and clipping see the true gradients
            self.scaler.unscale_(self.optimizer)
        gradients = self.gradients()
        self.grad_norms.add(gradients)
        # fp16's gradients overflow by design (the grad scaler skips those steps): the guard sees the loss
        if self.guard.skipping and not self.guard.step_is_finite(total, [] if self.scaler.is_enabled() else gradients):
            if self.replicas is not None:  # every group skips it (the same averaged gradients): the quorum ends
                self.replicas.commit(step, step_samples)
            self._step_scheduler()  # the schedule counts steps, taken or skipped
            return None, step_samples
        if not self.gradients_checked:  # DDP names the parameters that got no gradient
            self.strategy.check_gradients(self.module)
            self.gradients_checked = True
        if self.clip_grad:
            self.strategy.clip_gradients(self.params, self.clip_grad)
        if self.replicas is not None and not self.replicas.commit(step, step_samples):  # a peer failed in it
            self._step_scheduler()
            return total, step_samples
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.average is not None:
            self.average.update(step)
        self._step_scheduler()
        return total, step_samples

    def _forward_backward(self, group: list[tuple[Any, MicroBatch]], step: int) -> tuple[torch.Tensor, Any]:
        """Every micro-batch's forward and backward, gradients synchronised in the last backward
        only. Returns this rank's weighted loss over the step, and the count the loss sums are
        over when step_fn returned ``(sum, count)`` (else None)."""
        total, count = None, None
        self.figures, real = {}, sum(1 for _, micro in group if micro.samples)
        for i, (batch, micro) in enumerate(group):
            last = i == len(group) - 1
            # One gradient sync per step: DDP decides in the forward whether the backward reduces,
            # FSDP in the backward's hooks, so no_sync holds both for every micro-batch but the last.
            sync = contextlib.nullcontext() if last else self.strategy.no_sync(self.model)
            kept = contextlib.nullcontext() if micro.samples else leaves_no_trace(self.module)
            with sync:
                with kept, self.strategy.autocast():
                    if self.strategy.forward_syncs:
                        self.watchdog.arrive(FORWARD_SYNC, step)
                    loss, units, figures = self._loss(batch, step)
                    if figures and micro.samples:  # (a stand-in micro-batch's are not this rank's)
                        self._add_figures(figures, real)
                    if units is None:  # a mean over the micro-batch's samples
                        loss = loss if micro.weight == 1.0 else loss * micro.weight
                    else:  # a sum over `units` (tokens, say): divided once the step's count is known
                        loss, units = (loss, units) if micro.samples else (loss * 0.0, 0)
                        count = units if count is None else count + units
                if last:  # the gradient all-reduce happens in this backward
                    with self.watchdog.waiting(GRADIENT_SYNC, step, timed=False):
                        self.scaler.scale(loss).backward()
                        self.timings.backward_done()
                else:
                    self.scaler.scale(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None, "a step has at least one micro-batch"
        return total, count

    def _settle_buckets(self, group: list[tuple[Any, MicroBatch]], step: int) -> None:
        """DDP reduces a process's first backward in buckets of the parameters in reverse order, and
        every later one in buckets rebuilt in the order their gradients became ready; past two ranks,
        how a gradient's sum over them rounds depends on where it lies in its bucket. So a process
        restarted at step N would take step N in the first layout, where the run it continues took
        it in the rebuilt one (1e-8 apart on a transformer block's gradients, 4 ranks). Its first
        backward is therefore one more of this step's last micro-batch, weighted zero and leaving no
        trace (buffers, random streams and gradients as they were; the task's step_fn is called
        once more): DDP rebuilds after it, as the uninterrupted run did after its step 1."""
        self.buckets_settled = True
        if step == 1 or not self.strategy.settles_buckets:
            return
        batch, _ = group[-1]
        with leaves_no_trace(self.module):  # (buffers restored after the backward, which may read them)
            with self.strategy.autocast():
                loss, _, _ = self._loss(batch, step)
            with self.watchdog.waiting(GRADIENT_SYNC, step, timed=False):
                (loss * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _divide_by_count(self, local_sum: torch.Tensor, local_count: Any, step: int) -> torch.Tensor:
        """``step_fn`` returned ``(sum, count)``: scale the gradients (averaged over the ranks by
        DDP/FSDP) to the sum's gradient over the step's count on every rank, found with one small
        all-reduce. Returns this rank's part of the step's mean loss."""
        if self.replicas is not None:
            raise ConfigError("--fault-tolerance torchft: step_fn returned (sum, count), whose count would be summed "
                              "inside one replica group only; return a mean loss, or train without torchft")
        count = torch.as_tensor(local_count, dtype=torch.float64, device=self.ctx.device).detach().reshape(())
        if self.ctx.world_size > 1:
            with self.watchdog.waiting(COUNT_SYNC, step):
                dist.all_reduce(count)
        count = count.clamp(min=1)
        self._scale_gradients(self.ctx.world_size / count.item())  # a number: FSDP's gradients are DTensors
        return local_sum / count

    def _scale_gradients(self, factor: float) -> None:
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(factor)

    def _add_figures(self, figures: dict[str, Any], micro_batches: int) -> None:
        """A micro-batch's task figures into the step's (this rank's): the mean over the step's
        ``micro_batches`` that have samples, their sum or their largest, as Task.step_figures
        declares; on the device (no host sync)."""
        for name, value in figures.items():
            value = torch.as_tensor(value).detach().to(device=self.ctx.device, dtype=torch.float64).reshape(())
            combine, held = self.task.step_figures[name], self.figures.get(name)
            if combine == "sum" and not self.strategy.counts_data:  # (--tp: the group's first rank counts it)
                value = torch.zeros_like(value)
            if combine == "mean":
                value = value / micro_batches
            if held is not None:
                value = torch.maximum(held, value) if combine == "max" else held + value
            self.figures[name] = value

    def _loss(self, batch: Any, step: int) -> tuple[torch.Tensor, Any, dict[str, Any]]:
        """The task's loss of one batch, ``step_fn(model, batch)`` or ``loss_fn(model(inputs),
        target)``, the count it is a sum over when step_fn returned ``(sum, count)``, and the
        figures step_fn returned beside it (Task.step_figures)."""
        if not self.loss_checked and self.task.step_fn is None:
            check_pair(batch)
        try:
            if self.task.step_fn is not None:
                value = self.task.step_fn(self.model, batch)
            else:
                inputs, target = batch
                value = self.task.loss_fn(self.model(inputs), target)  # type: ignore[misc]  # loss_fn is set when step_fn is not (check_task)
        except RuntimeError as error:
            clearer = self.strategy.explain(error, self.module, step)
            if clearer is None:
                raise
            raise clearer from None
        value, figures = split_figures(value, self.task.step_figures, check=not self.loss_checked)
        loss, count = split_loss(value, "step_fn" if self.task.step_fn is not None else "loss_fn",
                                 check=not self.loss_checked)
        self.loss_checked = True
        return loss, count, figures

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _step_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
