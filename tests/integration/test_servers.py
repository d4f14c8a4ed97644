"""The servers the suite starts (moto, MLflow) end with it, even when pytest itself is killed
(a fresh clone's suite killed at its time limit once left its S3 server running)."""

import os
import signal
import subprocess
import sys
import time

from helpers.commands import TESTS, alive, clean_env

STARTER = """
import sys
from pathlib import Path
from helpers.servers import HttpServer
server = HttpServer(Path(sys.argv[1])).start()
print(server.process.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_server_outlives_no_killed_test_run(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True,
                               env=clean_env(PYTHONPATH=str(TESTS)), start_new_session=True)
    server = int(starter.stdout.readline())
    assert alive(server)
    os.kill(starter.pid, signal.SIGKILL)  # as a time limit kills pytest: no teardown runs
    starter.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server), "the server outlived the process that started it"
