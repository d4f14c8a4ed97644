"""Test tasks for run dirs on object storage: rank 0 dies after a snapshot's files reached the
store but before its manifest did. Named as ``--task storage_tasks:NAME``."""

from __future__ import annotations

import os
import signal
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
