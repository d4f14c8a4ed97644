"""Where a run starts: the snapshot every rank resumes from, or a fresh start.

Start-up is one collective step, ``restore_point``, taken before the data is built (a resume
on another world size changes the batch size per rank, and with it the data and the schedule):

- ``--resume never``, or nothing to resume: a fresh start. Files an earlier run left in the
  run dir (snapshots, metrics.jsonl, model.pt) are moved aside to ``previous-<time>/`` and
  named in one line, so the new run owns its folder.
- ``--resume auto``: rank 0 picks the newest snapshot that loads; ``--resume PATH``: that
  one. Rank 0 broadcasts its choice (or the reason there is none); every rank loads it and
  checks that it fits the model and the math settings, so all fail or succeed together.

Loading the snapshot into the run's components is the checkpointer's (``Checkpointer.resume``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .. import schedules
from ..comm import CollectiveMarks, DistContext, broadcast_object
from ..console import say
from ..errors import ConfigError
from ..run_dir import TIMELINE, RunDir, StoreRunDir
from ..settings import RunConfig, SnapshotSettings
from ..settings.task_options import without_resumable
from . import dcp as snapshot_dcp
from . import files
from .uploads import mirror_is_ahead, sync_up


@dataclass
class Snapshot:
    path: Path
    state: dict[str, Any]
    whole: bool = True  # weights are whole tensors (a file), not this rank's shards (a DCP folder)

    @property
    def global_step(self) -> int:
        return int(self.state["progress"]["global_step"])


def restore_point(snapshots: SnapshotSettings, ctx: DistContext, home: RunDir, module: torch.nn.Module,
                  templates: Callable[[], dict[str, Any]], marks: CollectiveMarks) -> Snapshot | None:
    """Collective: the snapshot every rank resumes from, checked on every rank, or None.
    ``templates()``: this run's own state dicts of the weights (model, optimizer, ema), which
    a DCP snapshot is loaded into."""
    chosen: Snapshot | None = None
    choice: Any = None
    if isinstance(home, StoreRunDir) and ctx.local_rank == 0 and mirror_is_ahead(home.local):
        _from_store(home, lambda: sync_pending(home, snapshots.keep))
    if snapshots.resume != "never":
        pull(home, ctx, marks)
    if ctx.is_main:
        choice = _choose(snapshots.resume, home)
        chosen = choice if isinstance(choice, Snapshot) else None
    with marks.waiting("start-up: agreeing on the snapshot to resume"):
        choice = broadcast_object(str(choice.path) if isinstance(choice, Snapshot) else choice)
    if isinstance(choice, dict):  # rank 0 could not choose: every rank raises the same error
        raise ConfigError(choice["error"])
    if choice is None:
        return None
    path = Path(choice)
    home.check_visible(path, ctx.rank)
    snapshot = chosen or Snapshot(path, files.load_snapshot(path))
    current = snapshot_dcp.whole_shapes(cast(dict[str, torch.Tensor], get_model_state_dict(module)))
    if path.is_dir():
        files.check_model_matches(current, snapshot_dcp.saved_shapes(path), path)
        shards = templates()
        if "ema" in shards and not snapshot_dcp.holds(path, "ema"):  # written without --ema
            del shards["ema"]
        snapshot.state.update(snapshot_dcp.load_shards(path, shards))
        snapshot.whole = False
    else:
        files.check_model_matches(current, snapshot_dcp.whole_shapes(snapshot.state["model"]), path)
    return snapshot


def pull(home: RunDir, ctx: DistContext, marks: CollectiveMarks) -> None:
    """Collective: every machine's mirror of a store's run dir gets the store's committed
    snapshots (each machine's first rank fetches them), rank 0 the run's files. A snapshot
    without its manifest (an upload cut short) is never loaded: rank 0 names it and removes it
    from the store. (A folder holds its own: nothing is fetched, the ranks only meet.)"""
    if ctx.local_rank == 0:
        cut = _from_store(home, lambda: home.pull(remove_cut=ctx.is_main))
        for name in cut if ctx.is_main else []:
            say(f"ddptrain: snapshot {home.url_of('snapshots/' + name)} was never committed (no manifest: its "
                "upload was cut short); removed it", sys.stderr)
    if ctx.is_main:
        _from_store(home, home.pull_run_files)
    with marks.waiting("start-up: every machine's copy of the run's snapshots"):
        dist.barrier()


def sync_pending(home: StoreRunDir, keep: int) -> None:
    """This machine's mirror holds uploads an earlier run could not make (uploads.py): they go
    first, before anything is read from the store."""
    sent = sync_up(home, keep)
    if sent:
        say(f"ddptrain: uploaded {sent} file(s) an earlier run on this machine could not ({home} "
            "did not answer then)", sys.stderr)


T = TypeVar("T")


def _from_store(home: RunDir, read: Callable[[], T]) -> T:
    """``read()``; a store that fails it is one line (ConfigError), not the client's traceback."""
    try:
        return read()
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - every client's own errors
        if not isinstance(home, StoreRunDir):  # a folder's own error is no store's
            raise
        text = " ".join(str(error).split())[:160]
        ahead = (f"; this machine's mirror {home.local} holds uploads it lacks, which go first"
                 if mirror_is_ahead(home.local) else "")
        raise ConfigError(f"--run-dir {home}: the store failed at start-up ({type(error).__name__}: {text})"
                          f"{ahead}; run the same command again once it answers") from None


def _choose(resume: str, home: RunDir) -> Snapshot | dict[str, str] | None:
    """Rank 0: the snapshot --resume names, None for a fresh start, or {"error": message}."""
    snapshots = files.snapshot_dir(home.local)
    snapshot_dcp.remove_partials(snapshots)
    try:
        if resume == "never":
            found = None
        elif resume == "auto":
            found = files.load_newest(snapshots)
        else:
            found = (Path(resume), files.load_snapshot(Path(resume)))
    except ConfigError as error:
        return {"error": str(error)}
    if found is None:
        # An attempt killed before its first snapshot (no snapshot, no model.pt) is this run's
        # first attempt: its timeline stays, so goodput counts its steps as redone.
        def move_aside() -> str | None:
            unfinished = resume == "auto" and not home.holds("model.pt")
            return home.move_aside(time.strftime("%Y%m%d-%H%M%S"), (TIMELINE,) if unfinished else ())
        moved = _from_store(home, move_aside)
        if moved is not None:
            say(f"ddptrain: a fresh start in {home}: moved the earlier run's files to {moved}")
        return None
    return Snapshot(*found)


# A task's own schedule (Task.make_scheduler) is given the run's length, which the settings' roles
# leave out of the fingerprint under a constant --lr-schedule: snapshots of such runs hold it here.
TASK_SCHEDULE_LENGTH = "task_schedule_length"


@dataclass
class TaskSchedule:
    """A task's own schedule as a resume checks it: its factory and the run's groups' base rates."""

    make: Callable[[torch.optim.Optimizer, int], Any]
    group_rates: list[float]


def task_schedule_length(cfg: RunConfig) -> list[Any]:
    """The run's length as a task's schedule is given it: [--max-steps, the epochs]."""
    return [cfg.max_steps, cfg.epochs]


def resumed_config(start: Snapshot | None, cfg: RunConfig, world_size: int,
                   info: Callable[[str], None], task_schedule: TaskSchedule | None = None) -> RunConfig:
    """The config a run continues ``start`` with: on another world size, the per-rank batch that
    keeps the snapshot's global batch (and so the sample order); then the math settings checked."""
    if start is None:
        return cfg
    saved_ranks = start.state.get("data_world", start.state["world_size"])  # (before --tp: the world)
    ranks = cfg.data_ranks(world_size)  # the data-parallel ranks the global batch is shared over
    if saved_ranks != ranks:
        batch = adapt_batch(start.state["global_batch"], ranks, cfg.grad_accum)
        # one line per membership change (an elastic job shrinking or growing says it here)
        what = "world size" if saved_ranks == start.state["world_size"] and ranks == world_size else \
            "data-parallel ranks"
        info(f"{what} {saved_ranks} → {ranks} at step {start.global_step}: batch size "
             f"per rank {batch} keeps the global batch {start.state['global_batch']}")
        cfg = cfg.replace(batch_size=batch)
    resumable = cfg.task_options_resumable()  # (the task's word: changing them changes no weight)
    saved = without_resumable(start.state["fingerprint"], resumable)
    current = without_resumable(cfg.math_fingerprint(ranks), resumable)
    if task_schedule is not None and TASK_SCHEDULE_LENGTH in saved:  # (older snapshots do not hold it)
        current[TASK_SCHEDULE_LENGTH] = task_schedule_length(cfg)
        if _task_schedule_goes_on(saved, current, task_schedule, start, info):
            saved = {**saved, TASK_SCHEDULE_LENGTH: current[TASK_SCHEDULE_LENGTH]}
    if _longer_run_goes_on_exactly(saved, current, cfg, start, info):
        saved = {**saved, "max_steps": current["max_steps"]}
    files.check_fingerprint(saved, current, start.path)
    return cfg


def _task_schedule_goes_on(saved: dict[str, Any], current: dict[str, Any], schedule: TaskSchedule, start: Snapshot,
                           info: Callable[[str], None]) -> bool:
    """A resume under another length of a run whose task builds its schedule: accepted when the
    schedule gives every step so far the rate it had (nanogpt_schedule decays to its own
    lr_decay_iters, whatever the run's length), refused in one line when not, or when the run is
    counted in epochs (its length in steps is not known before its data)."""
    if set(files.changed_keys(saved, current)) != {TASK_SCHEDULE_LENGTH}:
        return False
    (before, epochs_before), (after, epochs_after), step = saved[TASK_SCHEDULE_LENGTH], current[TASK_SCHEDULE_LENGTH], \
        start.global_step
    by_steps = epochs_before == epochs_after == math.inf and before is not None and after is not None
    if by_steps and step <= after and schedules.task_schedule_agrees(schedule.make, schedule.group_rates, before,
                                                                     after, step):
        info(f"--max-steps {before} → {after} at step {step}: the task's schedule gave every step so far the rate a "
             f"run of {after} steps gives it, so the run goes on as one started with {after}")
        return True
    was = f"--max-steps {before}" if epochs_before == math.inf else f"--max-epochs {epochs_before:g}"
    raise ConfigError(f"snapshot {start.path} (step {step}) was taken in a run of {was} whose task builds its own "
                      "schedule (Task.make_scheduler), which gives the steps so far other rates over the new length, "
                      f"so it cannot go on exactly; keep {was}, or start a new run from its weights and optimizer "
                      f"state with --init-from {start.path} --init-optimizer")


def _longer_run_goes_on_exactly(saved: dict[str, Any], current: dict[str, Any], cfg: RunConfig, start: Snapshot,
                                info: Callable[[str], None]) -> bool:
    """Whether a resume that changes only --max-steps is the run that length would have been from
    the start: every step so far had the rate the new length gives it (schedule_agrees; a
    warmup-stable-decay before its decay). Said in one line when it is; refused in one line naming
    what can go on when the schedule already differs."""
    if set(files.changed_keys(saved, current)) != {"max_steps"} or saved.get("max_epochs") != math.inf:
        return False
    before, after, step = saved["max_steps"], current["max_steps"], start.global_step
    if after is None or before is None or step > after:
        return False
    if schedules.schedule_agrees(cfg.optim, before, after, step):
        decay = schedules.decay_start(cfg.warmup_steps, after, cfg.decay_fraction)
        info(f"--max-steps {before} → {after} at step {step}: every step so far had the rate a run of {after} "
             f"steps gives it, so the run goes on as one started with {after}"
             + (f" (its decay begins at step {decay})" if cfg.lr_schedule != "constant" else ""))
        return True
    raise ConfigError(_cannot_extend(cfg, before, after, start))


def _cannot_extend(cfg: RunConfig, before: int, after: int, start: Snapshot) -> str:
    """The refusal of a longer (or shorter) run whose schedule has already differed, with what can go on."""
    decay = schedules.decay_start(cfg.warmup_steps, before, cfg.decay_fraction)
    earlier = [path for path in files.list_snapshots(start.path.parent) if files.snapshot_step(path) <= decay]
    how = (f"resume its snapshot from before the decay with --resume {earlier[-1]}" if earlier and
           cfg.decay_fraction is not None else
           "a run with --decay-fraction F (warmup-stable-decay) goes on from any snapshot before its decay; "
           f"from this one, start a new run from its weights and optimizer state with --init-from {start.path} "
           "--init-optimizer")
    return (f"--max-steps {before} → {after}: snapshot {start.path} (step {start.global_step}) was taken under a "
            f"{cfg.lr_schedule} decay from step {decay} of {before}, whose rates a run of {after} steps does not "
            f"share, so it cannot go on exactly; {how}, or keep --max-steps {before}")


def adapt_batch(global_batch: int, world_size: int, grad_accum: int) -> int:
    """The per-rank batch that keeps a snapshot's global batch (and so its sample order) on
    ``world_size`` ranks; ConfigError listing the world sizes that work when none does."""
    per_rank, rest = divmod(global_batch, world_size * grad_accum)
    if rest or per_rank < 1:
        workable = [w for w in range(1, global_batch + 1) if global_batch % (w * grad_accum) == 0]
        raise ConfigError(f"the snapshot's global batch {global_batch} cannot be split evenly over "
                          f"{world_size} ranks x --grad-accum {grad_accum}; use a world size in {workable}")
    return per_rank


def check_resume_path(path: str) -> None:
    """``--resume PATH`` before any rank starts: a one-line error if it is no snapshot."""
    files.load_snapshot(Path(path))
    if Path(path).is_dir() and not (Path(path) / ".metadata").is_file():
        raise files.SnapshotError(f"snapshot {path} has no DCP metadata (.metadata); give a complete snapshot")
