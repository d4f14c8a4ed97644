"""What each planned rank is doing, said on a terminal while a plan runs: a plan can take minutes
(GPT-2 with fake tensors at 16,384 ranks: 166 s) and said nothing until its end.

A planned rank (a process of plan/job.plan_ranks' pool) says each phase as it begins with
``doing``: building the task, wrapping the model, each step, measuring. The planning process
gathers them on a thread and prints one line every ``PROGRESS_EVERY_S`` seconds, the ranks
grouped by what they are doing. Nothing is said off a terminal or with ``--json`` (``Progress``
is then never made), and nothing at all by a plan that ends within the first interval.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, TextIO

PROGRESS_EVERY_S = 3.0  # between two lines (DDPTRAIN_PLAN_PROGRESS_S: another interval)
SHOWN_RANKS = 4  # ranks named per phase; the others counted

_said: Any = None  # in a planned rank's process: the queue its phases go to (None: not watched)
_rank = -1


def listen(said: Any) -> None:
    """A planned rank's process, as it starts: where its phases go."""
    global _said
    _said = said


def now_planning(rank: int) -> None:
    global _rank
    _rank = rank
    doing("joining the world")


def doing(what: str) -> None:
    """This planned rank begins ``what`` (nothing when no one watches)."""
    if _said is not None:
        _said.put((_rank, what, time.monotonic()))


def every_s() -> float:
    return float(os.environ.get("DDPTRAIN_PLAN_PROGRESS_S") or PROGRESS_EVERY_S)


class Progress:
    """The planning process: the ranks' phases from ``said``, a line every interval on ``out``."""

    def __init__(self, said: Any, ranks: list[int], out: TextIO) -> None:
        self.said, self.out, self.every = said, out, every_s()
        self.phases: dict[int, tuple[str, float]] = {}  # rank -> (what, since)
        self.waiting, self.started = set(ranks), time.monotonic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="ddptrain-plan-progress", daemon=True)

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()

    def _watch(self) -> None:
        due = self.started + self.every
        while not self.stopping.is_set():
            try:
                rank, what, since = self.said.get(timeout=max(0.0, min(0.2, due - time.monotonic())))
                self.phases[rank] = (what, since)
                self.waiting.discard(rank)
            except queue.Empty:
                pass
            except (EOFError, OSError):  # the queue's pipe closed under us: the plan is ending
                return
            if time.monotonic() >= due and not self.stopping.is_set():
                print(self.line(time.monotonic()), file=self.out, flush=True)
                due = time.monotonic() + self.every

    def line(self, now: float) -> str:
        """``ddptrain plan, 9 s: rank 0 at step 2 of 3 (4 s); ranks 1, 2 wrapping the model (8 s)``."""
        by_phase: dict[str, list[int]] = {}
        for rank, (what, _) in sorted(self.phases.items()):
            by_phase.setdefault(what, []).append(rank)
        parts = []
        for what, ranks in by_phase.items():
            longest = now - min(self.phases[rank][1] for rank in ranks)
            parts.append(f"{_ranks(ranks)} {what} ({longest:.0f} s)")
        if self.waiting:
            parts.append(f"{_ranks(sorted(self.waiting))} not started yet")
        return f"ddptrain plan, {now - self.started:.0f} s: " + "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(rank) for rank in ranks[:SHOWN_RANKS])
    more = f" and {len(ranks) - SHOWN_RANKS} more" if len(ranks) > SHOWN_RANKS else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"
