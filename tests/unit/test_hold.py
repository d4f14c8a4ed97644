"""One job per run dir: the hold's rules, in this process (real files, real locks)."""

import json
import os
import socket
import time

import pytest

from ddptrain.errors import ConfigError
from ddptrain.resilience.hold import HOLD_FILE, RunDirHold, job_id
from ddptrain.run_dir import RunDir


def test_a_held_run_dir_is_refused_naming_the_holder_and_a_dead_holders_hold_is_taken_over(tmp_path):
    first = RunDirHold(RunDir(tmp_path), "job-a").acquire()
    with pytest.raises(ConfigError, match=rf"run dir {tmp_path} is in use by job job-a \(host "
                                          rf"{socket.gethostname()}, pid {os.getpid()}, since .*\); wait for it"):
        RunDirHold(RunDir(tmp_path), "job-b").acquire()
    again = RunDirHold(RunDir(tmp_path), "job-a").acquire()  # the same job restarted (torchrun, Slurm requeue)
    again.release()
    first.release()
    assert not (tmp_path / HOLD_FILE).exists()
    # a holder on another host whose heartbeat stopped a while ago is gone
    (tmp_path / HOLD_FILE).write_text(json.dumps({"job": "job-c", "host": "elsewhere", "pid": 1, "since": 0,
                                                  "heartbeat": time.time() - 3600}))
    RunDirHold(RunDir(tmp_path), "job-d").acquire().release()
    (tmp_path / HOLD_FILE).write_text(json.dumps({"job": "job-c", "host": "elsewhere", "pid": 1, "since": 0,
                                                  "heartbeat": time.time()}))
    with pytest.raises(ConfigError, match="in use by job job-c"):
        RunDirHold(RunDir(tmp_path), "job-d").acquire()


def test_launchers_name_the_job_the_same_in_every_process_and_restart():
    assert job_id({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-42"
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchelastic-abc"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == "job-h:29500"
    assert job_id({"DDPTRAIN_JOB_ID": "local-1", "SLURM_JOB_ID": "42"}) == "local-1"


@pytest.mark.slow  # a real S3 client: ~2 s
def test_releasing_the_hold_on_a_store_that_is_gone_is_one_warning_not_a_traceback(monkeypatch, capsys):
    """A real S3 client against an endpoint where nothing listens (the store died at the end)."""
    pytest.importorskip("s3fs", reason="the s3 extra (pip install 'ddptrain[s3]') is not installed")
    from ddptrain.resilience.hold import RemoteHold
    from ddptrain.run_dir import StoreRunDir

    nowhere = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
               "AWS_MAX_ATTEMPTS": "1", "AWS_EC2_METADATA_DISABLED": "true"}
    for key, value in nowhere.items():
        monkeypatch.setenv(key, value)
    RemoteHold(StoreRunDir("s3://bucket/run"), "job-a").release()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ddptrain: warning: could not release the hold on s3://bucket/run ("), lines
    assert "it goes stale 60 s after its last heartbeat" in lines[0]
