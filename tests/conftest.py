"""Fixtures only: background commands killed at the end of a test, no leaked environment.
The helpers the tests call are in tests/helpers/commands.py."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parent

# Ranks share 2 cores: one thread each (set before torch starts its thread pool), and the
# helper tasks importable by every rank.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(TESTS / "helpers"), os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, str(TESTS / "helpers"))
# torch's TCPStore looks up names at every connection: the server each peer's (pytorch#159007),
# the client the address it connects to (strace: a PTR query for 127.0.0.1, which the client
# reaches over IPv6 as ::ffff:127.0.0.1 and /etc/hosts does not name): the queries go to DNS.
# This project's machines drop about 1 query in 25, and glibc waits 5 s before it asks again
# (measured: 4 of 100 store connections took 5.0 s). One second before asking again keeps the
# answer and spares the suite minutes of waiting on a resolver no test is about.
os.environ.setdefault("RES_OPTIONS", "timeout:1")
# Where the processes the tests start write their stacks when asked (helpers/sitecustomize.py),
# removed when this test process ends.
os.environ["DDPTRAIN_TEST_STACKS"] = tempfile.mkdtemp(prefix="ddptrain-stacks-")
atexit.register(shutil.rmtree, os.environ["DDPTRAIN_TEST_STACKS"], ignore_errors=True)

import pytest  # noqa: E402

from helpers.commands import ForkedCommand, clean_env, finish  # noqa: E402

# `make test` runs three test files at a time (pytest -n 3 --dist loadfile --no-loadscope-reorder):
# each file goes whole to a worker, in collection order (without that flag xdist sorts the files
# by their number of tests: the 4 tests of test_bench.py, 215 s, then started 12 minutes in and
# ended the suite). xdist hands each worker two files at the start (the fourth to sixth start when
# a worker has run its first), then one more each time a worker has run all it holds. The longest
# go first (measured, seconds of wall in a -n 3 run), so the suite does not end with workers idle
# beside one still running a long file; the rest keep their order, the unit tests (milliseconds
# each) last. The three files whose tests mostly wait by design (a store cut or silent for a
# minute, heartbeat and hang timeouts: 0.28-0.48 of a core each) are spread out beside files that
# keep the cores busy: test_remote_run_dir.py first, test_fault_tolerance.py fourth (it starts
# 180-310 s in), test_resilience.py ninth (680 s in, one run). As second, third and fifth, two ran at
# once from the start and the third right after the first on its worker: the cores were under 70%
# busy in 10 of the first 26 ten-second samples. (One xdist group of the three, `--dist loadgroup`,
# does nothing with pytest 9.2: xdist 3.8 appends the group to a test's `_nodeid`, which pytest now
# keeps as `_id`; tried: the tests went out one by one.)
LONGEST_FIRST = ("test_remote_run_dir.py", "test_data.py", "test_bench.py", "test_fault_tolerance.py",
                 "test_snapshots.py", "test_matrix.py", "test_stop_signals.py", "test_docs.py",
                 "test_resilience.py", "test_launch_multihost.py", "test_parallel_fsdp.py", "test_real_models.py",
                 "test_api.py", "test_launch_ray.py", "test_cli_bad_input.py", "test_trackers.py",
                 "test_semi_sync.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {f"integration/{name}": place for place, name in enumerate(LONGEST_FIRST)}
    # stable: a file's tests stay in their order
    items.sort(key=lambda item: order.get(f"{item.path.parent.name}/{item.path.name}", len(order)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """DDPTRAIN_TEST_CPU=FILE: a line per test with its wall time and the CPU it cost (this
    process's and every subprocess's it waited for: launchers, ranks, servers stopped in it), its
    worker and when it started, so
    a suite's CPU is found where it goes (the suite is CPU-bound two files at a time).
    Summed by file: ``python tests/helpers/cpu_by_file.py FILE``."""
    path = os.environ.get("DDPTRAIN_TEST_CPU")
    if not path:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        forked = ForkedCommand.cpu_seconds  # commands the command server forked: not this process's children
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked

    began, cpu_began, started = time.monotonic(), cpu(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(path, "a") as out:
        out.write(f"{item.nodeid}\t{time.monotonic() - began:.2f}\t{cpu() - cpu_began:.2f}\t{worker}\t{started:.1f}\n")


def _machine_cpu_seconds() -> float:
    """Every CPU-second this machine has spent (user, nice, system, irq), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[MACHINE_AT_START] = (_machine_cpu_seconds(), time.monotonic())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """DDPTRAIN_TEST_CPU=FILE: the machine's CPU over the whole session too (in the process that
    runs the workers), which the tests' own lines miss where a process no test waited for did the
    work: Ray's actors and daemons (test_launch_ray.py: 116 CPU-s alone, 11 counted), servers."""
    path = os.environ.get("DDPTRAIN_TEST_CPU")
    if not path or hasattr(session.config, "workerinput") or MACHINE_AT_START not in session.config.stash:
        return
    cpu, began = session.config.stash[MACHINE_AT_START]
    with open(path, "a") as out:
        out.write(f"#machine\t{time.monotonic() - began:.1f}\t{_machine_cpu_seconds() - cpu:.1f}\t{os.cpu_count()}\n")


MACHINE_AT_START = pytest.StashKey[tuple[float, float]]()


# Set by pytest itself, or by torch when a module is first imported: not a test's doing.
NOT_A_LEAK = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def no_leaked_environment():
    """A test that changes os.environ for the tests after it fails."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(k for k in set(before) | set(after)
                     if before.get(k) != after.get(k) and k not in NOT_A_LEAK)
    os.environ.clear()
    os.environ.update(before)
    assert not changed, f"test leaked environment variables: {changed}"


@pytest.fixture
def start():
    """``start(args, **popen_kwargs)``: a background command in its own process group; at
    the end of the test the whole group is killed, so no rank outlives a failed test."""
    started: list[subprocess.Popen] = []

    def launch(args: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}  # or a log file of the test's
        process = subprocess.Popen(args, text=True, env=env or clean_env(), stdin=subprocess.DEVNULL,
                                   start_new_session=True, **kwargs)
        started.append(process)
        return process

    yield launch
    for process in started:
        finish(process, timeout=0)




@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real MLflow tracking server for the session's tracker tests (each test its own experiment;
    a test may kill it and start it again)."""
    from helpers.servers import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.kill()



@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3-protocol server (moto) on loopback for the session (each test its own bucket)."""
    from helpers.servers import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.kill()
