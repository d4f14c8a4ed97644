"""Watching a run as LM practitioners do (issue 68): a step record every --log-every steps with
the loss the optimizer saw, exact across a kill; rates of training alone; --eval-batches'
fixed subset; --min-lr, --betas and a task's own schedule resumed bitwise; config.json saying
what was built. Real ranks (2, gloo), real kills."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from ddptrain.cli import main
from ddptrain.observe.summary import curve_series, read_metrics
from helpers.commands import assert_same_weights, fit, load_model

TASKS = "watch_tasks:"
SIXTY_STEPS = {"batch_size": 8, "max_steps": 60, "log_every": 10}  # 128 steps an epoch: all inside the first


def _kill_env(tmp_path, run_dir, after_snapshot: int, at_loss: int) -> dict[str, str]:
    return {"KILL_RANK": "1", "KILL_STEP": str(at_loss), "KILL_MARKER": str(tmp_path / "killed"),
            "KILL_AFTER_SNAPSHOT": str(after_snapshot), "RUN_DIR": str(run_dir)}


def _step_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "step"]


def _losses(folder, rank: int, attempt: int = 0) -> list[float]:
    path = folder / f"rank-{rank}-attempt-{attempt}.txt"
    return [float(line) for line in path.read_text().split()] if path.is_file() else []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("uninterrupted")
    (base / "losses").mkdir()
    fit(TASKS + "logged_losses", base / "run", env={"LOSS_DIR": str(base / "losses")}, **SIXTY_STEPS, save_every=7)
    return base


@pytest.mark.slow
def test_step_records_hold_the_mean_loss_every_rank_computed(uninterrupted, capsys):
    records = _step_records(uninterrupted / "run")
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    # the reference: each step's loss is the mean of the two ranks' (equal batches), as the optimizer saw it
    per_step = [(a + b) / 2 for a, b in zip(_losses(uninterrupted / "losses", 0), _losses(uninterrupted / "losses", 1),
                                            strict=True)]
    assert len(per_step) == 60
    for record in records:
        window = per_step[record["step"] - 10:record["step"]]
        assert record["train_loss"] == pytest.approx(statistics.fmean(window), rel=1e-6)
        assert record["epoch"] == 0 and record["lr"] == 1e-3
        assert record["grad_norm"] > 0 and record["samples_per_s"] > 0
    epoch = [r for r in read_metrics(uninterrupted / "run") if r["kind"] == "epoch"]
    assert len(epoch) == 1 and epoch[0]["partial"]  # the epoch's own record is still there, once
    series = curve_series(read_metrics(uninterrupted / "run"))  # what curves.png draws: a point a step record
    assert series["train_loss"] == [[r["step"], r["train_loss"]] for r in records]
    assert main(["report", str(uninterrupted / "run"), "--json"]) == 0  # the same series, for machines
    assert json.loads(capsys.readouterr().out)["curves"]["train_loss"] == series["train_loss"]


@pytest.mark.slow
def test_a_run_killed_inside_a_window_logs_each_step_record_once_and_the_same(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    (tmp_path / "losses").mkdir()
    # rank 1 dies at its 37th loss, after the snapshot of step 35: the window 31-40 straddles the resume
    env = {"LOSS_DIR": str(tmp_path / "losses"), **_kill_env(tmp_path, run_dir, after_snapshot=35, at_loss=37)}
    fit(TASKS + "logged_losses", run_dir, env=env, **SIXTY_STEPS, save_every=7, max_restarts=1)
    assert (tmp_path / "killed").is_file()
    assert len(_losses(tmp_path / "losses", 0, attempt=1)) == 25  # resumed at step 35: steps 36-60 again
    records, expected = _step_records(run_dir), _step_records(uninterrupted / "run")
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    for got, want in zip(records, expected, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-12)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-12)
    assert_same_weights(load_model(run_dir), load_model(uninterrupted / "run"), exact=True)


@pytest.mark.slow
def test_rates_leave_evaluations_out(tmp_path):
    options = {"batch_size": 8, "max_steps": 40, "log_every": 10}
    fit(TASKS + "sleepy_evaluation", tmp_path / "plain", **options)
    fit(TASKS + "sleepy_evaluation", tmp_path / "evaluating", **options, eval_every_steps=5)
    evaluations = [r for r in read_metrics(tmp_path / "evaluating") if r["kind"] == "eval"]
    assert len(evaluations) == 7  # steps 5-35, each 0.3 s of sleep beside 5 steps of about 0.02 s

    def rate(name: str) -> float:
        return statistics.median(r["samples_per_s"] for r in _step_records(tmp_path / name))
    # Counted in, the evaluations would be 3 of every 4 seconds: the rate a quarter or less. Left out,
    # the two runs' rates differ by the machine's noise only (sleep-bound steps: within 40% here).
    assert 0.6 < rate("evaluating") / rate("plain") < 1.67, (rate("evaluating"), rate("plain"))
    epochs = {name: read_metrics(tmp_path / name)[-2] for name in ("plain", "evaluating")}  # (the last: goodput's)
    assert all(r["kind"] == "epoch" for r in epochs.values())
    assert 0.6 < epochs["evaluating"]["samples_per_s"] / epochs["plain"]["samples_per_s"] < 1.67


@pytest.mark.slow
def test_eval_batches_is_the_same_subset_on_any_world_size_and_the_end_reads_the_whole_set(tmp_path):
    # lr 0: the weights stay as built, so each evaluation of the same samples must give the same figures
    options = {"batch_size": 16, "max_steps": 4, "eval_every_steps": 2, "eval_batches": 4, "lr": 0.0}
    for ranks in (1, 3):
        fit(TASKS + "digits", tmp_path / f"ranks-{ranks}", nproc=ranks, **options)
    runs = {ranks: [r for r in read_metrics(tmp_path / f"ranks-{ranks}") if "eval_loss" in r] for ranks in (1, 3)}
    for ranks, evaluated in runs.items():
        assert [(r["step"], r["eval_samples"]) for r in evaluated] == [(2, 64), (4, 359)], ranks
        assert evaluated[0]["evaluated_on"] == "--eval-batches subset" and "evaluated_on" not in evaluated[1]
    figures = [{k: v for k, v in runs[ranks][0].items() if k.startswith("eval_")} for ranks in (1, 3)]
    assert figures[0] == figures[1]
    whole = [{k: v for k, v in runs[ranks][1].items() if k.startswith("eval_")} for ranks in (1, 3)]
    assert whole[0] == whole[1]
    assert figures[0]["eval_loss"] != whole[0]["eval_loss"]  # another set of samples, another figure


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    {"task": "killable_mlp", "optimizer": "adamw", "betas": "0.9,0.95", "eps": 1e-7, "lr_schedule": "cosine",
     "warmup_steps": 5, "min_lr": 2e-4, "lr": 2e-3},
    {"task": "own_optimizer_and_schedule"},
], ids=["min-lr-betas-eps", "make-scheduler"])
def test_knobs_resume_bitwise(tmp_path, knobs):
    options = {"batch_size": 8, "max_steps": 30, "save_every": 7, "log_every": 5, **knobs}
    task = TASKS + options.pop("task")
    fit(task, tmp_path / "whole", **options)
    fit(task, tmp_path / "resumed", env=_kill_env(tmp_path, tmp_path / "resumed", after_snapshot=14, at_loss=17),
        **options, max_restarts=1)
    assert (tmp_path / "killed").is_file()
    assert_same_weights(load_model(tmp_path / "resumed"), load_model(tmp_path / "whole"), exact=True)
    lrs = [r["lr"] for r in _step_records(tmp_path / "whole")]
    assert lrs == [r["lr"] for r in _step_records(tmp_path / "resumed")]
    floor = knobs.get("min_lr", 1e-4)
    assert lrs[-1] == pytest.approx(floor) and lrs[0] > lrs[-1]  # the decay ends at the floor, not at 0
    built = json.loads((tmp_path / "whole" / "config.json").read_text())["built"]
    groups = built["optimizer"]["param_groups"]
    assert built["optimizer"]["class"] == "AdamW"
    if knobs["task"] == "own_optimizer_and_schedule":
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all(g["betas"] == [0.9, 0.95] for g in groups)
        assert [g["eps"] for g in groups] == [1e-7, 1e-7] and built["scheduler"] == {"class": "CosineAnnealingLR"}
        config = json.loads((tmp_path / "whole" / "config.json").read_text())
        assert config["optimizer"] is None and config["weight_decay"] is None  # not the flags' defaults
    else:
        assert groups[0]["betas"] == [0.9, 0.95] and groups[0]["eps"] == 1e-7 and groups[0]["lr"] == 2e-3


@pytest.mark.slow
def test_a_finished_runs_config_json_is_read_back_as_settings(tmp_path):
    """config.json's record of what was built is no setting: the same run found again through it."""
    fit(TASKS + "own_optimizer_and_schedule", tmp_path / "run", batch_size=64, max_steps=4)
    from ddptrain.settings.parsing import from_options, read_settings_file

    settings = read_settings_file(tmp_path / "run" / "config.json")
    assert "built" not in settings
    assert from_options({k: v for k, v in settings.items() if v is not None}).max_steps == 4
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)
