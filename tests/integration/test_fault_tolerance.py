"""--fault-tolerance torchft: replica groups, each a real `ddptrain train` job of its own, meeting
at a real torchft lighthouse on loopback; one group SIGKILLed while the other trains on."""

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from ddptrain import free_port
from ddptrain.observe.goodput import account, read_timeline
from ddptrain.observe.summary import summarize
from helpers import ft_groups
from helpers.commands import (
    ForkedCommand,
    assert_ok,
    assert_same_weights,
    clean_env,
    ddptrain_cli,
    finish,
    kill_tree,
    load_model,
    read_metrics,
)
from helpers.ft_groups import group_1_killed_and_restarted, group_job, serving_lighthouse, wait_ok

pytestmark = pytest.mark.slow

HEARTBEAT_MS = 3000  # the kill tests' lighthouse: a group silent this long counts as failed


@pytest.fixture
def lighthouse(request):
    """`ddptrain lighthouse` of this test's own (a group id of another test's never lingers in it);
    heartbeat timeout: the test's ``heartbeat_ms`` mark, else the default 5 s (a busy machine
    must not make a live group look failed where no group fails)."""
    with serving_lighthouse(request) as address:
        yield address


@pytest.mark.parametrize("ranks", [1, 2])
def test_with_every_group_present_two_groups_are_one_ddp_job_on_their_ranks(lighthouse, tmp_path, ranks):
    """Group G's rank r reads rank G·W + r's share of 2·W: the same samples, the same steps as a
    DDP job on 2·W ranks; the groups' weights are bitwise equal to each other (one average, taken
    by both). 1 rank a group: bitwise the 2-rank DDP job (a mean of two halves is exact); 2 ranks
    a group: allclose to 4-rank DDP (another order of the sum; 3e-8 measured)."""
    groups = [group_job(lighthouse, g, tmp_path / f"group-{g}", "--max-epochs", "2", "--task", "regression",
                     "--nproc", str(ranks)) for g in (0, 1)]
    logs = [wait_ok(p) for p in groups]
    assert_ok(ddptrain_cli("train", "--task", "regression", "--nproc", str(2 * ranks), "--batch-size", "16",
                           "--max-epochs", "2", "--run-dir", str(tmp_path / "ddp")))
    weights = [load_model(tmp_path / f"group-{g}") for g in (0, 1)]
    assert_same_weights(weights[0], weights[1], exact=True)
    assert_same_weights(weights[0], load_model(tmp_path / "ddp"), exact=ranks == 1)
    for g in (0, 1):
        records = read_metrics(tmp_path / f"group-{g}")
        assert [r["samples"] for r in records] == [2048, 2048]  # the whole set each epoch, over both groups
        assert records[-1]["samples_skipped"] == 0
        assert "not taken" not in logs[g] and " left;" not in logs[g]
    ddp = read_metrics(tmp_path / "ddp")
    assert [r["train_loss"] for r in records] == pytest.approx([r["train_loss"] for r in ddp], rel=1e-6)


def _steps_alone(log: str) -> tuple[int, int, list[int]]:
    """Group 0's own account: the step a group left at, the step it rejoined at, the steps not taken."""
    left = [int(s) for s in re.findall(r"step (\d+): replica group 1 left; 1 of 2 groups train on", log)]
    joined = [int(s) for s in re.findall(r"step (\d+): replica group 1 joined; 2 of 2 groups train", log)]
    failed = [int(s) for s in re.findall(r"step (\d+): not taken", log)]
    assert len(left) == 1 and len(joined) == 1, log
    return left[0], joined[0], failed


