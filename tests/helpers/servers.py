"""Real servers on loopback that the tests start once per session (fixtures in conftest.py): an
MLflow tracking server (sqlite backend, artifacts in a folder) and an S3-protocol server (moto's
server mode). Each can be killed and started again on the same port and data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ddptrain import free_port
from helpers.commands import BIN, clean_env

# A watcher beside each server: when the process that started the server is gone (pytest killed at
# a time limit, without its fixtures' teardown), it kills the server's session, workers and all.
WATCH = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class LoopbackServer:
    """A server process of its own session (``kill`` takes its workers too) on a free port; it
    ends with the process that started it, however that ends (``WATCH``)."""

    health_path = "/"
    environment: dict[str, str] = {}

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = Path(folder), free_port()
        self.process: subprocess.Popen | None = None
        self.watcher: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 120):
        """Start it and wait until it answers (the same port and data as before, after ``kill``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "server.log"
        self.process = subprocess.Popen(self.command(), stdout=open(log, "a"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=clean_env(**self.environment),
                                        start_new_session=True)
        self.watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(os.getpid()), str(self.process.pid)],
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.command()[0]} exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{self.command()[0]} not up after {timeout} s: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, the server and its workers: as a server that dies."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        if self.watcher is not None:
            self.watcher.kill()
            self.watcher.wait(timeout=30)


class HttpServer(LoopbackServer):
    """Python's own file server: the cheapest server there is (the watcher's test)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]


class MlflowServer(LoopbackServer):
    health_path = "/health"
    # MLflow 3 starts ~8 job-queue workers (huey, ~240 MB each) with its server; the tests need none
    environment = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

    @property
    def uri(self) -> str:
        return self.url

    def command(self) -> list[str]:
        return [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.folder / 'db.sqlite'}",
                "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
                "--port", str(self.port), "--workers", "1"]

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every value the run holds for ``key``, in step order."""
        return sorted((m.step, m.value) for m in self.client().get_metric_history(run_id, key))


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server(LoopbackServer):
    def command(self) -> list[str]:
        return [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to reach it: the endpoint and (any) credentials."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def filesystem(self):
        """An s3fs client of this server (no cached listings)."""
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=self.url,
                                 use_listings_cache=False, skip_instance_cache=True)

    def bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return f"s3://{name}"
