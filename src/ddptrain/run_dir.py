"""Where a run lives: ``RunDir.of(--run-dir)``, a local folder or a run dir on an object store.

Every other module takes one ``RunDir`` and asks it (``create``, ``check``, ``exists``,
``url_of``, ``move_aside``, ``pull``, ``readable``); only this module knows URLs and fsspec.

- ``RunDir``: a folder (shared by every node, for a multi-node job). ``local`` is the folder.
- ``StoreRunDir``: ``--run-dir s3://bucket/prefix`` (or ``gs://``, ``az://``). Every machine
  works in a local mirror, ``local`` (under ``DDPTRAIN_CACHE``, default ``~/.cache/ddptrain``),
  as on any run dir: flock, appends and torch's logs need a real folder. What is this machine's
  alone stays there (the launcher's logs, pids, hang stacks, traces); what makes the run is
  uploaded behind the training (snapshots/uploads.py: snapshots, metrics.jsonl, config.json,
  model.pt, the trackers' files; an outage costs the store, never the work) and pulled when a
  run starts, so the same command on any machine resumes where the run stopped. The features a
  store alone has take a ``StoreRunDir``: the uploads (snapshots/uploads.py; at start, those
  an earlier run here could not make, restore.py), the hold's record in the store
  (resilience/hold.py) and ``report --sync store``.

Object stores have no atomic rename, so a snapshot is committed by its manifest
(``snapshots/<name>.manifest``: every file of it and its size), written after every file:
a snapshot without one (an upload cut short) is never loaded, and rotation removes the
manifest before the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from .errors import ConfigError, StorageNotShared
from .store_calls import STORE_CALL_S, store_filesystem

MANIFEST = ".manifest"
SNAPSHOT_NAME = re.compile(r"^step-(\d{9})(\.pt)?$")  # a file (one rank wrote it) or a DCP folder (sharded)
# What makes a run (copied up as written, down at start); the rest of a run dir is the machine's.
TIMELINE = "timeline.jsonl"  # every attempt's timeline (observe/goodput.py)
RUN_FILES = ("metrics.jsonl", "config.json", "trackers.json", "metrics.csv", "hf_model.json", TIMELINE)
# What an earlier run leaves that a fresh start moves aside (the store holds those it was sent).
LEFTOVERS = ("snapshots", *RUN_FILES, "model.pt", "curves.png", "tensorboard", "wandb", "best", "ema")
LEDGER = ".not-uploaded.json"  # in a mirror, while it holds uploads the store lacks (snapshots/uploads.py)


def snapshot_name(global_step: int, folder: bool = False) -> str:
    return f"step-{global_step:09d}" + ("" if folder else ".pt")


def snapshot_member(name: str, relative: str) -> str:
    """Where a file of snapshot ``name`` lies in the snapshots folder: a DCP folder's inside it, a
    file snapshot's ranks' parts (``ranks/...``: snapshots/rank_parts.py) beside it in ``step-N.ranks/``,
    and ``""`` the file itself."""
    if not relative:
        return name
    if name.endswith(".pt"):
        return f"{name.removesuffix('.pt')}.{relative}"
    return f"{name}/{relative}"


def snapshot_paths(name: str) -> list[str]:
    """What snapshot ``name`` occupies in the snapshots folder: a file's parts' folder, then itself
    (removed in this order, a removal cut short leaves the file: a snapshot without its manifest,
    which the next rotation or start removes, with what is left of its parts)."""
    return [snapshot_member(name, "ranks"), name] if name.endswith(".pt") else [name]


def snapshot_number(name: str) -> int:
    """The global step in a snapshot's name (``step-000000042.pt``, ``step-000000042``)."""
    return int(SNAPSHOT_NAME.match(name).group(1))  # type: ignore[union-attr]  # named by that pattern


