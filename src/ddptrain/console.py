"""Printing from ranks that share one console."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def say(text: str, file: Any = None) -> None:
    """One line (or block) in a single write: ranks share the console, and with
    PYTHONUNBUFFERED ``print`` writes the text and its newline separately, so two ranks
    printing at once could splice their lines."""
    file = file or sys.stdout
    try:
        file.write(text + "\n")
        file.flush()
    except BrokenPipeError:  # the reader is gone (`ddptrain train | head`): training goes on, unseen
        drop_console(file)


def rank_list(ranks: list[int]) -> str:
    """'rank 0, 2, 5-63': runs of three or more as a range, so a line about 64 ranks stays a line."""
    ordered, parts = sorted(ranks), []
    while ordered:
        end = 0
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        parts += [f"{ordered[0]}-{ordered[end]}"] if end >= 2 else [str(r) for r in ordered[:end + 1]]
        ordered = ordered[end + 1:]
    return "rank " + ", ".join(parts)


def drop_console(stream: Any) -> None:
    """Send what this process prints to ``stream`` (sys.stdout or sys.stderr) nowhere from now on."""

    sink = open(os.devnull, "w")  # lives as long as the process
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is stream:
            setattr(sys, name, sink)


# Each native_stderr_to block in force in this process: (sys.stderr before it, the console's
# descriptor). A rank forked from a launcher inside one inherits it (reclaim_console).
_MOVED: list[tuple[Any, int]] = []


@contextlib.contextmanager
def native_stderr_to(path: Path, restore_after_error: bool = False) -> Iterator[None]:
    """What native code writes to file descriptor 2 goes to ``path`` for the block; Python's
    ``sys.stderr`` (ddptrain's lines, tracebacks, warnings, the progress bar) keeps the console.

    torch's C++ warnings write there: a rank whose peer died prints 20-40 lines of C++ frames
    per closed TCPStore connection ("recvVector failed", "Broken pipe") before ddptrain's own
    report; the launcher's store prints a line when a reverse lookup of a rank's address fails
    ("The hostname of the client socket cannot be retrieved"). They stay in the log for whoever
    wants them, not on everyone's console. Restored when the block ends normally (``fit()``
    under torchrun returns to its script); after an error only with ``restore_after_error``
    (a rank's process is ending, and its native last words go to the log too; a launcher in
    someone's script or notebook goes on)."""
    sys.stderr.flush()
    saved, console = sys.stderr, os.dup(2)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr = open(console, "w", buffering=1, closefd=False, errors="backslashreplace")
    os.dup2(log, 2)
    os.close(log)
    _MOVED.append((saved, console))
    ended = False
    try:
        yield
        ended = True
    finally:
        if ended or restore_after_error:
            sys.stderr.flush()
            os.dup2(console, 2)
            os.close(console)
            sys.stderr = saved
            _MOVED.remove((saved, console))


def reclaim_console() -> None:
    """In a rank forked from a launcher inside ``native_stderr_to``: descriptor 2 and
    ``sys.stderr`` back as the launcher found them, before the rank enables faulthandler (which
    writes to the descriptor ``sys.stderr`` has then) and moves its own native output to its log."""
    while _MOVED:
        saved, console = _MOVED.pop()
        os.dup2(console, 2)
        sys.stderr = saved
