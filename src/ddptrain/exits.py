"""What a process finishes before it ends: a snapshot write in flight, and its line on the run's
timeline (observe/goodput.py: the attempt's end is the process's).

A rank that fails, or is ended by its watchdog after a peer failed (resilience/failures.hard_exit,
``os._exit``: an interpreter shutting down after a failure can hang), would cut a write its
background thread is making. The write registers here while it runs, and the exit waits for it,
within its grace: the snapshot was taken before the failure, and the failure report names it as
the last good one. (A write that needs its peers, a DCP folder's commit, is not registered: its
peers may be gone.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

_lock = threading.Lock()
_in_flight: dict[Future, float] = {}  # each write in flight, and how long an exit may wait for it
_last_words: list[Callable[[], None]] = []  # called as the process ends, after the writes


def at_exit(last: Callable[[], None]) -> None:
    """Call ``last`` as this process ends through failures.hard_exit (after the writes in flight)."""
    _last_words.append(last)


def say_last_words() -> None:
    """What at_exit registered, each once; an error in one is no reason not to exit."""
    while _last_words:
        try:
            _last_words.pop()()
        except Exception:  # noqa: BLE001 - the process is ending: nothing may stop it
            pass


def finish_before_exit(write: Future, grace_s: float) -> None:
    """An exit after a failure waits up to ``grace_s`` for ``write`` (forgotten once it is done)."""
    with _lock:
        _in_flight[write] = grace_s
    write.add_done_callback(_forget)


def _forget(write: Future) -> None:
    with _lock:
        _in_flight.pop(write, None)


def finish_writes() -> None:
    """Wait for the writes in flight, each within its grace (the longest grace bounds the wait)."""
    with _lock:
        writes = dict(_in_flight)
    if writes:
        wait_for(list(writes), timeout=max(writes.values()))
