"""Sending a run's records to experiment trackers, off the training thread.

metrics.jsonl stays the source of truth; trackers get copies. On rank 0 each tracker has a
thread of its own (``Tracking``'s lanes), so a tracker that is slow, down, broken or silent
never stops training nor the other trackers: its first failure is one warning line, and it
gets nothing more in this run.
``ddptrain report RUN_DIR --sync NAME`` later sends what it missed (``sync``).

Each tracker gets each (metric, step) pair exactly once, across kills and resumes: the run
dir's ``trackers.json`` keeps each tracker's run id (a resumed run continues the same tracker
run); trackers that can say what they hold (MLflow's server, the CSV file, W&B's offline run
files) are asked, and a resumed run first sends each of them what it lacks of the records kept
before its snapshot (a kill can land before the tracking thread sent them, or before the
tracker wrote them down). Trackers that cannot tell (TensorBoard, W&B online) go by the last
step trackers.json says they took.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..console import say
from ..errors import ConfigError

STATE_FILE = "trackers.json"
# Record fields that place a record rather than measure anything.
PLACES = ("kind", "step", "time", "partial", "ended_by", "first_step_at")


class Tracker:
    """One experiment tracker. Only the tracking thread calls these; any may raise."""

    name = "tracker"
    tells_held = False  # held() is exact: its answer alone decides what is sent again


    def open(self, run_dir: Path, params: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
        """Start the tracker's run, or continue the one ``saved`` (this tracker's part of
        trackers.json) names; return what to keep there (ids). ``saved["uid"]``: this ddptrain
        run's own id for the tracker, kept before this is called (a run started under it by an
        attempt killed before its id was kept is found by it)."""
        return {}

    def held(self) -> set[tuple[str, int]]:
        """The (metric, step) pairs the tracker's run already holds, where it can tell."""
        return set()

    def send(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        raise NotImplementedError

    def close(self, status: str, artifacts: list[Path], summary: dict[str, Any]) -> None:
        """``status``: finished, stopped or failed; ``artifacts``: files to attach (those that exist)."""


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as flat numbers: nested figures joined with '/'
    (``data_s/max``, ``memory_mb/peak_rss_mb/max``), skipped steps counted; a step record's
    (--log-every) under ``step/`` (``step/train_loss``: an epoch's record at the same step keeps
    ``train_loss``, each figure its own curve)."""
    flat: dict[str, float] = {}
    within = "step/" if record.get("kind") == "step" else ""

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            flat[prefix] = float(value)
        elif isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}/{key}", inner)

    for key, value in record.items():
        if key == "skipped_steps":
            flat[key] = float(len(value))
        elif key not in PLACES:
            add(within + key, value)
    return flat


def params_of(config: dict[str, Any]) -> dict[str, str]:
    """config.json's settings as the text parameters trackers keep; what the run built (nested)
    flattened with '/' (``built/optimizer/param_groups/0/lr``), each value short."""
    params: dict[str, str] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}/{key}", inner)
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for index, inner in enumerate(value):
                add(f"{prefix}/{index}", inner)
        else:
            params[prefix] = str(value)

    for key, value in sorted(config.items()):
        add(key, value)
    return params


class TrackerState:
    """``RUN_DIR/trackers.json``: per tracker, its run's ids and the last step it took."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / STATE_FILE
        try:
            self.saved: dict[str, dict[str, Any]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.saved = {}
        self.lock = threading.Lock()

    def of(self, name: str) -> dict[str, Any]:
        return dict(self.saved.get(name, {}))

    def update(self, name: str, **values: Any) -> None:
        with self.lock:  # each tracker's thread writes its part
            self.saved.setdefault(name, {}).update(values)
            tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.saved, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.path)  # whole or not at all: a kill leaves the previous file


class Delivery:
    """What one tracker has taken: pairs it holds and the step it took last; sends the rest."""

    def __init__(self, tracker: Tracker, state: TrackerState) -> None:
        self.tracker, self.state = tracker, state
        self.held: set[tuple[str, int]] = set()
        self.through = -1
        self.sending: int | None = None  # the step this process sent last (a second record may share it)
        self.sent = 0

    def open(self, run_dir: Path, params: dict[str, str]) -> None:
        saved = self.state.of(self.tracker.name)
        if "uid" not in saved:  # kept before the tracker's run exists: a kill while it starts finds it again
            saved["uid"] = uuid.uuid4().hex
            self.state.update(self.tracker.name, uid=saved["uid"])
        kept = self.tracker.open(run_dir, params, saved)
        continued = kept.get("id") == saved.get("id")
        self.through = int(saved.get("through_step", -1)) if continued and not self.tracker.tells_held else -1
        self.held = self.tracker.held()
        self.state.update(self.tracker.name, **kept, through_step=self.through)

    def deliver(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        untaken = step > self.through or step == self.sending
        metrics = {k: v for k, v in metrics_of(record).items() if untaken and (k, step) not in self.held}
        if not metrics:
            return
        self.tracker.send(step, metrics, record.get("time"))
        self.held.update((k, step) for k in metrics)
        self.sent += len(metrics)
        self.sending = step
        if step > self.through:
            self.through = step
            self.state.update(self.tracker.name, through_step=step)


QUIET_WAIT_S = 1.0  # seconds the end waits for the trackers before it says that it waits


class Lane:
    """One tracker's own thread and queue: a tracker that hangs (a server that accepts and never
    answers) holds up only itself, never the CSV file or another tracker."""

    def __init__(self, delivery: Delivery, run_dir: Path) -> None:
        self.delivery, self.run_dir = delivery, run_dir
        self.name = delivery.tracker.name
        self.queue: queue.Queue[tuple[Callable[[Delivery], None], str] | None] = queue.Queue()
        self.doing = "starting"  # what the thread is at: named when the end has to wait for it
        self.thread = threading.Thread(target=self._work, name=f"ddptrain-tracker-{self.name}", daemon=True)
        self.thread.start()

    def put(self, action: Callable[[Delivery], None], what: str) -> None:
        self.queue.put((action, what))

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            action, what = job
            self.doing = what
            try:
                action(self.delivery)
            except Exception as error:  # noqa: BLE001 - any failure of a tracker: drop it, train on
                warn(f"tracker {self.name} failed {what} ({one_line(error)}); training goes on without it; "
                     f"metrics.jsonl has every record: `ddptrain report {self.run_dir} --sync {self.name}` "
                     "sends what it missed")
                return


class Tracking:
    """Rank 0's trackers, each driven by a thread of its own (``Lane``): ``begin``, ``log`` and
    ``end`` return at once (``end`` waits a bounded time for what is queued)."""

    def __init__(self, trackers: list[Tracker], run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.state = TrackerState(self.run_dir)
        self.lanes = [Lane(Delivery(t, self.state), self.run_dir) for t in trackers]

    def begin(self, config: dict[str, Any], kept: Iterable[dict[str, Any]] = ()) -> None:
        """Open every tracker's run; ``kept``: a resumed run's records from before its snapshot
        (or a finished run's, caught up), sent first to each tracker that lacks them."""
        kept = list(kept)

        def start(delivery: Delivery) -> None:
            delivery.open(self.run_dir, params_of(config))
            for record in kept:
                delivery.deliver(record)
        for lane in self.lanes:
            lane.put(start, "starting its run")

    def log(self, record: dict[str, Any]) -> None:
        for lane in self.lanes:
            lane.put(lambda d: d.deliver(record), f"sending step {record['step']}")

    def end(self, status: str, artifacts: Iterable[Path] = (), summary: dict[str, Any] | None = None,
            wait_s: float = 10.0) -> None:
        """Close every tracker's run, waiting at most ``wait_s`` in all (a server that hangs): a
        wait longer than a moment is said when it starts, naming who is waited for, and so is giving up."""
        files = [Path(p) for p in artifacts if Path(p).is_file()]
        for lane in self.lanes:
            lane.put(lambda d: d.tracker.close(status, files, summary or {}), "closing its run")
            lane.queue.put(None)
        deadline = time.monotonic() + wait_s
        self._join(min(QUIET_WAIT_S, wait_s))
        if busy := self._busy():
            warn(f"waiting up to {wait_s:g} s for {', '.join(f'{lane.name} ({lane.doing})' for lane in busy)}")
            self._join(deadline - time.monotonic())
        if busy := self._busy():
            warn(f"trackers ({', '.join(lane.name for lane in busy)}) still busy after {wait_s:g} s; not waiting "
                 f"for them (`ddptrain report {self.run_dir} --sync NAME` sends what they missed)")

    def _join(self, seconds: float) -> None:
        deadline = time.monotonic() + max(0.0, seconds)
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))

    def _busy(self) -> list[Lane]:
        return [lane for lane in self.lanes if lane.thread.is_alive()]


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def warn(message: str) -> None:
    say(f"ddptrain: warning: {message}", sys.stderr)


def sync(tracker: Tracker, run_dir: Path, records: list[dict[str, Any]], config: dict[str, Any],
         artifacts: Iterable[Path], summary: dict[str, Any]) -> tuple[int, int]:
    """Send a run's records to ``tracker`` now, each (metric, step) at most once: (values sent,
    values it already held). Failures raise ConfigError (the command's one line)."""
    delivery = Delivery(tracker, TrackerState(run_dir))
    try:
        delivery.open(run_dir, params_of(config))
        for record in records:
            delivery.deliver(record)
        tracker.close("finished", [Path(p) for p in artifacts if Path(p).is_file()], summary)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - one line for the command, whatever the client raised
        raise ConfigError(f"--sync {tracker.name}: {one_line(error)}; check that the tracker is reachable "
                          "and run the command again") from None
    total = sum(len(metrics_of(r)) for r in records)
    return delivery.sent, total - delivery.sent
