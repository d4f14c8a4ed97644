"""A rank of a torchft replica group whose sibling on this machine died leaves at once.

torchft keeps a group in the quorum while its ManagerServer (in the group's rank 0) sends
heartbeats to the lighthouse, and the lighthouse forms no quorum with half of the groups
it hears from or fewer (its guard against a split brain). When rank 1 of a 2-rank group is
SIGKILLed while rank 0 waits inside torchft's quorum or commit (a call into its Rust core
that Python's signal handlers cannot interrupt), rank 0 lives on until the launcher's
SIGKILL, 30 s after its SIGTERM: the healthy groups stalled 30 s in 3 of 5 trials. A thread
watching the group's ranks on this machine ends this process within ``every_s`` of a
sibling's death instead; the lighthouse drops the group one heartbeat timeout later.

A sibling is a rank whose pid file (launch/rank.py) names a child of this process's parent
(the launcher on this machine): a pid read from a run dir shared with other machines is never
mistaken for one here. A rank that returned removes its pid file first: its end is no death.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import PeerFailed
from .failures import hard_exit, parent_of, record_error


def siblings_of(pids_dir: Path, rank: int) -> dict[int, int]:
    """{rank: pid} of the other ranks this machine's launcher started (their pid files name
    children of this process's parent), read while they all live."""
    found = {}
    launcher = os.getppid()
    for path in pids_dir.glob("rank-*.pid"):
        try:
            other, pid = int(path.stem.split("-", 1)[1]), int(path.read_text())
        except (OSError, ValueError):
            continue
        if other != rank and parent_of(pid) == launcher:
            found[other] = pid
    return found


def is_zombie(pid: int) -> bool:
    """Dead and not yet reaped by its parent (the launcher, which learns its exit status so)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def wait_until_reaped(pids: Iterable[int], within_s: float) -> None:
    """Until the launcher has reaped every dead one of ``pids`` (at most ``within_s``): a rank
    leaving after a sibling's death lets torch's launcher see that death first, every 0.1 s, so
    its report names the signal that killed it (seeing both ends in one look, torch keeps one)."""
    deadline = time.monotonic() + within_s
    while any(is_zombie(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


class SiblingWatch:
    """Started once every rank wrote its pid file (after the process group formed)."""

    def __init__(self, pids_dir: Path, rank: int, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.siblings = self._siblings(pids_dir, rank)
        self._stop = threading.Event()
        if self.siblings:
            threading.Thread(target=self._watch, name="ddptrain-siblings", daemon=True).start()

    @staticmethod
    def _siblings(pids_dir: Path, rank: int) -> dict[int, tuple[Path, int]]:
        """{rank: (its pid file, its pid)} of the other ranks this machine's launcher started."""
        return {other: (pids_dir / f"rank-{other}.pid", pid) for other, pid in siblings_of(pids_dir, rank).items()}

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            for other, (path, pid) in self.siblings.items():
                if parent_of(pid) is None and self._still_names(path, pid) and not self._stop.is_set():
                    record_error(PeerFailed(f"rank {other} of this replica group died (its process ended "
                                            "without a report); this rank leaves so that the group leaves the "
                                            "quorum at once"))
                    hard_exit(1)

    @staticmethod
    def _still_names(path: Path, pid: int) -> bool:
        try:
            return int(path.read_text()) == pid
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._stop.set()
