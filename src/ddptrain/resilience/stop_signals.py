"""Stop signals and time-based snapshots: decisions every rank takes after the same step.

SIGTERM (torchelastic, Slurm), SIGUSR1 (Slurm's ``--signal``) and SIGINT (Ctrl-C, which the
elastic agent also forwards to every rank; if the ranks do not stop within its 30 s it kills
them) only set a flag. The ranks agree on it with one small asynchronous all-reduce at
agreed step boundaries: the collective started at one check is read at the next, so no step
waits for it, and every rank acts after the same step. The same message carries rank 0's
"a snapshot is due" (snapshots by time need every rank to take them after the same step).

A collective every step would cost ~1 ms on a 4 ms step (measured, tutorial job, 2 CPU
ranks), so checks are spaced to about CHECK_SECONDS apart: each check also carries every
rank's proposed interval (steps that fit in CHECK_SECONDS), and all ranks take the
smallest. A stop is acted upon within about two intervals, far inside the 30 s torchelastic
and Slurm give before SIGKILL. The interval is counted in steps at the speed measured before
it: a machine that turns 10x slower mid-interval (a CPU hog beside a small job) stretches the
wait 10x, so the checks are half a second apart (10 s then, not 20; their cost stays ~0.2%).
On NCCL jobs the flags travel over the trainer's gloo group, so agreeing never syncs the GPU.
``close`` puts back the signal handlers it replaced.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..comm import CollectiveMarks

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Exit status of a rank that stopped on a signal after saving its snapshot (128 + SIGTERM,
# the shell's "terminated"): launchers and schedulers see the job as unfinished.
PREEMPTED_EXIT_CODE = 143
CHECK_SECONDS = 0.5
MAX_INTERVAL = 1000


class Decision(NamedTuple):
    stop: bool
    snapshot: bool


NOTHING = Decision(False, False)


class StopSignal:
    def __init__(self, group: Any = None, snapshot_due: Callable[[], bool] | None = None,
                 watchdog: CollectiveMarks | None = None) -> None:
        """``group``: a gloo process group (None: the default group, which must be gloo).
        ``snapshot_due``: rank 0's clock; other ranks pass None."""
        self.requested = False
        self.group, self.snapshot_due, self.watchdog = group, snapshot_due, watchdog or CollectiveMarks()
        self.message = torch.zeros(3)
        self.pending: Any = None
        self.interval, self.next_check = 1, 1
        self.checked = False  # whether the last check() agreed (a collective every rank took)
        self.steps, self.last_check_step, self.last_check_time = 0, 0, time.perf_counter()
        self.replaced: dict[int, Any] = {}

    def listen(self) -> None:
        """Catch the stop signals from now until ``close`` (only the main thread can)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.replaced[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def check(self) -> Decision:
        """Call after every step on every rank: the same Decision on all ranks, after the same step."""
        self.steps += 1
        self.checked = self.steps >= self.next_check  # (others may act at the same steps: step records)
        if not self.checked:
            return NOTHING
        decision = NOTHING
        if self.pending is not None:
            with self.watchdog.waiting("the periodic stop/snapshot agreement", self.steps):
                self.pending.wait()
            decision = Decision(bool(self.message[0].item()), bool(self.message[1].item()))
            self.interval = max(1, int(-self.message[2].item()))  # the smallest proposal
        now = time.perf_counter()
        per_step = (now - self.last_check_time) / (self.steps - self.last_check_step)
        proposal = min(MAX_INTERVAL, max(1, int(CHECK_SECONDS / max(per_step, 1e-6))))
        self.last_check_step, self.last_check_time = self.steps, now
        due = self.snapshot_due is not None and not decision.snapshot and self.snapshot_due()
        self.message = torch.tensor([float(self.requested), float(due), -float(proposal)])
        self.pending = dist.all_reduce(self.message, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.next_check = self.steps + self.interval
        return decision

    def close(self, wait: bool = True, restore: bool = True) -> None:
        """Wait for the collective in flight (before the process group goes; not after a
        failure, when a peer may never answer), and restore the replaced handlers (``restore``;
        a failing rank that ends anyway keeps catching the launcher's SIGTERM, which would
        otherwise kill it before it writes its error report: the report's step was lost)."""
        if self.pending is not None and wait:
            self.pending.wait()
        self.pending = None
        if restore:
            restore_handlers(self.replaced)
            self.replaced.clear()


def restore_handlers(saved: dict[Any, Any]) -> None:
    """Put back signal handlers saved with ``signal.getsignal`` (None, for a handler set outside
    Python, becomes the default)."""
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
