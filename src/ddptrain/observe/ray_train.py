"""Ray Train: ``ddptrain.fit()`` inside a ``TorchTrainer``'s worker function.

Ray starts the workers and their process group; ddptrain runs as that rank on it (never
initialising or destroying it: launch/group.py). Ray restarts the whole group after a worker
fails (``FailureConfig(max_failures=N)``); the restarted workers call ``fit()`` again and it
resumes from ddptrain's newest snapshot in the shared run dir, bitwise, as after any restart.

What Ray learns: after each snapshot is committed, every worker calls ``ray.train.report`` with
where the run is, and rank 0 attaches a small Ray checkpoint (``ddptrain_snapshot.json``: the
run dir and the snapshot's location), so Ray's result names ddptrain's newest snapshot. The
weights stay in ddptrain's snapshot (Ray's storage gets the pointer, not a second copy).

Ray sets no restart count (torchrun and Slurm do), so a restart under ``resume="never"`` is
known by the trial: rank 0 leaves the Ray run's id (Tune's trial, or Ray Train's controller run) in the run dir
(``.ray-trial``) once the run's start is settled, and a start of the same run finding it there is
Ray's restart, which resumes the job's own snapshots (``ray_restarted``). (The mark is in the run dir's folder on
rank 0's machine: for a run dir on a store, a restart whose rank 0 is on another machine starts
afresh.)

Without a ``run_dir``, the run lives in Ray's own storage for the job
(``RunConfig(storage_path=...)``/``name``/``ddptrain``): the folder Ray keeps the job's results
in, which a restarted group finds again (a local folder, or ``s3://``/``gs://`` as Ray was given).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..console import say
from ..errors import ConfigError

POINTER = "ddptrain_snapshot.json"
TRIAL_MARK = ".ray-trial"  # in the run dir: the Ray trial training it, left by its first start's rank 0


def ray_train_session() -> Any | None:
    """``ray.train`` when this process is a Ray Train worker, else None. ddptrain never imports
    Ray itself: a worker function has imported it already."""
    if "ray.train" not in sys.modules:
        return None
    train = sys.modules["ray.train"]
    try:
        train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001 - outside a worker Ray raises one of several errors
        return None
    return train


# pyarrow's file systems Ray's storage may be on, and the URL scheme ddptrain reads them with
RAY_FILESYSTEMS = {"LocalFileSystem": "", "S3FileSystem": "s3://", "GcsFileSystem": "gs://"}


def ray_storage_run_dir() -> str | None:
    """Inside a Ray Train worker: the run dir in Ray's storage for this job; None elsewhere."""
    train = ray_train_session()
    if train is None:
        return None
    try:  # (get_storage is Ray's DeveloperAPI: checked rather than trusted)
        storage = train.get_context().get_storage()
        kind = type(storage.storage_filesystem).__name__
        path = f"{storage.storage_fs_path.rstrip('/')}/{storage.experiment_dir_name}/ddptrain"
    except Exception as error:  # noqa: BLE001 - any failure means the same to the user
        raise ConfigError(f"fit() in a Ray Train worker without run_dir, and Ray's storage path could not be read "
                          f"({type(error).__name__}); pass run_dir= storage every worker sees") from None
    if kind not in RAY_FILESYSTEMS:
        raise ConfigError(f"fit() in a Ray Train worker without run_dir: Ray's storage is a {kind}, which ddptrain "
                          "cannot write; pass run_dir= storage every worker sees (a shared folder or s3://...)")
    run_dir = RAY_FILESYSTEMS[kind] + path
    if train.get_context().get_world_rank() == 0:
        say(f"ddptrain: fit() in a Ray Train worker without run_dir: the run lives in Ray's storage, {run_dir}")
    return run_dir


def _trial(train: Any) -> str | None:
    """The Ray Train run this worker is part of, the same in every restart of its workers: Tune's
    trial (Ray Train's first API), else the run of Ray Train's controller (its second, where
    trials are gone; an internal name, so checked rather than trusted); None: not known."""
    try:
        return f"trial {train.get_context().get_trial_id()}"
    except Exception:  # noqa: BLE001 - Ray Train's second API raises DeprecationWarning here
        pass
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return f"run {get_train_context().train_run_context.run_id}"
    except Exception:  # noqa: BLE001 - neither: restarts under resume never start afresh, as before
        return None


def ray_restarted(folder: Path) -> bool:
    """Inside a Ray Train worker: whether this start is Ray's restart of the trial that trains the
    run dir (``folder``, on this machine), whose first start left the trial's id there."""
    train = ray_train_session()
    if train is None or (trial := _trial(train)) is None:
        return False
    mark = folder / TRIAL_MARK
    return mark.is_file() and mark.read_text().strip() == trial


class RayReports:
    """Tells Ray about each committed snapshot (a no-op outside Ray Train)."""

    def __init__(self, run_dir: str, is_main: bool, folder: Path | None = None) -> None:
        """``folder``: the run dir on this machine, where rank 0 marks the trial training it (made
        once the run's start is settled: every rank has chosen how to resume, an earlier run's
        files are aside)."""
        self.train = ray_train_session()
        self.run_dir, self.is_main = run_dir, is_main
        if self.train is not None and is_main and folder is not None and (trial := _trial(self.train)):
            (folder / TRIAL_MARK).write_text(trial + "\n")

    @property
    def active(self) -> bool:
        return self.train is not None

    def committed(self, location: str, progress: dict[str, Any]) -> None:
        """Every worker, after the same snapshot: ``progress`` (epoch, global_step, ...) as Ray's metrics."""
        if self.train is None:
            return
        metrics = {"epoch": progress.get("epoch"), "global_step": progress.get("global_step"), "snapshot": location}
        if not self.is_main:
            self.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="ddptrain-ray-") as folder:
            (Path(folder) / POINTER).write_text(json.dumps({"run_dir": self.run_dir, **metrics}) + "\n")
            self.train.report(metrics, checkpoint=self.train.Checkpoint.from_directory(folder))
