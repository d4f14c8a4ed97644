"""Goodput: the share of a run's wall time spent on steps its final model keeps, across every attempt.

Rank 0 of each attempt (the first start, each restart by torchrun, Slurm, Ray or the same command,
each elastic round) appends its timeline to the run dir's ``timeline.jsonl``: when it started,
when its first step began, stretches of steps, each snapshot's and evaluation's blocking time,
and how it ended. The intervals are contiguous (each begins where the one before ended), so
the parts of ``account()`` sum to the wall time. A stretch of steps is one line rewritten in
place at most every ``WRITE_EVERY_S`` (one ``pwrite``, no append per step): a SIGKILLed rank 0
leaves its last steps known to that resolution.

Badput, after Google's goodput and Meta's ETTR: start-up (process start to the first step,
restore included), steps redone (trained, then lost to a failure before a snapshot kept them:
the next attempt resumed from an earlier step), snapshots (their blocking time), evaluations,
waiting (a failed attempt's end: the failure's detection; torchft's quorum, where a failed
group's stall and a heal show; a step nobody took), the failure (a failed attempt's detection to
its end: the teardown, the last snapshot's wait), the end (the final snapshot and model.pt, up to
the summary, and the process's exit) and the time between attempts (an attempt's end to the next
start: the launcher's restart, a requeue, the user). An attempt ends where its process does: the
``exit`` lines, written by rank 0 as it leaves after a failure (resilience/failures.hard_exit) and
by ddptrain's launcher once its ranks are gone (``exited``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..exits import at_exit
from ..run_dir import TIMELINE

WRITE_EVERY_S = 0.02  # the resolution of a killed rank 0's last steps
SLOT = 160  # bytes of the line a stretch of steps rewrites in place
LAUNCHED_AT = "DDPTRAIN_LAUNCHED_AT"  # ddptrain's launcher's start: the attempt's, for its ranks
PARTS = ("steps_kept", "startup", "steps_redone", "snapshots", "evaluations", "waiting", "failure", "end",
         "between_attempts")
PART_OF = {"snapshot": "snapshots", "eval": "evaluations", "end": "end", "closed": "end"}
UNKNOWN = "goodput: unknown (the run started before ddptrain wrote timeline.jsonl)"


def process_started_at(pid: int | str = "self") -> float:
    """When process ``pid`` started (wall clock, to /proc's 10 ms); now where /proc is absent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Timeline:
    """Rank 0's timeline of this attempt, appended to ``run_dir/timeline.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / TIMELINE
        self.fd: int | None = None
        self.end_at = 0  # the file's end: where the next line goes
        self.slot: int | None = None  # where the open stretch's line is
        self.stretch: dict[str, Any] | None = None
        self.mark = 0.0  # where the last interval ended: the next one begins here
        self.ended_at: float | None = None  # when end() wrote the attempt's end
        self.written = 0.0
        self.waited_s = 0.0  # waits inside the next step (torchft's quorum), not yet in a stretch

    def begin(self, resumed_from: int, world_size: int) -> None:
        """The attempt's start (its process's, or ddptrain's launcher's) and its first step's."""
        from .. import __version__

        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.end_at = os.lseek(self.fd, 0, os.SEEK_END)
        process_t = process_started_at()
        self.mark = time.time()
        self._append({"e": "start", "t": float(os.environ.get(LAUNCHED_AT) or process_t), "process_t": process_t,
                      "ready_t": self.mark, "resumed_from": resumed_from, "world_size": world_size,
                      "version": __version__})
        at_exit(lambda: exited(self.path.parent))  # (a process ended by failures.hard_exit: after a failure)

    def step_done(self, step: int) -> None:
        if self.fd is None:
            return
        now = time.time()
        if self.stretch is None:
            self.stretch = {"e": "steps", "a": step - 1, "b": step, "t0": self.mark, "t1": now, "w": 0.0}
        self.stretch["b"], self.stretch["t1"] = step, now
        self.stretch["w"] += self.waited_s
        self.waited_s = 0.0
        self.mark = now
        if now - self.written >= WRITE_EVERY_S:
            self._write_stretch()

    def waited(self, seconds: float) -> None:
        """Time the next step spent waiting on others, not training (torchft's quorum: a failed
        group's stall, a heal): counted as waiting, inside its stretch."""
        self.waited_s += seconds

    @contextlib.contextmanager
    def activity(self, kind: str, step: int) -> Iterator[None]:
        """A snapshot's or an evaluation's blocking time (it begins where the last step ended)."""
        yield
        if self.fd is not None:
            self._close_stretch()
            now = time.time()
            self._append({"e": kind, "step": step, "t0": self.mark, "t1": now})
            self.mark = now

    def straggled(self, seconds: float, step: int) -> None:
        """The ranks waited ``seconds`` for a straggler in the steps up to ``step`` (the epoch
        record's figure): counted as waiting instead of as those steps."""
        if self.fd is not None and seconds > 0:
            now = time.time()
            self._append({"e": "straggled", "s": seconds, "b": step, "t0": now, "t1": now})

    def end(self, outcome: str) -> None:
        """``outcome``: finished, stopped, failed. Once."""
        if self.fd is None:
            return
        self._close_stretch()
        self.ended_at = time.time()
        self._append({"e": "end", "outcome": outcome, "t0": self.mark, "t1": self.ended_at})
        os.close(self.fd)
        self.fd = None

    def closed(self) -> None:
        """The end's waits after the summary (the trackers' last sends, the uploads): a last
        line, which ``ddptrain report`` counts in the end (the summary, printed before, cannot).
        On a store's run dir it stays in the mirror (run_dir.py's pull keeps it) and goes up with
        the timeline's next upload, or ``ddptrain report URL --sync store``."""
        if self.ended_at is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"e": "closed", "t0": self.ended_at, "t1": time.time()},
                                    separators=(",", ":")) + "\n")
        self.ended_at = None

    def _close_stretch(self) -> None:
        if self.stretch is not None:
            self._write_stretch()
            self.stretch, self.slot = None, None

    def _write_stretch(self) -> None:
        assert self.fd is not None and self.stretch is not None
        if self.slot is None:
            self.slot, self.end_at = self.end_at, self.end_at + SLOT
        line = json.dumps({key: round(value, 6) if isinstance(value, float) else value
                           for key, value in self.stretch.items()}, separators=(",", ":"))
        os.pwrite(self.fd, (line.ljust(SLOT - 1) + "\n").encode(), self.slot)
        self.written = time.time()

    def _append(self, event: dict[str, Any]) -> None:
        assert self.fd is not None
        data = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        os.pwrite(self.fd, data, self.end_at)
        self.end_at += len(data)


