"""torchft replica groups in tests: a `ddptrain lighthouse` of the test's own, and each group a
real `ddptrain train` job of its own meeting there (tests/integration/test_fault_tolerance.py,
test_semi_sync.py)."""

from __future__ import annotations

import contextlib
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from ddptrain import free_port
from ddptrain.resilience.lighthouse import read_dashboard
from helpers.commands import BIN, ForkedCommand, ask_for_stacks, clean_env, descendants, finish, kill_tree, start_cli

ARGS = ["--fault-tolerance", "torchft", "--replica-groups", "2", "--batch-size", "16"]


def start_lighthouse(port: int, heartbeat_ms: int, min_replicas: int = 1) -> subprocess.Popen:
    """`ddptrain lighthouse` on 127.0.0.1:``port``, once it said where it listens."""
    server = subprocess.Popen([str(BIN / "ddptrain"), "lighthouse", "--bind", f"127.0.0.1:{port}",
                               "--heartbeat-timeout-ms", str(heartbeat_ms), "--join-timeout-ms", "1000",
                               "--min-replicas", str(min_replicas)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready, _, _ = select.select([server.stdout], [], [], 120)  # its first line, or the test fails
    first = server.stdout.readline() if ready else "(nothing within 120 s)"  # type: ignore[union-attr]
    if not first.startswith(f"ddptrain: lighthouse on http://127.0.0.1:{port}: give every replica group"):
        kill_tree(server)
        raise AssertionError(f"ddptrain lighthouse did not start: {first}")
    return server


@contextlib.contextmanager
def serving_lighthouse(request) -> Iterator[str]:
    """A lighthouse for one test (a fixture's body): its address; heartbeat timeout the test's
    ``heartbeat_ms`` mark, else 5 s."""
    mark = request.node.get_closest_marker("heartbeat_ms")
    port = free_port()
    server = start_lighthouse(port, mark.args[0] if mark else 5000)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_tree(server)
        server.wait(timeout=30)


def group_job(lighthouse: str, group: int, run_dir: Path, *extra: str, **env: str) -> ForkedCommand:
    """Group ``group``'s job (forked by the command server: helpers.commands.start_cli); its
    output goes to a file beside its run dir (a pipe nobody reads while the test waits for the
    other group would fill up and stall it)."""
    with open(run_dir.with_name(run_dir.name + ".log"), "a") as output:
        return start_cli("train", *ARGS, "--lighthouse", lighthouse, "--replica-group", str(group),
                         "--run-dir", str(run_dir), *extra, output=output,
                         env=clean_env(DDPTRAIN_FT_HOST="127.0.0.1", OMP_NUM_THREADS="1", **env))


def wait_ok(process: ForkedCommand, timeout: float = 240) -> str:
    """Its output (the file's, this attempt's and earlier ones') once it ended, exit status 0."""
    _, _, late = finish(process, timeout)
    log = Path(process.args[process.args.index("--run-dir") + 1] + ".log").read_text()
    assert not late and process.returncode == 0, f"rc {process.returncode}\n{log}"
    return log


def group_1_killed_and_restarted(lighthouse: str, tmp_path: Path, options: tuple[str, ...],
                                 kill: dict[str, str]) -> tuple[str, str]:
    """Two groups of ``options``; group 1 kills itself as ``kill`` says, group 0 trains on
    alone (its losses' times in ``group-0.steps``) for 15 more, then group 1 is started again
    by the same command (group 0 waits at its 70th loss until it has). Both ends' logs."""
    steps, started = tmp_path / "group-0.steps", tmp_path / "group-1.started"
    first = group_job(lighthouse, 0, tmp_path / "group-0", *options, STEP_LOG=str(steps), STEP_SLEEP="0.05",
                      HOLD_AT="70", HOLD_UNTIL=str(started))
    second = group_job(lighthouse, 1, tmp_path / "group-1", *options, **kill)
    finish(second, 240)
    assert second.returncode != 0 and (tmp_path / "killed").exists(), (tmp_path / "group-1.log").read_text()
    killed_at = len(steps.read_text().splitlines())
    deadline = time.monotonic() + 120
    while len(steps.read_text().splitlines()) < killed_at + 15:  # group 0 trains on alone
        assert first.poll() is None and time.monotonic() < deadline, "group 0 stopped training"
        time.sleep(0.1)
    again = group_job(lighthouse, 1, tmp_path / "group-1", *options, STARTED=str(started), **kill)
    try:
        return wait_ok(first), wait_ok(again)
    finally:
        kill_tree(again)
        kill_tree(first)


def stalled(lighthouse: str, group: ForkedCommand, tmp_path: Path) -> str:
    """What a test that waited in vain for group ``group`` shows: every group's console, the
    lighthouse's view, the processes of every group still alive and each one's stacks."""
    logs = "\n".join(f"--- {log.name}\n{log.read_text()}" for log in sorted(tmp_path.glob("group-*.log")))
    try:
        view = read_dashboard(lighthouse, "/status", timeout_s=5)
    except (OSError, ValueError) as error:
        view = f"(no answer: {error})"
    alive = [int(pid.read_text()) for pid in tmp_path.glob("group-*/pids/rank-*.pid")
             if Path("/proc", pid.read_text().strip()).exists()]
    return (f"{logs}\n--- the lighthouse's /status\n{view}\n--- ranks alive (pid files): {alive}"
            f"{ask_for_stacks(sorted({group.pid, *descendants(group.pid), *alive}))}")
