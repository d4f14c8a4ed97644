"""Real 2-rank gloo runs: the files and the console of `ddptrain train`, and the math."""

import json

import pytest
import torch

from helpers.commands import assert_ok, assert_same_weights, ddptrain_cli, fit, load_model, read_metrics

TASKS = "ddptrain_test_tasks:"


@pytest.fixture(scope="module")
def tutorial_run(tmp_path_factory):
    """The tutorial's job through the real command, once, for several assertions."""
    run_dir = tmp_path_factory.mktemp("tutorial")
    result = ddptrain_cli("train", "--nproc", "2", "--max-epochs", "5", "--run-dir", str(run_dir), "--log-ranks")
    assert_ok(result)
    return run_dir, result


@pytest.mark.slow
def test_run_dir_holds_config_metrics_and_model(tutorial_run):
    run_dir, _ = tutorial_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["task"] == "regression" and config["batch_size"] == 32 and config["lr"] == 1e-3
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in records] == [32, 64, 96, 128, 160]  # 2048 / (2 x 32) per epoch
    assert all(r["samples_per_s"] > 0 for r in records)
    assert all({"data_s", "compute_s", "collective_s", "stragglers"} <= set(r) for r in records)
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(weights) == {"weight", "bias"}
    assert weights["weight"].shape == (1, 20) and weights["weight"].device.type == "cpu"
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == [  # the end's, and its ranks' parts
        "step-000000160.pt", "step-000000160.ranks"]


@pytest.mark.slow
def test_regression_loss_falls_every_epoch(tutorial_run):
    losses = [r["train_loss"] for r in read_metrics(tutorial_run[0])]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_console_shows_one_line_per_epoch_and_per_rank_lines(tutorial_run):
    _, result = tutorial_run
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epoch_lines) == 5 and "train_loss" in epoch_lines[0] and "samples/s" in epoch_lines[0]
    for rank in (0, 1):
        assert f"[CPU:{rank}] Epoch:0|Batchsize:32|Steps:32" in result.stdout
    assert result.stdout.count("summary") == 1  # rank 0 reports, the others do not


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    """DDP's averaged gradients: 2 ranks x batch 16 == 1 process x batch 32 over the same samples."""
    fit("regression", tmp_path / "2", nproc=2, batch_size=16, max_epochs=3, momentum=0.9)
    fit("regression", tmp_path / "1", nproc=1, batch_size=32, max_epochs=3, momentum=0.9)
    two, one = load_model(tmp_path / "2"), load_model(tmp_path / "1")
    assert_same_weights(two, one)
    assert not torch.equal(two["weight"], torch.nn.Linear(20, 1).weight)  # it trained


@pytest.mark.slow
def test_each_epoch_ranks_see_disjoint_covering_shards(tmp_path):
    """The samples each rank trained on, recorded inside the ranks' forward passes."""
    def record(name):
        out = tmp_path / name
        out.mkdir()
        fit(TASKS + "recording", out / "run", env={"RECORD_DIR": str(out), "RECORD_SAMPLES": "200"},
            batch_size=10, max_epochs=2)
        return [[json.loads(line) for line in (out / f"rank-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]

    ranks = record("first")
    for epoch in (0, 1):  # 10 steps of 10 samples per rank per epoch
        shards = [sum(batches[epoch * 10:(epoch + 1) * 10], []) for batches in ranks]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(200))
    epoch0, epoch1 = (sum(ranks[0][e * 10:(e + 1) * 10], []) for e in (0, 1))
    assert epoch0 != epoch1  # set_epoch reshuffled
    assert record("again") == ranks  # same seed, same order


def test_a_model_left_in_eval_mode_trains_in_train_mode_and_evaluates_in_eval_mode(tmp_path):
    """The tutorial's model.train(): from_pretrained returns a model in eval mode (no dropout)."""
    modes = tmp_path / "modes"
    fit(TASKS + "left_in_eval_mode", tmp_path / "run", env={"MODE_FILE": str(modes)}, nproc=1, max_epochs=1)
    steps = read_metrics(tmp_path / "run")[0]["step"]
    lines = modes.read_text().split()
    assert lines[:steps] == ["train"] * steps and set(lines[steps:]) == {"eval"}, lines


@pytest.mark.slow
def test_grad_accumulation_equals_the_big_batch(tmp_path):
    fit("regression", tmp_path / "accum", batch_size=8, grad_accum=4, max_epochs=2)
    fit("regression", tmp_path / "big", batch_size=32, max_epochs=2)
    assert_same_weights(load_model(tmp_path / "accum"), load_model(tmp_path / "big"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_path_gives_bitwise_the_fast_path_weights(tmp_path, workers):
    fit("regression", tmp_path / "fast", max_epochs=2)
    fit(TASKS + "regression_via_dataloader", tmp_path / "loader", max_epochs=2, workers=workers)
    assert_same_weights(load_model(tmp_path / "loader"), load_model(tmp_path / "fast"), exact=True)


UNEVEN = [  # (ranks, batch per rank, accumulation, strategy): each one global batch of 32
    (2, 16, 1, "ddp"), (2, 8, 2, "ddp"), (2, 8, 2, "fsdp"), (1, 16, 2, "ddp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("samples", [600, 601])
def test_data_that_does_not_divide_evenly_trains_as_one_large_batch(tmp_path, samples):
    """600 samples: the epoch's last global batch has 24; 601: the ranks' shares differ too
    (DistributedSampler would pad one with a duplicate). Every layout of a global batch of 32
    ends where one process with batch 32 ends, and each epoch counts every sample once."""
    env = {"UNEVEN_SAMPLES": str(samples)}
    common = {"max_epochs": 2, "save_seconds": 0}
    fit(TASKS + "uneven", tmp_path / "one", env=env, nproc=1, batch_size=32, **common)
    reference = load_model(tmp_path / "one")
    for nproc, batch, accum, strategy in UNEVEN:
        run_dir = tmp_path / f"{nproc}x{batch}x{accum}-{strategy}"
        fit(TASKS + "uneven", run_dir, env=env, nproc=nproc, batch_size=batch, grad_accum=accum,
            strategy=strategy, **common)
        assert_same_weights(load_model(run_dir), reference)
        assert [r["samples"] for r in read_metrics(run_dir)] == [samples, samples]
        assert [r["step"] for r in read_metrics(run_dir)] == [19, 38]  # ceil(samples / 32) steps per epoch
