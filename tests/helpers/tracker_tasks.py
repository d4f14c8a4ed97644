"""Test tasks for the experiment trackers: rank 0 waits, at a given step, until the tracker has
taken a given step (trackers.json says so), then kills itself or the tracker's server. Named
as ``--task tracker_tasks:NAME``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from ddptrain import Task
from ddptrain.tasks import regression_task

from kills import _first_attempt, _on_step, _rank


def _wait_until_tracked(run_dir: Path, tracker: str, step: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((run_dir / "trackers.json").read_text())[tracker]["through_step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{tracker} never took step {step}")


def _at_step_once_tracked(cfg, then) -> Task:
    """At rank 0's AT_STEP-th loss (first attempt only): wait until the tracker TRACKER has step
    TRACKED_STEP, then ``then()``."""
    at, tracked, marker = int(os.environ["AT_STEP"]), int(os.environ["TRACKED_STEP"]), Path(os.environ["MARKER"])

    def maybe(n: int) -> None:
        if n == at and _rank() == 0 and _first_attempt(marker):
            _wait_until_tracked(Path(cfg.run_dir), os.environ["TRACKER"], tracked)
            marker.write_text("done")
            then()
    return _on_step(regression_task(cfg), maybe)


def killed_once_tracked(cfg) -> Task:
    """Rank 0 SIGKILLs itself (and so its tracking thread) once the tracker has TRACKED_STEP."""
    return _at_step_once_tracked(cfg, lambda: os.kill(os.getpid(), signal.SIGKILL))


def server_dies_once_tracked(cfg) -> Task:
    """The tracker's server (process group SERVER_PGID) is SIGKILLed once it has TRACKED_STEP."""
    return _at_step_once_tracked(cfg, lambda: os.killpg(int(os.environ["SERVER_PGID"]), signal.SIGKILL))
