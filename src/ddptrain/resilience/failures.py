"""How a failed job is reported: which rank caused it, and what every other rank was doing.

Every rank that ends abnormally leaves torch's error file (``@record``'s format, also read by
torchrun), and exits at once (``hard_exit``): an interpreter shutting down after a failure
can block for minutes tearing down a process group whose peer is gone.

The launcher reads the files and picks the root cause. Ranks that only stopped because
another failed (``PeerFailed``), waited for a hung rank (``PeerStuck``), or lost their
connection to a dead peer are never blamed while a better candidate exists.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..console import rank_list
from ..errors import (
    ConfigError,
    DiskFull,
    LighthouseLost,
    NonFiniteError,
    PeerFailed,
    PeerStuck,
    RankStuck,
    SnapshotError,
    StorageNotShared,
    StoreBehind,
    TrainingFailed,
)
from ..exits import finish_writes, say_last_words
from .aborts import last_words

# A rank's error arrives as text ("ExceptionType: message", torch's error file): matched by
# the classes' names.
SECONDARY = (PeerFailed.__name__, PeerStuck.__name__)
STUCK = (RankStuck.__name__, PeerStuck.__name__)
# torch's exception in a rank that the launcher terminated (after another rank ended) before
# the rank heard of the failure itself: never the cause while a real error exists.
TERMINATED = "SignalException"
# Reported as one line "ddptrain: error: ..." (no traceback); the value is the exit status.
ONE_LINE = {ConfigError.__name__: 2, SnapshotError.__name__: 2, StorageNotShared.__name__: 2,
            NonFiniteError.__name__: 1, DiskFull.__name__: 1, StoreBehind.__name__: 1,
            LighthouseLost.__name__: 1}
# What a rank sees when its peer has died: the peer is the cause, not this rank.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
             "Socket closed", "Connection refused")


_error_file_lock = threading.Lock()
_error_file_written = False


def record_error(error: BaseException) -> None:
    """Write ``error`` to this rank's torchelastic error file (when a launcher asked for one).

    Once per process, the first error wins: the watchdog thread and the main thread can fail
    at the same moment (a peer's exit breaks the collective the main thread waits in while
    the thread acts on the verdict), and two writers interleaved in one file left JSON that
    torch's agent could not read (seen once in a fresh clone's suite)."""
    global _error_file_written
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    with _error_file_lock:
        if _error_file_written:
            return
        _error_file_written = True
        if sys.exc_info()[1] is error:  # being handled here (@record): its traceback as it is
            ErrorHandler().record_exception(error)
            return
        try:
            raise error
        except BaseException as raised:  # record_exception reads the exception being handled
            ErrorHandler().record_exception(raised)


def hard_exit(code: int) -> None:
    """End this process now, skipping interpreter shutdown (see the module docstring). After a
    failure (``code`` not 0) its child processes go first (kill_children).

    Nothing stops the exit: a DataLoader's SIGCHLD handler, run in the main thread when
    kill_children ended one of its workers, raised "DataLoader worker ... is killed by signal"
    out of here; the process then went on, and torch's outer error handler replaced the rank's
    own error (seen once in a fresh clone's suite: a misshaped sample reported as a killed worker)."""
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the children are ours to end now
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code:
            kill_children()
            finish_writes()  # a snapshot write in flight (rank 0's file) ends first, within its grace
        say_last_words()  # (the timeline's end of this attempt: goodput's failure part ends here)
    finally:
        os._exit(code)


def kill_children() -> None:
    """SIGKILL this process's children: a failed rank leaves no DataLoader worker behind. A
    worker notices its parent's death only once it runs Python; one stuck before that (forked
    into a deadlock: data/workers.settle_before_fork) lived on, holding its rank's pipes, so the
    launcher never saw the rank end and the job never did."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: no /proc to find them by
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if parent_of(int(entry)) == me:  # (a zombie is dead already)
                os.kill(int(entry), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to signal
            continue


def parent_of(pid: int) -> int | None:
    """The pid's parent, or None when it is gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # (the name, in parentheses, may hold spaces)
        return None if fields[0] in ("Z", "X") else int(fields[1])
    except (OSError, IndexError, ValueError):  # gone, or not Linux's /proc
        return None


@dataclass
class RankError:
    rank: int
    mtime_ns: int
    message: str  # "ExceptionType: text"
    traceback: str

    @property
    def kind(self) -> str:
        return self.message.split(":", 1)[0]

    @property
    def text(self) -> str:
        return self.message.split(": ", 1)[1] if ": " in self.message else self.message

    @property
    def lost_peer(self) -> bool:
        return any(words in self.message for words in LOST_PEER)


def lost_peer(error: BaseException) -> bool:
    """The error is this rank feeling a peer's end (its connection closed), not its own."""
    return any(words in str(error) for words in LOST_PEER)


def read_error_files(attempt_dir: Path) -> dict[int, RankError]:
    """rank -> its error, from one attempt's ``<rank>/error.json`` files."""
    found = {}
    for path in attempt_dir.glob("*/error.json"):
        try:
            body = json.loads(path.read_text())["message"]
            found[int(path.parent.name)] = RankError(int(path.parent.name), path.stat().st_mtime_ns,
                                                     body["message"], body["extraInfo"]["py_callstack"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def root_cause(errors: dict[int, RankError], killed: dict[int, str], nproc: int = 0) -> RankError | int | None:
    """The error to show, or the rank killed by a signal that explains the rest. torch's record
    of the failed ranks can miss the killed one (its exit not yet reaped when the first failure
    is polled: seen at 64 ranks); then a rank of ``nproc`` without an error report, while every
    report is a lost connection, is the one."""
    def earliest(candidates: list[RankError]) -> RankError | None:
        return min(candidates, key=lambda e: e.mtime_ns) if candidates else None

    primary = [e for e in errors.values() if e.kind not in (*SECONDARY, TERMINATED) and not e.lost_peer]
    if primary:
        return earliest(primary)
    # A SIGTERM is likely the launcher's own (it stops every rank after the first failure): the
    # ranks killed by another signal explain more (seen at 64 ranks: a terminated rank 10 was
    # named for the SIGKILLed rank 37).
    by_launcher = {r for r, name in killed.items() if name == "SIGTERM"}
    silent = sorted(r for r in killed if r not in errors and r not in by_launcher)
    if silent:
        return silent[0]
    unreported = [r for r in range(nproc) if r not in errors and r not in by_launcher]
    if unreported and any(e.lost_peer for e in errors.values()):
        return unreported[0]
    if terminated := sorted(by_launcher - set(errors)):
        return terminated[0]
    return earliest([e for e in errors.values() if e.kind not in SECONDARY]) or earliest(list(errors.values()))


def job_failure(failure: Any, nproc: int, run_dir: Path) -> ConfigError | TrainingFailed:
    """What torch's ChildFailedError means to ddptrain's caller: a rank's configuration error
    (one line, exit status 2) as a ConfigError, anything else as the failure report."""
    report, code = failure_report(failure, nproc, run_dir)
    if code == 2:
        return ConfigError(report.removeprefix("ddptrain: error: "))
    return TrainingFailed(report, code)


def failure_report(failure: Any, nproc: int, run_dir: Path) -> tuple[str, int]:
    """(what to print, exit status) for torch's ChildFailedError."""
    reported = next(iter(failure.failures.values()))
    attempt_dir = _attempt_dir(reported.error_file, run_dir)
    errors = read_error_files(attempt_dir) if attempt_dir else {}
    killed = {rank: _signal_name(f.exitcode) for rank, f in failure.failures.items() if f.exitcode < 0}
    if any(e.kind in STUCK for e in errors.values()):
        return _hang_report(errors, run_dir), 1
    cause = root_cause(errors, killed, nproc)
    if isinstance(cause, int):
        lines = _killed_report(cause, killed.get(cause, "a signal"), run_dir, errors)
    elif cause is None:
        return (f"ddptrain: rank {reported.local_rank} failed (exit code {reported.exitcode}); "
                "no error report\n" + str(failure)), 1
    elif cause.kind in ONE_LINE:
        return f"ddptrain: error: {cause.text}", ONE_LINE[cause.kind]
    elif cause.kind == PeerFailed.__name__ and "reported a configuration error: " in cause.text:
        message = cause.text.split("reported a configuration error: ", 1)[1]
        return f"ddptrain: error: {message.split(': ', 1)[-1]}", 2
    else:
        lines = short_report(cause)
    cause_rank = cause if isinstance(cause, int) else cause.rank
    others = _others(nproc, errors, cause_rank)
    if others:
        lines.append("ddptrain: " + others)
    if attempt_dir and isinstance(cause, RankError):
        lines.append(f"ddptrain: training failed; rank {cause.rank}'s full traceback: "
                     f"{attempt_dir / str(cause.rank) / 'error.json'}")
    elif attempt_dir:
        lines.append(f"ddptrain: training failed; error reports in {attempt_dir}")
    return "\n".join(lines), 1


def _killed_report(rank: int, signal_name: str, run_dir: Path, errors: dict[int, RankError]) -> list[str]:
    """A rank killed by a signal: what its native stderr says (a C++ abort's reason, the
    collective it was in, the user's frames: aborts.py), else the usual suspects. The step is
    the other ranks' (a collective mismatch stops every rank in the same step)."""
    words = last_words(run_dir / "logs" / f"rank-{rank}.stderr", is_users)
    frames = [f"  {frame}" for frame in words.frames] if words else []
    if words is None or not words.reason:
        return [f"ddptrain: rank {rank} was killed by {signal_name} (out of memory, or killed from outside); "
                "no error report", *frames]
    steps = {_step_of(e.traceback) for e in errors.values()} - {None}
    at = f" in step {steps.pop()}" if len(steps) == 1 else ""
    call = f" in {words.call}" if words.call else ""
    return [f"ddptrain: rank {rank} aborted ({signal_name}){at}{call}: {words.reason}", *frames]


def _others(nproc: int, errors: dict[int, RankError], cause: int) -> str:
    """What every other rank did, on one line: rank by rank, or at more than GROUPED ranks, the
    ranks that did the same thing together ('rank 1-4, 6-63 stopped after rank 5 failed')."""
    did = {rank: _what_rank_did(rank, errors, cause) for rank in range(nproc) if rank != cause}
    if len(did) <= GROUPED:
        return "; ".join(did.values())
    alike: dict[str, list[int]] = {}
    for rank, text in did.items():
        alike.setdefault(re.sub(rf"^rank {rank}\b", "{ranks}", text, count=1), []).append(rank)
    return "; ".join(text.replace("{ranks}", rank_list(ranks), 1) for text, ranks in alike.items())


def _what_rank_did(rank: int, errors: dict[int, RankError], cause: int) -> str:
    if rank in errors and errors[rank].kind in SECONDARY:
        return errors[rank].text.split(": ", 1)[0]
    if rank in errors and errors[rank].lost_peer:  # gloo's own words for it: "Connection closed by peer"
        note = re.search(re.escape(COLLECTIVE_NOTE) + r"(.+)", errors[rank].traceback)
        where = f" in {note.group(1).strip()}" if note else ""
        return f"rank {rank} stopped after rank {cause} failed (it lost its connection to it{where})"
    if rank in errors and errors[rank].kind != TERMINATED:
        return f"rank {rank}: {errors[rank].text.splitlines()[0][:300]}"
    return f"rank {rank} stopped by the launcher (it had no error of its own)"


GROUPED = 4  # beyond this many other ranks, the report groups those that did the same
STEP_NOTE = "ddptrain: in step "  # added to an exception that leaves the training loop (Trainer)
COLLECTIVE_NOTE = "ddptrain: in collective "  # added to a failing rank's exception (launch/rank.py)
USER_FRAMES = 3  # the innermost frames of the user's own code shown with a failure
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def short_report(cause: RankError) -> list[str]:
    """A rank's exception in a few lines: the rank, the step and the exception's own line, then
    the innermost frames of the user's code (file:line in function: source). The full traceback
    stays in the rank's error file (named after these lines)."""
    step = _step_of(cause.traceback)
    at = f" in step {step}" if step else ""
    lines = [f"ddptrain: rank {cause.rank} failed{at}: {original_message(cause.message)}"]
    return lines + [f"  {frame}" for frame in user_frames(cause.traceback)[-USER_FRAMES:]]


def _step_of(traceback: str) -> str | None:
    """The step an exception left the training loop in (the Trainer's note on it)."""
    found = re.search(re.escape(STEP_NOTE) + r"(\d+)", traceback)
    return found.group(1) if found else None


def original_message(message: str) -> str:
    """The exception's own line: for an error re-raised from a DataLoader worker ("Caught X in
    DataLoader worker process 0" + the worker's traceback), the worker's last line."""
    lines = [line for line in message.splitlines() if line.strip()]
    if "Original Traceback" in message and lines:
        return lines[-1].strip()[:500]
    return " ".join(line.strip() for line in lines)[:500] if lines else message


def user_frames(traceback: str) -> list[str]:
    """``path:line in function: source`` for each frame of the traceback (and of a DataLoader
    worker's traceback inside it) that is the user's code: not Python's, torch's, ddptrain's or
    an installed package's."""
    frames: list[str] = []
    lines = traceback.splitlines()
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if not match or not is_users(match["path"]):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        is_source = following.strip() and not _FRAME.match(following) and not following.strip().startswith(("^", "~"))
        source = following.strip() if is_source else ""
        frames.append(f"{match['path']}:{match['line']} in {match['name']}" + (f": {source}" if source else ""))
    return frames


def is_users(path: str) -> bool:
    """The file is the user's code: not Python's, torch's, ddptrain's or an installed package's."""
    import sysconfig

    if path.startswith("<") or "site-packages" in path or "dist-packages" in path:
        return False
    # Python's library, ddptrain, and the environment's scripts (bin/ddptrain, bin/torchrun)
    paths = sysconfig.get_paths()
    library = (paths["stdlib"], str(Path(__file__).resolve().parents[1]), paths["scripts"])
    return not any(path.startswith(folder) for folder in library)


def _attempt_dir(error_file: str | None, run_dir: Path) -> Path | None:
    """The folder of the failed attempt's per-rank logs and error files (LOGS/RUN_ID/attempt_N):
    from the failed rank's error file, else the newest attempt under the run dir's logs."""
    if error_file and Path(error_file).parent.parent.name.startswith("attempt_"):
        return Path(error_file).parent.parent
    attempts = sorted((run_dir / "logs").glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    return attempts[-1] if attempts else None


def _hang_report(errors: dict[int, RankError], run_dir: Path) -> str:
    summary = run_dir / "logs" / "hang.txt"
    if summary.is_file():
        return summary.read_text().rstrip()
    stuck = [e for e in errors.values() if e.kind == RankStuck.__name__]
    return "\n".join(f"ddptrain: {e.text}" for e in stuck) or "ddptrain: a rank hung (no summary was written)"


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"
