"""Stop signals (SIGTERM from torchelastic or Slurm, SIGUSR1 that Slurm can send ahead).

The handler only sets a flag. At every step boundary the ranks agree on it with one small
all-reduce (MAX) that runs asynchronously: the one started after step t is read after step
t+1, so no step waits for it, and all ranks stop after the same step. On NCCL jobs the flag
travels over a separate gloo group, so agreeing never synchronises the GPU.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Exit status of a rank that stopped on a signal after saving its snapshot (128 + SIGTERM,
# the shell's "terminated"): launchers and schedulers see the job as unfinished.
PREEMPTED_EXIT_CODE = 143


class StopSignal:
    def __init__(self, backend: str) -> None:
        self.requested = False
        self.group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.flag = torch.zeros(1)
        self.pending: Any = None
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank, after the same step, once any rank has received a stop signal."""
        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = bool(self.flag.item())
        self.flag = torch.tensor([float(self.requested)])
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return stop

    def close(self) -> None:
        """Wait for the collective in flight (before the process group is destroyed)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
