"""One job per run dir: a second job on a held folder is refused in one line and touches
nothing; a holder killed with SIGKILL leaves no stale hold. Real commands, real kills."""

import json
import os
import signal
import socket
import time

import pytest

from ddptrain.config import ConfigError
from ddptrain.resilience.hold import HOLD_FILE, RunDirHold, job_id

from conftest import BIN, assert_ok, assert_same_weights, clean_env, finish, load_model, read_metrics, run

COMMAND = [str(BIN / "ddptrain"), "train", "--task", "ddptrain_test_tasks:uneven", "--batch-size", "16",
           "--momentum", "0.9"]


def test_a_held_run_dir_is_refused_naming_the_holder_and_a_dead_holders_hold_is_taken_over(tmp_path):
    first = RunDirHold(tmp_path, "job-a").acquire()
    with pytest.raises(ConfigError, match=rf"run dir {tmp_path} is in use by job job-a \(host "
                                          rf"{socket.gethostname()}, pid {os.getpid()}, since .*\); wait for it"):
        RunDirHold(tmp_path, "job-b").acquire()
    again = RunDirHold(tmp_path, "job-a").acquire()  # the same job restarted (torchrun, Slurm requeue)
    again.release()
    first.release()
    assert not (tmp_path / HOLD_FILE).exists()
    # a holder on another host whose heartbeat stopped a while ago is gone
    (tmp_path / HOLD_FILE).write_text(json.dumps({"job": "job-c", "host": "elsewhere", "pid": 1, "since": 0,
                                                  "heartbeat": time.time() - 3600}))
    RunDirHold(tmp_path, "job-d").acquire().release()
    (tmp_path / HOLD_FILE).write_text(json.dumps({"job": "job-c", "host": "elsewhere", "pid": 1, "since": 0,
                                                  "heartbeat": time.time()}))
    with pytest.raises(ConfigError, match="in use by job job-c"):
        RunDirHold(tmp_path, "job-d").acquire()


def test_launchers_name_the_job_the_same_in_every_process_and_restart():
    assert job_id({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-42"
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchelastic-abc"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == "job-h:29500"
    assert job_id({"DDPTRAIN_JOB_ID": "local-1", "SLURM_JOB_ID": "42"}) == "local-1"


@pytest.mark.slow
def test_the_same_command_twice_at_once_one_trains_the_other_exits_2_touching_nothing(tmp_path, start):
    command = [*COMMAND, "--max-epochs", "30", "--run-dir", str(tmp_path / "run")]
    env = clean_env(UNEVEN_SAMPLES="64")
    first = start(command, env=env)
    time.sleep(0.3)
    second = start(command, env=env)
    results = sorted([(p.returncode, out, err) for p in (first, second)
                      for out, err, _ in [finish(p, timeout=120)]], key=lambda r: r[0])
    (ok, out, _), (refused, _, err) = results
    assert (ok, refused) == (0, 2), results
    assert len(err.strip().splitlines()) == 1 and "is in use by job local-" in err, err
    records = read_metrics(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(30))
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
