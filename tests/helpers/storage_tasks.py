"""Test tasks for where snapshots go: rank 0 dies after a snapshot's files reached the store but
before its manifest did; a disk whose snapshot writes are slow. Named as ``--task storage_tasks:NAME``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddptrain import Task
from ddptrain.tasks import regression_task

from kills import _first_attempt, _rank


def cut_before_manifest(cfg) -> Task:
    """On the first attempt, rank 0 SIGKILLs itself at its CUT_COMMIT-th snapshot commit: the
    snapshot's file is in the store, its manifest is not (MARKER names the snapshot)."""
    marker = Path(os.environ["MARKER"])
    if _rank() == 0 and _first_attempt(marker):
        from ddptrain.run_dir import StoreRunDir

        commit, calls = StoreRunDir.commit_snapshot, {"n": 0}

        def cut(self: StoreRunDir, name: str) -> None:
            calls["n"] += 1
            if calls["n"] == int(os.environ["CUT_COMMIT"]):
                assert self.exists(f"snapshots/{name}"), "the snapshot's file should be uploaded already"
                marker.write_text(name)
                os.kill(os.getpid(), signal.SIGKILL)
            commit(self, name)
        StoreRunDir.commit_snapshot = cut  # type: ignore[method-assign]
    return regression_task(cfg)


def slow_writes(cfg) -> Task:
    """The regression task, each step sleeping STEP_SLEEP seconds, on a disk where writing a
    snapshot file takes WRITE_SLEEP seconds more (behind the training, in the writer's thread)."""
    from ddptrain.snapshots import files

    write, pause = files.write_snapshot, float(os.environ["WRITE_SLEEP"])

    def slow(*args, **kwargs):
        time.sleep(pause)
        return write(*args, **kwargs)
    files.write_snapshot = slow  # type: ignore[assignment]
    from ddptrain_test_tasks import paced

    return paced(cfg)
