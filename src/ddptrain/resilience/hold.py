"""One job per run dir: a job holds its run dir for its whole life.

Two jobs writing one folder corrupt it (one moves the other's files aside, resumes from its
in-flight snapshot, interleaves metrics.jsonl). So before anything in a run dir is touched,
the job takes ``RUN_DIR/.hold``, a small JSON file naming the holder (job, host, pid, since,
heartbeat), and keeps it until it ends:

- Who holds: ``ddptrain train`` / ``fit()`` launching local ranks hold it in the launching
  process; under torchrun or srun the job's rank 0 holds it for every node of the job. A job
  is named by its launcher (``job_id``): a restart of the same job (torchrun's restarts, a
  Slurm requeue, the same ``--rdzv-id``) takes its own hold over.
- Liveness: the holder keeps an exclusive ``flock`` on the file, which the kernel drops when
  the holder dies, even by SIGKILL: on the same host a hold whose lock is free is stale. On
  shared storage seen from another host, locks may not cross hosts, so the holder rewrites
  its heartbeat every HEARTBEAT_S seconds and a hold whose heartbeat is older than STALE_S
  is stale.
- A second job on a held folder stops with one line naming the holder (ConfigError, exit 2)
  and touches nothing.
- A run dir on object storage (run_dir.py) is held twice: its local mirror as above, and the
  store's ``.hold`` object, by heartbeat alone (no locks there). A store without conditional
  writes leaves a race between two jobs starting in the same second: after writing its
  record, the job reads it back a moment later and gives way if another job's record won.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from ..errors import ConfigError
from ..run_dir import LEDGER, RunDir, StoreRunDir

HOLD_FILE = ".hold"
HEARTBEAT_S = 10.0
RELEASE_WAIT_S = 5.0  # seconds the end waits to remove a store's hold record
STALE_S = 60.0  # a heartbeat older than this (seen from another host) is a dead holder's


def job_id(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """The job this process belongs to, the same in every process and restart of the job."""
    if environ.get("DDPTRAIN_JOB_ID"):  # ddptrain's own local launch
        return environ["DDPTRAIN_JOB_ID"]
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchelastic-{run_id}"
    # torchrun's static rendezvous (run id "none"): no two live jobs share a master address and port
    return f"job-{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"


class RunDirHold:
    """This job's hold on ``run_dir`` (``acquire`` ... ``release``)."""

    def __init__(self, home: RunDir, job: str) -> None:
        """Held in ``home``'s folder on this machine (a store's run dir: its mirror, and the store)."""
        self.path = home.local / HOLD_FILE
        self.job = job
        self.store_record = RemoteHold(home, job) if isinstance(home, StoreRunDir) else None
        self.fd: int | None = None
        self.since = time.time()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> RunDirHold:
        """Take the hold, or raise ConfigError naming the live holder; touches nothing else."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _try_lock(fd)
            holder = _read(fd)
            for _ in range(40):  # locked by a job that is still writing its record: give it 2 s
                if locked or holder:
                    break
                time.sleep(0.05)
                holder = _read(fd)
            if holder and holder.get("job") != self.job and not stale(holder, gone_here=locked):  # lock free: gone
                raise ConfigError(self._refusal(holder))
            if not locked and not (holder and holder.get("job") == self.job):
                raise ConfigError(self._refusal(holder or {}))
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._write()
        if self.store_record is not None:
            try:
                self.store_record.acquire()
            except BaseException:
                self.release()
                raise
        self._beat = threading.Thread(target=self._heartbeat, name="ddptrain-hold", daemon=True)
        self._beat.start()
        return self

    def release(self) -> None:
        """Give the hold up (the file goes; the lock with it)."""
        self._stop.set()
        if self.fd is None:
            return
        if self.store_record is not None:  # quiet when the run's last line already said the store is down
            self.store_record.release(quiet=(self.path.parent / LEDGER).is_file())
        try:
            holder = _read(self.fd)
            if holder.get("job") == self.job and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None

    def _refusal(self, holder: dict[str, Any]) -> str:
        return refusal(str(self.path.parent), holder)

    def _write(self) -> None:
        data = json.dumps(hold_record(self.job, self.since)).encode()
        assert self.fd is not None
        os.pwrite(self.fd, data.ljust(max(len(data), 512)), 0)  # padded: a rewrite never leaves a tail

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except (OSError, AssertionError):
                return
            if self.store_record is not None:
                try:
                    self.store_record.write()
                except Exception:  # noqa: BLE001 - a store that is briefly unreachable: beat again later
                    pass


def hold_record(job: str, since: float) -> dict[str, Any]:
    """What a hold says, in the folder and on a store alike: the job, where it runs, since when,
    and its newest heartbeat."""
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": since, "heartbeat": time.time()}


def stale(holder: dict[str, Any], gone_here: bool) -> bool:
    """Whether ``holder`` is a dead job's: on this host, ``gone_here`` (its lock free, or its
    process gone: a SIGKILL leaves the record behind); elsewhere, a heartbeat older than STALE_S."""
    if holder.get("host") == socket.gethostname():
        return gone_here
    return time.time() - float(holder.get("heartbeat", 0)) > STALE_S


def refusal(run_dir: str, holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", time.time()))))
    who = (f"job {holder.get('job', '?')} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
           f"since {since})")
    return f"run dir {run_dir} is in use by {who}; wait for it to end, stop it, or give this job another --run-dir"


class RemoteHold:
    """The ``.hold`` object of a run dir on a store: the holder's record, its heartbeat rewritten."""

    SETTLE_S = 1.0  # how long a competing writer may take to overwrite our record

    def __init__(self, remote: StoreRunDir, job: str) -> None:
        self.remote, self.job, self.since = remote, job, time.time()

    def record(self) -> dict[str, Any]:
        return self.remote.read_json(HOLD_FILE)

    def acquire(self) -> None:
        holder = self.record()
        if holder and holder.get("job") != self.job and not stale(holder, gone_here=not _alive(holder)):
            raise ConfigError(refusal(self.remote.url, holder))
        self.write()
        time.sleep(self.SETTLE_S)
        holder = self.record()
        if holder.get("job") != self.job:
            raise ConfigError(refusal(self.remote.url, holder))

    def write(self) -> None:
        self.remote.write_json(HOLD_FILE, hold_record(self.job, self.since))

    def release(self, quiet: bool = False) -> None:
        """Remove our record, waiting at most RELEASE_WAIT_S (a store that hangs must not hold the
        job's exit); a store that fails is one warning line (none when ``quiet``): the record
        goes stale by itself."""
        failed: list[BaseException] = []

        def remove() -> None:
            try:
                if self.record().get("job") == self.job:
                    self.remote.remove(HOLD_FILE)
            except Exception as error:  # noqa: BLE001 - any client's error for a store that is unreachable
                failed.append(error)

        worker = threading.Thread(target=remove, name="ddptrain-release", daemon=True)
        worker.start()
        worker.join(RELEASE_WAIT_S)
        if worker.is_alive():
            why = f"no answer within {RELEASE_WAIT_S:g} s"
        elif failed:
            why = f"{type(failed[0]).__name__}: {' '.join(str(failed[0]).split())[:160]}"
        else:
            return
        if quiet:
            return
        print(f"ddptrain: warning: could not release the hold on {self.remote.url} ({why}); it goes stale "
              f"{STALE_S:g} s after its last heartbeat, then the run dir is free", file=sys.stderr, flush=True)


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder's process (on this host) still runs."""
    try:
        os.kill(int(holder.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _read(fd: int) -> dict[str, Any]:
    """The holder's record, {} if there is none yet. A record being written reads again."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if not text:
            return {}
        try:
            return json.loads(text)
        except ValueError:
            time.sleep(0.05)
    return {}
