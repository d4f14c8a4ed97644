"""Every rank's watchdog: fail fast when a peer fails, and name the rank that hangs.

A thread per rank talks to the job's store (its own connection, see launch/group.connect_store):

- **Heartbeat.** The training loop marks each collective it enters (``arrive``) and leaves
  (``depart``): plain attribute writes, nothing on the step's path waits. The thread
  publishes ``(collectives entered, inside one?, label)`` whenever it changes.
- **Fail fast.** A rank that raises publishes a verdict (the first one wins, through the
  store's compare-and-set); every other rank's thread sees it within ``PERIOD_S`` and ends
  its process, even when its main thread is blocked in a collective or ignores SIGTERM.
- **Hang diagnosis.** Rank 0's thread judges: a rank that has waited inside collective #n
  for ``--timeout`` seconds means some rank never arrived there. The ranks that entered
  fewer collectives (or none, or never started) are the culprits; the ranks that waited
  are never blamed. Every rank writes its stack to ``RUN_DIR/logs/stacks/rank-N.txt``; the
  culprits' innermost frames go into the summary (``RUN_DIR/logs/hang.txt``) the launcher
  prints. Then every rank exits non-zero.

torch's own collective timeout stays as a backstop, later than ``--timeout``: when it fires
it blames the rank that waited (pytorch#140563), which is what this module avoids.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..comm import CollectiveMarks
from ..console import say
from ..errors import PeerFailed, PeerStuck, RankStuck
from .failures import hard_exit, record_error

PERIOD_S = 0.5  # how often each rank publishes and looks for a verdict
STACK_WAIT_S = 5.0  # how long the judge waits for the culprits' stacks
CONFIG_ERROR_GRACE_S = 3.0  # a configuration error usually hits every rank: let them return it
STORE_LOSS_GRACE_S = 2.0  # the store's host (rank 0) may simply have finished first
LINGER_S = 2.0  # the store's host waits this long at most for the other ranks to leave first
INNERMOST_FRAMES = 8


class Watchdog(CollectiveMarks):
    """Started before the task is built; stopped when the rank's work is done."""

    def __init__(self, env: Any, timeout_s: float, run_dir: str | os.PathLike[str] | None,
                 period_s: float = PERIOD_S, hosts_store: bool = False) -> None:
        self.rank, self.world_size = env.rank, env.world_size
        self.hosts_store = hosts_store  # this process serves the store: it leaves last
        self.address = (env.master_addr, env.master_port)
        self.timeout_s, self.period_s = timeout_s, period_s
        self.run_dir = Path(run_dir) if run_dir else None
        # Keys of one attempt: a restarted job (--max-restarts) starts from a clean slate.
        self.prefix = f"ddptrain/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        # Written by the rank's main thread, read by the watchdog thread.
        self.arrivals, self.inside, self.label, self.step = 0, False, "start-up", None
        self.waited_s, self.arrived_at = 0.0, None  # time spent inside timed collectives
        self.main_thread = threading.get_ident()
        self.finished = threading.Event()
        self.acting = threading.Event()  # the thread is acting on a verdict: it ends the process
        self.store: Any = None
        self.thread: threading.Thread | None = None
        self.seen: dict[int, tuple[Heartbeat | None, float]] = {}  # the judge's view: rank -> (beat, since)

    # --- called by the training loop -------------------------------------------------------
    def arrive(self, label: str, step: int | None = None, timed: bool = True) -> None:
        """This rank enters a collective (every rank enters the same ones in the same order).
        ``timed``: add the time until ``depart`` to ``waited_s`` (the straggler report)."""
        self.label, self.step = label, step
        self.arrivals += 1
        self.inside = True
        self.arrived_at = time.perf_counter() if timed else None

    def depart(self) -> None:
        self.inside = False
        if self.arrived_at is not None:
            self.waited_s += time.perf_counter() - self.arrived_at
            self.arrived_at = None

    def take_waited(self) -> float:
        """Seconds spent in timed collectives since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def phase(self, label: str) -> None:
        """What this rank is doing outside collectives (start-up stages)."""
        self.label, self.step = label, None

    # --- life cycle ------------------------------------------------------------------------
    def start(self) -> Watchdog:
        if self.world_size > 1:
            host, port = self.address
            self.store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=30))
            info = {"pid": os.getpid(), "host": socket.gethostname()}
            self.store.set(self._key(f"info/{self.rank}"), json.dumps(info))
            self.thread = threading.Thread(target=self._run, name="ddptrain-watchdog", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        """The rank is done (finished, stopped by a signal, or returning a config error)."""
        self.finished.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        self._say_leaving()

    def exit_process(self, code: int) -> None:
        """End this rank's process now (after a failure). When the watchdog thread is acting on
        a verdict (writing stacks, the hang summary), the main thread lets it end the process."""
        if self.acting.is_set() and threading.current_thread() is not self.thread:
            time.sleep(STACK_WAIT_S + 5)  # the thread exits the process meanwhile
        self.finished.set()
        self._say_leaving()
        hard_exit(code)

    def _say_leaving(self) -> None:
        """Mark this rank as leaving; the store's host waits (briefly) for every other rank to
        leave first, so nobody finds the store gone while still reading a verdict."""
        if self.store is None or getattr(self, "left", False):
            return
        self.left = True
        try:
            self.store.set(self._key(f"left/{self.rank}"), "1")
            if self.hosts_store:
                others = [self._key(f"left/{r}") for r in range(self.world_size) if r != self.rank]
                deadline = time.monotonic() + LINGER_S
                while others and not self.store.check(others) and time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store went first: nothing to wait for
            pass

    def report_failure(self, error: BaseException) -> bool:
        """Tell every rank that this one failed. True if it is the first failure of the job."""
        if self.store is None:
            return True
        from ..errors import ConfigError

        kind = "config_error" if isinstance(error, ConfigError) else "failed"
        message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        verdict = json.dumps({"kind": kind, "rank": self.rank, "message": message})
        try:
            won = self.store.compare_set(self._key("verdict"), "", verdict)
        except Exception:  # the store is gone: the job is ending anyway
            return False
        return won.decode() == verdict

    # --- the thread ------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self.prefix + name

    def _run(self) -> None:
        published = None
        while not self.finished.wait(self.period_s):
            try:
                where = self.label if self.step is None else f"{self.label} (step {self.step})"
                state = Heartbeat(self.arrivals, self.inside, where).encode()
                if state != published:
                    self.store.set(self._key(f"hb/{self.rank}"), state)
                    published = state
                verdict = self._read_verdict()
                if verdict is not None:
                    self._act_on(verdict)
                elif self.rank == 0:
                    self._judge()
            except Exception as error:  # noqa: BLE001 - any store failure means the same
                self._lost_store(error)

    def _read_verdict(self) -> dict[str, Any] | None:
        key = self._key("verdict")
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def _lost_store(self, error: Exception) -> None:
        if self.finished.wait(STORE_LOSS_GRACE_S):
            return  # rank 0 finished and took the store with it: nothing is wrong
        record_error(PeerFailed(f"rank {self.rank} lost the job's store ({error}): rank 0 or the "
                                "launcher has gone"))
        self.store = None
        hard_exit(1)

    def _act_on(self, verdict: dict[str, Any]) -> None:
        if verdict["kind"] == "hang":
            self.acting.set()
            self._answer_hang(verdict)
        if verdict["rank"] == self.rank:
            return  # our own report: the main thread is on its way out
        if verdict["kind"] == "config_error" and self.finished.wait(CONFIG_ERROR_GRACE_S):
            return  # this rank hit the same error and returned it
        what = "reported a configuration error" if verdict["kind"] == "config_error" else "failed"
        self.acting.set()
        record_error(PeerFailed(f"rank {self.rank} stopped because rank {verdict['rank']} {what}: "
                                f"{verdict['message']}"))
        self.exit_process(1)

    # --- hang judgement (rank 0) -----------------------------------------------------------
    def _heartbeats(self) -> dict[int, Heartbeat | None]:
        keys = [self._key(f"hb/{r}") for r in range(self.world_size)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return {rank: None if value is None else Heartbeat.decode(value.decode()) for rank, value in enumerate(values)}

    def _judge(self) -> None:
        now = time.monotonic()
        for rank, beat in self._heartbeats().items():
            if rank not in self.seen or self.seen[rank][0] != beat:
                self.seen[rank] = (beat, now)
        verdict = judge_hang(self.seen, now, self.timeout_s)
        if verdict is None:
            return
        self.acting.set()  # from now on this thread ends the process, not the main thread
        won = self.store.compare_set(self._key("verdict"), "", json.dumps(verdict))
        self._act_on(json.loads(won))

    def _answer_hang(self, verdict: dict[str, Any]) -> None:
        stack = self._dump_stacks()
        self.store.set(self._key(f"stack/{self.rank}"), stack)
        culprit = self.rank in verdict["culprits"]
        if self.rank == 0:
            stacks_dir = self.run_dir / "logs" / "stacks" if self.run_dir is not None else None
            summary = hang_summary(verdict, self._culprit_stacks(verdict["culprits"]), self.timeout_s, stacks_dir)
            if self.run_dir is not None:
                (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
                (self.run_dir / "logs" / "hang.txt").write_text(summary + "\n")
            if not os.environ.get("DDPTRAIN_LOCAL_LAUNCH"):  # ddptrain's own launcher prints it
                say(summary, sys.stderr)
        if culprit:
            record_error(RankStuck(f"rank {self.rank} did not reach {verdict['label']} within --timeout "
                                   f"{self.timeout_s:g} s; it was in:\n{stack}"))
        else:
            record_error(PeerStuck(f"rank {self.rank} waited in {verdict['label']} for rank(s) "
                                   f"{', '.join(map(str, verdict['culprits'])) or '(none)'}"))
        self.exit_process(1)

    def _dump_stacks(self) -> str:
        """Every thread's stack into RUN_DIR/logs/stacks/rank-N.txt; the main thread's innermost frames returned."""
        if self.run_dir is not None:
            folder = self.run_dir / "logs" / "stacks"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank-{self.rank}.txt", "w") as handle:
                faulthandler.dump_traceback(file=handle, all_threads=True)
        frame = sys._current_frames().get(self.main_thread)
        if frame is None:
            return "  (the main thread has no Python frame)"
        frames = traceback.extract_stack(frame)[-INNERMOST_FRAMES:]
        return "".join(traceback.format_list(frames)).rstrip()

    def _culprit_stacks(self, culprits: list[int]) -> dict[int, str | None]:
        """Each culprit's innermost frames from the store (None: it did not answer in time)."""
        stacks: dict[int, str | None] = {}
        deadline = time.monotonic() + STACK_WAIT_S
        for rank in culprits:
            key = self._key(f"stack/{rank}")
            while not self.store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.05)
            stacks[rank] = self.store.get(key).decode() if self.store.check([key]) else None
        return stacks


