"""Snapshot policy: where a run starts, when it saves, and what every rank knows was saved.

The Trainer is known here only as a source and sink of state (``state_dict()`` /
``load_state_dict()``); file handling (atomic writes, validated loads, rotation) lives in
files.py. Start-up is one collective step, ``restore_point``:

- ``--resume never``, or nothing to resume: a fresh start. Files an earlier run left in the
  run dir (snapshots, metrics.jsonl, model.pt) are moved aside to ``previous-<time>/`` and
  named in one line, so the new run owns its folder.
- ``--resume auto``: rank 0 picks the newest snapshot that loads; ``--resume PATH``: that
  one. Rank 0 broadcasts its choice (or the reason there is none); every rank loads it and
  checks that it fits the model and the math settings, so all fail or succeed together.

Saving: every ``--save-every`` steps, and when ``--save-seconds`` of training have passed
(stretched to 50x what a snapshot costs the training path, so snapshots take at most 2% of
the time), at the end and on a stop signal. Written in the background: a file by rank 0
(ddp), or a DCP folder to which every rank writes its shards (fsdp).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..comm import CollectiveMarks, DistContext, broadcast_object
from ..config import RunConfig
from ..console import say
from ..errors import ConfigError, StorageNotShared
from . import dcp as snapshot_dcp
from . import files

MAX_SNAPSHOT_SHARE = 0.02  # of training time, at most, spent on the training path saving
LEFTOVERS = ("snapshots", "metrics.jsonl", "model.pt", "config.json", "curves.png", "tensorboard")


@dataclass
class Snapshot:
    path: Path
    state: dict[str, Any]
    whole: bool = True  # weights are whole tensors (a file), not this rank's shards (a DCP folder)


def adapt_batch(global_batch: int, world_size: int, grad_accum: int) -> int:
    """The per-rank batch that keeps a snapshot's global batch (and so its sample order) on
    ``world_size`` ranks; ConfigError listing the world sizes that work when none does."""
    per_rank, rest = divmod(global_batch, world_size * grad_accum)
    if rest or per_rank < 1:
        workable = [w for w in range(1, global_batch + 1) if global_batch % (w * grad_accum) == 0]
        raise ConfigError(f"the snapshot's global batch {global_batch} cannot be split evenly over "
                          f"{world_size} ranks x --grad-accum {grad_accum}; use a world size in {workable}")
    return per_rank


def move_aside(run_dir: Path) -> Path | None:
    """Move an earlier run's files into ``run_dir/previous-<time>/``; its path, or None if none."""
    found = [name for name in LEFTOVERS if (run_dir / name).exists()]
    if not found:
        return None
    target = run_dir / time.strftime("previous-%Y%m%d-%H%M%S")
    suffix = 1
    while target.exists():
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
        suffix += 1
    target.mkdir(parents=True)
    for name in found:
        os.replace(run_dir / name, target / name)
    return target


def check_resume_path(path: str) -> None:
    """``--resume PATH`` before any rank starts: a one-line error if it is no snapshot."""
    files.load_snapshot(Path(path))
    if Path(path).is_dir() and not (Path(path) / ".metadata").is_file():
        raise files.SnapshotError(f"snapshot {path} has no DCP metadata (.metadata); give a complete snapshot")


