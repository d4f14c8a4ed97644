"""Goodput's accounting (observe/goodput.py) on timelines written by hand: every part, the
steps a later attempt redid, an elastic restart's start, a line cut by a crash."""

import json
import os

import pytest

from ddptrain.observe.goodput import PARTS, SLOT, Timeline, account, read_timeline


def start(t, ready, resumed_from=0, process_t=None):
    return {"e": "start", "t": t, "process_t": process_t or t, "ready_t": ready, "resumed_from": resumed_from,
            "world_size": 2}


def steps(a, b, t0, t1):
    return {"e": "steps", "a": a, "b": b, "t0": t0, "t1": t1}


def test_every_part_and_the_steps_a_later_attempt_redid():
    events = [
        start(0, 2),                                  # start-up 2 s
        steps(0, 10, 2, 12), {"e": "snapshot", "step": 10, "t0": 12, "t1": 13},
        steps(10, 20, 13, 23),                        # resumed from 14 below: 4 kept, 6 redone
        {"e": "end", "outcome": "failed", "t0": 23, "t1": 25},   # the failure's detection: waiting
        # an elastic restart: the launcher's start (0) is before the end of attempt 1, the process's counts
        start(0, 31, resumed_from=14, process_t=30),  # 5 s between, 1 s start-up
        {**steps(14, 30, 31, 47), "w": 3},            # 3 s of it in torchft's quorum: waiting
        {"e": "straggled", "s": 1.5, "b": 30, "t0": 47, "t1": 47},  # and 1.5 s waiting for a slow rank
        {"e": "eval", "step": 30, "t0": 47, "t1": 49},
        {"e": "end", "outcome": "finished", "t0": 49, "t1": 50},
        {"e": "closed", "t0": 50, "t1": 52},          # the trackers' and uploads' waits after the summary
    ]
    found = account(events)
    assert found["attempts"] == 2 and found["steps_redone"] == 6
    assert found["wall_s"] == 52
    assert {name: found[f"{name}_s"] for name in PARTS} == pytest.approx({
        "steps_kept": 10 + 4 + 13 - 1.5, "startup": 2 + 1, "steps_redone": 6, "snapshots": 1, "evaluations": 2,
        "waiting": 2 + 3 + 1.5, "failure": 0, "end": 1 + 2, "between_attempts": 5})
    assert found["goodput"] == pytest.approx(25.5 / 52)


def test_a_failed_attempt_ends_where_its_process_did_and_the_wall_where_the_launcher_did():
    """The failure part: from the failure's detection to the failed attempt's exit (rank 0's, after
    its snapshot write); between attempts: from there to the next start. The launcher's exit ends
    the wall."""
    events = [
        start(0, 2), steps(0, 10, 2, 12),
        {"e": "end", "outcome": "failed", "t0": 12, "t1": 13},   # detected 1 s after the last step
        {"e": "exit", "t1": 13.4},                                # rank 0 left 0.4 s later
        start(15, 17, resumed_from=10), steps(10, 20, 17, 27),
        {"e": "end", "outcome": "finished", "t0": 27, "t1": 28},
        {"e": "closed", "t0": 28, "t1": 28.5},
        {"e": "exit", "t1": 28.7},                                # the launcher, its ranks gone
    ]
    found = account(events)
    assert found["wall_s"] == pytest.approx(28.7)
    assert found["failure_s"] == pytest.approx(0.4) and found["between_attempts_s"] == pytest.approx(1.6)
    assert found["waiting_s"] == pytest.approx(1) and found["end_s"] == pytest.approx(1 + 0.5 + 0.2)
    assert sum(found[f"{name}_s"] for name in PARTS) == pytest.approx(found["wall_s"])


def test_no_timeline_is_unknown_and_a_cut_line_is_skipped(tmp_path):
    assert account([]) is None
    (tmp_path / "timeline.jsonl").write_text(json.dumps(start(0, 1)) + "\n" + '{"e": "steps", "a": 0, "b"\n')
    assert account(read_timeline(tmp_path))["startup_s"] == 1


def test_the_timeline_rewrites_one_line_per_stretch_of_steps(tmp_path):
    """A step is one pwrite in place (at most every WRITE_EVERY_S), not a line per step."""
    timeline = Timeline(tmp_path)
    timeline.begin(0, 2)
    for step in range(1, 201):
        timeline.step_done(step)
    with timeline.activity("snapshot", 200):
        pass
    timeline.step_done(201)
    timeline.end("finished")
    timeline.closed()
    timeline.closed()  # once
    events = read_timeline(tmp_path)
    assert [e["e"] for e in events] == ["start", "steps", "snapshot", "steps", "end", "closed"]
    assert (events[1]["a"], events[1]["b"], events[3]["a"], events[3]["b"]) == (0, 200, 200, 201)
    assert os.path.getsize(tmp_path / "timeline.jsonl") < 2 * SLOT + 700
    found = account(events)
    assert sum(found[f"{name}_s"] for name in PARTS) == pytest.approx(found["wall_s"])


def test_the_projection_young_daly_interval_is_the_best_and_replicas_lose_less():
    from ddptrain.observe.goodput import replica_goodput, restart_goodput
    from ddptrain.progress import best_interval_s

    mttf, snapshot, restart = 3 * 3600, 5.0, 600.0
    best = best_interval_s(mttf, snapshot)
    assert best == pytest.approx((2 * snapshot * mttf) ** 0.5)
    at_best = restart_goodput(mttf, best, snapshot, restart)
    assert all(restart_goodput(mttf, best * f, snapshot, restart) < at_best for f in (0.5, 0.8, 1.25, 2))
    assert at_best == pytest.approx(1 - snapshot / best - (restart + best / 2) / mttf)
    assert restart_goodput(60, 600, snapshot, restart) == 0  # a failure before any snapshot: nothing kept
    assert best_interval_s(mttf, snapshot, write_s=3600) == 3600  # no sooner than the last one is written
    assert replica_goodput(mttf, 8, stall_s=2, heal_s=restart) > at_best
