"""The Trainer: the tutorial's ``_run_batch`` / ``_run_epoch`` / ``train`` shape, made real.

Everything a step does is in ``_run_batch``; everything an epoch does is in ``_run_epoch``;
``fit`` is resume -> epochs -> final evaluation -> model.pt. Read them top to bottom.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import snapshot
from .config import ConfigError, RunConfig
from .data import ResumableDistributedSampler, TrainBatches, steps_per_epoch
from .dist import DistContext, apply_step_timeout
from .hooks import register_comm_hook
from .metrics import RunningLoss, evaluate
from .optim import build_optimizer, build_scheduler
from .preemption import StopSignal
from .report import Reporter
from .tasks.protocol import Task

LOSS_DISPLAY_EVERY = 20  # steps between progress-bar loss reads (each read syncs the device)


class Trainer:
    def __init__(self, task: Task, cfg: RunConfig, ctx: DistContext) -> None:
        self.task, self.cfg, self.ctx, self.device = task, cfg, ctx, ctx.device
        self.run_dir = Path(cfg.run_dir or ".")
        self.module = task.model.to(self.device)  # unwrapped: state_dict, evaluation, model.pt
        self.model = self._wrap(torch.compile(self.module) if cfg.compile else self.module)
        apply_step_timeout(cfg.timeout)  # DDP's start-up broadcast is done
        params = self.model.parameters()
        self.optimizer = task.make_optimizer(params) if task.make_optimizer else build_optimizer(params, cfg)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and self.device.type == "cuda")
        self.epoch = self.step_in_epoch = self.global_step = 0
        self.last_saved_step = -1
        self.resumed_steps: set[int] = set()  # loaded with --resume PATH: maybe not in our folder
        self.running_loss = RunningLoss(self.device)
        self.reporter = Reporter(cfg, self.run_dir, enabled=ctx.is_main)
        # Small control messages (stop flags, RNG states) travel on CPU: gloo even on NCCL jobs.
        self.cpu_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else None
        self.stop_signal = StopSignal(self.cpu_group)
        self.writer = snapshot.SnapshotWriter()
        self.first_step_at: float | None = None
        self.first_step_reported = False

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP across ranks. One rank has nobody to talk to: DDP would only add its overhead."""
        if self.ctx.world_size == 1:
            return model
        ddp = DDP(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            static_graph=self.cfg.static_graph,
            find_unused_parameters=self.cfg.find_unused_parameters,
            **({"bucket_cap_mb": self.cfg.bucket_cap_mb} if self.cfg.bucket_cap_mb else {}),
        )
        register_comm_hook(ddp, self.cfg.comm_hook)
        return ddp

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    # --- the loop ------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to ``max_epochs``. Returns ``"finished"``, or ``"preempted"`` after a stop signal."""
        try:
            return self._fit()
        finally:
            self.stop_signal.close()
            self.writer.close()

    def _fit(self) -> str:
        resumed = self._resume()
        self._build_data()
        if resumed is not None:
            self._apply_state(*resumed)
        else:
            self.reporter.info(f"training {self.cfg.task} on {self.ctx.world_size} rank(s), "
                               f"{self.ctx.device.type}/{self.ctx.backend}, global batch "
                               f"{self.global_batch}, {self.steps_per_epoch} steps per epoch")
        if self.cfg.max_epochs == 0:
            self._log_evaluation(epoch=-1)
        while self.epoch < self.cfg.max_epochs:
            if self._run_epoch(self.epoch) == "preempted":
                self.save_snapshot()
                self._commit_snapshots()
                return "preempted"
        self._finish()
        return "finished"

    def train(self, max_epochs: int | None = None) -> str:
        """The tutorial's name for ``fit``."""
        if max_epochs is not None:
            self.cfg.max_epochs = max_epochs
        return self.fit()

    def _run_epoch(self, epoch: int) -> str:
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(self.step_in_epoch * self.cfg.grad_accum * self.cfg.batch_size)
        if self.cfg.log_ranks:  # the tutorial's per-rank line
            print(f"{self.ctx.tag} Epoch:{epoch}|Batchsize:{self.cfg.batch_size}|"
                  f"Steps:{steps_per_epoch(len(self.task.train_set), self.ctx.world_size, self.cfg.batch_size)}",
                  flush=True)
        self.reporter.epoch_started(epoch, self.steps_per_epoch, self.step_in_epoch)
        started, samples = time.perf_counter(), 0
        micro_batches = iter(self.batches)
        while self.step_in_epoch < self.steps_per_epoch:
            group = [b for _, b in zip(range(self.cfg.grad_accum), micro_batches)]
            loss = self._run_batch(group)
            samples += sum(b[0].shape[0] for b in group) * self.ctx.world_size
            self.running_loss.add(loss)
            self.step_in_epoch += 1
            self.global_step += 1
            if self.first_step_at is None:
                self.first_step_at = time.time()
            show = self.global_step % LOSS_DISPLAY_EVERY == 0
            self.reporter.step_done(loss if show else None)
            if self.cfg.save_every and self.global_step % self.cfg.save_every == 0:
                self.save_snapshot()
            if self.stop_signal.agreed():
                self.reporter.epoch_finished()
                return "preempted"
        self.reporter.epoch_finished()
        self._end_epoch(epoch, time.perf_counter() - started, samples)
        return "done"

    def _run_batch(self, group: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One optimizer step over ``group`` (``--grad-accum`` micro-batches). Returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for i, (inputs, target) in enumerate(group):
            last = i == len(group) - 1
            sync = contextlib.nullcontext() if last else self._no_sync()  # all-reduce once per step
            with sync, self._autocast():
                loss = self.task.loss_fn(self._forward(inputs), target)
                if len(group) > 1:
                    loss = loss / len(group)  # the mean over the whole group's samples
            self.scaler.scale(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return total

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        try:
            return self.model(inputs)
        except RuntimeError as error:
            if "find_unused_parameters" in str(error):
                raise RuntimeError(f"{error}\nddptrain: some parameters got no gradient; "
                                   "pass --find-unused-parameters") from None
            raise

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # --- epoch ends, evaluation, the end -------------------------------------------------------
    def _end_epoch(self, epoch: int, seconds: float, samples: int) -> None:
        record: dict[str, Any] = {
            "kind": "epoch", "epoch": epoch, "step": self.global_step,
            "train_loss": self.running_loss.global_mean(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None,
            "epoch_time_s": round(seconds, 3), "samples": samples, "time": round(time.time(), 3),
        }
        if not self.first_step_reported and self.first_step_at is not None:
            record["first_step_at"] = self.first_step_at  # wall clock, for start-up benchmarks
            self.first_step_reported = True
        if self._eval_due(epoch):
            record.update(self._evaluation())
        self.reporter.log(record)
        self.running_loss.reset()
        self.epoch, self.step_in_epoch = epoch + 1, 0
        self.save_snapshot()

    def _eval_due(self, epoch: int) -> bool:
        if self.task.eval_set is None:
            return False
        last = epoch == self.cfg.max_epochs - 1
        every = self.cfg.eval_every
        return last or (every > 0 and (epoch + 1) % every == 0)

    def _evaluation(self) -> dict[str, Any]:
        if self.task.eval_set is None:
            return {}
        result = evaluate(self.module, self.task.eval_set, self.task.loss_fn, self.task.metrics,
                          self.cfg.batch_size, self.device, self.ctx.rank, self.ctx.world_size)
        return {f"eval_{k}": v for k, v in result.items()}

    def _log_evaluation(self, epoch: int) -> None:
        record = {"kind": "eval", "epoch": epoch, "step": self.global_step, **self._evaluation()}
        self.reporter.log(record)

    def _finish(self) -> None:
        self._commit_snapshots()
        if self.ctx.is_main:
            weights = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
            snapshot.atomic_save(weights, self.run_dir / "model.pt")
        dist.barrier()  # model.pt is complete before any rank reports success
        from .report import summarize
        self.reporter.finish(summarize(self.run_dir) if self.ctx.is_main else {})

    # --- snapshots -----------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.ctx.world_size * self.cfg.grad_accum

    def state_dict(self, rng_states: list[Any], loss_sums: tuple[float, int]) -> dict[str, Any]:
        return {
            "format_version": snapshot.FORMAT_VERSION,
            # copies: the writer thread saves them while training changes the originals
            "model": snapshot.cpu_copy(self.module.state_dict()),
            "optimizer": snapshot.cpu_copy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "epoch_loss_total": loss_sums[0], "epoch_loss_steps": loss_sums[1],
            "world_size": self.ctx.world_size, "batch_size": self.cfg.batch_size,
            "global_batch": self.global_batch,
            "fingerprint": self.cfg.math_fingerprint(self.ctx.world_size),
            "rng": rng_states,
        }

    def save_snapshot(self) -> None:
        """Every rank calls this; rank 0 writes the file in the background.

        The state is copied at once (so training can go on), and the copy is written by a
        thread: the file I/O (4 ms for the tutorial job, far more for big models) stays off
        the training path. Rank 0 finishes the previous write before it joins the gather
        below, so after the gather every rank knows that write was committed and checks it
        can see it.
        """
        if self.global_step == self.last_saved_step:
            return
        # At an epoch end the running loss was just read and reset on every rank alike.
        loss_sums = self.running_loss.global_sums() if self.running_loss.steps else (0.0, 0)
        if self.ctx.is_main:
            self.writer.wait()
        rng_states = snapshot.gather_rng_states(self.ctx.world_size, self.cpu_group)
        self._check_visible(self.last_saved_step)
        if self.ctx.is_main:
            self.writer.submit(self.state_dict(rng_states, loss_sums), self._snapshot_dir, self.cfg.keep)
        self.last_saved_step = self.global_step

    def _commit_snapshots(self) -> None:
        """Wait until the last snapshot is on disk and every rank can see it."""
        if self.ctx.is_main:
            self.writer.wait()
        dist.barrier()
        self._check_visible(self.last_saved_step)

    def _check_visible(self, step: int) -> None:
        if step < 0:
            return
        path = self._snapshot_dir / snapshot.snapshot_name(step)
        if not path.exists() and step not in self.resumed_steps:
            raise snapshot.SnapshotNotShared(self.ctx.rank, path)

    @property
    def _snapshot_dir(self) -> Path:
        return snapshot.snapshot_dir(self.run_dir)

    def _resume(self) -> tuple[dict[str, Any], Path] | None:
        """Load and check the snapshot ``--resume`` names (rank 0 chooses, every rank loads it)."""
        choice: list[Any] = [None]
        if self.ctx.is_main and self.cfg.resume != "never":
            choice = [self._choose_snapshot()]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        path = Path(choice[0])
        if not path.exists():
            raise snapshot.SnapshotNotShared(self.ctx.rank, path)
        state = snapshot.load_snapshot(path)
        self._adapt_batch_to(state, path)
        snapshot.check_model_matches(self.module, state["model"], path)
        snapshot.check_fingerprint(state["fingerprint"], self.cfg.math_fingerprint(self.ctx.world_size), path)
        return state, path

    def _choose_snapshot(self) -> str | None:
        if self.cfg.resume == "auto":
            found = snapshot.load_newest(snapshot.snapshot_dir(self.run_dir))
            return str(found[0]) if found else None
        snapshot.load_snapshot(Path(self.cfg.resume))  # validate before the others load it
        return self.cfg.resume

    def _apply_state(self, state: dict[str, Any], path: Path) -> None:
        """Continue exactly where the snapshot stopped (after the scheduler exists)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = self.last_saved_step = state["global_step"]
        self.resumed_steps.add(self.global_step)
        if self.ctx.is_main:  # the epoch's loss so far, already summed over ranks
            self.running_loss.restore(state.get("epoch_loss_total", 0.0), state.get("epoch_loss_steps", 0))
        if state["world_size"] == self.ctx.world_size:
            snapshot.restore_rng(state["rng"][self.ctx.rank])
        self.reporter.truncate_after(self.global_step)
        self.reporter.info(f"resumed from {path}: epoch {self.epoch}, step {self.global_step}")

    def _adapt_batch_to(self, state: dict[str, Any], path: Path) -> None:
        """On another world size, keep the snapshot's global batch (and so the sample order)."""
        if state["world_size"] == self.ctx.world_size:
            return
        per_rank, rest = divmod(state["global_batch"], self.ctx.world_size * self.cfg.grad_accum)
        if rest or per_rank < 1:
            workable = [w for w in range(1, state["global_batch"] + 1)
                        if state["global_batch"] % (w * self.cfg.grad_accum) == 0]
            raise ConfigError(f"snapshot {path} has global batch {state['global_batch']}, which "
                              f"{self.ctx.world_size} ranks cannot split evenly; use a world size "
                              f"in {workable}")
        if per_rank != self.cfg.batch_size:
            self.reporter.info(f"resuming a {state['world_size']}-rank run on {self.ctx.world_size}: "
                               f"batch size per rank {per_rank} keeps the global batch {state['global_batch']}")
        self.cfg.batch_size = per_rank

    def _build_data(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.sampler = ResumableDistributedSampler(self.task.train_set, ctx.world_size, ctx.rank, cfg.seed)
        self.batches = TrainBatches(self.task.train_set, self.sampler, cfg.batch_size, self.device, cfg.workers)
        micro = steps_per_epoch(len(self.task.train_set), ctx.world_size, cfg.batch_size)
        self.steps_per_epoch = math.ceil(micro / cfg.grad_accum)
        constant = cfg.lr_schedule == "constant" and cfg.warmup_steps == 0  # nothing to step
        total_steps = self.steps_per_epoch * cfg.max_epochs
        self.scheduler = None if constant else build_scheduler(self.optimizer, cfg, total_steps)
