"""Experiment trackers against real ones: an MLflow tracking server on loopback (killed for
real), W&B offline read back with wandb's own reader, TensorBoard's and the CSV file."""

import json

import pytest

from ddptrain import TrainingFailed
from ddptrain.observe.summary import read_metrics as every_record  # metrics.jsonl whole: the trackers' copy
from ddptrain.snapshots import files
from helpers.commands import assert_ok, clean_env, ddptrain_cli, fit, read_metrics

pytestmark = pytest.mark.slow
TASK = "tracker_tasks:"
ARGS = {"max_epochs": 3, "momentum": 0.9, "save_every": 32, "tracker": "mlflow"}
EPOCH_ENDS = [32, 64, 96]  # the regression task on 2 ranks: 32 steps per epoch


def _env(server, tmp_path, experiment, **more):
    return {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": experiment,
            "MARKER": str(tmp_path / "marker"), "TRACKER": "mlflow", **more}


def _only_run(server, experiment):
    client = server.client()
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def _assert_each_epoch_once(server, run, run_dir):
    epochs = [r for r in read_metrics(run_dir) if r["kind"] == "epoch"]
    assert server.history(run.info.run_id, "train_loss") == [(r["step"], r["train_loss"]) for r in epochs]
    assert [s for s, _ in server.history(run.info.run_id, "samples_per_s")] == EPOCH_ENDS


def test_mlflow_run_killed_and_resumed_is_one_run_with_each_step_once(mlflow_server, tmp_path, capfd):
    run_dir = tmp_path / "run"
    env = _env(mlflow_server, tmp_path, "killed", AT_STEP="80", TRACKED_STEP="64")
    with pytest.raises(TrainingFailed):  # rank 0 SIGKILLed in epoch 2, once MLflow has epoch 1's step
        fit(TASK + "killed_once_tracked", run_dir, env=env, **ARGS)
    *_, previous, newest = files.list_snapshots(run_dir / "snapshots")
    newest.write_bytes(newest.read_bytes()[:1000])  # resume from step 32: epoch 1 runs, and logs, again
    fit(TASK + "killed_once_tracked", run_dir, env=env, **ARGS)  # the same command
    assert f"resumed from {previous}" in capfd.readouterr().out
    run = _only_run(mlflow_server, "killed")
    _assert_each_epoch_once(mlflow_server, run, run_dir)
    assert run.info.status == "FINISHED"
    config = json.loads((run_dir / "config.json").read_text())
    assert run.data.params["lr"] == str(config["lr"]) and run.data.params["tracker"] == "mlflow"
    artifacts = {a.path for a in mlflow_server.client().list_artifacts(run.info.run_id)}
    assert {"config.json", "summary.json"} <= artifacts
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["id"] == run.info.run_id


def test_mlflow_server_dying_mid_run_costs_one_warning_and_sync_sends_the_rest(mlflow_server, tmp_path, capfd):
    server, run_dir = mlflow_server, tmp_path / "run"
    env = _env(server, tmp_path, "down", AT_STEP="40", TRACKED_STEP="32", SERVER_PGID=str(server.process.pid))
    fit(TASK + "server_dies_once_tracked", run_dir, env=env, **ARGS)  # returns: training went on
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "mlflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith("ddptrain: warning: tracker mlflow failed"), err
    assert f"ddptrain report {run_dir} --sync mlflow" in warnings[0]
    assert (run_dir / "model.pt").is_file() and len(read_metrics(run_dir)) == 3

    server.start()  # the same server, port and database, back again
    command_env = clean_env(MLFLOW_TRACKING_URI=server.uri)
    synced = ddptrain_cli("report", str(run_dir), "--sync", "mlflow", env=command_env)
    assert_ok(synced)
    run = _only_run(server, "down")
    _assert_each_epoch_once(server, run, run_dir)
    again = ddptrain_cli("report", str(run_dir), "--sync", "mlflow", env=command_env)
    assert "mlflow: sent 0 value(s)" in again.stdout, again.stdout + again.stderr
    _assert_each_epoch_once(server, run, run_dir)


