"""--sync local-sgd | diloco: replica groups (--replicas) that meet every --sync-every steps.
On this machine the groups are local: 2 ranks as 2 groups of 1, or 4 as 2 groups of 2 (DDP
inside each). What they hold: with a sync every step and a plain outer step they are every-step
DDP; the groups meet in one all-reduce per sync and in nothing between; their weights agree
right after each sync and differ between; a killed run resumes bitwise."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ddptrain.errors import ConfigError
from ddptrain.snapshots import files
from helpers.commands import REPO, assert_same_weights, clean_env, fit, load_model, read_metrics
from helpers.costs import STOP_AGREEMENT, collectives_per_step, pop_step_records

pytestmark = pytest.mark.slow
TASKS = "ddptrain_test_tasks:"
BASE = {"max_epochs": 1, "lr": 0.05, "momentum": 0.9}  # the tutorial's job: 32 steps an epoch on 2 ranks
GROUPS = {"replicas": 2}
# --sync diloco needs its outer step given (the DiLoCo paper's here, which 0.5 took by default)
OUTER = {"diloco": {"outer_lr": 0.7, "outer_momentum": 0.9}, "local-sgd": {}}


def test_a_sync_every_step_with_a_plain_outer_step_is_every_step_ddp(tmp_path):
    """Averaging the groups' weights after each SGD step (momentum too: it is linear) is
    stepping with their averaged gradients: local SGD, and DiLoCo with outer lr 1 and no momentum."""
    fit("regression", tmp_path / "ddp", **BASE)
    fit("regression", tmp_path / "local", sync="local-sgd", sync_every=1, **GROUPS, **BASE)
    fit("regression", tmp_path / "diloco", sync="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0,
        **GROUPS, **BASE)
    ddp = load_model(tmp_path / "ddp")
    for name in ("local", "diloco"):
        assert_same_weights(load_model(tmp_path / name), ddp)


def test_diloco_with_a_plain_outer_step_is_local_sgd_at_any_interval(tmp_path):
    """Outer lr 1 without momentum moves the last synced weights all the way to the groups' mean."""
    options = {"sync_every": 4, "optimizer": "adamw", **GROUPS, **BASE}
    fit("regression", tmp_path / "local", sync="local-sgd", **options)
    fit("regression", tmp_path / "diloco", sync="diloco", outer_lr=1.0, outer_momentum=0.0, **options)
    fit("regression", tmp_path / "nesterov", sync="diloco", outer_lr=0.7, outer_momentum=0.9, **options)  # the paper's
    local = load_model(tmp_path / "local")
    assert_same_weights(load_model(tmp_path / "diloco"), local)
    assert not torch.allclose(load_model(tmp_path / "nesterov")["weight"], local["weight"])


def _weights_by_step(log_dir, rank: int) -> dict[int, str]:
    lines = (log_dir / f"rank-{rank}.txt").read_text().splitlines()
    return {int(n): weights for n, weights in (line.split(" ", 1) for line in lines)}


