"""Run dirs on object storage: ``--run-dir s3://bucket/prefix`` (or ``gs://``, ``az://``: fsspec).

A remote run dir has a local mirror on every machine, ``local_dir(url)`` (under
``DDPTRAIN_CACHE``, default ``~/.cache/ddptrain``): the rest of ddptrain works on that folder
as on any run dir. What is this machine's alone stays there (the launcher's logs, pids, hang
stacks, traces); what makes the run is uploaded behind the training (snapshots/uploads.py: snapshots,
metrics.jsonl, config.json, model.pt, the trackers' files; an outage costs the store, never
the work) and downloaded when a run starts (``RemoteDir.pull_snapshots``), so the same command
on any machine resumes where the run stopped.

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
import time
from pathlib import Path
from typing import Any

from .errors import ConfigError

MANIFEST = ".manifest"
_SNAPSHOT = re.compile(r"^step-(\d{9})(\.pt)?$")
# What makes a run (copied up as written, down at start); the rest of a run dir is the machine's.
RUN_FILES = ("metrics.jsonl", "config.json", "trackers.json", "metrics.csv", "hf_model.json")
LEDGER = ".not-uploaded.json"  # in a mirror, while it holds uploads the store lacks (snapshots/uploads.py)


def snapshot_number(name: str) -> int:
    """The global step in a snapshot's name (``step-000000042.pt``, ``step-000000042``)."""
    return int(name.removeprefix("step-").split(".", 1)[0])


def is_remote(run_dir: str | os.PathLike[str] | None) -> bool:
    return bool(run_dir) and "://" in str(run_dir) and not str(run_dir).startswith("file://")


def local_dir(run_dir: str | os.PathLike[str] | None) -> Path:
    """The folder this machine works in: the run dir itself, or a remote one's local mirror."""
    assert run_dir is not None, "a run dir is resolved first (RunConfig.with_run_dir)"
    if not is_remote(run_dir):
        return Path(run_dir)
    scheme, rest = str(run_dir).split("://", 1)
    cache = Path(os.environ.get("DDPTRAIN_CACHE") or Path.home() / ".cache" / "ddptrain")
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", rest.strip("/"))[:80]
    return cache / "runs" / scheme / f"{readable}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"


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


def check_location(run_dir: str | os.PathLike[str] | None, flag: str = "--run-dir") -> None:
    """A store URL's shape and its client, before anything is imported or asked of the network:
    ConfigError (one line) for an unknown scheme, an empty bucket or a missing fsspec backend."""
    if not is_remote(run_dir):
        return
    url = str(run_dir)
    scheme, rest = url.split("://", 1)
    if scheme not in BACKENDS:
        known = ", ".join(f"{name}://" for name in BACKENDS)
        raise ConfigError(f"{flag} {url}: unknown storage scheme {scheme!r}; use a local folder or one of {known}")
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise ConfigError(f"{flag} {url}: no bucket; write {scheme}://BUCKET/PREFIX")
    module, extra, _ = BACKENDS[scheme]
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{flag} {url}: needs the {module} package; pip install 'ddptrain[{extra}]'")


def _quiet_dropped_connections() -> None:
    """A store that drops its connections leaves aiohttp's write tasks failed and never awaited
    (the request itself failed, and is retried): asyncio would print each as "Task exception was
    never retrieved" with a traceback. fsspec's event loop (its own thread) drops those; any
    other problem there is reported as asyncio would."""
    import fsspec.asyn

    loop = fsspec.asyn.get_loop()

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ConnectionError) and "never retrieved" in context.get("message", ""):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def remote_of(run_dir: str | os.PathLike[str] | None) -> RemoteDir | None:
    return RemoteDir(str(run_dir)) if is_remote(run_dir) else None


