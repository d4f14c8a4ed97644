"""Data at scale: --max-steps, iterable training sets (shares, uneven ends, exact resume) and
token files larger than memory. Real ranks, real DataLoader workers, real SIGKILLs."""

import collections
import random
import re

import numpy as np
import pytest
import torch

from ddptrain import ConfigError, TrainingFailed
from ddptrain.tasks.regression import regression_data
from helpers.commands import assert_ok, assert_same_weights, clean_env, ddptrain_cli, fit, load_model, read_metrics

TASKS = "ddptrain_test_tasks:"


def _epochs(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "epoch"]


# --- --max-steps -------------------------------------------------------------------------------
@pytest.mark.slow
def test_max_steps_trains_exactly_that_many_steps_across_epochs_and_resumes_bitwise(tmp_path):
    """digits has 23 steps per epoch on 2 ranks x 32: --max-steps 50 ends inside epoch 2, whose
    record says so; evaluations every 20 steps too; killed at step 41 and run again, the weights
    are bitwise the uninterrupted run's; a later --max-steps 60 continues the finished run
    bitwise as if it had never stopped, its partial record replaced."""
    fit("regression", tmp_path / "tutorial", max_steps=50)  # 32 steps per epoch: exactly 50 steps
    assert [(r["step"], r.get("partial", False)) for r in _epochs(tmp_path / "tutorial")] == [(32, False), (50, True)]
    args = {"max_steps": 50, "save_every": 10, "eval_every_steps": 20}
    fit("digits", tmp_path / "whole", **args)
    records = read_metrics(tmp_path / "whole")
    assert [(r["kind"], r["epoch"], r["step"], r.get("partial", False)) for r in records] == [
        ("eval", 0, 20, False), ("epoch", 0, 23, False), ("eval", 1, 40, False), ("epoch", 1, 46, False),
        ("epoch", 2, 50, True)]
    assert records[1]["samples"] == records[3]["samples"] == 1797 - 359  # every training sample once
    assert records[-1]["samples"] == 4 * 64 and "eval_accuracy" in records[-1]  # 4 steps; the final evaluation

    env = {"KILL_RANK": "1", "KILL_STEP": "41", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_digits", tmp_path / "resumed", env=env, **args)
    fit(TASKS + "kill_digits", tmp_path / "resumed", env=env, **args)
    assert_same_weights(load_model(tmp_path / "resumed"), load_model(tmp_path / "whole"), exact=True)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [20, 23, 40, 46, 50]

    fit("digits", tmp_path / "whole", max_steps=60)  # the same run, longer
    fit("digits", tmp_path / "straight", max_steps=60)
    assert_same_weights(load_model(tmp_path / "whole"), load_model(tmp_path / "straight"), exact=True)
    assert [(r["step"], r.get("partial", False)) for r in _epochs(tmp_path / "whole")] == [
        (23, False), (46, False), (60, True)]


# --- iterable training sets --------------------------------------------------------------------
STREAM = {"max_steps": 60, "workers": 2, "batch_size": 8, "save_every": 5}


@pytest.fixture(scope="module")
def whole_stream(tmp_path_factory):
    """250 samples on 2 ranks x 2 workers (4 readers of 62-63), 60 steps: 3 epochs of 16 steps
    and 12 of a fourth, uninterrupted; every batch's sample ids recorded."""
    base = tmp_path_factory.mktemp("stream")
    (base / "ids").mkdir()
    fit(TASKS + "stream", base / "run", env={"RECORD_DIR": str(base / "ids")}, **STREAM)
    return base


@pytest.mark.slow
def test_a_stream_trains_every_sample_once_per_epoch_across_ranks_and_workers(whole_stream):
    read = [int(line) for path in (whole_stream / "ids").iterdir() for line in path.read_text().split()]
    epochs = _epochs(whole_stream / "run")
    assert [(r["step"], r["samples"], r.get("partial", False)) for r in epochs] == [
        (16, 250, False), (32, 250, False), (48, 250, False), (60, 12 * 16, True)]
    for epoch in range(3):  # each whole epoch: every sample exactly once, over both ranks' 4 readers
        counts = collections.Counter(i % 1_000_000 for i in read if i // 1_000_000 == epoch)
        assert sorted(counts) == list(range(250)) and set(counts.values()) == {1}, epoch
    # the fourth epoch, ended by --max-steps: its 12 steps' 192 samples, and what the workers read ahead
    assert 192 <= sum(1 for i in read if i // 1_000_000 == 3) <= 250


@pytest.mark.slow
def test_a_stream_killed_at_three_random_steps_resumes_bitwise(whole_stream, tmp_path):
    for step in random.Random(20).sample(range(3, 59), 3):
        env = {"KILL_RANK": str(step % 2), "KILL_STEP": str(step), "KILL_MARKER": str(tmp_path / f"killed-{step}")}
        with pytest.raises(TrainingFailed):
            fit(TASKS + "killable_stream", tmp_path / str(step), env=env, **STREAM)
        fit(TASKS + "killable_stream", tmp_path / str(step), env=env, **STREAM)
        assert_same_weights(load_model(tmp_path / str(step)), load_model(whole_stream / "run"), exact=True)


@pytest.mark.slow
def test_a_stream_without_state_resumes_by_reading_again_and_says_so(whole_stream, tmp_path, capfd):
    env = {"KILL_RANK": "0", "KILL_STEP": "27", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "killable_stateless_stream", tmp_path / "run", env=env, **STREAM)
    capfd.readouterr()
    fit(TASKS + "killable_stateless_stream", tmp_path / "run", env=env, **STREAM)
    assert_same_weights(load_model(tmp_path / "run"), load_model(whole_stream / "run"), exact=True)
    said = [line for line in capfd.readouterr().out.splitlines() if "no state_dict()" in line]
    assert len(said) == 1, said  # (the snapshot of step 25 or, if the kill beat its write, of step 20)
    assert re.fullmatch(r"the training stream has no state_dict\(\): reading epoch 1 again up to step (9|4) "
                        r"\(slower, still exact; docs/data.md\)", said[0]), said


@pytest.mark.slow
def test_a_stream_of_300_short_epochs_forks_its_workers_1200_times_and_ends(tmp_path):
    """Each epoch forks 2 DataLoader workers per rank. Forked the instant another thread of the
    rank entered Python (CPython 3.11.7, gh-112275), a worker deadlocked before it ran a line:
    unpaused, this job hung in most runs of 1000 steps (data/workers.settle_before_fork)."""
    fit(TASKS + "stream", tmp_path, env={"STREAM_SAMPLES": "32"}, max_steps=600, workers=2, batch_size=8,
        timeout=30)
    epochs = _epochs(tmp_path)
    assert len(epochs) == 300 and epochs[-1]["step"] == 600


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_uneven_shares_end_the_epoch_on_every_rank_at_the_same_step(tmp_path, strategy):
    """Shares of 100 and 130 samples, batch 10: rank 0 runs out after 10 steps and takes 3
    more with stand-ins; both end each epoch at step 13, every sample trained."""
    summary = fit(TASKS + "uneven_stream", tmp_path, batch_size=10, max_epochs=2, timeout=60, strategy=strategy)
    assert [(r["step"], r["samples"]) for r in _epochs(tmp_path)] == [(13, 230), (26, 230)]
    assert summary["steps"] == 26
    # Each step is the mean over the samples in it, the short ones (rank 1's alone) too: the
    # same steps by hand, in one process, give the same weights.
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = regression_data(0, 230).tensors
    steps = [[*range(10 * t, 10 * t + 10), *range(100 + 10 * t, 110 + 10 * t)] for t in range(10)]
    steps += [list(range(200 + 10 * t, 210 + 10 * t)) for t in range(3)]
    for _ in range(2):
        for samples in steps:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs[samples]), targets[samples]).backward()
            optimizer.step()
    assert_same_weights(load_model(tmp_path), model.state_dict())


@pytest.mark.slow
def test_a_stream_resumed_inside_an_epoch_on_another_world_size_is_one_line(whole_stream, tmp_path):
    fit(TASKS + "stream", tmp_path, **{**STREAM, "max_steps": 20})  # ends inside epoch 1
    with pytest.raises(ConfigError, match=r"^the snapshot stopped inside an epoch of an iterable training set "
                                          r"read by 2 rank\(s\) x --workers 2; this run has 1 x 2"):
        fit(TASKS + "stream", tmp_path, nproc=1, **{**STREAM, "max_steps": 40})


@pytest.mark.slow
def test_the_jsonl_example_reads_its_own_files_and_resumes_bitwise(tmp_path):
    """examples/stream_jsonl.py: 8 shards of 500 lines, 4 readers each reading 2 files
    (``set_shard``), the position a (file, byte offset) state; killed at step 83 of 100 (in
    epoch 0, past several snapshots) and run again: bitwise the uninterrupted run."""
    from ddptrain_test_tasks import write_jsonl_shards

    write_jsonl_shards(tmp_path / "shards")
    env = {"STREAM_JSONL_SHARDS": str(tmp_path / "shards"), "KILL_RANK": "1", "KILL_STEP": "83",
           "KILL_MARKER": str(tmp_path / "killed")}
    args = {"max_steps": 100, "workers": 2, "batch_size": 16, "save_every": 25}
    fit(TASKS + "jsonl_stream", tmp_path / "whole", env={"STREAM_JSONL_SHARDS": env["STREAM_JSONL_SHARDS"]}, **args)
    with pytest.raises(TrainingFailed):
        fit(TASKS + "killable_jsonl_stream", tmp_path / "resumed", env=env, **args)
    fit(TASKS + "killable_jsonl_stream", tmp_path / "resumed", env=env, **args)
    assert_same_weights(load_model(tmp_path / "resumed"), load_model(tmp_path / "whole"), exact=True)
    assert _epochs(tmp_path / "whole")[-1]["samples"] == 100 * 32  # inside epoch 0 of 4000 samples


# --- token files -------------------------------------------------------------------------------
def _token_file(path, megabytes):
    tokens = np.random.default_rng(0).integers(0, 256, size=megabytes * 2**19, dtype=np.uint16)
    tokens.tofile(path)
    return path


@pytest.mark.slow
def test_a_token_file_keeps_memory_flat_and_fit_equals_the_command(tmp_path):
    """10 MB and 100 MB of tokens: the ranks' peak RSS differs by less than 10%; on the same
    file ``ddptrain train`` and ``fit()`` train bitwise the same weights."""
    args = ["train", "--task", TASKS + "token_file_lm", "--max-steps", "20", "--batch-size", "8", "--nproc", "2"]
    peaks = {}
    for megabytes in (10, 100):
        tokens = _token_file(tmp_path / f"{megabytes}.bin", megabytes)
        run_dir = tmp_path / f"cli-{megabytes}"
        assert_ok(ddptrain_cli(*args, "--run-dir", str(run_dir), env=clean_env(TOKEN_FILE=str(tokens))))
        peaks[megabytes] = _epochs(run_dir)[-1]["memory_mb"]["peak_rss_mb"]["max"]
    assert abs(peaks[100] - peaks[10]) < 0.1 * peaks[10], peaks
    fit(TASKS + "token_file_lm", tmp_path / "fit-10", env={"TOKEN_FILE": str(tmp_path / "10.bin")}, max_steps=20,
        batch_size=8)
    assert_same_weights(load_model(tmp_path / "fit-10"), load_model(tmp_path / "cli-10"), exact=True)


SQUARES = {"batch_size": 8, "max_epochs": 3, "save_every": 5}


@pytest.mark.slow
@pytest.mark.parametrize("workers,stateless", [(0, False), (1, False), (2, False), (2, True)])
def test_a_share_that_ran_out_stays_out_after_a_stop_or_a_kill(tmp_path, workers, stateless):
    """Shares in proportion to (i+1)² (2 ranks; 4 readers of 40/160/360/640 with 2 workers, else 2
    of 240/960): rank 0's share runs out at step 25 (30) of 125 (120). Stopped by --max-steps 30
    (35) and continued, or rank 1 SIGKILLed at step 40, the run ends bitwise the uninterrupted
    one, and every epoch trains its 1,200 samples once (a finished share used to be read again);
    a stream without state the same."""
    ran_out = 25 if workers == 2 else 30
    data_env = {"STATELESS": "1"} if stateless else {}
    fit(TASKS + "square_shares", tmp_path / "whole", env=data_env, workers=workers, **SQUARES)
    whole = load_model(tmp_path / "whole")
    steps = 125 if workers == 2 else 120
    assert [(r["step"], r["samples"]) for r in _epochs(tmp_path / "whole")] == [
        (steps, 1200), (2 * steps, 1200), (3 * steps, 1200)]

    fit(TASKS + "square_shares", tmp_path / "stopped", env=data_env, workers=workers, max_steps=ran_out + 5,
        **SQUARES)
    fit(TASKS + "square_shares", tmp_path / "stopped", env=data_env, workers=workers, **SQUARES)
    assert_same_weights(load_model(tmp_path / "stopped"), whole, exact=True)
    assert [r["samples"] for r in _epochs(tmp_path / "stopped") if not r.get("partial")] == [1200] * 3

    env = {**data_env, "KILL_RANK": "1", "KILL_STEP": "40", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "killable_square_shares", tmp_path / "killed-run", env=env, workers=workers, **SQUARES)
    fit(TASKS + "killable_square_shares", tmp_path / "killed-run", env=env, workers=workers, **SQUARES)
    assert_same_weights(load_model(tmp_path / "killed-run"), whole, exact=True)
    assert [r["samples"] for r in _epochs(tmp_path / "killed-run")] == [1200] * 3
