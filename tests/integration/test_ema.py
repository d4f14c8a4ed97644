"""--ema (parallel/averaging.py): the average is the lerp of every step's weights, evaluated
beside them, in every snapshot (a kill and resume ends bitwise where the uninterrupted run
does), sharded under fsdp and resumed across strategies, written to ema/model.pt and exported."""

import re

import pytest
import torch

from ddptrain import TrainingFailed
from ddptrain.snapshots import dcp as snapshot_dcp
from ddptrain.snapshots import files
from helpers.commands import assert_same_weights, ddptrain_cli, fit, load_model, read_metrics

pytestmark = pytest.mark.slow
EMA = {"max_epochs": 2, "ema": 0.9}  # digits: 23 steps per epoch on 2 ranks
ROOTED = "sharding_tasks:rooted_digits"  # digits, with parameters in fsdp's root


def _average(run_dir):
    return load_model(run_dir / "ema")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """digits, 2 ranks, 2 epochs, --ema 0.9, under each strategy (ddp: a snapshot every step)."""
    base = tmp_path_factory.mktemp("ema")
    fit("digits", base / "ddp", save_every=1, keep=100, **EMA)
    fit(ROOTED, base / "fsdp", strategy="fsdp", **EMA)
    return base


def test_the_average_follows_every_step_and_is_evaluated_beside_the_weights(runs):
    run_dir = runs / "ddp"
    snapshots = {files.snapshot_step(p): files.load_snapshot(p) for p in files.list_snapshots(run_dir / "snapshots")}
    assert len(snapshots) == 46
    for step in (2, 24, 46):  # the lerp of the step's weights, across an epoch's end
        before, after = snapshots[step - 1], snapshots[step]
        for name, value in after["ema"].items():
            expected = torch.lerp(before["ema"][name], after["model"][name], 0.1)
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-7, msg=f"step {step}: {name}")
    average, weights = _average(run_dir), load_model(run_dir)
    assert average.keys() == weights.keys()  # loads into the plain model as model.pt does
    assert_same_weights(average, snapshots[46]["ema"], exact=True)
    assert any(not torch.equal(average[name], weights[name]) for name in weights)
    records = [r for r in read_metrics(run_dir) if r.get("kind") == "epoch"]
    assert all({"ema_eval_loss", "ema_eval_accuracy"} <= r.keys() for r in records), records[-1].keys()
    assert records[-1]["ema_eval_loss"] != records[-1]["eval_loss"]


def test_after_init_from_the_average_starts_at_the_weights_loaded(runs, tmp_path):
    fit("digits", tmp_path / "tuned", init_from=str(runs / "ddp"), save_every=1, keep=100, **{**EMA, "max_epochs": 1})
    first = files.load_snapshot(files.list_snapshots(tmp_path / "tuned" / "snapshots")[0])
    assert files.snapshot_step(files.list_snapshots(tmp_path / "tuned" / "snapshots")[0]) == 1
    loaded = load_model(runs / "ddp")
    for name, value in first["ema"].items():
        torch.testing.assert_close(value, torch.lerp(loaded[name], first["model"][name], 0.1), rtol=0, atol=1e-7)


