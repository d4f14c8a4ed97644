"""A run dir on a store: its files go up behind the training, so an outage costs the store, never the work.

Everything that makes the run (snapshots, metrics.jsonl and the other run files, model.pt) is
written to this machine's mirror first (RunDir.local) and queued here; one thread uploads
the queue in order. A failed upload is retried with backoff (1 s doubling to 15 s) while the
training goes on: one warning line when the store stops answering, one line when it is back
("caught up: N files"). No step ever waits on the store.

- A snapshot is committed in the store (its manifest, run_dir.py) once every file of it is
  there; the mirror's copy is never rotated away before that (``pending_snapshots``).
- FSDP's DCP folders: on rank 0's machine the folder is complete in the mirror (every local
  rank writes its shards there) and rank 0 uploads it whole. A rank on another machine uploads
  its own shard files, then removes them from its mirror; rank 0 commits the folder once every
  file DCP's ``.metadata`` names is in the store.
- While the store is behind, the mirror holds ``.not-uploaded.json``. At the run's end the
  queue gets UPLOAD_WAIT_S seconds (``DDPTRAIN_UPLOAD_WAIT_S``); what is still not uploaded then
  is named in one line (exit 1), and ``sync_up`` uploads it later: ``ddptrain report RUN --sync
  store``, or the same train command, whose start syncs a mirror that is ahead first.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..comm import DistContext
from ..console import say
from ..errors import StoreBehind
from ..run_dir import LEDGER, RUN_FILES, RunDir, StoreRunDir, snapshot_member, snapshot_number
from . import files, rank_parts

UPLOAD_WAIT_S = 60.0  # default seconds a finished run waits for a store to take what it has not yet
PREEMPTED_UPLOAD_WAIT_S = 10.0  # at most, after a stop signal (its grace period is short; the next start syncs)
# An end's wait shorter than this, with the store answering, prints nothing: a live store's last
# uploads took over 1 s on a busy machine (a CPU hog beside a fresh clone's suite) right after an
# outage's catch-up, and said it waited where nothing was worth a line.
QUIET_WAIT_S = 5.0
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)  # between attempts while the store does not answer (a silent one's take ~15 s)
# beside the run files: model.pt, --keep-best's best/, --ema's average
END_FILES = ("model.pt", "best/model.pt", "best/best.json", "ema/model.pt")


def upload_wait_s() -> float:
    return float(os.environ.get("DDPTRAIN_UPLOAD_WAIT_S") or UPLOAD_WAIT_S)


class NotYet(Exception):
    """A DCP folder whose other machines' shards are not in the store yet: try again soon."""


@dataclass
class Target:
    """Where uploads go from, and to: the run dir (its mirror and its store), and how many
    snapshots the store keeps."""

    remote: StoreRunDir
    keep: int
    spare: frozenset[str] = frozenset()  # snapshots kept whatever --keep says (Checkpointer.spare)

    @property
    def mirror(self) -> Path:
        return self.remote.local


class Upload:
    """One queued upload: a run file, a snapshot (file or folder), or this rank's part of a DCP folder."""

    def __init__(self, key: str, target: Target) -> None:
        self.key, self.up = key, target
        self.done: set[str] = set()  # store names uploaded already (a retry skips them)

    def put(self, local: Path, name: str) -> int:
        if name in self.done or not local.is_file():
            return 0
        self.up.remote.put(local, name)
        self.done.add(name)
        return 1

    def run(self) -> int:
        """Upload; the number of files sent."""
        return self.put(self.up.mirror / self.key, self.key)


