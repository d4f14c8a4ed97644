"""A real MLflow tracking server on loopback (sqlite backend, artifacts in a folder), as the
tracker tests' fixture starts it: once per test session, or per test when a test kills it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from helpers.commands import BIN, clean_env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on a free loopback port; ``kill`` and ``start`` again keep its data."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = Path(folder), free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> MlflowServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "server.log", "a")
        self.process = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.folder / 'db.sqlite'}",
             "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=clean_env(),
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"mlflow server exited: {(self.folder / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"mlflow server not up after {timeout} s")

    def kill(self) -> None:
        """SIGKILL, the server and its workers: as a server that dies."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every value the run holds for ``key``, in step order."""
        return sorted((m.step, m.value) for m in self.client().get_metric_history(run_id, key))
