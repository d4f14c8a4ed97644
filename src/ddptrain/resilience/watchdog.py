"""Every rank's watchdog: fail fast when a peer fails, and name the rank that hangs.

A thread per rank talks to the job's store (its own connection, see launch/group.connect_store):

- **Heartbeat.** The training loop marks each collective it enters (``arrive``) and leaves
  (``depart``): plain attribute writes, nothing on the step's path waits. The thread
  publishes ``(collectives entered, inside one?, label, the collective it is in)`` when it
  changed, every ``beat_period`` (a twentieth of ``--timeout``, 0.5 to 5 s; beyond 1,024
  ranks slower in proportion to the ranks, up to a quarter of ``--timeout``).
- **Fail fast.** A rank that raises publishes a verdict (the first one wins, through the
  store's compare-and-set); every other rank's thread sees it within a ``verdict_period``
  (``PERIOD_S`` up to 1,024 ranks, at most 2 s) and ends its process, even when its main
  thread is blocked in a collective or ignores SIGTERM. Between its rounds the thread sleeps.
- **Hang diagnosis.** Rank 0's thread judges: a rank that has waited inside collective #n
  for ``--timeout`` seconds means some rank never arrived there. The ranks that entered
  fewer collectives (or none, or never started) are the culprits; the ranks that waited
  are never blamed. Every rank writes its stack to ``RUN_DIR/logs/stacks/rank-N.txt``; the
  culprits' innermost frames go into the summary (``RUN_DIR/logs/hang.txt``) the launcher
  prints. Then every rank exits non-zero.

The store's keys are board.py's; judging a hang, stacks and the summary, hangs.py's. This
module is the thread and what it does with a verdict.

torch's own collective timeout stays as a backstop, later than ``--timeout``: when it fires
it blames the rank that waited (pytorch#140563), which is what this module avoids.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# record_error's writer, imported before any thread needs it: imported by the first thread to
# fail, 500 threads of a process of 4,096 simulated ranks waited minutes on its import's lock
# (control_plane.py); in a real rank it costs milliseconds at start-up instead of at a failure.
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401

from ..comm import CollectiveMarks
from ..console import say
from ..errors import ConfigError, PeerFailed, PeerStuck, RankStuck
from .board import LINGER_S, Board, Heartbeat, store_answers
from .failures import hard_exit, parent_of, record_error
from .flight import in_flight, last_entered, recent
from .hangs import dump_stacks, hang_summary, judge_hang, refine
from .siblings import siblings_of, wait_until_reaped
from .stall import StallWatch

PERIOD_S = 0.5  # how often each rank's thread wakes at most: looks for a verdict, publishes its heartbeat when due
EARLY_S = 0.01  # a round this much early counts as due (a timed wait may end a little early)
SCALE_RANKS = 1024  # beyond this many ranks the heartbeats and the verdict polls slow down in proportion
MAX_VERDICT_S = 2.0  # the verdict polls' slowest period (verdict_period)
BEAT_SHARE, MAX_BEAT_S = 20, 5.0  # heartbeats every --timeout / 20, at most every 5 s (beat_period)
STALE_SHARE = 4  # however many ranks, heartbeats at least every --timeout / 4 (beat_period)
STACK_WAIT_S = 10.0  # how long the judge waits for the ranks' answers to a hang (collectives, then stacks)
CONFIG_ERROR_GRACE_S = 3.0  # a configuration error usually hits every rank: let them return it
STORE_LOSS_GRACE_S = 2.0  # the store's host (rank 0) may simply have finished first
STORE_SILENT_S = (10.0, 30.0)  # a store call unanswered for --timeout, within these bounds: the store is gone
STORE_PROBE_S = 5.0  # a fresh connection's wait for the store's answer (it answered in 0.3 s as 4,096 ranks started)
STORE_EXCUSES = 2  # windows a silent call is excused while the store answers fresh connections
EARLY_LEAVE_S = 0.25  # after a failure, the host's wait for the others beyond one verdict period
REAPED_WITHIN_S = 0.3  # a failed rank's wait for its dead siblings' reaping (the launcher looks every 0.1 s)
LOST_STORE = "rank 0 or the launcher has gone, or is frozen (stopped, or its machine unreachable)"
LOST_CONNECTION = "this rank's connection to it is broken, or this process is starved of CPU"


def store_silent_s(timeout_s: float, world_size: int = 1, answered: bool = True) -> float:
    """How long a call on the job's store may go unanswered before the store counts as lost.
    torch's TCPStore client waits forever for a server that accepts and never answers (its
    timeout bounds waiting for a key, not for an answer): a SIGSTOPped rank 0, or its frozen
    machine, left every other rank hanging, and the hang judge is rank 0's.

    Until the store has ``answered`` this rank's first round, the window grows with the ranks
    beyond SCALE_RANKS: that round meets every rank's connection at once, and the store greets
    them one at a time. At 4,096 ranks and --timeout 5, on 2 cores (quiet once, and beside a busy
    process), a round waited more than the 10 s allowed and ended a process of 512 simulated ranks
    with "lost the job's store" (control_plane.py); there the first round is now allowed 40 s, the window once per
    1,024 ranks (torch's libuv store greeted ~1,000 ranks a second in its own 96K-rank runs). Once
    the store has answered, its load stays flat whatever the size (beat_period), and so does the window."""
    low, high = STORE_SILENT_S
    window = min(max(timeout_s, low), high)
    return window if answered else window * max(world_size / SCALE_RANKS, 1.0)


def beat_period(timeout_s: float, world_size: int = 1, period_s: float = PERIOD_S) -> float:
    """How often a rank publishes its heartbeat (when it changed) and rank 0 reads them all: a
    twentieth of --timeout, between the verdict polls' period and MAX_BEAT_S; beyond SCALE_RANKS
    ranks at least ``period_s`` x ranks / SCALE_RANKS, so the store's heartbeats a second stay
    flat from there on, but never more than a quarter of --timeout: the judge sees a heartbeat
    up to two periods old, and one older than --timeout reads as a rank that stopped. A hang is
    named within --timeout + 2 of these: at the default --timeout 300 every 5 s whatever the
    size; at --timeout 5, every 0.5 s up to 1,024 ranks and every 1.25 s from 2,560 on, where
    the heartbeats were three quarters of the store's load (control_plane.py)."""
    scaled = min(max(timeout_s / BEAT_SHARE, period_s * max(world_size / SCALE_RANKS, 1.0)), MAX_BEAT_S)
    return min(scaled, max(timeout_s / STALE_SHARE, period_s))


def verdict_period(world_size: int, period_s: float = PERIOD_S) -> float:
    """How often a rank looks for a verdict: every period up to SCALE_RANKS ranks, then less
    often in proportion to the ranks, at most every MAX_VERDICT_S. Every rank's poll is a store
    request: at 4,096 ranks and --timeout 5 the polls were half of the store's load (15,900
    requests a second, 15% of what it served here: control_plane.py); beyond 1,024 ranks their
    share stays flat, and a failure ends every rank within 2 s instead of 0.5 s."""
    return min(max(period_s * world_size / SCALE_RANKS, period_s), MAX_VERDICT_S)


class Watchdog(CollectiveMarks):
    """Started before the task is built; stopped when the rank's work is done."""

    def __init__(self, env: Any, timeout_s: float, run_dir: str | os.PathLike[str] | None,
                 period_s: float = PERIOD_S, hosts_store: bool = False) -> None:
        self.rank, self.world_size = env.rank, env.world_size
        self.hosts_store = hosts_store  # this process serves the store: it leaves last
        self.address = (env.master_addr, env.master_port)
        self.timeout_s, self.period_s = timeout_s, period_s
        self.beat_period_s = beat_period(timeout_s, self.world_size, period_s)
        self.verdict_period_s = verdict_period(self.world_size, period_s)
        self.run_dir = Path(run_dir) if run_dir else None
        # Written by the rank's main thread, read by the watchdog thread.
        self.arrivals, self.inside, self.label = 0, False, "start-up"
        self.step: int | None = None
        self.aside_depth = 0  # inside evaluations or snapshots (aside): a one-rank job's stall watch waits
        self.waited_s = 0.0  # time spent inside timed collectives
        self.arrived_at: float | None = None
        self.main_thread = threading.get_ident()
        self.finished = threading.Event()
        self.acting = threading.Event()  # the thread is acting on a verdict: it ends the process
        self.board: Board | None = None
        self.thread: threading.Thread | None = None
        self.seen: dict[int, tuple[Heartbeat | None, float]] = {}  # the judge's view: rank -> (beat, since)
        self.calling_since: float | None = None  # when the thread's pending round of store calls began
        self.store_answered = False  # the thread's first round of store calls has ended
        self.winner: dict[str, Any] | None = None  # the job's verdict, as report_failure found it
        self.siblings: dict[int, int] = {}  # rank -> pid of the other ranks this machine's launcher started
        self.stall_watch: StallWatch | None = None  # a one-rank job's, while its loop runs

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
        """What this rank is doing outside collectives: a start-up stage, or "step N" (where a
        hang in the task's own collectives happened)."""
        self.label, self.step = label, None

    def training_begins(self, alone: bool = True) -> None:
        """Every rank has started: each notes which ranks are its siblings on this machine (the
        store's host does not wait for a dead one to leave; a rank leaving after a failure lets
        the launcher see a dead one first); a job of one rank starts its stall watch (no peer
        would ever wait for it; not a torchft replica group's, ``alone`` False: its waits are the
        groups' meetings, which torchft's timeouts and the lighthouse's watch judge)."""
        if self.run_dir is not None and self.world_size > 1:
            self.siblings = siblings_of(self.run_dir / "pids", self.rank)
        if self.world_size == 1 and alone and self.timeout_s > 0:
            self.stall_watch = StallWatch(self, self.timeout_s, self.run_dir, self.finished, self.period_s).start()

    def training_ends(self) -> None:
        if self.stall_watch is not None:
            self.stall_watch.stop()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """An evaluation or a snapshot: not judged as a stall."""
        self.aside_depth += 1
        try:
            yield
        finally:
            self.aside_depth -= 1

    # --- life cycle ------------------------------------------------------------------------
    def start(self) -> Watchdog:
        if self.world_size > 1:
            self.board = Board(*self.address, self.rank, self.world_size)
            self.thread = threading.Thread(target=self._run, name="ddptrain-watchdog", daemon=True)
            self.thread.start()
            threading.Thread(target=self._watch_store, name="ddptrain-store-silence", daemon=True).start()
        return self

    def stop(self) -> None:
        """The rank is done (finished, stopped by a signal, or returning a config error)."""
        self.finished.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        self._leave()

    def exit_process(self, code: int) -> None:
        """End this rank's process now (after a failure). When the watchdog thread is acting on
        a verdict (writing stacks, the hang summary), the main thread lets it end the process."""
        if self.acting.is_set() and threading.current_thread() is not self.thread:
            time.sleep(STACK_WAIT_S + 5)  # the thread exits the process meanwhile
        self.finished.set()
        wait_until_reaped(self.siblings.values(), REAPED_WITHIN_S)  # (a dead sibling: the launcher sees it first)
        # A living rank reads the job's verdict within a verdict period, and leaves: the store's
        # host waits no longer for the others (one on another node may be dead: 2 s lost there)
        self._leave(within_s=self.verdict_period_s + EARLY_LEAVE_S)
        hard_exit(code)

    def _leave(self, within_s: float = LINGER_S) -> None:
        if self.board is not None:  # (the store's host waits for the others to leave: not for the dead)
            gone = {rank for rank, pid in self.siblings.items() if parent_of(pid) is None}
            self.board.leave(wait_for_others=self.hosts_store, gone=gone, within_s=within_s)

    def report_failure(self, error: BaseException) -> bool:
        """Tell every rank that this one failed. True if it is the first failure of the job."""
        if self.board is None:
            return True
        kind = "config_error" if isinstance(error, ConfigError) else "failed"
        message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        verdict = {"kind": kind, "rank": self.rank, "message": message}
        try:
            self.winner = self.board.propose(verdict)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            return False
        return self.winner == verdict

    @property
    def answers_a_hang(self) -> bool:
        """The job's verdict, as this rank's report found it, is a hang's: the thread answers it
        (stacks, the summary) and ends the process."""
        return self.winner is not None and self.winner.get("kind") == "hang"

    # --- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        board, published, marks = self.board, None, None
        last_beat = last_poll = -float("inf")
        assert board is not None
        wait_s = self.period_s
        while not self.finished.wait(wait_s):
            self.calling_since = time.monotonic()
            try:
                due = time.monotonic() - last_beat >= self.beat_period_s - EARLY_S
                last_beat = time.monotonic() if due else last_beat
                poll = time.monotonic() - last_poll >= self.verdict_period_s - EARLY_S
                last_poll = time.monotonic() if poll else last_poll
                # The recorder is read (about a millisecond) only for a heartbeat due from a rank that
                # has not moved since the last round: a rank that takes steps faster never pays for it,
                # and a still one (a long load, a hang) once a heartbeat period (5 s at --timeout 300).
                now = (self.arrivals, self.inside, self.label, self.step)
                still, marks = now == marks, now
                if due:
                    beat = Heartbeat(self.arrivals, self.inside,
                                     self.label if self.step is None else f"{self.label} (step {self.step})",
                                     in_flight() if still else None)
                    if beat != published:
                        board.publish(beat)
                        published = beat
                verdict = board.verdict() if poll or (self.rank == 0 and due) else None
                if verdict is not None:
                    self._act_on(verdict)
                elif self.rank == 0 and due:
                    self._judge()
            except Exception as error:  # noqa: BLE001 - any store failure means the same
                self._lost_store(error)
            self.calling_since = None
            self.store_answered = True
            # Asleep until the next heartbeat or poll is due: beyond SCALE_RANKS ranks both come
            # less often than a period (4,096 ranks at --timeout 5: 0.8 rounds a second, not 2).
            wait_s = max(min(last_beat + self.beat_period_s, last_poll + self.verdict_period_s) - time.monotonic(),
                         EARLY_S)

    def _watch_store(self) -> None:
        """A second thread: the first one's store calls must end (see store_silent_s). A call
        silent for the window is excused for one more when the store answers a connection of
        the probe's own: then the store lives and this process is what is slow (at 4,096
        simulated ranks, 1,000 threads a process on 2 cores waited more than 10 s for the
        interpreter's lock while the store answered another process within 0.3 s; a rank on an
        overloaded host could too). STORE_EXCUSES at most: a call that never ends on a store that
        answers others (its connection lost) ends the rank too."""
        excused_round, excuses = None, 0  # the round whose silence was excused, how many times
        while not self.finished.wait(1.0):
            since = self.calling_since
            if since is None or self.acting.is_set():
                continue
            silent_s = store_silent_s(self.timeout_s, self.world_size, self.store_answered)
            excuses = excuses if excused_round == since else 0
            if time.monotonic() - since <= silent_s * (1 + excuses):
                continue
            if excuses < STORE_EXCUSES and store_answers(*self.address, STORE_PROBE_S):
                excused_round, excuses = since, excuses + 1
                continue
            if excuses:
                self._lost_store(TimeoutError(f"a call waited {time.monotonic() - since:.0f} s, though the store "
                                              "answers new connections"), cause=LOST_CONNECTION)
            else:
                self._lost_store(TimeoutError(f"it did not answer for {silent_s:g} s, nor a new connection within "
                                              f"{STORE_PROBE_S:g} s"))

    def _lost_store(self, error: Exception, cause: str = LOST_STORE) -> None:
        if self.finished.wait(STORE_LOSS_GRACE_S):
            return  # rank 0 finished and took the store with it: nothing is wrong
        record_error(PeerFailed(f"rank {self.rank} lost the job's store ({error}): {cause}"))
        self.board = None
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
        collective = last_entered()
        where = f" (in {collective.describe()})" if collective is not None else ""
        record_error(PeerFailed(f"rank {self.rank} stopped because rank {verdict['rank']} {what}{where}: "
                                f"{verdict['message']}"))
        self.exit_process(1)

    # --- hangs -----------------------------------------------------------------------------
    def _judge(self) -> None:
        """Rank 0: a hang's verdict from the heartbeats, posted and acted upon."""
        assert self.board is not None
        now = time.monotonic()
        for rank, beat in self.board.heartbeats().items():
            if rank not in self.seen or self.seen[rank][0] != beat:
                self.seen[rank] = (beat, now)
        verdict = judge_hang(self.seen, now, self.timeout_s)
        if verdict is None:
            return
        self.acting.set()  # from now on this thread ends the process, not the main thread
        self._act_on(self.board.propose(verdict))

    def _answer_hang(self, verdict: dict[str, Any]) -> None:
        assert self.board is not None
        stacks_dir = self.run_dir / "logs" / "stacks" if self.run_dir is not None else None
        stack = dump_stacks(stacks_dir, self.rank, self.main_thread)
        self.board.post_collectives(recent())
        self.board.post_stack(stack)
        if self.rank == 0:
            # One deadline for both answers: a rank busy elsewhere (2 cores beside 64 starting
            # ranks) gets the whole wait for its stack, and a rank that never answers costs it once.
            answers_by = time.monotonic() + STACK_WAIT_S
            verdict = refine(verdict, self.board.collectives(STACK_WAIT_S))
            stacks = self.board.stacks(verdict["culprits"], max(0.0, answers_by - time.monotonic()))
            summary = hang_summary(verdict, stacks, self.timeout_s, stacks_dir)
            if self.run_dir is not None:
                (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
                (self.run_dir / "logs" / "hang.txt").write_text(summary + "\n")
            if not os.environ.get("DDPTRAIN_LOCAL_LAUNCH"):  # ddptrain's own launcher prints it
                say(summary, sys.stderr)
            self.board.post_summary_written()
        else:
            self.board.wait_summary_written(STACK_WAIT_S + 2)  # rank 0 waits STACK_WAIT_S at most
        if self.rank in verdict["culprits"] and verdict.get("desync"):
            record_error(RankStuck(f"rank {self.rank}'s collective does not match the others' at "
                                   f"{verdict['label']}: {verdict['desync']}; it was in:\n{stack}"))
        elif self.rank in verdict["culprits"]:
            record_error(RankStuck(f"rank {self.rank} did not reach {verdict['label']} within --timeout "
                                   f"{self.timeout_s:g} s; it was in:\n{stack}"))
        else:
            record_error(PeerStuck(f"rank {self.rank} waited in {verdict['label']} for rank(s) "
                                   f"{', '.join(map(str, verdict['culprits'])) or '(none)'}"))
        self.exit_process(1)
