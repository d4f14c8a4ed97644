"""Printing from ranks that share one console."""

from __future__ import annotations

import os
import sys
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
