"""Hangs: judging one from the ranks' heartbeats (a pure function), every rank's stack, and the
summary the launcher prints. The watchdog thread (watchdog.py) calls these; nothing here talks
to the store.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from ..console import rank_list
from .board import Heartbeat
from .failures import is_users
from .flight import Collective, classify, first_disagreement

INNERMOST_FRAMES = 2  # a hang at 64 ranks is 5 lines: what, where, two frames, the stacks' folder
TORCH_DISTRIBUTED = os.path.join("torch", "distributed", "")  # the frames below the user's collective call


def judge_hang(seen: dict[int, tuple[Heartbeat | None, float]], now: float, timeout_s: float) -> dict[str, Any] | None:
    """A hang's verdict, or None. ``seen``: rank -> (its heartbeat, None if it never published;
    since when it has not changed). A rank that has waited inside a collective for more than
    ``timeout_s`` means some rank never arrived there, or arrived somewhere else:

    - by ddptrain's marks, the culprits are the ranks that entered fewer of its collectives,
      stand at the same one outside it, or never published;
    - when every rank is inside a collective, the Flight Recorder's view decides (a desync:
      ranks in different collectives, flight.classify).

    The ranks that waited where they should are never blamed."""
    timed_out = sorted(r for r, (beat, since) in seen.items() if beat and beat.waits and now - since > timeout_s)
    if not timed_out:
        return None
    beats = {rank: beat for rank, (beat, _) in seen.items()}
    top = max(beats[r].arrivals for r in timed_out)  # type: ignore[union-attr]  # the waiting ranks have beats
    culprits = [r for r, beat in sorted(beats.items())
                if beat is None or beat.arrivals < top or (beat.arrivals == top and not beat.waits)]
    # Every rank inside a collective waits (some not yet for --timeout: on a busy machine ranks arrive apart)
    waiting = [r for r, beat in sorted(beats.items()) if beat is not None and beat.waits and r not in culprits]
    verdict = {"kind": "hang", "rank": 0, "culprits": culprits, "waiting": waiting,
               "label": beats[timed_out[0]].where, "message": "hang",  # type: ignore[union-attr]  # likewise
               "collectives": {str(r): beat.collective.describe() for r, beat in beats.items()
                               if beat is not None and beat.collective is not None}}
    if not culprits and all(beat is not None for beat in beats.values()):
        desync = classify({r: beat.collective for r, beat in beats.items()})  # type: ignore[union-attr]  # checked
        if desync is not None:
            verdict.update(culprits=desync.culprits, desync=desync.reason,
                           waiting=[r for r in waiting if r not in desync.culprits])
    return verdict


def refine(verdict: dict[str, Any], histories: dict[int, list[Collective]]) -> dict[str, Any]:
    """The verdict, its culprits named by the first collective the ranks called differently
    when their recent collectives show one (flight.first_disagreement): the heartbeats show
    only where each rank stands now, and after a mismatch gloo may let some ranks run on."""
    desync = first_disagreement(histories)
    if desync is None:
        return verdict
    waiting = [r for r in sorted(set(verdict["waiting"]) | set(verdict["culprits"])) if r not in desync.culprits]
    return {**verdict, "culprits": desync.culprits, "desync": desync.reason, "waiting": waiting}


def hang_summary(verdict: dict[str, Any], stacks: dict[int, str | None], timeout_s: float,
                 stacks_dir: Path | None) -> str:
    """The lines the launcher prints (and RUN_DIR/logs/hang.txt holds) for a hang's verdict."""
    culprits, waiting, where = verdict["culprits"], verdict["waiting"], verdict["label"]
    if verdict.get("desync"):
        step = re.search(r"\bstep (\d+)", where)  # the collective's own name is in the reason
        lines = [f"ddptrain: the ranks' collectives do not match at {f'step {step[1]}' if step else where} "
                 f"(waited --timeout {timeout_s:g} s): {verdict['desync']}"]
    elif not culprits:
        inside = sorted(set(verdict.get("collectives", {}).values()))
        return (f"ddptrain: every rank waits in {where}{' in ' + inside[0] if len(inside) == 1 else ''} for "
                f"more than --timeout {timeout_s:g} s: the collective itself does not complete (network, "
                "backend or a device problem)")
    else:
        lines = [f"ddptrain: {rank_list(culprits)} did not reach {where} within --timeout {timeout_s:g} s; "
                 f"{rank_list(waiting)} waited there{_in(verdict, waiting)}."]
    for rank in culprits:
        if stacks.get(rank) is not None:
            lines += [f"ddptrain: rank {rank} was in (innermost call last):", stacks[rank]]  # type: ignore[list-item]  # stacks of the ranks named
        else:
            lines.append(f"ddptrain: rank {rank} did not answer: it never started, or its Python "
                         "interpreter is blocked")
    if stacks_dir is not None:
        lines.append(f"ddptrain: every rank's stack: {stacks_dir}")
    return "\n".join(lines)


def _in(verdict: dict[str, Any], ranks: list[int]) -> str:
    """' in all_reduce #10 ([21] float32)' when the recorder saw those ranks in one collective."""
    inside = {verdict.get("collectives", {}).get(str(r)) for r in ranks}
    return f" in {inside.pop()}" if len(inside) == 1 and None not in inside else ""


def dump_stacks(stacks_dir: Path | None, rank: int, main_thread: int) -> str:
    """Every thread's stack into ``stacks_dir/rank-N.txt``; the main thread's innermost frames
    returned, one line each (``path:line in function: code``): the user's own code's when it
    is on the stack (where the user's bug is), else the innermost of all."""
    if stacks_dir is not None:
        stacks_dir.mkdir(parents=True, exist_ok=True)
        with open(stacks_dir / f"rank-{rank}.txt", "w") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
    frame = sys._current_frames().get(main_thread)
    if frame is None:
        return "  (the main thread has no Python frame)"
    frames = [f for f in traceback.extract_stack(frame) if TORCH_DISTRIBUTED not in f.filename] or \
        traceback.extract_stack(frame)  # torch's wrappers around the collective call say nothing
    shown = [f for f in frames if is_users(f.filename)] or frames
    return "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
                     for f in shown[-INNERMOST_FRAMES:])