def test_killed_and_resumed_the_average_ends_bitwise(runs, tmp_path):
    kill = {"KILL_RANK": "1", "KILL_STEP": "30", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit("ddptrain_test_tasks:kill_digits", tmp_path / "run", env=kill, save_every=7, **EMA)
    fit("ddptrain_test_tasks:kill_digits", tmp_path / "run", env=kill, save_every=7, **EMA)
    assert (tmp_path / "killed").exists()
    assert_same_weights(_average(tmp_path / "run"), _average(runs / "ddp"), exact=True)
    assert_same_weights(load_model(tmp_path / "run"), load_model(runs / "ddp"), exact=True)


def test_under_fsdp_killed_and_resumed_the_average_ends_bitwise(runs, tmp_path):
    kill = {"KILL_RANK": "0", "KILL_STEP": "30", "KILL_MARKER": str(tmp_path / "killed")}
    task = "sharding_tasks:kill_rooted_digits"
    with pytest.raises(TrainingFailed):
        fit(task, tmp_path / "run", env=kill, strategy="fsdp", save_every=7, **EMA)
    fit(task, tmp_path / "run", env=kill, strategy="fsdp", save_every=7, **EMA)
    assert (tmp_path / "killed").exists()
    assert_same_weights(_average(tmp_path / "run"), _average(runs / "fsdp"), exact=True)
    assert_same_weights(load_model(tmp_path / "run"), load_model(runs / "fsdp"), exact=True)


def test_fsdp_shards_the_average_and_it_resumes_across_strategies(runs, tmp_path):
    (folder,) = files.list_snapshots(runs / "fsdp" / "snapshots")[-1:]
    assert snapshot_dcp.holds(folder, "ema") and snapshot_dcp.holds(folder, "model")
    # The same steps, the average sharded. The root's layers gathered for an evaluation must
    # not outlive a swap (strategy.settle): else the average's figures and ema/model.pt would
    # hold the weights' root layers.
    assert_same_weights(_average(runs / "fsdp"), _average(runs / "ddp"))
    assert_same_weights(load_model(runs / "fsdp"), load_model(runs / "ddp"))
    fsdp, ddp = (read_metrics(runs / s)[-1] for s in ("fsdp", "ddp"))
    assert fsdp["ema_eval_loss"] == pytest.approx(ddp["ema_eval_loss"], rel=1e-5)
    for first, then in (("ddp", "fsdp"), ("fsdp", "ddp")):
        run_dir = tmp_path / f"{first}-then-{then}"
        fit(ROOTED, run_dir, strategy=first, **{**EMA, "max_epochs": 1})
        fit(ROOTED, run_dir, strategy=then, **EMA)
        assert_same_weights(_average(run_dir), _average(runs / then), exact=True)


def test_report_names_the_average_and_export_writes_it(runs, tmp_path):
    shown = ddptrain_cli("report", str(runs / "ddp"))
    assert shown.returncode == 0, shown.stderr
    assert f"ddptrain export {runs / 'ddp'} --ema --format safetensors" in shown.stdout
    out = tmp_path / "average.safetensors"
    done = ddptrain_cli("export", str(runs / "ddp"), "--ema", "--out", str(out))
    assert done.returncode == 0 and re.search(r"\(ema/model.pt\) -> ", done.stdout), done.stdout + done.stderr
    from safetensors.torch import load_file

    assert_same_weights(load_file(str(out)), _average(runs / "ddp"), exact=True)
    missing = ddptrain_cli("export", str(runs / "fsdp"), "--best", "--out", str(tmp_path / "x.safetensors"))
    assert missing.returncode == 2 and "train with --keep-best" in missing.stderr


@pytest.mark.parametrize("changed,words", [
    (["--ema", "0.5"], "ema: 0.9 -> 0.5"),  # another decay would mix two averages
    ([], "ema: 0.9 -> 0.0"),  # dropping --ema would silently stop the average
    (["--ema", "0.9", "--keep-best", "eval_accuracy"], "keep_best: '' -> 'eval_accuracy:max'"),
])
def test_a_resume_with_another_average_or_best_metric_is_refused_in_one_line(runs, changed, words, tmp_path, capfd):
    """Resumed with more epochs (the same run) but another --ema or --keep-best: exit 2, one line,
    and the run's snapshots untouched."""
    import shutil

    from ddptrain.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(runs / "ddp", run_dir)
    before = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    capfd.readouterr()
    code = main(["train", "--task", "digits", "--run-dir", str(run_dir), "--nproc", "2", "--max-epochs", "3",
                 *changed])
    err = capfd.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert "use the original flags" in err
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == before