class SnapshotUpload(Upload):
    """A snapshot the mirror holds whole: its files, then its manifest, then the store's rotation."""

    def run(self) -> int:
        name = self.key.removeprefix("snapshots/")
        local = self.up.mirror / self.key
        if not local.is_dir():  # a file, then its ranks' parts beside it
            sent = self.put(local, self.key)
            local_parts = self.up.mirror / "snapshots" / snapshot_member(name, "ranks")
            sent += sum(self.put(file, f"snapshots/{snapshot_member(name, 'ranks/' + relative)}")
                        for file, relative in _folder_files(local_parts))
            missing = parts_missing(self.up.remote, name, local_parts)
        else:
            present = set(self.up.remote.files_of(self.key)) if not self.done else set()
            sent = sum(self.put(file, f"{self.key}/{relative}") for file, relative in _folder_files(local)
                       if relative not in present)
            missing = dcp_missing(self.up.remote, local) + parts_missing(self.up.remote, name, local / "ranks")
        if missing:
            raise NotYet(f"{name}: {len(missing)} file(s) of other machines not in the store yet")
        self.up.remote.commit_snapshot(name)
        self.up.remote.rotate(self.up.keep, spare=self.up.spare)
        return sent + 1


class PartUpload(Upload):
    """A rank on another machine than rank 0: its own files of a snapshot (a DCP folder's shard
    files, its part: ``(local file, path inside the snapshot)``), from its mirror."""

    def __init__(self, key: str, target: Target, local_files: list[tuple[Path, str]]) -> None:
        super().__init__(key, target)
        self.local_files = local_files

    def run(self) -> int:
        name = self.key.removeprefix("snapshots/")
        sent = sum(self.put(file, f"snapshots/{snapshot_member(name, relative)}")
                   for file, relative in self.local_files)
        for file, _ in self.local_files:  # the store holds them now; this machine never reads them
            file.unlink(missing_ok=True)
        for folder in {parent for file, _ in self.local_files for parent in (file.parent, file.parent.parent)}:
            if folder.name.startswith((".step-", "step-")) or folder.name == "ranks":
                try:
                    folder.rmdir()  # (the last rank of this machine to finish)
                except OSError:
                    pass
        return sent


def _folder_files(folder: Path) -> list[tuple[Path, str]]:
    return [(file, str(file.relative_to(folder))) for file in sorted(folder.rglob("*")) if file.is_file()]


def parts_missing(remote: StoreRunDir, name: str, local_parts: Path) -> list[str]:
    """The ranks' parts of snapshot ``name`` (rank_parts.py) that neither the store nor this mirror's
    ``local_parts`` holds: those other machines have not uploaded yet."""
    here = [p.name for p in local_parts.glob("rank-*.pt")] if local_parts.is_dir() else []
    expected = rank_parts.expected_parts(here)
    if not expected or len(here) == len(expected):
        return []
    present = set(remote.files_of(f"snapshots/{snapshot_member(name, 'ranks')}")) | set(here)
    return [part for part in expected if part not in present]


def dcp_missing(remote: StoreRunDir, folder: Path) -> list[str]:
    """The files DCP's ``.metadata`` in ``folder`` names that the store's copy of it lacks."""
    metadata = folder / ".metadata"
    if not metadata.is_file():
        return []
    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in FileSystemReader(folder).read_metadata().storage_data.values()}
    present = set(remote.files_of(f"snapshots/{folder.name}"))
    return sorted(named - present)


def rank_uploader(home: RunDir, keep: int, ctx: DistContext) -> Uploader | None:
    """A run dir on a store: rank 0 uploads the run; a rank on another machine than rank 0's
    uploads its own files of each snapshot (its part, rank_parts.py; under FSDP its shard files too)."""
    if not isinstance(home, StoreRunDir):  # a folder holds the run as written
        return None
    if not (ctx.is_main or ctx.rank >= ctx.local_world_size):
        return None
    return Uploader(home, keep, speaks=ctx.is_main)


