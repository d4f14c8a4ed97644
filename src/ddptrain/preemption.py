"""Stop signals: SIGTERM (torchelastic, Slurm), SIGUSR1 (Slurm's --signal) and SIGINT
(Ctrl-C, which the elastic agent also forwards to every rank; if the ranks do not stop
within its 30 s it kills them).

The handler only sets a flag. The ranks agree on it with one small asynchronous all-reduce
at agreed step boundaries: the collective started at one check is read at the next, so no
step waits for it, and every rank stops after the same step. A collective every step would
cost ~1 ms on a 4 ms step (measured, tutorial job, 2 CPU ranks), so checks are spaced to
about CHECK_SECONDS apart: each check also carries every rank's proposed interval (steps
that fit in CHECK_SECONDS), and all ranks take the smallest. A stop is acted upon within
about two intervals, far inside the 30 s torchelastic and Slurm give before SIGKILL. On
NCCL jobs the flag travels over the trainer's gloo group, so agreeing never syncs the GPU.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Exit status of a rank that stopped on a signal after saving its snapshot (128 + SIGTERM,
# the shell's "terminated"): launchers and schedulers see the job as unfinished.
PREEMPTED_EXIT_CODE = 143
CHECK_SECONDS = 1.0
MAX_INTERVAL = 1000


class StopSignal:
    def __init__(self, group: Any = None) -> None:
        """``group``: a gloo process group (None: the default group, which must be gloo)."""
        self.requested = False
        self.group = group
        self.message = torch.zeros(2)
        self.pending: Any = None
        self.interval, self.next_check = 1, 1
        self.steps, self.last_check_step, self.last_check_time = 0, 0, time.perf_counter()
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Call after every step on every rank: True on all ranks, after the same step,
        once any rank has received a stop signal."""
        self.steps += 1
        if self.steps < self.next_check:
            return False
        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = bool(self.message[0].item())
            self.interval = max(1, int(-self.message[1].item()))  # the smallest proposal
        now = time.perf_counter()
        per_step = (now - self.last_check_time) / (self.steps - self.last_check_step)
        proposal = min(MAX_INTERVAL, max(1, int(CHECK_SECONDS / max(per_step, 1e-6))))
        self.last_check_step, self.last_check_time = self.steps, now
        self.message = torch.tensor([float(self.requested), -float(proposal)])
        self.pending = dist.all_reduce(self.message, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.next_check = self.steps + self.interval
        return stop

    def close(self) -> None:
        """Wait for the collective in flight (before the process group is destroyed)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