@dataclass(frozen=True)
class Heartbeat:
    """What a rank publishes: how many collectives it entered, whether it is inside one, where."""

    arrivals: int
    inside: bool
    where: str

    def encode(self) -> str:
        return f"{self.arrivals}|{int(self.inside)}|{self.where}"

    @classmethod
    def decode(cls, text: str) -> Heartbeat:
        arrivals, inside, where = text.split("|", 2)
        return cls(int(arrivals), inside == "1", where)


def judge_hang(seen: dict[int, tuple[Heartbeat | None, float]], now: float, timeout_s: float) -> dict[str, Any] | None:
    """A hang's verdict, or None. ``seen``: rank -> (its heartbeat, None if it never published;
    since when it has not changed). A rank that has waited inside collective #n for more than
    ``timeout_s`` means some rank never arrived there: the culprits are the ranks that entered
    fewer collectives, stand at #n outside it, or never published; the ranks that waited are
    never blamed."""
    waiting = sorted(r for r, (beat, since) in seen.items() if beat and beat.inside and now - since > timeout_s)
    if not waiting:
        return None
    beats = {rank: beat for rank, (beat, _) in seen.items()}
    top = max(beats[r].arrivals for r in waiting)  # type: ignore[union-attr]
    culprits = [r for r, beat in sorted(beats.items())
                if beat is None or beat.arrivals < top or (beat.arrivals == top and not beat.inside)]
    return {"kind": "hang", "rank": 0, "culprits": culprits, "waiting": waiting,
            "label": beats[waiting[0]].where, "message": "hang"}  # type: ignore[union-attr]


