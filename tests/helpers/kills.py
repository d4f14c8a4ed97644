"""How the tests' tasks fail on purpose: a hook before the n-th loss, a rank that SIGKILLs itself
once (a marker file remembers, so the resumed attempt trains on), or in successive attempts on a
schedule, and waiting for a snapshot."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddptrain import Task


def _rank() -> int:
    return int(os.environ["RANK"])


def _on_step(task: Task, on_step) -> Task:
    """Call ``on_step(n)`` before the n-th loss this rank computes (n counts from 1)."""
    calls = {"n": 0}

    def counted(fn):
        def wrapped(*args):
            calls["n"] += 1
            on_step(calls["n"])
            return fn(*args)
        return wrapped

    if task.step_fn is not None:
        task.step_fn = counted(task.step_fn)
    else:
        task.loss_fn = counted(task.loss_fn)
    return task


def _first_attempt(marker: Path) -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not marker.exists()


def killable(factory):
    """``factory``, whose rank KILL_RANK SIGKILLs itself at its KILL_STEP-th loss (evaluation
    batches count too), once (a marker file KILL_MARKER says it happened); without KILL_RANK, just
    ``factory``. With KILL_ONCE_SAVED (a snapshots folder), the kill first waits until a snapshot
    is committed there: the writer is a background thread, which a busy machine can hold back
    past the kill, and a resume with nothing to resume is a fresh start, another scenario. With
    KILL_ONCE_STORED (a store's run dir), until the store holds a committed snapshot: its uploads
    are a background thread's too (seen: a busy machine's run killed before any, and the "other
    machine" started afresh)."""
    def build(cfg) -> Task:
        task = factory(cfg)
        if "KILL_RANK" not in os.environ:
            return task
        rank, step, marker = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"]), Path(os.environ["KILL_MARKER"])
        saved_in, stored_in = os.environ.get("KILL_ONCE_SAVED"), os.environ.get("KILL_ONCE_STORED")

        def maybe_kill(n: int) -> None:
            if n == step and _rank() == rank and _first_attempt(marker):
                if saved_in:
                    _wait_for_a_snapshot(Path(saved_in))
                if stored_in:
                    _wait_for_a_stored_snapshot(stored_in)
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        return _on_step(task, maybe_kill)
    build.__name__ = build.__qualname__ = f"killable_{factory.__name__}"
    return build


def _wait_for_a_snapshot(folder: Path, timeout_s: float = 60.0) -> None:
    from ddptrain.snapshots import files

    deadline = time.monotonic() + timeout_s
    while not (folder.is_dir() and files.list_snapshots(folder)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no snapshot committed in {folder} after {timeout_s:.0f} s")
        time.sleep(0.02)


def _wait_for_a_stored_snapshot(url: str, timeout_s: float = 60.0) -> None:
    from ddptrain.run_dir import StoreRunDir

    store, deadline = StoreRunDir(url), time.monotonic() + timeout_s
    while not store.committed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no snapshot committed in {url} after {timeout_s:.0f} s")
        time.sleep(0.1)


def killed_on_schedule(factory):
    """``factory``, killed in successive attempts of an elastic restart: KILLS="RANK:N,RANK:N" (the
    first attempt's rank and its N-th loss, then the second's, ...), each kill waiting until the
    snapshot the next attempt resumes from (every SAVE_EVERY steps) is in KILL_SNAPSHOTS."""
    def build(cfg) -> Task:
        task = factory(cfg)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kills = [tuple(int(x) for x in kill.split(":")) for kill in os.environ["KILLS"].split(",")]
        if attempt >= len(kills):
            return task
        rank, step = kills[attempt]
        folder, every = Path(os.environ["KILL_SNAPSHOTS"]), int(os.environ["SAVE_EVERY"])
        resumed_from = 0 if attempt == 0 else every * ((kills[0][1] - 1) // every)

        def maybe_kill(n: int) -> None:
            if n == step and _rank() == rank:
                wanted = (resumed_from + n - 1) // every * every  # the snapshot the next attempt resumes from
                while wanted and not (folder / f"step-{wanted:09d}.pt").is_file():  # 0: none to wait for
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
        return _on_step(task, maybe_kill)
    build.__name__ = build.__qualname__ = f"killed_on_schedule_{factory.__name__}"
    return build
