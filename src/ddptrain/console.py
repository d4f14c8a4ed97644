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


def drop_console(stream: Any) -> None:
    """Send what this process prints to ``stream`` (sys.stdout or sys.stderr) nowhere from now on."""

    sink = open(os.devnull, "w")  # lives as long as the process
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is stream:
            setattr(sys, name, sink)


@contextlib.contextmanager
def native_stderr_to(path: Path) -> Iterator[None]:
    """What native code writes to file descriptor 2 goes to ``path`` for the block; Python's
    ``sys.stderr`` (ddptrain's lines, tracebacks, warnings, the progress bar) keeps the console.

    torch's C++ warnings write there: a rank whose peer died prints 20-40 lines of C++ frames
    per closed TCPStore connection ("recvVector failed", "Broken pipe") before ddptrain's own
    report. They stay in the rank's log for whoever wants them, not on everyone's console.
    Restored when the block ends normally (``fit()`` under torchrun returns to its script)."""
    sys.stderr.flush()
    saved, console = sys.stderr, os.dup(2)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr = open(console, "w", buffering=1, closefd=False, errors="backslashreplace")
    os.dup2(log, 2)
    os.close(log)
    yield  # after an error, left as it is: the process is ending, its native last words go to the log too
    sys.stderr.flush()
    os.dup2(console, 2)
    os.close(console)
    sys.stderr = saved
