"""Fail fast: a rank that raises ends the whole job, with its traceback, and nothing left behind."""

import os
import time

import pytest

from conftest import clean_env, ddptrain


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited: it is not left running
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
def test_rank_raising_at_step_3_stops_the_job_with_its_traceback(tmp_path):
    started = time.monotonic()
    result = ddptrain("train", "--task", "ddptrain_test_tasks:fail_on_rank", "--nproc", "2",
                      "--run-dir", str(tmp_path), "--timeout", "600",
                      env=clean_env(FAIL_RANK="1", FAIL_STEP="3"), timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    err = result.stderr
    assert "ddptrain: rank 1 failed first; its traceback:" in err
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: deliberate failure on rank 1 at step 3" in err
    assert "ddptrain: rank 0:" in err  # the other rank is accounted for
    pids = [int((tmp_path / "pids" / f"rank-{r}.pid").read_text()) for r in (0, 1)]
    assert not any(_alive(pid) for pid in pids), "a rank process was left running"
    assert not (tmp_path / "model.pt").exists()