class RemoteDir:
    """A run dir on object storage, through fsspec (listings never cached: other machines write too)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.scheme = url.split("://", 1)[0]
        self._fs: Any = None

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            # An unreachable S3 endpoint fails a request in seconds, not botocore's minutes of
            # retries: snapshots/uploads.py retries with its own backoff while the training goes on.
            options = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                         "retries": {"max_attempts": 2}}} if self.scheme == "s3" else {}
            try:
                self._fs = fsspec.filesystem(self.scheme, use_listings_cache=False, skip_instance_cache=True,
                                             **options)
            except ImportError:
                check_location(self.url)  # names the package and its extra
                raise
            _quiet_dropped_connections()
        return self._fs

    def path(self, name: str = "") -> str:
        """The store's own path of ``name`` (no scheme: fsspec's calls take these)."""
        root = self.url.split("://", 1)[1]
        return f"{root}/{name}" if name else root

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    # --- checks ----------------------------------------------------------------------------
    def check(self) -> None:
        """Before any rank starts: the URL, credentials and bucket, as one line each."""
        check_location(self.url)
        bucket = self.path().split("/", 1)[0]
        try:
            self.fs.info(bucket)  # one small request, whatever the bucket holds
        except FileNotFoundError:
            raise ConfigError(f"--run-dir {self.url}: bucket {bucket!r} does not exist (or this endpoint does not "
                              "have it); create it or give another --run-dir") from None
        except Exception as error:  # noqa: BLE001 - every client's own credential and permission errors
            kind, variables = type(error).__name__, BACKENDS.get(self.scheme, ("", "", "the store's settings"))[2]
            message = " ".join(str(error).split())[:160]
            if "Credential" in kind or isinstance(error, PermissionError):
                raise ConfigError(f"--run-dir {self.url}: no access ({kind}: {message}); set the store's "
                                  f"credentials: {variables}") from None
            endpoint = " (AWS_ENDPOINT_URL for a server of your own)" if self.scheme == "s3" else ""
            raise ConfigError(f"--run-dir {self.url}: cannot reach it ({kind}: {message}); check the "
                              f"endpoint{endpoint} and the network") from None

    # --- plain files -----------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def put(self, local: Path, name: str) -> None:
        """One object from a local file (an object appears whole or not at all)."""
        self.fs.put_file(str(local), self.path(name))

    def get(self, name: str, local: Path) -> bool:
        """``name`` into ``local`` (written aside, then renamed); False when the store has none."""
        if not self.exists(name):
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.download")
        self.fs.get_file(self.path(name), str(tmp))
        os.replace(tmp, local)
        return True

    def read_json(self, name: str) -> dict[str, Any]:
        """A small JSON object of the run dir ({} when there is none, or it is cut short)."""
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except (FileNotFoundError, ValueError):
            return {}

    def write_json(self, name: str, value: dict[str, Any]) -> None:
        self.fs.pipe_file(self.path(name), json.dumps(value).encode())

    def remove(self, name: str) -> None:
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)

    def names(self, folder: str = "") -> list[str]:
        """The names directly under ``folder`` (files and folders)."""
        try:
            entries = self.fs.ls(self.path(folder), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def files_of(self, folder: str) -> list[str]:
        """Every file under ``folder``, relative to it (none when there is no such folder)."""
        prefix = self.path(folder)
        try:
            found = self.fs.find(prefix)
        except FileNotFoundError:
            return []
        return [str(path)[len(prefix) + 1:] for path in found if str(path) != prefix]

    # --- snapshots -------------------------------------------------------------------------
    def committed(self) -> list[str]:
        """The committed snapshots' names (``step-N.pt`` files, ``step-N`` DCP folders), oldest first."""
        names = set(self.names("snapshots"))
        done = [n for n in names if _SNAPSHOT.match(n) and f"{n}{MANIFEST}" in names]
        return sorted(done, key=lambda n: int(_SNAPSHOT.match(n).group(1)))  # type: ignore[union-attr]  # listed by that pattern

    def uncommitted(self) -> list[str]:
        """Snapshots whose upload never finished (no manifest): never loaded."""
        names = set(self.names("snapshots"))
        return sorted(n for n in names if _SNAPSHOT.match(n) and f"{n}{MANIFEST}" not in names)

    def commit(self, name: str) -> None:
        """Write snapshot ``name``'s manifest: every file of it is in the store now."""
        prefix = self.path(f"snapshots/{name}")
        if self.fs.isdir(prefix):
            found = self.fs.find(prefix, detail=True)
            listing = {path[len(prefix) + 1:]: info["size"] for path, info in found.items()}
        else:
            listing = {"": self.fs.info(prefix)["size"]}
        manifest = {"snapshot": name, "files": listing, "committed_at": time.time()}
        self.fs.pipe_file(self.path(f"snapshots/{name}{MANIFEST}"), json.dumps(manifest).encode())

    def rotate(self, keep: int) -> None:
        """Remove all but the newest ``keep`` committed snapshots (the manifest first), and
        uncommitted ones older than the newest committed (parts of a snapshot that was dropped)."""
        committed = self.committed()
        for old in committed[:-keep]:
            self.remove(f"snapshots/{old}{MANIFEST}")
            self.remove(f"snapshots/{old}")
        newest = snapshot_number(committed[-1]) if committed else -1
        for orphan in self.uncommitted():
            if snapshot_number(orphan) < newest:
                self.remove(f"snapshots/{orphan}")

    def pull_snapshots(self, local_snapshots: Path, remove_cut: bool = True) -> list[str]:
        """Make ``local_snapshots`` hold exactly the committed snapshots; ``remove_cut``: remove
        the uncommitted ones from the store. Returns the uncommitted names."""
        import shutil

        cut = self.uncommitted()
        for name in cut if remove_cut else []:
            self.remove(f"snapshots/{name}")
        shutil.rmtree(local_snapshots, ignore_errors=True)
        local_snapshots.mkdir(parents=True)
        for name in self.committed():
            manifest = json.loads(self.fs.cat_file(self.path(f"snapshots/{name}{MANIFEST}")))
            staging = local_snapshots / f".{name}.download"
            for relative in manifest["files"]:
                target = staging / relative if relative else staging
                self.get(f"snapshots/{name}/{relative}" if relative else f"snapshots/{name}", target)
            os.replace(staging, local_snapshots / name)
        return cut

    def pull_run_files(self, local: Path) -> None:
        """The run's own files as the store has them (a file the store lacks goes locally too)."""
        for name in RUN_FILES:
            if not self.get(name, local / name):
                (local / name).unlink(missing_ok=True)

    def move_aside(self, stamp: str) -> str | None:
        """A fresh start: an earlier run's objects go to ``previous-<stamp>/``; its name, or None."""
        found = [n for n in self.names() if n in (*RUN_FILES, "snapshots", "model.pt", "curves.png", "best", "ema")]
        if not found:
            return None
        target = f"previous-{stamp}"
        for name in found:
            self.fs.mv(self.path(name), self.path(f"{target}/{name}"), recursive=True)
        return self.url_of(target)


def readable_copy(run_dir: str, snapshots: bool = False) -> Path:
    """A run dir to read (``ddptrain report``, ``export``): a local one as it is; a store's run
    copied down (its run files, model.pt, best/ and ema/; its committed snapshots too with ``snapshots``) into
    a folder beside its mirror, so a job training into that mirror here is never disturbed."""
    if not is_remote(run_dir):
        return Path(run_dir)
    check_location(run_dir, flag="run dir")
    remote = RemoteDir(run_dir)
    remote.check()
    copy = local_dir(run_dir).with_name(local_dir(run_dir).name + ".read")
    copy.mkdir(parents=True, exist_ok=True)
    remote.pull_run_files(copy)
    for name in ("model.pt", "best/model.pt", "best/best.json", "ema/model.pt"):
        if not remote.get(name, copy / name):
            (copy / name).unlink(missing_ok=True)
    if snapshots:
        remote.pull_snapshots(copy / "snapshots", remove_cut=False)
    return copy