@pytest.mark.parametrize("kind", ["local-sgd", "diloco"])
def test_the_groups_agree_right_after_each_sync_and_differ_between(tmp_path, kind):
    log = tmp_path / "weights"
    log.mkdir()
    fit("semi_sync_tasks:logged_weights", tmp_path / "run", env={"WEIGHTS_LOG": str(log)}, sync=kind,
        sync_every=4, max_steps=12, **OUTER[kind], **GROUPS, **BASE)
    ranks = [_weights_by_step(log, rank) for rank in (0, 1)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == list(range(1, 13))
    agree = [n for n in range(1, 13) if ranks[0][n] == ranks[1][n]]  # the weights before step n
    assert agree == [1, 5, 9], agree  # the start, and after the syncs at steps 4 and 8
    assert load_model(tmp_path / "run")  # and the run ends with one model (a sync after step 12)


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_groups_meet_in_one_all_reduce_per_sync_and_nothing_between(tmp_path, nproc):
    """Rank 0's collectives in steps 2 to 8 (--profile 7), DiLoCo every 4 steps: on 2 ranks (groups
    of 1) the sync's all-reduce of the 21 parameters' changes is all there is; on 4 (groups of 2),
    DDP's gradient all-reduce inside the group every step, and the sync's beside it at steps 4 and 8.
    The step records (--log-every 4) run theirs beside the stop agreement only."""
    fit("regression", tmp_path, nproc=nproc, sync="diloco", sync_every=4, max_steps=9, profile=7, batch_size=8,
        log_every=4, **OUTER["diloco"], **GROUPS)
    steps = collectives_per_step(tmp_path)
    pop_step_records(steps, every=4)
    for step in steps:
        step.pop(STOP_AGREEMENT, None)  # the stop agreement (about twice a second)
    inside = 0 if nproc == 2 else 1
    expected = {n: collections.Counter({"all_reduce[21]": inside + (n % 4 == 0)}) for n in range(4, 9)}
    by_step = {n: +steps[n - 2] for n in range(4, 9)}  # (steps 2 and 3 hold one-off costs)
    assert by_step == {n: +counter for n, counter in expected.items()}, by_step


def test_diloco_killed_between_syncs_resumes_bitwise_from_the_last_sync(tmp_path):
    """Adam inside (each group's moments its own), DiLoCo every 4 steps, snapshots asked for every
    6 steps (taken at the next sync: 8, 12, 20, 24, ...), rank 1 SIGKILLed at its 23rd step; the
    restart resumes from a sync and ends bitwise equal to a run never interrupted."""
    options = {"sync": "diloco", "sync_every": 4, "save_every": 6, "optimizer": "adamw", "max_epochs": 2,
               "lr": 0.01, **OUTER["diloco"], **GROUPS}
    fit("regression", tmp_path / "whole", **options)
    env = {"KILL_RANK": "1", "KILL_STEP": "23", "KILL_MARKER": str(tmp_path / "killed"),
           "KILL_ONCE_SAVED": str(tmp_path / "run" / "snapshots")}
    fit(TASKS + "kill_at_step", tmp_path / "run", env=env, max_restarts=1, **options)
    assert (tmp_path / "killed").exists()
    steps = [files.snapshot_step(path) for path in files.list_snapshots(tmp_path / "run" / "snapshots")]
    assert steps and all(step % 4 == 0 for step in steps), steps
    assert_same_weights(load_model(tmp_path / "run"), load_model(tmp_path / "whole"), exact=True)
    losses = [[r["train_loss"] for r in read_metrics(tmp_path / name) if r["kind"] == "epoch"]
              for name in ("run", "whole")]
    assert losses[0] == losses[1], losses  # the epochs' losses too: the snapshot holds the steps' before it
    # Another count of groups is another run (on 2 ranks only 2 are possible: 4 ranks as 4 groups,
    # where the global batch is kept): refused in one line, the snapshots untouched
    before = sorted(files.list_snapshots(tmp_path / "whole" / "snapshots"))
    with pytest.raises(ConfigError, match=r"^snapshot .* was taken with other settings \(replicas: 2 -> 4\)"):
        fit("regression", tmp_path / "whole", **{**options, "replicas": 4, "nproc": 4})
    assert sorted(files.list_snapshots(tmp_path / "whole" / "snapshots")) == before


def test_local_sgd_in_groups_of_two_with_accumulation_and_a_stream_killed_resumes_bitwise(tmp_path):
    """Where the features meet: 4 ranks as 2 groups of 2 (DDP inside), 2 micro-batches a step, a
    stream whose epochs end in a partial step (400 samples, 32 a step: 12.5 steps) and whose
    reading positions are in the snapshot, local SGD every 3 steps, rank 2 SIGKILLed in step 17."""
    options = {"nproc": 4, "sync": "local-sgd", "sync_every": 3, "grad_accum": 2, "save_every": 4, "max_epochs": 2,
               "batch_size": 4, **GROUPS, "lr": 0.05, "momentum": 0.9}
    fit("semi_sync_tasks:killed_stream", tmp_path / "whole", env={"STREAM_SAMPLES": "400"}, **options)
    env = {"STREAM_SAMPLES": "400", "KILL_RANK": "2", "KILL_STEP": "33", "KILL_MARKER": str(tmp_path / "killed"),
           "KILL_ONCE_SAVED": str(tmp_path / "run" / "snapshots")}  # (its 33rd micro-batch: step 17's first)
    fit("semi_sync_tasks:killed_stream", tmp_path / "run", env=env, max_restarts=1, **options)
    assert (tmp_path / "killed").exists()
    steps = [files.snapshot_step(path) for path in files.list_snapshots(tmp_path / "run" / "snapshots")]
    assert steps and all(step % 3 == 0 or step == 26 for step in steps), steps  # (26: the run's end)
    assert_same_weights(load_model(tmp_path / "run"), load_model(tmp_path / "whole"), exact=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="network namespaces and tc need root")
def test_the_slow_links_benchmark_runs_two_nodes_in_network_namespaces(tmp_path):
    """A smoke run of benchmarks/slow_links.py (not a timed test): two torchrun agents in two
    network namespaces, every-step DDP, local SGD and DiLoCo every 4 steps; the syncs send a
    fraction of DDP's bytes, and DiLoCo with a plain outer step is local SGD."""
    out = tmp_path / "figures.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "slow_links.py"), "--steps", "12", "--every",
                             "4", "--rates", "none", "--outer", "1.0:0", "--probe-s", "0.5", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    ddp, local, diloco = json.loads(out.read_text())
    assert [ddp["method"], local["method"], diloco["method"]] == ["every-step DDP", "local-sgd H=4",
                                                                 "diloco H=4 outer 1.0/0"]
    assert local["bytes_per_sample"] < ddp["bytes_per_sample"] / 2, (local, ddp)
    assert abs(diloco["eval_loss"] - local["eval_loss"]) < 1e-3 * local["eval_loss"]
    assert "| none (" in result.stdout and "samples/s" in result.stdout
