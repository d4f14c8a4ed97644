"""Snapshot policy: what a snapshot holds, when it is written, how a run resumes, and what
every rank knows was saved.

The run's components are handed over as ``states`` (torchtitan's ``CheckpointManager`` shape):
each has ``state_dict()`` / ``load_state_dict()`` and is saved under its name; the model and
optimizer (``weights``) apart, because under fsdp they are shards every rank writes. Where a
run starts is restore.py's; file handling (atomic writes, validated loads, rotation) is files.py's.

Saving: every ``--save-every`` steps, and when ``--save-seconds`` of training have passed
(stretched to 50x what a snapshot costs the training path, so snapshots take at most 2% of
the time), at the end and on a stop signal. Written in the background: a file by rank 0
(ddp), or a DCP folder to which every rank writes its shards (fsdp).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch.distributed as dist

from ..comm import CollectiveMarks, DistContext
from ..console import say
from ..progress import best_interval_s
from ..random_states import capture_rng, restore_rng
from ..run_dir import RunDir
from ..settings import SnapshotSettings
from . import dcp as snapshot_dcp
from . import files, rank_parts
from .restore import Snapshot

MAX_SNAPSHOT_SHARE = 0.02  # of training time, at most, spent on the training path saving
# A snapshot that waited longer than this for the previous one's write found the write outlasting
# the interval between them (a write already done answers in microseconds).
WRITE_WAIT_NOTICED_S = 0.01
# Snapshots by time are spaced this much beyond the longest write seen: spaced by the write alone,
# the next write, a few milliseconds longer, made each snapshot wait again (and lengthen it again).
WRITE_HEADROOM = 1.1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PerRank(Protocol):
    """A state every rank has its own of: saved in each rank's part of the snapshot (rank_parts.py)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any] | None, saved_world_size: int) -> None:
        """This rank's saved state (on another world size: rank 0's, for what every rank's holds
        alike; None: the snapshot has none), and the world size that saved it. A state one rank
        saves for others (a replica group's optimizer) says whose part holds it: ``saved_by()``."""