@pytest.mark.heartbeat_ms(HEARTBEAT_MS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_group_leaves_the_other_training_and_rejoins_with_its_weights(lighthouse, tmp_path, ranks):
    """Group 1's rank 0 SIGKILLs itself at its 30th loss (after its snapshot of step 20; with 2
    ranks a group, ddptrain's launcher then stops the group's other rank); group 0 trains on
    alone; group 1 is started again (the same command) once group 0 trained 15 steps more,
    resumes from its snapshot and heals from group 0's live state, each rank from its peer rank
    (group 0 waits at its 70th loss until the restarted job has started, so a slow start on a
    busy machine still finds it training). Both end bitwise equal; group 0 never waited longer
    than the lighthouse's heartbeat timeout and 4 s (2.02-2.06 s measured with a 2 s timeout; 3 s
    here, for a busy machine); samples_skipped counts what group 1 missed."""
    steps = tmp_path / "group-0.steps"  # (group_1_killed_and_restarted writes it)
    kill = {"KILL_RANK": "0", "KILL_STEP": "30", "KILL_MARKER": str(tmp_path / "killed"),
            "KILL_ONCE_SAVED": str(tmp_path / "group-1" / "snapshots"), "STEP_SLEEP": "0.05"}
    # 96 steps either way: 2,048 samples in steps of 16 x ranks x 2 groups
    options = ("--task", "ft_tasks:kill_paced", "--max-epochs", str(3 * ranks), "--save-every", "10",
               "--nproc", str(ranks))
    log0, log1 = group_1_killed_and_restarted(lighthouse, tmp_path, options, kill)
    left, joined, failed = _steps_alone(log0)
    assert joined - left >= 10, log0
    assert re.search(rf"step {joined}: replica group 1 rejoined from a live peer", log1), log1
    assert "resumed from" in log1 and "step-000000020.pt" in log1  # its snapshot, then the peer's live state
    assert_same_weights(load_model(tmp_path / "group-0"), load_model(tmp_path / "group-1"), exact=True)
    skipped = [r["samples_skipped"] for r in read_metrics(tmp_path / "group-0")]
    group_step = 16 * ranks  # the samples one group trains in a step; a step not taken loses both groups'
    assert skipped[-1] == group_step * (joined - left) + 2 * group_step * len(failed), (skipped, left, joined, failed)
    assert read_metrics(tmp_path / "group-1")[-1]["samples_skipped"] == skipped[-1]
    assert summarize(tmp_path / "group-0")["samples_skipped"] == skipped[-1]
    times = [float(t) for t in steps.read_text().split()]
    gaps = [b - a for n, (a, b) in enumerate(zip(times, times[1:]), start=2) if n != 70]  # (70: the test's wait)
    assert max(gaps) < HEARTBEAT_MS / 1000 + 4, max(gaps)  # measured: the heartbeat timeout and 0.02-0.06 s
    # goodput: group 0's stall while group 1 was missing (the step nobody took, the quorum that
    # waited out the heartbeat timeout, then the heal it served) is waiting, not steps; nothing redone
    found = account(read_timeline(tmp_path / "group-0"))
    assert found["waiting_s"] >= max(gaps) - 0.5 and found["steps_redone"] == 0, (found, max(gaps))
    assert found["steps_kept_s"] + found["waiting_s"] < found["wall_s"]


def _training_together(tmp_path: Path, restarts: int) -> bool:
    """Both groups take steps: group 0 took 20 (the start), or said group 1 joined again."""
    if restarts == 0:
        steps = tmp_path / "group-0.steps"
        return steps.exists() and len(steps.read_text().split()) >= 20
    return (tmp_path / "group-0.log").read_text().count("replica group 1 joined") >= restarts


@pytest.mark.heartbeat_ms(HEARTBEAT_MS)
def test_a_2_rank_group_whose_rank_1_is_sigkilled_leaves_the_quorum_within_the_heartbeat_timeout(lighthouse,
                                                                                                  tmp_path):
    """Group 1's rank 1 SIGKILLed from outside at a random moment, three times (the group
    restarted by the same command each time, healing from group 0): group 0's longest wait
    between two steps stays under the heartbeat timeout + 4 s every time. Rank 0 of the failed
    group, which holds the group's place at the lighthouse, used to live on inside torchft's
    quorum until the launcher's SIGKILL 30 s later (without the fix this test saw 33 s waits
    after 2 of the 3 kills, in both of two runs); it now leaves within 0.5 s of its sibling's
    death (resilience/siblings.py): 3.1-3.5 s waits. No step pause: the more of a step is
    torchft's, the likelier a kill finds rank 0 inside it."""
    steps = tmp_path / "group-0.steps"
    # 300 epochs, more than the test needs (it ends after the third leave): with 100, group 0 once
    # had nearly finished the job when group 1 came back a third time (four test files at a time),
    # and group 1 finished it before its kill.
    options = ("--task", "ft_tasks:kill_paced", "--max-epochs", "300", "--nproc", "2")
    first = group_job(lighthouse, 0, tmp_path / "group-0", *options, STEP_LOG=str(steps))
    log1 = tmp_path / "group-1.log"
    processes = [first]
    try:
        for kill in range(3):
            second = group_job(lighthouse, 1, tmp_path / "group-1", *options)
            processes.append(second)
            deadline = time.monotonic() + 120
            while not _training_together(tmp_path, kill):
                assert first.poll() is None and second.poll() is None and time.monotonic() < deadline, log1.read_text()
                time.sleep(0.1)
            time.sleep(random.uniform(1.0, 2.0))  # a random moment of its training
            rank_1 = tmp_path / "group-1" / "pids" / "rank-1.pid"
            assert second.poll() is None and rank_1.exists(), f"group 1 ended before its kill:\n{log1.read_text()}"
            os.kill(int(rank_1.read_text()), signal.SIGKILL)
            finish(second, 60)
            assert second.returncode != 0 and first.poll() is None, log1.read_text()
            # Group 0 trains alone before group 1 comes back: a restart quicker than the lighthouse's
            # heartbeat timeout found its place still held, so group 0 never saw it leave (and this
            # loop then waited for a "joined" that never came).
            deadline = time.monotonic() + 60
            while (tmp_path / "group-0.log").read_text().count("replica group 1 left") < kill + 1:
                if first.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(ft_groups.stalled(lighthouse, first, tmp_path))
                time.sleep(0.1)
        time.sleep(0.5)  # a step after the last leave
    finally:
        for process in processes:
            kill_tree(process)
    log0 = (tmp_path / "group-0.log").read_text()
    assert log0.count("replica group 1 left") == 3, log0
    times = [float(t) for t in steps.read_text().split()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < HEARTBEAT_MS / 1000 + 4, sorted(gaps)[-5:]
    # each failure reads in a few lines on both groups' consoles (torchft's tracebacks and
    # torch's C++ frames go to the ranks' logs/)
    for attempt in log1.read_text().split("training ft_tasks")[1:]:
        said = [line for line in attempt.splitlines()[1:] if not line.startswith(("epoch ", "step "))]
        assert len(said) <= 5 and "frame #" not in attempt and "Traceback" not in attempt, attempt
    assert "frame #" not in log0 and "Traceback" not in log0 and "Unable to reset" not in log0, log0


def _resumed_step(log: str) -> int:
    found = re.findall(r"resumed from \S*step-(\d+)\.pt", log)
    assert found, log
    return int(found[-1])


@pytest.mark.heartbeat_ms(HEARTBEAT_MS)
def test_a_whole_job_restart_from_snapshots_of_different_steps_heals_the_group_behind(lighthouse, tmp_path):
    """Group 1 SIGKILLed at its 35th loss (after a snapshot: step 30 as a rule), group 0 at its
    55th (step 50), alone by then; both started again, group 1 first. Group 1 must wait for
    group 0 rather than train alone from its older snapshot (group 0 would then heal from it and
    lose its steps 31-50): it heals from group 0's state, and both end bitwise equal."""
    options = ("--task", "ft_tasks:kill_paced", "--max-epochs", "3", "--save-every", "10", "--nproc", "1")

    def start(group: int, kill_step: int, **env: str) -> ForkedCommand:
        return group_job(lighthouse, group, tmp_path / f"group-{group}", *options, KILL_RANK="0",
                      KILL_STEP=str(kill_step), KILL_MARKER=str(tmp_path / f"killed-{group}"),
                      KILL_ONCE_SAVED=str(tmp_path / f"group-{group}" / "snapshots"), STEP_SLEEP="0.05", **env)

    first = [start(0, 55), start(1, 35)]
    for group, process in enumerate(first):
        finish(process, 240)
        assert process.returncode != 0 and (tmp_path / f"killed-{group}").exists(), process.returncode
    started = tmp_path / "group-1.started"
    behind = start(1, 35, STARTED=str(started))  # (the markers are there: no kill this time)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert behind.poll() is None and time.monotonic() < deadline, "group 1 did not start again"
        time.sleep(0.1)
    time.sleep(2)  # group 1 at the lighthouse first, alone
    ahead = start(0, 55)
    try:
        log1, log0 = wait_ok(behind), wait_ok(ahead)
    finally:
        kill_tree(behind)
        kill_tree(ahead)
    step0, step1 = _resumed_step(log0), _resumed_step(log1)
    assert step1 < step0, (step0, step1)
    assert re.search(rf"step {step0 + 1}: replica group 1 rejoined from a live peer", log1), log1
    assert "replica group 0 rejoined" not in log0, log0
    assert_same_weights(load_model(tmp_path / "group-0"), load_model(tmp_path / "group-1"), exact=True)
    for group in (0, 1):
        assert [r["epoch"] for r in read_metrics(tmp_path / f"group-{group}")] == [0, 1, 2]


def test_a_group_resumed_alone_after_the_others_finished_waits_then_trains_on(lighthouse, tmp_path):
    """Both groups train 10 steps and stop; group 1 alone is then asked for 10 more. Its resumed
    start waits for the other group (at most --timeout, here 5 s, or 60 s), says so in one line
    and trains on alone rather than failing: the others may have finished, or be gone."""
    options = ("--task", "regression", "--nproc", "1", "--save-every", "10")
    pair = [group_job(lighthouse, g, tmp_path / f"group-{g}", *options, "--max-steps", "10") for g in (0, 1)]
    for process in pair:
        wait_ok(process)
    started = time.monotonic()
    log = wait_ok(group_job(lighthouse, 1, tmp_path / "group-1", *options, "--max-steps", "20", "--timeout", "5"))
    assert "only 1 of 2 replica groups reached the lighthouse within 5 s of this resumed start; training on" in log, log
    assert time.monotonic() - started < 120
    assert read_metrics(tmp_path / "group-1")[-1]["step"] == 20


@pytest.mark.heartbeat_ms(HEARTBEAT_MS)
def test_a_group_restarted_after_the_others_finished_the_job_says_so_and_trains_nothing(lighthouse, tmp_path):
    """Group 1 SIGKILLed at its 15th loss (after its snapshot of step 10); group 0 trains the job's
    64 steps alone and finishes; group 1, restarted by the same command, finds in the
    lighthouse's last quorum that the job ended: one line, exit 0, nothing trained (alone it
    would train a model of its own, 0.08 away from the job's)."""
    options = ("--task", "ft_tasks:kill_paced", "--max-epochs", "1", "--save-every", "10", "--nproc", "1")
    kill = {"KILL_RANK": "0", "KILL_STEP": "15", "KILL_MARKER": str(tmp_path / "killed"),
            "KILL_ONCE_SAVED": str(tmp_path / "group-1" / "snapshots")}
    pair = [group_job(lighthouse, 0, tmp_path / "group-0", *options, STEP_SLEEP="0.02"),
            group_job(lighthouse, 1, tmp_path / "group-1", *options, **kill)]
    finish(pair[1], 240)
    assert pair[1].returncode != 0 and (tmp_path / "killed").exists(), (tmp_path / "group-1.log").read_text()
    assert "replica group 1 left" in wait_ok(pair[0])
    before = (tmp_path / "group-1.log").read_text()
    started = time.monotonic()
    log = wait_ok(group_job(lighthouse, 1, tmp_path / "group-1", *options, **kill))[len(before):]
    assert time.monotonic() - started < 60  # no wait for groups that will not come
    lines = [line for line in log.splitlines() if line.startswith("ddptrain: the other replica groups")]
    assert lines == ["ddptrain: the other replica groups finished this job (the lighthouse's last quorum took step "
                     "64) while replica group 1 stood at step 10: nothing left to train here; the job's model is in "
                     "their run dirs"], log
    assert "epoch 0 |" not in log and not (tmp_path / "group-1" / "model.pt").exists(), log


def test_bad_torchft_settings_and_a_lighthouse_that_is_down_are_one_line(tmp_path):
    for args, message in (
        (["--replica-groups", "2"], "--replica-groups belongs to --fault-tolerance torchft"),
        (["--fault-tolerance", "torchft", "--replica-groups", "2", "--replica-group", "2"],
         "--replica-group must be 0 to 1 (--replica-groups 2), got 2"),
        (["--fault-tolerance", "torchft", "--strategy", "fsdp"], "works with --strategy ddp for now"),
        (["--fault-tolerance", "torchft"], "needs the lighthouse's address"),
    ):
        result = ddptrain_cli("train", "--run-dir", str(tmp_path / "run"), *args,
                              env=clean_env(TORCHFT_LIGHTHOUSE=""))
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    down = f"http://127.0.0.1:{free_port()}"
    result = ddptrain_cli("train", "--nproc", "1", "--fault-tolerance", "torchft", "--lighthouse", down,
                          "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"ddptrain: error: --lighthouse {down}: no lighthouse answers there" in result.stderr
    bad = ddptrain_cli("lighthouse", "--bind", "nowhere")
    assert bad.returncode == 2
    assert bad.stderr == "ddptrain: error: --bind nowhere: give HOST:PORT, e.g. 127.0.0.1:29510\n"