def hang_summary(verdict: dict[str, Any], stacks: dict[int, str | None], timeout_s: float,
                 stacks_dir: Path | None) -> str:
    """The lines the launcher prints (and RUN_DIR/logs/hang.txt holds) for a hang's verdict."""
    culprits, waiting, where = verdict["culprits"], verdict["waiting"], verdict["label"]
    if not culprits:
        return (f"ddptrain: every rank waits in {where} for more than --timeout {timeout_s:g} s: "
                "the collective itself does not complete (network, backend or a device problem)")
    lines = [f"ddptrain: rank {', '.join(map(str, culprits))} did not reach {where} within --timeout "
             f"{timeout_s:g} s; rank {', '.join(map(str, waiting))} waited there."]
    for rank in culprits:
        if stacks.get(rank) is not None:
            lines += [f"ddptrain: rank {rank} was in (innermost call last):", stacks[rank]]  # type: ignore[list-item]
        else:
            lines.append(f"ddptrain: rank {rank} did not answer: it never started, or its Python "
                         "interpreter is blocked")
    if stacks_dir is not None:
        lines.append(f"ddptrain: every rank's stack: {stacks_dir}")
    return "\n".join(lines)


class NullWatchdog(Watchdog):
    """One rank, or a Trainer built without one: marks cost nothing and nothing runs."""

    def __init__(self) -> None:
        self.arrivals, self.inside, self.label, self.step = 0, False, "", None
        self.waited_s, self.arrived_at = 0.0, None
        self.store, self.thread = None, None
        self.finished, self.acting = threading.Event(), threading.Event()

    def start(self) -> NullWatchdog:
        return self
