"""A real S3-protocol server on loopback (moto's server mode), as the remote run dir tests'
fixture starts it once per session; each test makes a bucket of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from helpers.commands import BIN, clean_env
from helpers.mlflow_server import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    def __init__(self, folder: Path) -> None:
        self.folder, self.port = Path(folder), free_port()
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to reach it: the endpoint and (any) credentials."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}

    def start(self, timeout: float = 60) -> S3Server:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "server.log", "a")
        self.process = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=clean_env(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"moto server not up after {timeout} s: {(self.folder / 'server.log').read_text()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def filesystem(self):
        """An s3fs client of this server (no cached listings)."""
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=self.env["AWS_ENDPOINT_URL"],
                                 use_listings_cache=False, skip_instance_cache=True)

    def bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return f"s3://{name}"
