"""One job per run dir: the hold's rules, in this process (real files, real locks)."""

import json
import os
import socket
import time

import pytest

from ddptrain.errors import ConfigError
from ddptrain.resilience.hold import HOLD_FILE, RunDirHold, job_id


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
