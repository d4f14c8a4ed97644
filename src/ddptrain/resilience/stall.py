"""A job of one rank that stops making progress: the watchdog's hang judge needs a rank waiting
inside a collective for one that never arrives, and one rank never waits for anyone, so a hang
in its data or in the user's code would last for ever. ``StallWatch`` is its judge: a thread
that ends the rank once its marks (the steps, the collectives it enters, the phases it passes)
stand still for ``--timeout`` seconds, evaluations and snapshots left out (they may take longer
than a step), with the same report as a hang of several ranks: the rank, where it stood, its
stack (RUN_DIR/logs/hang.txt, then the stacks), exit status 1.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..console import say
from ..errors import RankStuck
from .failures import hard_exit, record_error
from .hangs import dump_stacks

PERIOD_S = 0.5  # how often the marks are read


class StallWatch:
    """Started by the watchdog of a one-rank job when training begins; ended with it."""

    def __init__(self, marks: Any, timeout_s: float, run_dir: Path | None, finished: threading.Event,
                 period_s: float = PERIOD_S) -> None:
        """``marks``: the rank's Watchdog (its ``arrivals``, ``inside``, ``label``, ``step`` and
        ``aside_depth``, written by the main thread); ``finished``: set when the rank's work is done."""
        self.marks, self.timeout_s, self.run_dir = marks, timeout_s, run_dir
        self.finished, self.period_s = finished, period_s
        self.main_thread = threading.get_ident()
        self.over = threading.Event()  # the loop is over: the end's writes and waits are not judged

    def start(self) -> StallWatch:
        threading.Thread(target=self._run, name="ddptrain-stall-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self.over.set()

    def _now(self) -> tuple[Any, ...]:
        marks = self.marks
        return marks.arrivals, marks.inside, marks.label, marks.step

    def _run(self) -> None:
        seen, since = self._now(), time.monotonic()
        while not self.finished.wait(self.period_s) and not self.over.is_set():
            now = self._now()
            if now != seen or self.marks.aside_depth:  # moving, or in an evaluation or a snapshot
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.timeout_s:
                self._stalled()

    def _where(self) -> str:
        """What the rank has not done: leave the collective it is in, or go on after its last mark."""
        marks = self.marks
        where = marks.label if marks.step is None else f"{marks.label} (step {marks.step})"
        return f"did not leave {where}" if marks.inside else f"did not move on after {where}"

    def _stalled(self) -> None:
        stacks_dir = self.run_dir / "logs" / "stacks" if self.run_dir is not None else None
        stack = dump_stacks(stacks_dir, 0, self.main_thread)
        where = self._where()
        summary = [f"ddptrain: rank 0 {where} within --timeout {self.timeout_s:g} s (it is the "
                   "job's only rank: nothing else waits for it).",
                   "ddptrain: rank 0 was in (innermost call last):", stack]
        if stacks_dir is not None:
            summary.append(f"ddptrain: every rank's stack: {stacks_dir}")
        if self.run_dir is not None:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            (self.run_dir / "logs" / "hang.txt").write_text("\n".join(summary) + "\n")
        if not os.environ.get("DDPTRAIN_LOCAL_LAUNCH"):  # ddptrain's own launcher prints it
            say("\n".join(summary), sys.stderr)
        record_error(RankStuck(f"rank 0 {where} within --timeout {self.timeout_s:g} s; it was "
                               f"in:\n{stack}"))
        hard_exit(1)
