"""DataLoader workers forked from a rank: the pause that makes the fork safe."""

from __future__ import annotations

import time

import torch.distributed as dist

FORK_SETTLE_S = 0.02  # seconds a rank pauses before forking DataLoader workers (settle_before_fork)


def settle_before_fork() -> None:
    """Call in a rank just before DataLoader workers are forked: a pause that lets the threads
    still busy with the last collective finish entering and leaving Python first.

    A thread entering Python from C++ (most likely gloo's, freeing a tensor of the collective
    just done) creates its Python thread state under CPython's runtime lock. A fork at that
    instant copies the lock held, and CPython before gh-112275's fix (this machine's 3.11.7)
    deadlocks the child in PyOS_AfterFork_Child, before any Python code runs: a DataLoader
    worker that never starts, and that outlives its rank. Reproduced here: a 2-rank stream with
    2-step epochs (4 worker forks each) hung once in about 600 forks; with a 1 ms pause, never
    in 8,000. 20 ms leaves room on a loaded machine; it is paid per epoch, with workers only."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(FORK_SETTLE_S)
