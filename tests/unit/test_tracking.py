"""Trackers' logic in this process: records flattened, each (metric, step) sent once across
resumes, a failing or hanging tracker costs one warning line and never the others' records.
(The real MLflow server, W&B's offline files and TensorBoard: tests/integration.)"""

import json
import threading
import time

import pytest

from ddptrain import ConfigError
from ddptrain.api import prepare
from ddptrain.observe import trackers
from ddptrain.observe.trackers import CsvTracker, check_installed
from ddptrain.observe.tracking import Delivery, Tracker, TrackerState, Tracking, metrics_of

RECORD = {"kind": "epoch", "epoch": 1, "step": 64, "train_loss": 0.5, "lr": 0.1, "samples_per_s": None,
          "time": 1.7e9, "partial": True, "skipped_steps": [40, 41],
          "data_s": {"min": 0.1, "max": 0.3, "slowest_rank": 1}, "stragglers": {"1": 2.5},
          "memory_mb": {"peak_rss_mb": {"max": 300.0, "rank": 0}}}


class Remembering(Tracker):
    """A tracker that keeps what it is sent; ``holds``: what its run held before (it says so)."""

    name, tells_held = "remembering", True

    def __init__(self, holds=(), fail_on=None, block: threading.Event | None = None):
        self.holds, self.fail_on, self.block = set(holds), fail_on, block
        self.sent: list[tuple[int, dict]] = []
        self.closed = None

    def open(self, run_dir, params, saved):
        return {"id": saved.get("id", "run-1")}

    def held(self):
        return set(self.holds)

    def send(self, step, metrics, wall_time):
        if self.block is not None:
            self.block.wait(timeout=30)  # (set by the test when it is done)
        if step == self.fail_on:
            raise ConnectionError("connection refused\nby the server")
        self.sent.append((step, metrics))

    def close(self, status, artifacts, summary):
        self.closed = (status, [p.name for p in artifacts], summary)


def test_a_record_becomes_flat_numbers_without_its_places():
    assert metrics_of(RECORD) == {
        "epoch": 1.0, "train_loss": 0.5, "lr": 0.1, "skipped_steps": 2.0, "data_s/min": 0.1, "data_s/max": 0.3,
        "data_s/slowest_rank": 1.0, "stragglers/1": 2.5, "memory_mb/peak_rss_mb/max": 300.0,
        "memory_mb/peak_rss_mb/rank": 0.0}


def test_what_a_tracker_holds_is_not_sent_again(tmp_path):
    tracker = Remembering(holds={("train_loss", 32), ("epoch", 32)})
    delivery = Delivery(tracker, TrackerState(tmp_path))
    delivery.open(tmp_path, {})
    delivery.deliver({"kind": "epoch", "epoch": 0, "step": 32, "train_loss": 1.0, "lr": 0.1})
    delivery.deliver({"kind": "epoch", "epoch": 1, "step": 64, "train_loss": 0.5, "lr": 0.1})
    delivery.deliver({"kind": "eval", "epoch": 1, "step": 64, "train_loss": 0.5, "lr": 0.1})  # the same step again
    assert tracker.sent == [(32, {"lr": 0.1}), (64, {"epoch": 1.0, "train_loss": 0.5, "lr": 0.1})]
    state = json.loads((tmp_path / "trackers.json").read_text())["remembering"]
    assert state.pop("uid") and state == {"id": "run-1", "through_step": 64}  # uid: kept before the tracker's run


