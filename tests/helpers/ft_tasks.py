"""Tasks for --fault-tolerance torchft: the tutorial's regression, each step a little slower
(STEP_SLEEP seconds), rank 0 noting when each of its losses is computed (STEP_LOG), the
killable variant (kills.py), and one killed inside a meeting of the groups (KILL_MEETING).
HOLD_AT / HOLD_UNTIL: rank 0 waits at its HOLD_AT-th loss until the file HOLD_UNTIL exists
(which STARTED writes when a group's job builds its task): a group restarted on a busy machine
then still finds the other training. Named as ``--task ft_tasks:NAME``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddptrain import Task
from ddptrain.tasks import regression_task

from kills import _on_step, _rank, killable


def paced(cfg) -> Task:
    task = regression_task(cfg)
    if os.environ.get("STARTED"):
        Path(os.environ["STARTED"]).write_text("started")
    log = Path(os.environ["STEP_LOG"]) if os.environ.get("STEP_LOG") and _rank() == 0 else None
    pause = float(os.environ.get("STEP_SLEEP", "0"))
    hold_at, until = int(os.environ.get("HOLD_AT", "0")), Path(os.environ.get("HOLD_UNTIL", "/nonexistent"))

    def note(n: int) -> None:
        time.sleep(pause)
        if n == hold_at and _rank() == 0:
            deadline = time.monotonic() + 180
            while not until.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if log is not None:
            with open(log, "a") as out:
                out.write(f"{time.time():.3f}\n")
    return _on_step(task, note)


kill_paced = killable(paced)


def kill_in_meeting(cfg) -> Task:
    """``paced``, whose rank SIGKILLs itself inside its KILL_MEETING-th meeting of the replica
    groups (--sync: torchft's all-reduce of what the groups bring), once it has started that
    all-reduce, in the first attempt (KILL_MARKER)."""
    task = paced(cfg)
    if os.environ.get("KILL_MEETING"):
        from torchft.manager import Manager

        meeting, marker, allreduce = int(os.environ["KILL_MEETING"]), Path(os.environ["KILL_MARKER"]), Manager.allreduce
        calls = {"n": 0}

        def allreduce_then_die(self, tensor, *args, **kwargs):
            work = allreduce(self, tensor, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] == meeting and not marker.exists():
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            return work

        Manager.allreduce = allreduce_then_die
    return task