def timeline_size(run_dir: Path) -> int:
    """How long the run's timeline is now (0: none yet): ``exited(run_dir, since=...)``'s mark."""
    path = Path(run_dir) / TIMELINE
    return path.stat().st_size if path.is_file() else 0


def exited(run_dir: Path, since: int = -1) -> None:
    """The attempt's end, where this process's is: an ``exit`` line (rank 0 leaving after a
    failure, ddptrain's launcher once its ranks are gone), if the run has a timeline that grew
    past ``since`` (a launch that found the run finished began no attempt: nothing to end)."""
    path = Path(run_dir) / TIMELINE
    if path.is_file() and path.stat().st_size > since:
        with open(path, "a") as handle:
            handle.write(json.dumps({"e": "exit", "t1": time.time()}, separators=(",", ":")) + "\n")


def read_timeline(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / TIMELINE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # a line cut by a crash: the rest stands
            continue
    return events


@dataclass
class Attempt:
    start: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    begun: float = 0.0  # when it started, as counted (place())

    @property
    def last_t(self) -> float:
        return max([self.start["ready_t"], *(e["t1"] for e in self.events)])

    @property
    def failed(self) -> bool:
        return any(e["e"] == "end" and e["outcome"] == "failed" for e in self.events)


def attempts_of(events: list[dict[str, Any]]) -> list[Attempt]:
    attempts: list[Attempt] = []
    for event in events:
        if event.get("e") == "start":
            attempts.append(Attempt(event))
        elif attempts:
            attempts[-1].events.append(event)
    return attempts


def place(attempts: list[Attempt]) -> None:
    """Each attempt's start: ddptrain's launcher's, unless the launcher restarted this attempt's
    ranks (elastic: its start is before the last attempt ended), then the process's; never
    before the attempt before it ended (clocks of two machines)."""
    previous_end = -math.inf
    for attempt in attempts:
        start = attempt.start["t"] if attempt.start["t"] >= previous_end else attempt.start["process_t"]
        attempt.begun = max(start, previous_end)
        previous_end = attempt.last_t


def account(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's goodput and its parts in seconds (they sum to ``wall_s``), or None without a
    timeline. A step counts as kept unless a later attempt resumed from before it."""
    attempts = attempts_of(events)
    if not attempts:
        return None
    place(attempts)
    parts = dict.fromkeys(PARTS, 0.0)
    redone_steps = 0
    for n, attempt in enumerate(attempts):
        if n:
            parts["between_attempts"] += attempt.begun - attempts[n - 1].last_t
        parts["startup"] += attempt.start["ready_t"] - attempt.begun
        kept_up_to = attempts[n + 1].start["resumed_from"] if n + 1 < len(attempts) else math.inf
        mark = attempt.start["ready_t"]  # where the attempt's intervals so far end
        for event in attempt.events:
            if event["e"] == "exit":  # the process's end, from wherever the attempt stood
                parts["failure" if attempt.failed else "end"] += max(event["t1"] - mark, 0.0)
                mark = max(mark, event["t1"])
                continue
            mark = max(mark, event["t1"])
            seconds = event["t1"] - event["t0"]
            if event["e"] == "steps":
                parts["waiting"] += event.get("w", 0.0)
                seconds -= event.get("w", 0.0)
                kept = min(max(kept_up_to - event["a"], 0), event["b"] - event["a"]) / (event["b"] - event["a"])
                parts["steps_kept"] += seconds * kept
                parts["steps_redone"] += seconds * (1 - kept)
                redone_steps += max(event["b"] - max(kept_up_to, event["a"]), 0)
            elif event["e"] == "straggled":  # inside steps already counted: moved to waiting
                parts["waiting"] += event["s"]
                parts["steps_kept" if event["b"] <= kept_up_to else "steps_redone"] -= event["s"]
            elif event["e"] == "end" and event["outcome"] == "failed":
                parts["waiting"] += seconds  # from the last step to the failure's detection
            else:
                parts[PART_OF[event["e"]]] += seconds
    wall = attempts[-1].last_t - attempts[0].begun
    return {"goodput": parts["steps_kept"] / wall if wall > 0 else 0.0, "wall_s": wall,
            "attempts": len(attempts), "steps_redone": redone_steps,
            **{f"{name}_s": seconds for name, seconds in parts.items()}}


def goodput_figures(run_dir: Path) -> dict[str, Any]:
    """The summary's figures: goodput and its parts, rounded; {} without a timeline."""
    found = account(read_timeline(run_dir))
    if found is None:
        return {}
    figures: dict[str, Any] = {"goodput": round(found["goodput"], 4), "attempts": found["attempts"]}
    figures.update({key: round(value, 3) for key, value in found.items() if key.endswith("_s")})
    figures["steps_redone"] = found["steps_redone"]
    return figures


def goodput_table(found: dict[str, Any]) -> str:
    """``ddptrain report``'s table: each part's seconds and share of the wall time."""
    wall = found["wall_s"]
    lines = [f"goodput {found['goodput']:.3f} over {found['attempts']} attempt(s), wall {wall:,.2f} s"]
    for name in PARTS:
        seconds = found[f"{name}_s"]
        share = seconds / wall if wall > 0 else 0.0
        extra = f" ({found['steps_redone']} steps)" if name == "steps_redone" and found["steps_redone"] else ""
        lines.append(f"  {name.replace('_', ' '):<17} {seconds:>10,.2f} s  {share:>6.1%}{extra}")
    return "\n".join(lines)


COLOURS = {"startup": "tab:gray", "steps_kept": "tab:green", "steps_redone": "tab:red", "snapshot": "tab:blue",
           "eval": "tab:purple", "end": "tab:olive", "waiting": "tab:orange", "failure": "tab:brown"}


def plot_timeline(run_dir: Path) -> str | None:
    """``goodput.png``: one bar per attempt, coloured by part; a one-line note if it cannot be drawn."""
    attempts = attempts_of(read_timeline(run_dir))
    if not attempts:
        return "goodput.png not drawn: no timeline.jsonl"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "goodput.png not drawn: matplotlib is not installed (pip install 'ddptrain[plot]')"
    place(attempts)
    origin = attempts[0].begun
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(attempts) + 1.4))
    for row, attempt in enumerate(attempts):
        kept_up_to = attempts[row + 1].start["resumed_from"] if row + 1 < len(attempts) else math.inf
        spans = [("startup", attempt.begun, attempt.start["ready_t"])]
        mark = attempt.start["ready_t"]
        for event in attempt.events:
            kind, t0, mark = event["e"], event.get("t0", mark), max(mark, event["t1"])
            if kind == "straggled":  # a sum inside the steps, not a span of its own
                continue
            if kind == "steps":
                kind = "steps_kept" if event["b"] <= kept_up_to else "steps_redone"
            elif kind in ("end", "closed"):
                kind = "waiting" if event.get("outcome") == "failed" else "end"
            elif kind == "exit":  # from where the attempt stood to its process's end
                kind = "failure" if attempt.failed else "end"
            spans.append((kind, t0, event["t1"]))
        for kind, t0, t1 in spans:
            ax.broken_barh([(t0 - origin, max(t1 - t0, 1e-3))], (row - 0.35, 0.7), color=COLOURS[kind])
    ax.set_yticks(range(len(attempts)), [f"attempt {n + 1}" for n in range(len(attempts))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first start")
    ax.legend(handles=[Patch(color=c, label=k.replace("_", " ")) for k, c in COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "goodput.png", dpi=110)
    plt.close(fig)
    return None


# --- projected to scale (docs/fault-tolerance.md, benchmarks/goodput_projection.py) -----------
def restart_goodput(job_mttf_s: float, interval_s: float, snapshot_s: float, restart_s: float) -> float:
    """First-order expected goodput of a job that restarts from its newest snapshot (Young 1974,
    Daly 2006): a snapshot blocks ``snapshot_s`` every ``interval_s`` of training; a failure, one
    every ``job_mttf_s``, costs ``restart_s`` (detection, start-up, restore) and, on average, half
    an interval of steps redone."""
    return min(1.0, max(0.0, 1 - snapshot_s / interval_s - (restart_s + interval_s / 2) / job_mttf_s))


def replica_goodput(job_mttf_s: float, groups: int, stall_s: float, heal_s: float) -> float:
    """First-order expected goodput with torchft's replica groups: at a failure every group
    stalls ``stall_s`` (the lighthouse's heartbeat timeout), and the failed group's share of the
    job (1/``groups``) is missing for ``heal_s`` (its restart and heal); nothing is redone."""
    return min(1.0, max(0.0, 1 - (stall_s + heal_s / groups) / job_mttf_s))
