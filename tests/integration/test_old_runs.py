"""A run started by ddptrain 0.5 goes on under this version: the same command finds its run dir
(the default name is unchanged), reads its config.json and snapshot, and ends with the weights,
average, best model and records that this version gives that snapshot.

tests/data/run-0.5 was written by 0.5 (commit d59854c) with::

    ddptrain train --task digits --max-epochs 2 --optimizer adamw --ema 0.9 --keep-best eval_loss --log-every 5

(its logs, pids and final weights left out: the resumed run writes its own). Its snapshot's bits
were computed on the CPU that wrote it, and torch promises no bitwise equality across CPUs
(AVX2 and AVX-512 differ in the last bits), so nothing here compares them with bits made on
this machine as if they were the same: the run that continues the old run dir is compared
bitwise with this version resuming the same snapshot by its path into a run dir of its own, and
with a run started here from scratch within a tolerance.
"""

import shutil

from helpers.commands import TESTS, assert_ok, assert_same_weights, ddptrain_cli, load_model, read_metrics

FLAGS = ["train", "--task", "digits", "--optimizer", "adamw", "--ema", "0.9", "--keep-best", "eval_loss",
         "--log-every", "5", "--max-epochs", "4"]
OLD_RUN = TESTS / "data" / "run-0.5"
NAME = "runs/digits-94d8ac2f"  # the default run dir 0.5 gave this command
SNAPSHOT = "snapshots/step-000000046.pt"
FIGURES = ("epoch", "step", "train_loss", "grad_norm", "eval_loss", "eval_accuracy", "ema_eval_loss")
# How far a run whose step-46 state came from another CPU may end from one computed here from the
# start, 46 AdamW steps later. Measured here: the snapshot's weights and average moved by up to
# 2.6e-6 (the fixture against an AVX-512 machine's run) and its Adam moments by 1e-6 of themselves
# end up to 5.8e-4 apart (eval loss 4.6e-5 of itself); the moments lost (zeroed), 0.107 apart.
ACROSS_CPUS = {"rtol": 1e-3, "atol": 3e-3}


def later_records(run_dir):
    return [{k: r[k] for k in FIGURES} for r in read_metrics(run_dir) if r["epoch"] >= 2]


def test_a_run_started_by_0_5_resumes_under_its_default_run_dir_as_this_version_resumes_its_snapshot(tmp_path):
    shutil.copytree(OLD_RUN, tmp_path / "old")
    resumed = ddptrain_cli(*FLAGS, cwd=tmp_path / "old")
    assert_ok(resumed)
    assert "step-000000046" in resumed.stdout + resumed.stderr, resumed.stderr  # its snapshot, named
    assert sorted(p.name for p in (tmp_path / "old" / "runs").iterdir()) == [NAME.split("/")[1]]

    # this version, given the same snapshot by its path, in a run dir of its own (no 0.5 files beside it)
    (tmp_path / "by-path").mkdir()
    snapshot = tmp_path / "snapshot.pt"
    shutil.copy(OLD_RUN / NAME / SNAPSHOT, snapshot)
    by_path = ddptrain_cli(*FLAGS, "--resume", str(snapshot), "--run-dir", "runs/by-path", cwd=tmp_path / "by-path")
    assert_ok(by_path)
    old, mine = tmp_path / "old" / NAME, tmp_path / "by-path" / "runs" / "by-path"
    for weights in ("model.pt", "ema/model.pt", "best/model.pt"):
        assert_same_weights(load_model((old / weights).parent), load_model((mine / weights).parent), exact=True)
    assert len(later_records(old)) == 2 and later_records(old) == later_records(mine)

    # and what a run started here from scratch ends with (the first 46 steps' bits are this CPU's)
    (tmp_path / "new").mkdir()
    straight = ddptrain_cli(*FLAGS, cwd=tmp_path / "new")
    assert_ok(straight)
    new = tmp_path / "new" / NAME  # the same default name today
    for weights in ("model.pt", "ema/model.pt", "best/model.pt"):
        for key, value in load_model((new / weights).parent).items():
            expected = load_model((old / weights).parent)[key]
            assert value.shape == expected.shape and value.sub(expected).abs().le(
                ACROSS_CPUS["atol"] + ACROSS_CPUS["rtol"] * expected.abs()).all(), f"{weights}: {key}"
    for before, after in zip(later_records(old), later_records(new), strict=True):
        assert (before["epoch"], before["step"]) == (after["epoch"], after["step"])
        assert abs(before["eval_loss"] - after["eval_loss"]) <= 1e-3 * abs(after["eval_loss"])
