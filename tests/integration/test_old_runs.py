"""A run started by ddptrain 0.5 goes on under this version: the same command finds its run dir
(the default name is unchanged), reads its config.json and snapshot, and ends with the weights,
average and records of a run that was never stopped.

tests/data/run-0.5 was written by 0.5 (commit d59854c) with::

    ddptrain train --task digits --max-epochs 2 --optimizer adamw --ema 0.9 --keep-best eval_loss --log-every 5

(its logs, pids and final weights left out: the resumed run writes its own).
"""

import shutil

from helpers.commands import TESTS, assert_ok, assert_same_weights, ddptrain_cli, load_model, read_metrics

FLAGS = ["train", "--task", "digits", "--optimizer", "adamw", "--ema", "0.9", "--keep-best", "eval_loss",
         "--log-every", "5"]
OLD_RUN = TESTS / "data" / "run-0.5"
NAME = "runs/digits-94d8ac2f"  # the default run dir 0.5 gave this command


def test_a_run_started_by_0_5_resumes_bitwise_under_its_default_run_dir(tmp_path):
    shutil.copytree(OLD_RUN, tmp_path / "old")
    resumed = ddptrain_cli(*FLAGS, "--max-epochs", "4", cwd=tmp_path / "old")
    assert_ok(resumed)
    assert "step-000000046" in resumed.stdout + resumed.stderr, resumed.stderr  # its snapshot, named
    assert sorted(p.name for p in (tmp_path / "old" / "runs").iterdir()) == [NAME.split("/")[1]]

    (tmp_path / "new").mkdir()
    straight = ddptrain_cli(*FLAGS, "--max-epochs", "4", cwd=tmp_path / "new")
    assert_ok(straight)
    old, new = tmp_path / "old" / NAME, tmp_path / "new" / NAME  # the same default name today
    for weights in ("model.pt", "ema/model.pt", "best/model.pt"):
        assert_same_weights(load_model((old / weights).parent), load_model((new / weights).parent), exact=True)
    figures = ("epoch", "step", "train_loss", "grad_norm", "eval_loss", "eval_accuracy", "ema_eval_loss")
    later = [[{k: r[k] for k in figures} for r in read_metrics(run) if r["epoch"] >= 2] for run in (old, new)]
    assert len(later[0]) == 2 and later[0] == later[1]