def default_name(task: str, identity: dict[str, Any]) -> str:
    """``runs/TASK-HASH``: the same settings (``identity``) give the same folder, others another."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_.]+", "-", task.replace(":", ".")).strip("-.") or "task"
    return os.path.join("runs", f"{name}-{digest}")


def _names_a_store(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class RunDir:
    """A run dir that is a folder on this machine (one every node shares, for a multi-node job)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.location = str(location)  # as the user gave it
        self.local = Path(location)  # the folder this machine works in

    @staticmethod
    def of(location: str | os.PathLike[str] | None) -> RunDir:
        """The run dir ``--run-dir`` names: a folder, or a store's URL (``s3://bucket/prefix``)."""
        assert location is not None, "a run dir is resolved first (RunConfig.with_run_dir)"
        return StoreRunDir(str(location)) if _names_a_store(str(location)) else RunDir(location)

    def __str__(self) -> str:
        return self.location

    def url_of(self, name: str) -> str:
        """Where ``name`` in the run dir is, as a user reads it (and ``--resume`` takes it)."""
        return str(self.local / name)

    def check_url(self, flag: str = "--run-dir") -> None:
        """The location's shape, asking nothing of disk or network (a folder has none to check)."""

    def check(self, flag: str = "--run-dir") -> None:
        """Before any rank starts, as one line: a store's URL, client, credentials and bucket."""

    def create(self) -> None:
        """Make this machine's folder now: one that cannot be made is one line before any rank starts."""
        path, shown = self.local, self.location
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--run-dir {shown} is a file, not a folder; choose another --run-dir")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
            reason = f"{blocker} is a file, not a folder" if blocker else error.strerror
            raise ConfigError(f"--run-dir {shown} cannot be created ({reason}); choose a folder "
                              "you can write to") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"--run-dir {shown} is not writable; choose a folder you can write to")

    def exists(self, name: str) -> bool:
        return (self.local / name).exists()

    def check_visible(self, path: Path, rank: int) -> None:
        """A snapshot rank 0 committed must be in this rank's folder: else the folder is not shared."""
        if not path.exists():
            raise StorageNotShared(rank, path)

    def pull(self, remove_cut: bool = True) -> list[str]:
        """The store's committed snapshots into this machine's mirror; the uncommitted ones' names
        (removed from the store with ``remove_cut``). A folder is its own: nothing to pull."""
        return []

    def pull_run_files(self) -> None:
        """The store's run files into the mirror (a folder holds its own)."""

    def move_aside(self, stamp: str, keep: tuple[str, ...] = ()) -> str | None:
        """A fresh start: an earlier run's files (but those named in ``keep``) go to
        ``previous-<stamp>/``; where, or None."""
        found = [name for name in LEFTOVERS if name not in keep and (self.local / name).exists()]
        if not found:
            return None
        target = self.local / f"previous-{stamp}"
        suffix = 1
        while target.exists():
            target = target.with_name(f"previous-{stamp}.{suffix}")
            suffix += 1
        target.mkdir(parents=True)
        for name in found:
            os.replace(self.local / name, target / name)
        return str(target)

    def holds(self, name: str) -> bool:
        """Whether the run dir holds the file ``name`` (a store's: in its mirror or in the store)."""
        return (self.local / name).exists()

    def readable(self, snapshots: bool = False) -> Path:
        """A folder holding the run to read (``ddptrain report``, ``export``): this one."""
        return self.local


# The object stores ddptrain knows: the fsspec backend each needs, the extra that installs it, and
# the variables that hold its credentials (named when access is refused).
BACKENDS = {"s3": ("s3fs", "s3", "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE (AWS_ENDPOINT_URL for "
                   "a server of your own)"),
            "gs": ("gcsfs", "gcs", "GOOGLE_APPLICATION_CREDENTIALS"),
            "gcs": ("gcsfs", "gcs", "GOOGLE_APPLICATION_CREDENTIALS"),
            "az": ("adlfs", "azure", "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME / "
                   "AZURE_STORAGE_ACCOUNT_KEY"),
            "abfs": ("adlfs", "azure", "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME / "
                     "AZURE_STORAGE_ACCOUNT_KEY")}


