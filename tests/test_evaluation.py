"""Evaluation is exact on any world size; the digits task learns; schedules follow their formula."""

import json
import math

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain.config import RunConfig
from ddptrain.metrics import evaluate
from ddptrain.optim import build_scheduler, lr_factor
from ddptrain.tasks.digits import accuracy, digits_task

from conftest import assert_ok, ddptrain
from ranks import run_on_ranks


def _digits_eval(rank, world, batch):
    torch.manual_seed(0)
    task = digits_task(RunConfig(task="digits"))
    return evaluate(task.model, task.eval_set, task.loss_fn, task.metrics, batch, torch.device("cpu"), rank, world)


def _odd_eval(rank, world):
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(37, 5, generator=generator), torch.randint(0, 3, (37,), generator=generator))
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    return evaluate(model, data, F.cross_entropy, {"accuracy": accuracy}, 4, torch.device("cpu"), rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_evaluation_equals_single_process_exactly(world):
    single = _digits_eval(0, 1, 16)
    assert single["samples"] == 359  # the digits test split: 359 does not divide by 2 or 3
    for result in run_on_ranks(world, _digits_eval, 16):
        assert result == single  # same n, same loss sum, same correct count: bit for bit
    odd_single = _odd_eval(0, 1)
    assert odd_single["samples"] == 37
    for result in run_on_ranks(world, _odd_eval):
        assert result == odd_single


def test_lr_follows_schedule_formula():
    total, warmup = 20, 5
    model = torch.nn.Linear(2, 1)
    for schedule, formula in [
        ("constant", lambda p: 1.0),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("linear", lambda p: 1 - p),
    ]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = build_scheduler(optimizer, RunConfig(lr_schedule=schedule, warmup_steps=warmup), total)
        for step in range(total):
            expected = 0.1 * ((step + 1) / warmup if step < warmup else formula((step - warmup) / (total - warmup)))
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected), (schedule, step)
            optimizer.step()
            scheduler.step()
    assert lr_factor("cosine", 0, 10)(10) == pytest.approx(0.0)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("digits")
    result = ddptrain("train", "--task", "digits", "--nproc", "2", "--max-epochs", "3",
                      "--lr-schedule", "cosine", "--warmup-steps", "5", "--tensorboard", "--run-dir", str(run_dir))
    assert_ok(result)
    return run_dir, result


@pytest.mark.slow
def test_digits_learns_far_past_chance(digits_run):
    run_dir, _ = digits_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3  # one line per epoch: only rank 0 writes
    assert records[-1]["eval_accuracy"] > 0.8  # chance is 0.1
    assert records[-1]["eval_samples"] == 359
    steps = records[-1]["step"]  # 3 epochs x 23 steps; cosine reaches 0 at the last step
    assert records[-1]["lr"] == pytest.approx(3e-3 * lr_factor("cosine", 5, steps)(steps))
    assert all({"lr", "epoch_time_s", "eval_loss", "eval_accuracy"} <= set(r) for r in records)


@pytest.mark.slow
def test_only_rank_0_reports(digits_run):
    run_dir, result = digits_run
    assert result.stdout.count("summary") == 1
    assert len([line for line in result.stdout.splitlines() if line.startswith("epoch ")]) == 3
    assert len(list((run_dir / "tensorboard").iterdir())) == 1


@pytest.mark.slow
def test_curves_png_is_a_real_picture(digits_run):
    import matplotlib.image

    run_dir, _ = digits_run
    png = run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 600 and height > 200


@pytest.mark.slow
def test_tensorboard_holds_the_scalars(digits_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = digits_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "eval_accuracy", "eval_loss", "lr", "samples_per_s"} <= tags
    accuracy_points = events.Scalars("eval_accuracy")
    assert [p.step for p in accuracy_points] == [23, 46, 69]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert accuracy_points[-1].value == pytest.approx(metrics[-1]["eval_accuracy"])


@pytest.mark.slow
def test_report_command_prints_summary_and_redraws(digits_run):
    run_dir, _ = digits_run
    (run_dir / "curves.png").unlink()
    result = ddptrain("report", str(run_dir))
    assert_ok(result)
    assert "eval_accuracy" in result.stdout and "epochs" in result.stdout
    assert (run_dir / "curves.png").exists()


@pytest.mark.slow
def test_zero_epochs_evaluates_the_initial_model(tmp_path):
    result = ddptrain("train", "--task", "digits", "--nproc", "2", "--max-epochs", "0", "--run-dir", str(tmp_path))
    assert_ok(result)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["kind"] == "eval" and record["eval_accuracy"] < 0.3
    assert (tmp_path / "model.pt").exists()


@pytest.mark.slow
def test_progress_bar_when_asked(tmp_path):
    result = ddptrain("train", "--nproc", "2", "--max-epochs", "1", "--progress", "--run-dir", str(tmp_path))
    assert_ok(result)
    assert "epoch 0:" in result.stderr and "/32 [" in result.stderr and "step/s" in result.stderr
