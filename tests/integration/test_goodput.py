"""Goodput over every attempt of a run (observe/goodput.py): real ranks, really SIGKILLed and
restarted by the elastic launcher; the report read back as users read it."""

import json
import re
import time

import pytest

from ddptrain.cli import main
from ddptrain.observe.goodput import PARTS, TIMELINE, UNKNOWN, account, attempts_of, place, read_timeline
from ddptrain.observe.summary import read_metrics
from helpers.commands import fit

TASKS = "ddptrain_test_tasks:"
STEP_SLEEP = 0.05  # every step sleeps this long on every rank: its time is known from outside


def _parts_sum(found):
    return sum(found[f"{name}_s"] for name in PARTS)


@pytest.mark.slow
def test_a_run_killed_twice_counts_the_steps_redone_and_each_start_up(tmp_path, capsys):
    """Attempt 1: rank 1 SIGKILLed at its 18th step (steps 11-17 trained after the snapshot of
    step 10); attempt 2 resumes at 10, rank 0 SIGKILLed at its 14th step (steps 21-23 after the
    snapshot of step 20); attempt 3 resumes at 20 and finishes."""
    run_dir = tmp_path / "run"
    env = {"KILLS": "1:18,0:14", "KILL_SNAPSHOTS": str(run_dir / "snapshots"), "SAVE_EVERY": "10",
           "STEP_SLEEP": str(STEP_SLEEP)}
    fit(TASKS + "killed_twice", run_dir, env=env, max_restarts=2, max_epochs=2, save_every=10, momentum=0.9)

    attempts = attempts_of(read_timeline(run_dir))
    place(attempts)
    assert [a.start["resumed_from"] for a in attempts] == [0, 10, 20]
    found = account(read_timeline(run_dir))
    assert found["attempts"] == 3 and found["steps_redone"] == 7 + 3
    # the time of those 10 steps: each sleeps STEP_SLEEP; the rest of a step is a tiny model's
    assert 10 * STEP_SLEEP <= found["steps_redone_s"] <= 10 * STEP_SLEEP * 3
    # the steps kept: the final model's 64, each at least STEP_SLEEP
    assert found["steps_kept_s"] >= 64 * STEP_SLEEP
    assert all(a.start["ready_t"] > a.begun for a in attempts)  # a start-up in each attempt, counted once
    assert found["startup_s"] == pytest.approx(sum(a.start["ready_t"] - a.begun for a in attempts))
    assert found["between_attempts_s"] > 0 and found["waiting_s"] > 0  # rank 1's kill: rank 0 saw it fail
    # and left (its exit line): the failure's teardown, apart from the launcher's restart
    assert 0 < found["failure_s"] < 1.5, found
    assert _parts_sum(found) == pytest.approx(found["wall_s"], rel=0.01)
    assert 0 < found["goodput"] < 1

    # where users look: the summary, metrics.jsonl's record, `ddptrain report` (and --json)
    goodput = [r for r in read_metrics(run_dir) if r.get("kind") == "goodput"]
    assert len(goodput) == 1 and goodput[0]["step"] == 64 and goodput[0]["steps_redone"] == 10
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"goodput {found['goodput']:.3f} over 3 attempt(s)" in out and "(10 steps)" in out
    assert (run_dir / "goodput.png").is_file()
    assert main(["report", str(run_dir), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["goodput"]["steps_redone"] == 10 and printed["summary"]["goodput"] == goodput[0]["goodput"]

    (run_dir / TIMELINE).unlink()  # a run dir of an older ddptrain: one line, no error
    assert main(["report", str(run_dir)]) == 0
    assert UNKNOWN in capsys.readouterr().out


@pytest.mark.slow
def test_an_attempt_killed_before_the_first_snapshot_is_counted_as_redone(tmp_path, capfd):
    """Rank 1 SIGKILLed at its 5th step, before any snapshot: the next attempt starts afresh and
    moves the first one's files aside, but not its timeline, so its 4 steps count as redone."""
    run_dir = tmp_path / "run"
    env = {"KILLS": "1:5", "KILL_SNAPSHOTS": str(run_dir / "snapshots"), "SAVE_EVERY": "10",
           "STEP_SLEEP": str(STEP_SLEEP)}
    fit(TASKS + "killed_twice", run_dir, env=env, max_restarts=1, max_epochs=1, save_every=10, save_seconds=0)
    assert "ddptrain: a fresh start in " in capfd.readouterr().out  # the killed attempt's other files: aside
    attempts = attempts_of(read_timeline(run_dir))
    assert [a.start["resumed_from"] for a in attempts] == [0, 0]
    found = account(read_timeline(run_dir))
    assert found["attempts"] == 2 and found["steps_redone"] == 4
    assert 4 * STEP_SLEEP <= found["steps_redone_s"] <= 4 * STEP_SLEEP * 3
    assert _parts_sum(found) == pytest.approx(found["wall_s"], rel=0.01) and 0 < found["goodput"] < 1
    assert [r["epoch"] for r in read_metrics(run_dir) if r.get("kind") == "epoch"] == [0]  # once, not twice


def test_an_uninterrupted_run_redoes_nothing(tmp_path, capfd):
    fit("regression", tmp_path / "run", max_epochs=1)
    returned = time.time()
    events = read_timeline(tmp_path / "run")
    found = account(events)
    assert found["attempts"] == 1 and found["steps_redone"] == 0 and found["steps_redone_s"] == 0
    assert found["goodput"] == pytest.approx(found["steps_kept_s"] / found["wall_s"], rel=0.01)
    assert _parts_sum(found) == pytest.approx(found["wall_s"], rel=0.01)
    # the summary is printed before the end's last waits (trackers, uploads): the timeline's last
    # lines, which `ddptrain report` counts in the end, come after it; the wall ends where the
    # launcher did, its ranks gone (its exit line)
    assert [e["e"] for e in events[-3:]] == ["end", "closed", "exit"] and events[-2]["t0"] == events[-3]["t1"]
    assert events[-2]["t1"] <= events[-1]["t1"] <= returned
    assert found["wall_s"] == pytest.approx(events[-1]["t1"] - attempts_of(events)[0].start["t"], abs=0.02)
    printed = account(events[:-2])["goodput"]
    shown = re.search(r"^  goodput +(\S+)$", capfd.readouterr().out, re.M)
    assert shown and shown.group(1) == f"{round(printed, 4):.4g}", shown