def test_a_tracker_that_cannot_tell_skips_the_steps_it_took_before_a_resume(tmp_path):
    (tmp_path / "trackers.json").write_text(json.dumps({"remembering": {"id": "run-1", "through_step": 64}}))
    tracker = Remembering()
    tracker.tells_held = False
    delivery = Delivery(tracker, TrackerState(tmp_path))
    delivery.open(tmp_path, {})
    for step in (32, 64, 96):
        delivery.deliver({"kind": "epoch", "epoch": step // 32 - 1, "step": step, "train_loss": 1.0})
    assert [step for step, _ in tracker.sent] == [96]


def test_a_failing_tracker_is_one_warning_and_the_others_get_everything(tmp_path, capsys):
    failing, healthy = Remembering(fail_on=64), Remembering()
    failing.name = "flaky"
    tracking = Tracking([failing, healthy], tmp_path)
    tracking.begin({"lr": 0.1})
    for step in (32, 64, 96):
        tracking.log({"kind": "epoch", "epoch": step // 32 - 1, "step": step, "train_loss": 1.0})
    (tmp_path / "config.json").write_text("{}")
    tracking.end("finished", [tmp_path / "config.json", tmp_path / "curves.png"], {"steps": 96})
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ddptrain: warning: tracker flaky failed sending step 64 (ConnectionError: connection refused "
                   f"by the server); training goes on without it; metrics.jsonl has every record: "
                   f"`ddptrain report {tmp_path} --sync flaky` sends what it missed"]
    assert [s for s, _ in failing.sent] == [32] and failing.closed is None
    assert [s for s, _ in healthy.sent] == [32, 64, 96]
    assert healthy.closed == ("finished", ["config.json"], {"steps": 96})  # curves.png: not drawn, not sent


@pytest.mark.slow  # waits its 1.5 s
def test_a_hanging_tracker_delays_the_end_only_as_long_as_allowed(tmp_path, capsys):
    never = threading.Event()
    tracking = Tracking([Remembering(block=never)], tmp_path)
    tracking.begin({})
    tracking.log({"kind": "epoch", "epoch": 0, "step": 1, "train_loss": 1.0})
    tracking.end("stopped", wait_s=1.5)
    err = capsys.readouterr().err
    assert "waiting up to 1.5 s for remembering (sending step 1)\n" in err, err  # (no guess at a server)
    assert "trackers (remembering) still busy after 1.5 s; not waiting" in err
    never.set()


def test_a_tracker_that_never_answers_holds_up_no_other(tmp_path, capsys):
    """Each tracker has its own thread: the healthy one takes every record as they come and
    closes its run while the silent one is still stuck in its first send."""
    never = threading.Event()
    silent, healthy = Remembering(block=never), Remembering()
    silent.name = "silent"
    tracking = Tracking([silent, healthy], tmp_path)
    tracking.begin({})
    for step in (1, 2, 3):
        tracking.log({"kind": "epoch", "epoch": step - 1, "step": step, "train_loss": 1.0})
    deadline = time.monotonic() + 10
    while len(healthy.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s for s, _ in healthy.sent] == [1, 2, 3] and silent.sent == []  # as the run goes, not at its end
    tracking.end("finished", wait_s=0.2)
    assert healthy.closed is not None and silent.closed is None
    err = capsys.readouterr().err
    assert "waiting up to 0.2 s for silent (sending step 1)\n" in err and "trackers (silent) still busy" in err, err
    never.set()


def test_the_csv_file_knows_what_it_holds_after_a_restart(tmp_path):
    first = CsvTracker()
    first.open(tmp_path, {}, {})
    first.send(32, {"train_loss": 1.0}, None)
    first.send(64, {"train_loss": 0.5, "eval_loss": 0.7}, None)  # a new column: the file is written again
    again = CsvTracker()
    again.open(tmp_path, {}, {})
    assert again.held() == {("train_loss", 32), ("train_loss", 64), ("eval_loss", 64)}
    again.send(96, {"train_loss": 0.25}, None)
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,train_loss,eval_loss", "32,1.0,", "64,0.5,0.7", "96,0.25,"]


def test_tracker_settings_from_flags_files_and_keywords(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('tracker = ["csv", "tensorboard"]\n')
    from_file, _ = prepare(None, {}, str(toml))
    from_keywords, _ = prepare("regression", {"tracker": "csv,tensorboard"})
    assert from_file.trackers() == from_keywords.trackers() == ["csv", "tensorboard"]
    assert prepare("regression", {"tracker": "csv", "tensorboard": True})[0].trackers() == ["csv", "tensorboard"]
    with pytest.raises(ConfigError, match=r"^--tracker neptune: unknown tracker; choose from csv, tensorboard"):
        prepare("regression", {"tracker": "csv,neptune"})


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(trackers.PACKAGES, "mlflow", ("no_such_mlflow_package", "mlflow"))
    with pytest.raises(ConfigError) as error:
        check_installed(["csv", "mlflow"])
    assert str(error.value) == ("--tracker mlflow: the no_such_mlflow_package package is not installed; "
                                "pip install 'ddptrain[mlflow]'")
