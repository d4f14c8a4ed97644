"""--keep-best and --early-stop (snapshots/best.py): the kept best is the evaluation with the best
figure, bitwise the snapshot of its step; the same best and stop step on 1 and 2 ranks, and
through a kill and resume; the finished run's message, report and export name it."""

import json
import re

import pytest
import torch

from ddptrain import TrainingFailed
from helpers.commands import assert_same_weights, ddptrain_cli, fit, load_model, read_metrics

pytestmark = pytest.mark.slow
# digits improves by more than 0.005 per evaluation up to step ~70 (measured): the run stops near step 90
BEST = {"max_epochs": 30, "keep_best": "eval_loss", "early_stop": 2, "early_stop_delta": 0.005,
        "eval_every_steps": 10, "save_every": 1, "keep": 500}


def _evaluations(run_dir):
    return [(r["step"], r["eval_loss"]) for r in read_metrics(run_dir) if "eval_loss" in r]


def _kept(run_dir):
    return json.loads((run_dir / "best" / "best.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("best") / "two-ranks"
    fit("digits", run_dir, **BEST)
    return run_dir


def test_the_kept_best_is_the_lowest_evaluation_and_its_snapshot(two_ranks):
    evaluations = _evaluations(two_ranks)
    step, value = min(evaluations, key=lambda e: e[1])
    kept = _kept(two_ranks)
    assert (kept["metric"], kept["mode"], kept["step"], kept["value"]) == ("eval_loss", "min", step, value)
    snapshot = torch.load(two_ranks / "snapshots" / f"step-{step:09d}.pt", weights_only=True)
    assert_same_weights(torch.load(two_ranks / "best" / "model.pt", weights_only=True), snapshot["model"], exact=True)
    # stopped by --early-stop, long before --max-epochs, at an evaluation
    last = read_metrics(two_ranks)[-1]
    last_step = last["step"]
    assert last_step < 10 * 23 and evaluations[-1][0] == last_step
    assert last.get("ended_by") == ("--early-stop" if last_step % 23 else None), last  # inside an epoch: partial
    # an evaluation at an epoch's (or the run's) last step is in the epoch's record, not recorded twice
    assert len({s for s, _ in evaluations}) == len(evaluations), evaluations
    assert "eval_loss" in last and last["kind"] == "epoch"
    summary = ddptrain_cli("report", str(two_ranks))
    assert summary.returncode == 0 and re.search(rf"best_step +{step}\n", summary.stdout), summary.stdout
    assert f"ddptrain export {two_ranks} --best --format safetensors" in summary.stdout
    again = ddptrain_cli("train", "--task", "digits", "--run-dir", str(two_ranks), "--nproc", "2",
                         *[f"--{k.replace('_', '-')}={v}" for k, v in BEST.items()])
    assert again.returncode == 0, again.stderr
    assert f"holds a run that stopped early at step {last_step} (--early-stop 2)" in again.stdout, again.stdout


def test_one_rank_stops_where_two_do_and_keeps_the_same_best(two_ranks, tmp_path, capfd):
    fit("digits", tmp_path / "one", nproc=1, batch_size=64, **BEST)
    kept = _kept(tmp_path / "one")
    stopped_at = read_metrics(tmp_path / "one")[-1]["step"]
    assert (f"ddptrain: stopped early at step {stopped_at}: 2 evaluation(s) in a row without an improvement of more "
            f"than 0.005 (--early-stop 2); the best eval_loss {kept['value']:.6g} was at step {kept['step']}; "
            "best model: ") in capfd.readouterr().out
    assert _kept(tmp_path / "one")["step"] == _kept(two_ranks)["step"]
    assert read_metrics(tmp_path / "one")[-1]["step"] == read_metrics(two_ranks)[-1]["step"]
    assert kept["value"] == pytest.approx(_kept(two_ranks)["value"], rel=1e-4)
    one, two = load_model(tmp_path / "one" / "best"), load_model(two_ranks / "best")
    for key in two:  # 80 AdamW steps summed in another order: close, not equal
        torch.testing.assert_close(one[key], two[key], rtol=1e-3, atol=1e-4)


def test_killed_between_evaluations_and_resumed_keeps_the_same_best_and_stop_step(two_ranks, tmp_path):
    kill = {"KILL_RANK": "1", "KILL_STEP": "85", "KILL_MARKER": str(tmp_path / "killed")}  # between evaluations
    with pytest.raises(TrainingFailed):
        fit("ddptrain_test_tasks:kill_digits", tmp_path / "run", env=kill, **BEST)
    fit("ddptrain_test_tasks:kill_digits", tmp_path / "run", env=kill, **BEST)
    assert (tmp_path / "killed").exists()
    assert _kept(tmp_path / "run") == _kept(two_ranks)
    assert_same_weights(load_model(tmp_path / "run" / "best"), load_model(two_ranks / "best"), exact=True)
    assert_same_weights(load_model(tmp_path / "run"), load_model(two_ranks), exact=True)
    assert _evaluations(tmp_path / "run") == _evaluations(two_ranks)


def test_fsdp_keeps_the_whole_best_model_and_export_reads_it(tmp_path):
    fit("digits", tmp_path / "fsdp", strategy="fsdp", **{**BEST, "save_every": 0})
    step, _ = min(_evaluations(tmp_path / "fsdp"), key=lambda e: e[1])
    assert _kept(tmp_path / "fsdp")["step"] == step
    best, final = load_model(tmp_path / "fsdp" / "best"), load_model(tmp_path / "fsdp")
    assert {k: v.shape for k, v in best.items()} == {k: v.shape for k, v in final.items()}
    out = tmp_path / "best.safetensors"
    exported = ddptrain_cli("export", str(tmp_path / "fsdp"), "--best", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    assert_same_weights(load_file(out), best, exact=True)
