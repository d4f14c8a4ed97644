"""What a rank killed by a signal left behind: its native stderr (launch/rank.py sends it to
``RUN_DIR/logs/rank-N.stderr``) holds C++'s last words and faulthandler's Python frames.

A collective mismatch on gloo (ranks in all_reduces of different sizes: one rank called an
extra collective, or another shape) aborts a rank inside gloo (``gloo::EnforceNotMet``: "Is
there a distributed collective mismatch in your code?"), where no Python can run to report
it: this is how the launcher names it, with the rank's own frames, instead of "killed by
SIGABRT".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TAIL_BYTES = 64 * 1024  # the stack dump is at the end; earlier warnings do not matter
FRAMES_SHOWN = 3
_WHAT = re.compile(r"what\(\):\s*(?:\[[^\]]*\]\s*)?(?P<text>.+)")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>.+)$')


@dataclass
class LastWords:
    reason: str  # the C++ exception's message ('' when none)
    call: str  # the torch.distributed function the rank was in ('' when none): "all_reduce"
    frames: list[str]  # the innermost frames of the user's code, innermost last: "path:line in name"


def last_words(stderr: Path, is_users: Callable[[str], bool]) -> LastWords | None:
    """What the rank's stderr says of its end (None: nothing, or no file): the reason a C++
    exception aborted it, and the thread that had the user's frames (faulthandler's dump)."""
    try:
        with open(stderr, "rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - TAIL_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    terminate = text.rfind("terminate called after throwing")  # C++'s words come before Python's
    start = terminate if terminate >= 0 else max(text.rfind("Fatal Python error"), 0)
    what = _WHAT.search(text[start:])
    words = LastWords(what["text"].strip()[:300] if what else "", "", [])
    for block in text[start:].split("\n\n"):  # one block per thread, innermost frame first
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        users = [m for m in frames if is_users(m["path"])]
        if users:
            words.frames = [f"{m['path']}:{m['line']} in {m['name']}" for m in users[:FRAMES_SHOWN]][::-1]
            words.call = next((m["name"] for m in frames if m["path"].endswith("distributed_c10d.py")), "")
            break
    return words if words.reason or words.frames else None