class Checkpointer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, run_dir: Path, strategy: Any,
                 watchdog: CollectiveMarks, group: Any = None) -> None:
        self.cfg, self.ctx, self.strategy, self.group, self.watchdog = cfg, ctx, strategy, group, watchdog
        self.dir = files.snapshot_dir(run_dir)
        self.run_dir = run_dir
        self.sharded = strategy.snapshot_format == "dcp"
        if self.sharded:  # DCP's background writes talk on a group of their own
            with watchdog.waiting("start-up: creating the snapshot writers' process group"):
                self.writer: Any = snapshot_dcp.DCPWriter(dist.new_group(backend="gloo"), ctx.is_main)
        else:
            self.writer = files.SnapshotWriter() if ctx.is_main else None
        self.saved_step = -1  # the newest snapshot's global step (-1: none yet)
        self.resumed_step: int | None = None  # loaded with --resume PATH: maybe not in our folder
        self.last_saved_at = time.perf_counter()
        self.cost_s = 0.0  # the most a snapshot has cost the training path (rank 0)

    # --- start-up --------------------------------------------------------------------------
    def restore_point(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot | None:
        """Collective: the snapshot every rank resumes from, checked on every rank, or None."""
        choice: Any = None
        if self.ctx.is_main:
            choice = self._choose()
        with self.watchdog.waiting("start-up: agreeing on the snapshot to resume"):
            choice = broadcast_object(choice if not isinstance(choice, Snapshot) else str(choice.path))
        if isinstance(choice, dict):  # rank 0 could not choose: every rank raises the same error
            raise ConfigError(choice["error"])
        if choice is None:
            return None
        path = Path(choice)
        if not path.exists():
            raise StorageNotShared(self.ctx.rank, path)
        snapshot = self._chosen if self.ctx.is_main else Snapshot(path, files.load_snapshot(path))
        current = snapshot_dcp.whole_shapes(get_model_state_dict(module))
        if path.is_dir():
            files.check_model_matches(current, snapshot_dcp.saved_shapes(path), path)
            snapshot.state.update(snapshot_dcp.load_shards(path, self.strategy.state(module, optimizer)))
            snapshot.whole = False
        else:
            files.check_model_matches(current, snapshot_dcp.whole_shapes(snapshot.state["model"]), path)
        self.saved_step = self.resumed_step = snapshot.state["progress"]["global_step"]
        return snapshot

    def _choose(self) -> Any:
        """Rank 0: the snapshot, None for a fresh start, or {"error": message}."""
        snapshot_dcp.remove_partials(self.dir)
        try:
            if self.cfg.resume == "never":
                found = None
            elif self.cfg.resume == "auto":
                found = files.load_newest(self.dir)
            else:
                found = (Path(self.cfg.resume), files.load_snapshot(Path(self.cfg.resume)))
        except ConfigError as error:
            return {"error": str(error)}
        if found is None:
            moved = move_aside(self.run_dir)
            if moved is not None:
                say(f"ddptrain: a fresh start in {self.run_dir}: moved the earlier run's files to {moved}")
            return None
        self._chosen = Snapshot(*found)
        return self._chosen

    def check_fits(self, snapshot: Snapshot, cfg: RunConfig) -> None:
        files.check_fingerprint(snapshot.state["fingerprint"], cfg.math_fingerprint(self.ctx.world_size),
                                snapshot.path)

    # --- policy ----------------------------------------------------------------------------
    def due_by_steps(self, global_step: int) -> bool:
        return bool(self.cfg.save_every) and global_step % self.cfg.save_every == 0

    def due_by_time(self) -> bool:
        """Rank 0's clock (agreed by every rank through resilience/stop_signals.StopSignal)."""
        if not self.cfg.save_seconds:
            return False
        interval = max(self.cfg.save_seconds, self.cost_s / MAX_SNAPSHOT_SHARE)
        return time.perf_counter() - self.last_saved_at >= interval

    # --- saving ----------------------------------------------------------------------------
    def save(self, global_step: int, trainer_state: Any) -> None:
        """Every rank calls this after the same step; the files are written in the background.

        ``trainer_state()`` is the Trainer's state_dict. One file (ddp): rank 0 copies it to
        CPU and its writer thread saves the copy. A DCP folder (fsdp): every rank hands its
        shards to dcp.async_save, rank 0 the rest. Each writer finishes its previous write
        before the gather below, so after the gather every rank knows that snapshot was
        committed, and checks that it can see it (shared storage)."""
        if global_step == self.saved_step:
            return
        started = time.perf_counter()
        if self.writer is not None:
            self.writer.wait()
        with self.watchdog.waiting("snapshot: gathering every rank's random state", global_step):
            rng_states = files.gather_rng_states(self.ctx.world_size, self.group)
        self._check_visible(self.saved_step)
        meta = {"format_version": files.FORMAT_VERSION, "world_size": self.ctx.world_size,
                "batch_size": self.cfg.batch_size,
                "global_batch": self.cfg.global_batch(self.ctx.world_size),
                "fingerprint": self.cfg.math_fingerprint(self.ctx.world_size), "rng": rng_states}
        if self.sharded:
            state = trainer_state()
            shards = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}
            extra = {**meta, **files.cpu_copy(state)} if self.ctx.is_main else None
            self.writer.submit(shards, extra, self.dir, global_step, self.cfg.keep)
        elif self.writer is not None:
            self.writer.submit({**meta, **files.cpu_copy(trainer_state())}, self.dir, self.cfg.keep)
        self.saved_step = global_step
        self.last_saved_at = time.perf_counter()
        self.cost_s = max(self.cost_s, self.last_saved_at - started)

    def commit(self) -> None:
        """Wait until the newest snapshot is on disk and every rank can see it."""
        if self.writer is not None:
            self.writer.wait()
        with self.watchdog.waiting("snapshot: waiting until the newest one is on disk"):
            dist.barrier()
        self._check_visible(self.saved_step)

    def newest_path(self) -> str | None:
        return str(self.dir / files.snapshot_name(self.saved_step, self.sharded)) if self.saved_step >= 0 else None

    def close(self, wait: bool = True) -> None:
        if self.writer is not None:
            self.writer.close(wait)

    def _check_visible(self, step: int) -> None:
        if step < 0 or step == self.resumed_step:
            return
        path = self.dir / files.snapshot_name(step, self.sharded)
        if not path.exists():
            raise StorageNotShared(self.ctx.rank, path)