class Uploader:
    """This rank's uploads to the store, in order, on a thread of their own."""

    def __init__(self, remote: StoreRunDir, keep: int, speaks: bool = True) -> None:
        """``speaks``: this rank prints the outage's lines and raises at the end (rank 0)."""
        self.remote, self.mirror, self.keep, self.speaks = remote, remote.local, keep, speaks
        self.target = Target(remote, keep)
        self.queue: OrderedDict[str, Upload] = OrderedDict()
        self.cond = threading.Condition()
        self.closing = False
        self.given_up = False  # close's wait ran out: the thread makes no further attempt
        self.down_since: float | None = None
        self.problem = ""  # the last error, in a few words
        self.sent_while_down = 0
        self.thread = threading.Thread(target=self._work, name="ddptrain-upload", daemon=True)
        self.thread.start()

    # --- what the training queues ----------------------------------------------------------
    def add_file(self, name: str) -> None:
        """A run file (or model.pt) of the mirror, as it is when its upload starts."""
        self._add(Upload(name, self.target))

    def add_snapshot(self, name: str) -> None:
        """A snapshot the mirror holds whole (a file, or rank 0's DCP folder)."""
        self._add(SnapshotUpload(f"snapshots/{name}", self.target))

    def add_part(self, name: str, local_files: list[tuple[Path, str]]) -> None:
        """This rank's files of snapshot ``name``: (the file in the mirror, its path inside the snapshot)."""
        self._add(PartUpload(f"snapshots/{name}", self.target, local_files))

    def _add(self, upload: Upload) -> None:
        with self.cond:
            self.queue[upload.key] = upload  # a newer copy of a file replaces the queued one
            self.cond.notify_all()

    def pending_snapshots(self) -> set[str]:
        """Snapshot names the store has not committed yet: the mirror keeps them."""
        with self.cond:
            return {key.removeprefix("snapshots/") for key in self.queue if key.startswith("snapshots/")}

    # --- the thread --------------------------------------------------------------------------
    def _work(self) -> None:
        attempt = 0
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue or self.given_up:
                    return
                upload = next(iter(self.queue.values()))
            try:
                sent = upload.run()
            except NotYet:
                self._pause(0.5)
                continue
            except Exception as error:  # noqa: BLE001 - any client's error: the store is not answering
                if self._given_up():  # close() has named what is left: nothing more to say
                    return
                self._went_down(error)
                self._pause(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                attempt += 1
                continue
            attempt = 0
            self._uploaded(upload, sent)

    def _given_up(self) -> bool:
        """(Set by close() on another thread, while this one waited on the store.)"""
        with self.cond:
            return self.given_up

    def _pause(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)

    def _uploaded(self, upload: Upload, sent: int) -> None:
        # All of it before close() can see the queue empty: the process may end as soon as it
        # does (the line that the store caught up was once cut off that way, under load)
        with self.cond:
            if self.queue.get(upload.key) is upload:  # else a newer copy was queued meanwhile: it goes too
                del self.queue[upload.key]
            if self.down_since is not None:
                self.sent_while_down += sent
            if isinstance(upload, SnapshotUpload):
                kept = self.target.spare | set(self.pending_snapshots())
                files.rotate(self.mirror / "snapshots", self.keep, spare=kept)
            if self.down_since is not None and not self.queue:
                self._back()
            self.cond.notify_all()

    def _went_down(self, error: BaseException) -> None:
        self.problem = f"{type(error).__name__}: {' '.join(str(error).split())[:120]}"
        if self.down_since is not None:
            return
        self.down_since, self.sent_while_down = time.monotonic(), 0
        self._write_ledger()
        if self.speaks:
            say(f"ddptrain: warning: the store {self.remote.url} does not answer ({self.problem}); training goes "
                f"on, its uploads wait in {self.mirror} and are retried", sys.stderr)

    def _back(self) -> None:
        seconds = time.monotonic() - (self.down_since or time.monotonic())
        self.down_since = None
        (self.mirror / LEDGER).unlink(missing_ok=True)
        if self.speaks:
            say(f"ddptrain: the store {self.remote.url} answers again after {seconds:.0f} s; caught up: "
                f"{self.sent_while_down} file(s) uploaded", sys.stderr)

    def _write_ledger(self) -> None:
        with self.cond:
            names = list(self.queue)
        write_ledger(self.mirror, self.remote.url, names)

    # --- the end -----------------------------------------------------------------------------
    def close(self, wait_s: float | None = None, at_end: bool = True) -> None:
        """Give the queue ``wait_s`` seconds (default: ``upload_wait_s()``) to empty; what is left
        is named in the ledger and, on the speaking rank, in StoreBehind (one line) ``at_end``,
        else in a warning (after a stop signal; none after a failure, whose wait is 0)."""
        wait_s = upload_wait_s() if wait_s is None else wait_s
        started = time.monotonic()
        deadline, said = started + wait_s, False
        with self.cond:
            self.closing = True
            self.cond.notify_all()
            while self.queue and time.monotonic() < deadline:
                slow = self.down_since is not None or time.monotonic() > started + QUIET_WAIT_S
                if slow and not said and self.speaks and at_end:  # a wait worth a line
                    said = True
                    say(f"ddptrain: waiting up to {wait_s:g} s for the store {self.remote.url} ({len(self.queue)} "
                        "upload(s) left)", sys.stderr)
                self.cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            left = list(self.queue)
            self.given_up = bool(left)  # (a request in flight may still land: the ledger's sync checks)
        if not left:
            return
        write_ledger(self.mirror, self.remote.url, left)
        if self.speaks and at_end:
            raise StoreBehind(behind_message(self.remote.url, self.mirror, left, self.problem, wait_s))
        if self.speaks and wait_s > 0:  # a stop signal's short wait (a failure's, 0, leaves the report alone)
            say(f"ddptrain: warning: {len(left)} upload(s) to {self.remote.url} not made before the stop; they are "
                f"safe in {self.mirror}, and the next start uploads them first", sys.stderr)


def write_ledger(mirror: Path, url: str, names: list[str]) -> None:
    record = {"store": url, "not_uploaded": names, "since": time.time()}
    tmp = mirror / f".{LEDGER}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, mirror / LEDGER)
    except OSError:
        pass  # a full mirror disk: the next start compares the mirror with the store anyway


def behind_message(url: str, mirror: Path, left: list[str], problem: str, waited: float) -> str:
    shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    why = f" ({problem})" if problem else " (its requests had not returned)"
    return (f"the store {url} did not take the run's last uploads within {waited:g} s{why}: not uploaded: {shown}; "
            f"they are safe in {mirror}; upload them with: ddptrain report {url} --sync store "
            "(or run the same train command)")


# --- later: the mirror's uploads that never happened ------------------------------------------
def mirror_is_ahead(mirror: Path) -> bool:
    return (Path(mirror) / LEDGER).is_file()


def sync_up(remote: StoreRunDir, keep: int) -> int:
    """Upload what the mirror holds and the store lacks (the run files, model.pt, the newest
    ``keep`` snapshots newer than the store's newest), commit the snapshots, rotate the store and
    the mirror; the number of files uploaded.
    A mirror older than the store (another machine went on from the store since) uploads nothing."""
    mirror = remote.local
    committed = remote.committed()
    newest_stored = snapshot_number(committed[-1]) if committed else -1
    local = files.list_snapshots(files.snapshot_dir(mirror))
    newest_local = files.snapshot_step(local[-1]) if local else -1
    sent = 0
    if newest_local >= newest_stored:
        target = Target(remote, keep)  # the uploads, run here and now (no thread)
        for path in [p for p in local if files.snapshot_step(p) > newest_stored][-keep:]:
            sent += SnapshotUpload(f"snapshots/{path.name}", target).run()
        for name in (*RUN_FILES, *END_FILES):
            sent += Upload(name, target).run()
        for partial in sorted(files.snapshot_dir(mirror).glob(".step-*.partial")):  # other machines' shards
            name = partial.name[1:].removesuffix(".partial")
            if snapshot_number(name) > newest_stored:
                sent += PartUpload(f"snapshots/{name}", target, _folder_files(partial)).run()
        for local_parts in sorted(files.snapshot_dir(mirror).glob("step-*.ranks")):  # other machines' parts
            name = local_parts.name.removesuffix(".ranks") + ".pt"
            if snapshot_number(name) > newest_stored and not (local_parts.parent / name).exists():
                sent += PartUpload(f"snapshots/{name}", target,
                                   [(file, f"ranks/{relative}") for file, relative in _folder_files(local_parts)]).run()
        files.rotate(files.snapshot_dir(mirror), keep)
    (mirror / LEDGER).unlink(missing_ok=True)
    return sent


def sync_line(url: str, sent: int) -> str:
    return f"store: uploaded {sent} file(s) the mirror held and {url} lacked" if sent else \
        f"store: {url} already holds everything the mirror does"