class OneTable:
    """Several components' states in one table of the snapshot (their keys never clash): the
    ``progress`` table, as snapshots since 0.1 hold it."""

    def __init__(self, *parts: Stateful) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {key: value for part in self.parts for key, value in part.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict(state)


class Weights(Protocol):
    """The model's and the optimizer's state: ``{"model": ..., "optimizer": ...}``, whole
    tensors or this rank's shards (parallel/base.ModelAndOptimizer)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None: ...


class Checkpointer:
    def __init__(self, snapshots: SnapshotSettings, recorded: Mapping[str, Any], ctx: DistContext, home: RunDir,
                 strategy: Any, marks: CollectiveMarks, weights: Weights, states: Mapping[str, Stateful],
                 per_rank: Mapping[str, PerRank] | None = None,
                 start: Snapshot | None = None, group: Any = None, uploads: Any = None,
                 on_committed: Callable[[str, dict[str, Any]], None] | None = None,
                 spare_step: int | None = None) -> None:
        """``recorded``: what every snapshot holds of the run's settings, for the run that resumes it to
        compare (``batch_size``, ``global_batch``, ``fingerprint``: RunConfig.math_fingerprint);
        ``per_rank``: states every rank has its own of (a stream's reading position), saved with
        its random states in this rank's part of the snapshot (rank_parts.py); ``start``: the snapshot
        the run resumes from (restore.restore_point), loaded by ``resume``; ``group``: a gloo group
        for the snapshot's collectives (None: the default group); ``uploads``: this rank's
        uploads.Uploader to the run dir's store, if it has one (snapshots go up behind the training,
        committed there by their manifests); ``on_committed(location, progress)``:
        called on every rank once every rank knows a snapshot is committed (Ray Train's reports);
        ``spare_step``: the step whose snapshot --keep never removes (schedules.stable_end)."""
        self.snapshots, self.recorded = snapshots, dict(recorded)
        self.ctx, self.group, self.marks = ctx, group, marks
        self.weights, self.states, self.start = weights, dict(states), start
        self.per_rank = dict(per_rank or {})
        self.home, self.dir = home, files.snapshot_dir(home.local)
        self.sharded = strategy.snapshot_format == "dcp"
        if self.sharded:  # DCP's background writes talk on a group of their own
            with marks.waiting("start-up: creating the snapshot writers' process group"):
                self.writer: Any = snapshot_dcp.DCPWriter(dist.new_group(backend="gloo"), ctx.rank, uploads,
                                                          on_main_machine=ctx.rank < ctx.local_world_size)
        else:
            self.writer = files.SnapshotWriter(uploads) if ctx.is_main else None
        self.spare(spare_step)
        # A file snapshot's parts on another machine than rank 0's go up from there (a DCP folder's
        # go with the rank's shards: dcp.DCPWriter)
        self.part_uploads = uploads if not (self.sharded or ctx.rank < ctx.local_world_size) else None
        # The newest snapshot's global step (-1: none yet); a resumed one may lie outside our folder.
        self.saved_step = self.resumed_step = start.global_step if start is not None else -1
        self.on_committed, self.announced_step = on_committed, self.saved_step
        self.saved_progress: dict[str, Any] = {}
        self.last_saved_at = time.perf_counter()
        self.cost_s = 0.0  # the most a snapshot has cost the training path (rank 0), waits for a write aside
        self.write_s = 0.0  # the longest write seen to outlast the interval after it, with WRITE_HEADROOM
        self.told_interval = False  # --mttf-hours: the interval it chose, said once
        self.told_save_every = False  # --save-every shorter than a write: said once

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a snapshot holds but its metadata: the weights, and each state by name."""
        return {**self.weights.state_dict(), **{name: s.state_dict() for name, s in self.states.items()}}

    def load_state_dict(self, state: dict[str, Any], whole: bool = True) -> None:
        self.weights.load_state_dict(state, whole)
        for name, stateful in self.states.items():
            stateful.load_state_dict(state.get(name) or {})

    def resume(self) -> bool:
        """Load the restore point into every component, and this rank's part: its per-rank
        states and, on the same world size, its random states. False on a fresh start."""
        start = self.start
        if start is None:
            return False
        self.load_state_dict(start.state, start.whole)
        saved_world = int(start.state["world_size"])
        same_world = saved_world == self.ctx.world_size
        read: dict[int, dict[str, Any] | None] = {}

        def part_of(rank: int) -> dict[str, Any] | None:
            if rank not in read:
                read[rank] = rank_parts.read_part(start.path, start.state, rank)
            return read[rank]

        mine = part_of(self.ctx.rank if same_world else 0)
        for name, stateful in self.per_rank.items():
            saved_by = getattr(stateful, "saved_by", None)  # (a state one rank saves for others: PerRank)
            part = part_of(saved_by()) if saved_by is not None and same_world else mine
            stateful.load_state_dict(part.get(name) if part else None, saved_world)
        if same_world and mine is not None:
            restore_rng(mine["rng"])
        elif same_world:
            say(f"ddptrain: warning: snapshot {start.path} has no readable part for rank {self.ctx.rank} (its "
                f"random states, in {rank_parts.parts_folder(start.path).name}/): its random draws from here are not "
                "the ones an uninterrupted run makes", sys.stderr)
        return True

    # --- policy ----------------------------------------------------------------------------
    def retarget(self, recorded: Mapping[str, Any], scheduler: Stateful, spare_step: int | None) -> None:
        """Trainer.train(max_epochs=...): a longer or shorter run (its settings as recorded), and the
        schedule made for it."""
        self.recorded, self.states["scheduler"] = dict(recorded), scheduler
        self.spare(spare_step)

    def spare(self, step: int | None) -> None:
        """The snapshot after ``step`` stays whatever --keep says (None: none does)."""
        names = frozenset({files.snapshot_name(step, folder=self.sharded)} if step is not None else ())
        if self.writer is not None:
            self.writer.spare = names
            if self.writer.uploads is not None:  # a run dir on a store: its rotations there and in the mirror
                self.writer.uploads.target.spare = names

    def due_by_time(self) -> bool:
        """Rank 0's clock (agreed by every rank through resilience/stop_signals.StopSignal)."""
        if not self.snapshots.save_seconds:
            return False
        return time.perf_counter() - self.last_saved_at >= self.interval_s()

    def interval_s(self) -> float:
        """Seconds of training between snapshots by time: --save-seconds, stretched so snapshots
        cost at most 2% of the training; with --mttf-hours, once a snapshot's cost is known,
        Young's interval from it (the costliest snapshot's: the first includes one-off work).
        Never shorter than a write that was seen to outlast it: the next snapshot would wait for it."""
        if self.snapshots.mttf_hours and self.cost_s:
            return best_interval_s(self.snapshots.mttf_hours * 3600, self.cost_s, self.write_s)
        return max(self.snapshots.save_seconds, self.cost_s / MAX_SNAPSHOT_SHARE, self.write_s)

    # --- saving ----------------------------------------------------------------------------
    def wants(self, global_step: int) -> bool:
        """Whether a snapshot after ``global_step`` would be new: none before the first step (a
        fresh start recreates that state exactly), none twice."""
        return global_step not in (0, self.saved_step)

    def save(self, global_step: int, last: bool = False) -> None:
        """Every rank calls this after the same step; the files are written in the background.

        One file (ddp): rank 0 copies the state to CPU and its writer thread saves the copy
        (``last``: no step follows before ``commit``, so CPU tensors are written as they are:
        a copy of the whole state at the end was a CPU ddp run's peak memory). A
        DCP folder (fsdp): every rank hands its shards to dcp.async_save, rank 0 the rest. Each
        writer finishes its previous write before the gather below, so after the gather every
        rank knows that snapshot was committed, and checks that it can see it (shared storage)."""
        if not self.wants(global_step):
            return
        if self.writer is not None:
            self._wait_for_the_last_write(say_it=not last)
        started = time.perf_counter()
        self._write_part(global_step)
        with self.marks.waiting("snapshot: every rank's part written", global_step):
            dist.barrier(group=self.group)
        self._check_visible(self.saved_step)
        self._announce()
        meta = {"format_version": files.FORMAT_VERSION, "world_size": self.ctx.world_size, **self.recorded}
        if self.sharded:
            state = self.state_dict()
            shards = {part: state.pop(part) for part in ("model", "optimizer", "ema") if part in state}
            extra = {**meta, **files.cpu_copy(state, copy=not last)} if self.ctx.is_main else None
            self.writer.submit(shards, extra, self.dir, global_step, self.snapshots.keep, last=last)
        elif self.writer is not None:
            self.writer.submit({**meta, **files.cpu_copy(self.state_dict(), copy=not last)}, self.dir,
                               self.snapshots.keep)
        self.saved_step = global_step
        self.saved_progress = dict(self.states["progress"].state_dict()) if "progress" in self.states else {}
        self.last_saved_at = time.perf_counter()
        self.cost_s = max(self.cost_s, self.last_saved_at - started)
        by_time = self.snapshots.mttf_hours and self.snapshots.save_seconds
        if by_time and self.ctx.is_main and not (self.told_interval or last):
            self.told_interval = True  # (the first snapshot's cost is known: the interval it sets, said once)
            say(f"ddptrain: snapshots every {self.interval_s():.3g} s of training from now (--mttf-hours "
                f"{self.snapshots.mttf_hours:g}: Young's interval for a snapshot that blocks {self.cost_s:.3g} s)")

    def _wait_for_the_last_write(self, say_it: bool = True) -> None:
        """The previous snapshot's write, finished. One that outlasted the interval since (this
        snapshot waited for it) took at least that interval and the wait: snapshots by time are
        spaced by it from now on, and a --save-every shorter than it is said, once (rank 0; not
        ``say_it``: the run's last snapshot, after which no interval matters)."""
        before, interval = time.perf_counter(), self.interval_s()
        self.writer.wait()
        waited = time.perf_counter() - before
        if waited < WRITE_WAIT_NOTICED_S:
            return
        took = time.perf_counter() - self.last_saved_at
        self.write_s = max(self.write_s, took * WRITE_HEADROOM)
        if not (self.ctx.is_main and say_it):
            return
        if self.snapshots.save_seconds and self.interval_s() > interval:
            say(f"ddptrain: a snapshot's write took {took:.3g} s, longer than the {interval:.3g} s between "
                f"snapshots by time: one every {self.interval_s():.3g} s of training from now")
        if self.snapshots.save_every and not self.told_save_every:
            self.told_save_every = True
            say(f"ddptrain: a snapshot waited {waited:.3g} s for the previous one's write ({took:.3g} s): "
                f"--save-every {self.snapshots.save_every} starts them faster than they are written; raise it "
                "(each such snapshot holds the training up by its wait)")

    def _write_part(self, global_step: int) -> None:
        """This rank's part of the snapshot (rank_parts.py), on disk before the collective that follows:
        every rank's is, before rank 0 commits the snapshot. A rank on another machine than rank
        0's, of a run dir on a store, uploads its own."""
        part = {"rng": capture_rng(), **{name: s.state_dict() for name, s in self.per_rank.items()}}
        written = rank_parts.write_part(self.dir, global_step, self.sharded, self.ctx.rank, self.ctx.world_size, part)
        if self.part_uploads is not None:
            self.part_uploads.add_part(files.snapshot_name(global_step), [(written, f"ranks/{written.name}")])

    def commit(self) -> None:
        """Wait until the newest snapshot is on disk and every rank can see it."""
        if self.writer is not None:
            self.writer.wait()
        with self.marks.waiting("snapshot: waiting until the newest one is on disk"):
            dist.barrier()
        self._check_visible(self.saved_step)
        self._announce()

    def _announce(self) -> None:
        """The newest snapshot is committed and every rank knows it (after the gather in
        ``save``, or the barrier in ``commit``): tell ``on_committed``, once per snapshot."""
        if self.on_committed is None or self.saved_step in (-1, self.announced_step):
            return
        self.announced_step = self.saved_step
        self.on_committed(self.newest_path() or "", self.saved_progress)

    def newest_path(self) -> str | None:
        if self.saved_step < 0:
            return None
        name = files.snapshot_name(self.saved_step, self.sharded)
        return self.home.url_of(f"snapshots/{name}")

    def close(self, wait: bool = True) -> None:
        if self.writer is not None:
            self.writer.close(wait)

    def _check_visible(self, step: int) -> None:
        if step < 0 or step == self.resumed_step:
            return
        self.home.check_visible(self.dir / files.snapshot_name(step, self.sharded), self.ctx.rank)