class StoreRunDir(RunDir):
    """A run dir on object storage, through fsspec (listings never cached: other machines write
    too), worked in through this machine's mirror of it (``local``)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url.rstrip("/")
        self.scheme, rest = url.split("://", 1)
        cache = Path(os.environ.get("DDPTRAIN_CACHE") or Path.home() / ".cache" / "ddptrain")
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", rest.strip("/"))[:80]
        self.local = cache / "runs" / self.scheme / f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"
        self._fs: Any = None

    def __str__(self) -> str:
        return self.url

    @property
    def _store(self) -> Any:
        if self._fs is None:
            try:
                self._fs = store_filesystem(self.scheme)  # every call bounded in time (store_calls.py)
            except ImportError:
                self.check_url()  # names the package and its extra
                raise
        return self._fs

    def _path(self, name: str = "") -> str:
        """The store's own path of ``name`` (no scheme: fsspec's calls take these)."""
        root = self.url.split("://", 1)[1]
        return f"{root}/{name}" if name else root

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    # --- checks ----------------------------------------------------------------------------
    def check_url(self, flag: str = "--run-dir") -> None:
        """The URL's shape and its client, before anything is imported or asked of the network:
        one line for an unknown scheme, an empty bucket or a missing fsspec backend."""
        scheme, rest = self.location.split("://", 1)
        if scheme not in BACKENDS:
            known = ", ".join(f"{name}://" for name in BACKENDS)
            raise ConfigError(f"{flag} {self.location}: unknown storage scheme {scheme!r}; use a local folder or one "
                              f"of {known}")
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise ConfigError(f"{flag} {self.location}: no bucket; write {scheme}://BUCKET/PREFIX")
        module, extra, _ = BACKENDS[scheme]
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} {self.location}: needs the {module} package; pip install 'ddptrain[{extra}]'")

    def check(self, flag: str = "--run-dir") -> None:
        """Before any rank starts: the URL, credentials and bucket, as one line each."""
        self.check_url(flag)
        bucket = self._path().split("/", 1)[0]
        try:
            self._store.info(bucket)  # one small request, whatever the bucket holds
        except TimeoutError:  # (fsspec's, at STORE_CALL_S: a store that accepts and never answers)
            raise ConfigError(f"{flag} {self.url}: the store accepts connections but did not answer within "
                              f"{STORE_CALL_S:g} s; check the endpoint and the network, then run the same "
                              "command again") from None
        except FileNotFoundError:
            raise ConfigError(f"{flag} {self.url}: bucket {bucket!r} does not exist (or this endpoint does not "
                              "have it); create it or give another --run-dir") from None
        except Exception as error:  # noqa: BLE001 - every client's own credential and permission errors
            kind, variables = type(error).__name__, BACKENDS.get(self.scheme, ("", "", "the store's settings"))[2]
            message = " ".join(str(error).split())[:160]
            if "Credential" in kind or isinstance(error, PermissionError):
                raise ConfigError(f"{flag} {self.url}: no access ({kind}: {message}); set the store's "
                                  f"credentials: {variables}") from None
            endpoint = " (AWS_ENDPOINT_URL for a server of your own)" if self.scheme == "s3" else ""
            raise ConfigError(f"{flag} {self.url}: cannot reach it ({kind}: {message}); check the "
                              f"endpoint{endpoint} and the network") from None

    # --- plain files -----------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return bool(self._store.exists(self._path(name)))

    def put(self, local: Path, name: str) -> None:
        """One object from a local file (an object appears whole or not at all)."""
        self._store.put_file(str(local), self._path(name))

    def get(self, name: str, local: Path) -> bool:
        """``name`` into ``local`` (written aside, then renamed); False when the store has none."""
        if not self.exists(name):
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.download")
        self._store.get_file(self._path(name), str(tmp))
        os.replace(tmp, local)
        return True

    def read_json(self, name: str) -> dict[str, Any]:
        """A small JSON object of the run dir ({} when there is none, or it is cut short)."""
        try:
            return json.loads(self._store.cat_file(self._path(name)))
        except (FileNotFoundError, ValueError):
            return {}

    def write_json(self, name: str, value: dict[str, Any]) -> None:
        self._store.pipe_file(self._path(name), json.dumps(value).encode())

    def remove(self, name: str) -> None:
        if self._store.exists(self._path(name)):
            self._store.rm(self._path(name), recursive=True)

    def holds(self, name: str) -> bool:
        return super().holds(name) or name in self.names()  # (another machine's mirror may hold it)

    def names(self, folder: str = "") -> list[str]:
        """The names directly under ``folder`` (files and folders)."""
        try:
            entries = self._store.ls(self._path(folder), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def files_of(self, folder: str) -> list[str]:
        """Every file under ``folder``, relative to it (none when there is no such folder)."""
        prefix = self._path(folder)
        try:
            found = self._store.find(prefix)
        except FileNotFoundError:
            return []
        return [str(path)[len(prefix) + 1:] for path in found if str(path) != prefix]

    # --- snapshots -------------------------------------------------------------------------
    def committed(self) -> list[str]:
        """The committed snapshots' names (``step-N.pt`` files, ``step-N`` DCP folders), oldest first."""
        names = set(self.names("snapshots"))
        done = [n for n in names if SNAPSHOT_NAME.match(n) and f"{n}{MANIFEST}" in names]
        return sorted(done, key=lambda n: int(SNAPSHOT_NAME.match(n).group(1)))  # type: ignore[union-attr]  # listed by that pattern

    def uncommitted(self) -> list[str]:
        """Snapshots whose upload never finished (no manifest): never loaded."""
        names = set(self.names("snapshots"))
        return sorted(n for n in names if SNAPSHOT_NAME.match(n) and f"{n}{MANIFEST}" not in names)

    def commit_snapshot(self, name: str) -> None:
        """Write snapshot ``name``'s manifest: every file of it is in the store now."""
        prefix = self._path(f"snapshots/{name}")
        if self._store.isdir(prefix):
            found = self._store.find(prefix, detail=True)
            listing = {path[len(prefix) + 1:]: info["size"] for path, info in found.items()}
        else:  # a file, and its ranks' parts beside it
            parts = self._path(f"snapshots/{snapshot_member(name, 'ranks')}")
            found = self._store.find(parts, detail=True) if self._store.isdir(parts) else {}
            listing = {"": self._store.info(prefix)["size"],
                       **{f"ranks/{path[len(parts) + 1:]}": info["size"] for path, info in found.items()}}
        manifest = {"snapshot": name, "files": listing, "committed_at": time.time()}
        self._store.pipe_file(self._path(f"snapshots/{name}{MANIFEST}"), json.dumps(manifest).encode())

    def rotate(self, keep: int, spare: Collection[str] = ()) -> None:
        """Remove all but the newest ``keep`` committed snapshots (the manifest first; ``spare``:
        names kept whatever their age), and uncommitted ones older than the newest committed
        (parts of a snapshot that was dropped)."""
        committed = self.committed()
        for old in committed[:-keep]:
            if old in spare:
                continue
            self.remove(f"snapshots/{old}{MANIFEST}")
            for path in snapshot_paths(old):
                self.remove(f"snapshots/{path}")
        newest = snapshot_number(committed[-1]) if committed else -1
        for orphan in self.uncommitted():
            if snapshot_number(orphan) < newest:
                for path in snapshot_paths(orphan):
                    self.remove(f"snapshots/{path}")
        names = set(self.names("snapshots"))
        for parts in [n for n in names if n.startswith("step-") and n.endswith(".ranks")]:
            file = parts.removesuffix(".ranks") + ".pt"  # parts whose file never came (or went before them)
            if file not in names and snapshot_number(file) < newest:
                self.remove(f"snapshots/{parts}")

    def pull(self, remove_cut: bool = True) -> list[str]:
        """Make the mirror's snapshots folder hold exactly the store's committed snapshots;
        ``remove_cut``: remove the uncommitted ones from the store. Returns the uncommitted names."""
        return self._pull_snapshots(self.local / "snapshots", remove_cut)

    def _pull_snapshots(self, local_snapshots: Path, remove_cut: bool) -> list[str]:
        cut = self.uncommitted()
        for name in cut if remove_cut else []:
            for path in snapshot_paths(name):
                self.remove(f"snapshots/{path}")
        shutil.rmtree(local_snapshots, ignore_errors=True)
        local_snapshots.mkdir(parents=True)
        for name in self.committed():
            manifest = json.loads(self._store.cat_file(self._path(f"snapshots/{name}{MANIFEST}")))
            staging = local_snapshots / f".{name}.download"
            for relative in sorted(manifest["files"], key=lambda r: r == ""):  # a file's parts before it
                if name.endswith(".pt") and relative:  # beside the file: in place before the file appears
                    target = local_snapshots / snapshot_member(name, relative)
                else:
                    target = staging / relative if relative else staging
                self.get(f"snapshots/{snapshot_member(name, relative)}", target)
            os.replace(staging, local_snapshots / name)
        return cut

    def pull_run_files(self, local: Path | None = None) -> None:
        """The run's own files as the store has them (a file the store lacks goes locally too).
        A mirror's timeline that only adds lines to the store's copy stays: its last line is
        written after the end's last upload (observe/goodput.py), and goes up with the next."""
        local = local or self.local
        for name in RUN_FILES:
            mine = (local / name).read_bytes() if name == TIMELINE and (local / name).is_file() else None
            if not self.get(name, local / name):
                (local / name).unlink(missing_ok=True)
            elif mine is not None and len(mine) > (local / name).stat().st_size \
                    and mine.startswith((local / name).read_bytes()):
                (local / name).write_bytes(mine)

    def check_visible(self, path: Path, rank: int) -> None:
        """Each machine's mirror is its own; the store's copy follows behind."""

    def move_aside(self, stamp: str, keep: tuple[str, ...] = ()) -> str | None:
        """A fresh start: an earlier run's files (but ``keep``) go to ``previous-<stamp>/``, in the
        mirror and in the store; the store's folder, or None."""
        super().move_aside(stamp, keep)
        found = [n for n in self.names() if n in LEFTOVERS and n not in keep]
        if not found:
            return None
        target = f"previous-{stamp}"
        for name in found:
            self._store.mv(self._path(name), self._path(f"{target}/{name}"), recursive=True)
        return self.url_of(target)


    def readable(self, snapshots: bool = False) -> Path:
        """The run copied down (its run files, model.pt, best/ and ema/; its committed snapshots
        too with ``snapshots``) into a folder beside the mirror, so a job training into that
        mirror here is never disturbed."""
        self.check(flag="run dir")
        copy = self.local.with_name(self.local.name + ".read")
        copy.mkdir(parents=True, exist_ok=True)
        self.pull_run_files(copy)
        for name in ("model.pt", "best/model.pt", "best/best.json", "ema/model.pt"):
            if not self.get(name, copy / name):
                (copy / name).unlink(missing_ok=True)
        if snapshots:
            self._pull_snapshots(copy / "snapshots", remove_cut=False)
        return copy
