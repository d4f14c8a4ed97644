"""Hangs: judging one from the ranks' heartbeats (a pure function), every rank's stack, and the
summary the launcher prints. The watchdog thread (watchdog.py) calls these; nothing here talks
to the store.
"""

from __future__ import annotations

import faulthandler
import sys
import traceback
from pathlib import Path
from typing import Any

from .board import Heartbeat

INNERMOST_FRAMES = 8


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
    top = max(beats[r].arrivals for r in waiting)  # type: ignore[union-attr]  # the waiting ranks have beats
    culprits = [r for r, beat in sorted(beats.items())
                if beat is None or beat.arrivals < top or (beat.arrivals == top and not beat.inside)]
    return {"kind": "hang", "rank": 0, "culprits": culprits, "waiting": waiting,
            "label": beats[waiting[0]].where, "message": "hang"}  # type: ignore[union-attr]  # likewise


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
            lines += [f"ddptrain: rank {rank} was in (innermost call last):", stacks[rank]]  # type: ignore[list-item]  # stacks of the ranks named
        else:
            lines.append(f"ddptrain: rank {rank} did not answer: it never started, or its Python "
                         "interpreter is blocked")
    if stacks_dir is not None:
        lines.append(f"ddptrain: every rank's stack: {stacks_dir}")
    return "\n".join(lines)


def dump_stacks(stacks_dir: Path | None, rank: int, main_thread: int) -> str:
    """Every thread's stack into ``stacks_dir/rank-N.txt``; the main thread's innermost frames returned."""
    if stacks_dir is not None:
        stacks_dir.mkdir(parents=True, exist_ok=True)
        with open(stacks_dir / f"rank-{rank}.txt", "w") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
    frame = sys._current_frames().get(main_thread)
    if frame is None:
        return "  (the main thread has no Python frame)"
    frames = traceback.extract_stack(frame)[-INNERMOST_FRAMES:]
    return "".join(traceback.format_list(frames)).rstrip()