def test_unknown_tracker_and_sync_of_a_server_that_is_down_are_one_line_errors(tmp_path):
    result = ddptrain_cli("train", "--tracker", "mlflow,neptune", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    assert result.stderr.strip() == ("ddptrain: error: --tracker neptune: unknown tracker; choose from csv, "
                                     "tensorboard, mlflow, wandb (comma-separated for several)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"kind": "epoch", "epoch": 0, "step": 3, "train_loss": 1.0}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    down = clean_env(MLFLOW_TRACKING_URI="http://127.0.0.1:9", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    result = ddptrain_cli("report", str(run_dir), "--sync", "mlflow", env=down)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("ddptrain: error: --sync mlflow: ") and "reachable" in result.stderr
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    unknown = ddptrain_cli("report", str(fresh), "--sync", "nosuch")  # refused before any output or file
    assert unknown.returncode == 2 and unknown.stdout == "" and not (fresh / "curves.png").exists()
    assert unknown.stderr.strip() == ("ddptrain: error: --sync nosuch: unknown tracker; choose one of csv, "
                                      "tensorboard, mlflow, wandb")


DIGITS_EPOCHS = [23, 46, 69, 92]  # digits on 2 ranks x 32: 23 steps per epoch


def _wandb_pairs(run_dir):
    """Every (metric, step) in every W&B run file of the run dir (each attempt writes its own),
    read with wandb's own reader, with how often each occurs."""
    import collections

    from ddptrain.observe.trackers import wandb_history

    pairs = collections.Counter()
    for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
        for row in wandb_history(path):
            step = row.pop("_step")
            pairs.update((key, step) for key in row if not key.startswith("_"))
    return pairs


def _record_steps(run_dir) -> list[int]:
    """The steps of metrics.jsonl's records, each once: the CSV file's rows (a step record, an
    epoch's and the run's goodput at one step share a row)."""
    return list(dict.fromkeys(r["step"] for r in every_record(run_dir)))


def _assert_holds_the_records(held: set[tuple[str, int]], expected: set[tuple[str, int]]) -> None:
    """A tracker holds every (metric, step) of metrics.jsonl, and nothing else but what a killed
    attempt measured of a step the resumed run redid and measured otherwise: a straggler's
    figures exist only in an epoch where a rank straggled (a busy machine's timing), and a
    tracker cannot take back what it was sent. Epoch 1's record (step 46) is redone when the
    kill beat step 46's snapshot."""
    assert expected <= held, sorted(expected - held)
    others = held - expected
    assert all(key.startswith("straggler") and step <= 50 for key, step in others), sorted(others)


@pytest.mark.parametrize("kill_step", [47, 62])
def test_a_kill_at_any_moment_leaves_every_tracker_each_metric_and_step_once(mlflow_server, tmp_path, kill_step):
    """mlflow, wandb (offline) and csv at once, digits for 4 epochs; rank 0 SIGKILLed at its 47th
    loss (step 41: epoch 0's 23 steps and its 6 evaluation batches count; epoch 0's record may
    still be on the trackers' thread, W&B may not have started its run) or at its 62nd (step 50,
    early in epoch 2), once step 23's snapshot is on disk; the same command resumes from the
    newest snapshot (step 46, or 23 if the kill beat its writer). Each tracker then holds every
    (metric, step) of metrics.jsonl once: the resumed run sent each what it lacked of the
    records before its snapshot. (A busy machine's stragglers in a redone epoch: see
    ``_assert_holds_the_records``; seen once beside a CPU hog, three test files at a time.)"""
    from ddptrain.observe.tracking import metrics_of

    run_dir, experiment = tmp_path / "run", f"kill-{kill_step}"
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_NAME": experiment, "WANDB_MODE": "offline",
           "KILL_RANK": "0", "KILL_STEP": str(kill_step), "KILL_MARKER": str(tmp_path / "killed"),
           "KILL_ONCE_SAVED": str(run_dir / "snapshots")}
    args = {"max_epochs": 4, "tracker": "mlflow,wandb,csv", "save_every": 23}
    with pytest.raises(TrainingFailed):
        fit("ddptrain_test_tasks:kill_digits", run_dir, env=env, **args)
    fit("ddptrain_test_tasks:kill_digits", run_dir, env=env, **args)  # the same command
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == DIGITS_EPOCHS
    expected = {(key, r["step"]) for r in every_record(run_dir) for key in metrics_of(r)}  # goodput's too

    run = _only_run(mlflow_server, experiment)
    keys = {k for k, _ in expected} | {"straggler_wait_s", "stragglers/0", "stragglers/1"}
    held = [(key, step) for key in keys for step, _ in mlflow_server.history(run.info.run_id, key)]
    assert len(held) == len(set(held)), sorted(held)  # each once: a repeated step would be listed twice
    _assert_holds_the_records(set(held), expected)

    wandb = _wandb_pairs(run_dir)
    _assert_holds_the_records(set(wandb), expected)
    assert set(wandb.values()) == {1}, wandb

    import csv

    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == _record_steps(run_dir)  # a row a step: the step records' too
    assert [float(row["train_loss"]) for row in rows if row["train_loss"]] == [r["train_loss"] for r in records]


def test_a_tracker_server_that_never_answers_holds_the_end_at_most_15_s_and_says_why(tmp_path):
    """A server that accepts connections and never answers: training goes on; the end waits a
    bounded time, saying so when the wait starts; the trackers beside it (W&B offline, the CSV
    file) get every record all the same (each tracker has a thread of its own)."""
    import os
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # kept open, never read, never answered
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        run_dir = tmp_path / "run"
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        result = ddptrain_cli("train", "--task", "digits", "--max-epochs", "2", "--tracker", "mlflow,wandb,csv",
                              "--run-dir", str(run_dir), env=clean_env(MLFLOW_TRACKING_URI=uri, WANDB_MODE="offline"),
                              timeout=120)
        ended = time.time()
    finally:
        stop.set()
        thread.join(5)
        for connection in held:
            connection.close()
        listener.close()
    assert_ok(result)
    last_step = os.path.getmtime(run_dir / "metrics.jsonl")
    assert ended - last_step < 15, f"{ended - last_step:.1f} s after the last record"
    assert "ddptrain: warning: waiting up to 10 s for mlflow (" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # goodput's end counts that wait: the timeline's last line, written once the trackers let go
    from ddptrain.observe.goodput import account, read_timeline

    closed = read_timeline(run_dir)[-2]  # (the last: the launcher's exit, once its ranks are gone)
    assert closed["e"] == "closed" and closed["t1"] - closed["t0"] >= 9, closed
    assert account(read_timeline(run_dir))["end_s"] >= closed["t1"] - closed["t0"]
    from ddptrain.observe.tracking import metrics_of

    records = read_metrics(run_dir)
    wandb = _wandb_pairs(run_dir)
    assert set(wandb) == {(key, r["step"]) for r in every_record(run_dir) for key in metrics_of(r)}, wandb
    with open(run_dir / "metrics.csv") as handle:
        assert [int(line.split(",")[0]) for line in handle.readlines()[1:]] == _record_steps(run_dir)
    assert [r["step"] for r in records] == [23, 46]


@pytest.mark.parametrize("uri", ["localhost:5000", "htp://localhost:5000", "http://localhost:port", "http://"])
def test_an_mlflow_address_that_cannot_work_is_one_line_before_training(tmp_path, uri):
    result = ddptrain_cli("train", "--tracker", "mlflow", "--run-dir", str(tmp_path / "r"),
                          env=clean_env(MLFLOW_TRACKING_URI=uri))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"ddptrain: error: MLFLOW_TRACKING_URI={uri!r}: "), result.stderr
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_kill_during_the_runs_end_then_the_same_command_catches_every_tracker_up(tmp_path, start):
    """SIGKILL of the launcher's whole group on the "summary" line (the trackers still finishing:
    W&B offline, the CSV file), then the same command: it says the run already finished, and each
    tracker holds every (metric, step) of metrics.jsonl once."""
    from ddptrain.observe.tracking import metrics_of
    from helpers.commands import BIN, kill_tree

    run_dir = tmp_path / "run"
    command = [str(BIN / "ddptrain"), "train", "--task", "digits", "--max-epochs", "3", "--tracker", "wandb,csv",
               "--run-dir", str(run_dir), "--nproc", "2"]
    env = clean_env(WANDB_MODE="offline")
    process = start(command, env=env)
    seen = []
    for line in process.stdout:  # (the test's own timeout bounds it: the run ends in ~10 s)
        seen.append(line)
        if line.startswith("summary"):
            kill_tree(process)
            break
    process.wait(timeout=30)
    assert any(line.startswith("summary") for line in seen), "".join(seen)
    again = ddptrain_cli(*command[1:], env=env)
    assert_ok(again)
    assert "holds a run that already finished 3 epoch(s)" in again.stdout, again.stdout
    records = read_metrics(run_dir)
    expected = {(key, r["step"]) for r in every_record(run_dir) for key in metrics_of(r)}
    wandb = _wandb_pairs(run_dir)
    assert set(wandb) == expected and set(wandb.values()) == {1}, wandb
    import csv

    with open(run_dir / "metrics.csv", newline="") as handle:
        assert [int(row["step"]) for row in csv.DictReader(handle)] == _record_steps(run_dir)
    assert [r["step"] for r in records] == [23, 46, 69]
