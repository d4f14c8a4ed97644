"""One job per run dir: a second job on a held folder is refused in one line and touches
nothing; a holder killed with SIGKILL leaves no stale hold. Real commands, real kills."""

import os
import signal
import time

import pytest

from ddptrain.resilience.hold import HOLD_FILE
from helpers.commands import BIN, assert_ok, assert_same_weights, clean_env, finish, load_model, read_metrics, run

COMMAND = [str(BIN / "ddptrain"), "train", "--task", "ddptrain_test_tasks:uneven", "--batch-size", "16",
           "--momentum", "0.9"]


@pytest.mark.slow
def test_the_same_command_twice_at_once_one_trains_the_other_exits_2_touching_nothing(tmp_path, start):
    # The second starts once the first holds the run dir, and the first waits before its second
    # step until the second has ended (its steps' head start once ran out: beside a CPU hog the
    # first finished before the second had started, and the second found a finished run).
    command = [str(BIN / "ddptrain"), "train", "--task", "ddptrain_test_tasks:slow_steps", "--max-epochs", "4",
               "--run-dir", str(tmp_path / "run")]
    gate = tmp_path / "second-ended"
    env = clean_env(STEP_SLEEP="0.02", STEP_GATE=str(gate))
    first = start(command, env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / HOLD_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    second = start(command, env=env)
    _, err, _ = finish(second, timeout=120)
    gate.touch()
    out, _, _ = finish(first, timeout=120)
    assert (first.returncode, second.returncode) == (0, 2), (out, err)
    assert len(err.strip().splitlines()) == 1 and "is in use by job local-" in err, err
    records = read_metrics(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(4))
    assert not list((tmp_path / "run").glob("previous-*")) and not (tmp_path / "run" / HOLD_FILE).exists()


@pytest.mark.slow
def test_after_sigkill_of_the_holder_its_ranks_end_and_the_same_command_resumes(tmp_path, start):
    """Only the launcher is killed: its ranks die with it (no orphan writes on), its hold is
    stale at once (its lock died with it), and the same command resumes bitwise."""
    env = clean_env(UNEVEN_SAMPLES="64")
    straight = [*COMMAND, "--max-epochs", "400", "--run-dir", str(tmp_path / "straight")]
    assert_ok(run(straight, env=env))
    command = [*COMMAND, "--max-epochs", "400", "--save-every", "50", "--run-dir", str(tmp_path / "run")]
    job = start(command, env=env)
    snapshots = tmp_path / "run" / "snapshots"
    deadline = time.monotonic() + 60
    while not list(snapshots.glob("step-*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int(p.read_text()) for p in (tmp_path / "run" / "pids").glob("rank-*.pid")]
    os.kill(job.pid, signal.SIGKILL)
    finish(job, timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived its launcher"
    result = run(command, env=env)
    assert_ok(result)
    assert "resumed from" in result.stdout
    assert_same_weights(load_model(tmp_path / "run"), load_model(tmp_path / "straight"), exact=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
