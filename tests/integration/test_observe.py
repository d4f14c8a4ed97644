"""What observe/ reports: evaluation exact on any world size, schedules that follow their
formula, TensorBoard and curves from rank 0, the progress bar, the straggler report."""

import json
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddptrain import ConfigError, Task
from ddptrain.cli import main
from ddptrain.data import EvalBatches
from ddptrain.observe.evaluation import evaluate
from ddptrain.optim import build_scheduler, lr_factor
from ddptrain.settings import RunConfig
from ddptrain.tasks.digits import accuracy, digits_task
from helpers.commands import assert_same_weights, fit, load_model, read_metrics
from helpers.ranks import run_on_ranks

TASKS = "ddptrain_test_tasks:"


def _digits_eval(rank, world, batch, workers=0, fast_path=None):
    torch.manual_seed(0)
    task = digits_task(RunConfig(task="digits"))
    batches = EvalBatches(task.eval_set, batch, rank, world, torch.device("cpu"), workers, fast_path=fast_path)
    return evaluate(task.model, batches, task, rank=rank, world_size=world)


def _odd_eval(rank, world):
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(37, 5, generator=generator), torch.randint(0, 3, (37,), generator=generator))
    torch.manual_seed(0)
    task = Task(model=torch.nn.Linear(5, 3), train_set=data, loss_fn=F.cross_entropy, metrics={"accuracy": accuracy})
    batches = EvalBatches(data, 4, rank, world, torch.device("cpu"))
    return evaluate(task.model, batches, task, rank=rank, world_size=world)


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


@pytest.mark.slow
def test_evaluation_is_identical_through_the_fast_path_and_dataloader_workers_on_1_and_2_ranks():
    fast = _digits_eval(0, 1, 16, fast_path=True)
    assert _digits_eval(0, 1, 16, workers=2, fast_path=False) == fast
    for result in run_on_ranks(2, _digits_eval, 16, 2, False) + run_on_ranks(2, _digits_eval, 16, 0, True):
        assert result == fast


def test_lr_follows_schedule_formula():
    total, warmup = 20, 5
    model = torch.nn.Linear(2, 1)
    for schedule, formula in [
        ("constant", lambda p: 1.0),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("linear", lambda p: 1 - p),
    ]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = build_scheduler(optimizer, RunConfig(lr_schedule=schedule, warmup_steps=warmup).optim, total)
        for step in range(total):
            expected = 0.1 * ((step + 1) / warmup if step < warmup else formula((step - warmup) / (total - warmup)))
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected), (schedule, step)
            optimizer.step()
            scheduler.step()
    assert lr_factor("cosine", 0, 10)(10) == pytest.approx(0.0)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("digits")
    fit("digits", run_dir, env={"WANDB_MODE": "offline"}, max_epochs=3, lr_schedule="cosine", warmup_steps=5,
        tensorboard=True, tracker="csv,wandb", plot=True)
    return run_dir


@pytest.mark.slow
def test_digits_learns_far_past_chance(digits_run):
    run_dir = digits_run
    records = read_metrics(run_dir)
    assert len(records) == 3  # one line per epoch: only rank 0 writes
    assert records[-1]["eval_accuracy"] > 0.8  # chance is 0.1
    assert records[-1]["eval_samples"] == 359
    steps = records[-1]["step"]  # 3 epochs x 23 steps; cosine reaches 0 at the last step
    assert records[-1]["lr"] == pytest.approx(3e-3 * lr_factor("cosine", 5, steps)(steps))
    assert all({"lr", "epoch_time_s", "eval_loss", "eval_accuracy"} <= set(r) for r in records)


@pytest.mark.slow
def test_only_rank_0_writes_tensorboard(digits_run):
    assert len(list((digits_run / "tensorboard").iterdir())) == 1


@pytest.mark.slow
def test_curves_png_is_a_real_picture(digits_run):
    import matplotlib.image

    png = digits_run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 600 and height > 200


@pytest.mark.slow
def test_tensorboard_holds_the_scalars(digits_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = digits_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "eval_accuracy", "eval_loss", "lr", "samples_per_s"} <= tags
    accuracy_points = events.Scalars("eval_accuracy")
    assert [p.step for p in accuracy_points] == [23, 46, 69]
    assert accuracy_points[-1].value == pytest.approx(read_metrics(run_dir)[-1]["eval_accuracy"])


def _epochs(run_dir, *keys):
    return [tuple(r[k] for k in keys) for r in read_metrics(run_dir) if r["kind"] == "epoch"]


@pytest.mark.slow
def test_wandb_offline_run_holds_every_epoch(digits_run):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore  # wandb's own reader of its run files

    (run_file,) = (digits_run / "wandb").glob("offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    history = []
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    keys = ("step", "train_loss", "eval_accuracy", "lr")
    epochs = [h for h in history if "train_loss" in h]  # (the step records' are step/train_loss, ...)
    assert [(h["_step"], h["train_loss"], h["eval_accuracy"], h["lr"]) for h in epochs] == _epochs(digits_run, *keys)
    assert all("memory_mb/peak_rss_mb/max" in h and "samples_per_s" in h for h in epochs)
    steps = [h for h in history if "step/train_loss" in h]
    assert [h["_step"] for h in steps] == [10, 20, 30, 40, 50, 60] and all("step/lr" in h for h in steps)
    files = run_file.parent / "files"
    assert json.loads((files / "config.json").read_text()) == json.loads((digits_run / "config.json").read_text())


@pytest.mark.slow
def test_csv_has_a_row_per_epoch_and_a_column_per_metric(digits_run):
    import csv

    with open(digits_run / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(r["step"]), float(r["train_loss"]), float(r["eval_accuracy"])) for r in rows if r["train_loss"]] \
        == _epochs(digits_run, "step", "train_loss", "eval_accuracy")
    assert [int(r["step"]) for r in rows if r["step/train_loss"]] == [10, 20, 30, 40, 50, 60]
    assert {"data_s/max", "memory_mb/model_state_mb/max", "epoch_time_s"} <= set(rows[0])


@pytest.mark.slow
def test_report_command_prints_summary_and_redraws(digits_run, capsys):
    (digits_run / "curves.png").unlink()
    assert main(["report", str(digits_run)]) == 0
    out = capsys.readouterr().out
    assert "eval_accuracy" in out and "epochs" in out
    assert (digits_run / "curves.png").exists()
    assert f"export: ddptrain export {digits_run} --format safetensors --out {digits_run / 'model.safetensors'}" in out


@pytest.mark.slow
def test_zero_epochs_evaluates_the_initial_model(tmp_path, capfd):
    fit("digits", tmp_path, max_epochs=0)
    (record,) = read_metrics(tmp_path)
    assert record["kind"] == "eval" and record["eval_accuracy"] < 0.3 and record["epoch"] == 0
    assert "before training | step 0 | eval_loss" in capfd.readouterr().out
    assert (tmp_path / "model.pt").exists() and not (tmp_path / "snapshots").exists()


@pytest.mark.slow
def test_eval_at_start_evaluates_the_initial_weights_once_and_changes_no_weight(tmp_path, capfd):
    """--eval-at-start: a record before step 1 with --max-epochs 0's figures (the initial
    weights, the whole set), shown as "before training"; the weights trained after it equal a run's
    without it, bit for bit; a resumed run does not evaluate its start again."""
    fit("digits", tmp_path / "initial", max_epochs=0)
    (initial,) = read_metrics(tmp_path / "initial")
    fit("digits", tmp_path / "at-start", max_steps=3, eval_at_start=True, eval_every=0)
    first, *rest = read_metrics(tmp_path / "at-start")
    assert first["kind"] == "eval" and first["step"] == 0 and first["eval_loss"] == initial["eval_loss"]
    assert "before training | step 0 | eval_loss" in capfd.readouterr().out
    fit("digits", tmp_path / "plain", max_steps=3, eval_every=0)
    assert_same_weights(load_model(tmp_path / "at-start"), load_model(tmp_path / "plain"), exact=True)
    fit("digits", tmp_path / "at-start", max_steps=5, eval_at_start=True, eval_every=0)
    assert [r["step"] for r in read_metrics(tmp_path / "at-start") if r["kind"] == "eval"] == [0]
    with pytest.raises(ConfigError, match=r"^--eval-at-start: the task regression has no evaluation set"):
        fit("regression", tmp_path / "no-eval-set", max_steps=1, eval_at_start=True)


@pytest.mark.slow
def test_progress_bar_when_asked(tmp_path, capfd):
    assert main(["train", "--nproc", "2", "--max-epochs", "1", "--progress", "--run-dir", str(tmp_path)]) == 0
    err = capfd.readouterr().err
    assert "epoch 0:" in err and "/32 [" in err and "step/s" in err


def _single_process_eval_loss(run_dir) -> float:
    """What model.pt scores in this process, with nothing from ddptrain but the task."""
    import ddptrain_test_tasks

    task = ddptrain_test_tasks.batchnorm(RunConfig())
    task.model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    task.model.eval()
    inputs, targets = task.eval_set.tensors
    with torch.no_grad():
        return F.mse_loss(task.model(inputs), targets).item()


@pytest.mark.slow
def test_batchnorm_buffers_follow_rank_0_so_the_reported_evaluation_is_model_pts(tmp_path):
    """Each rank's running statistics see only its own batches; every rank evaluates, saves and
    snapshots rank 0's. Under DDP and FSDP alike, and an FSDP run stopped after epoch 1 and
    resumed to 3 ends bitwise where the uninterrupted run does, running statistics included."""
    options = {"batch_size": 16, "max_epochs": 3}
    for strategy in ("ddp", "fsdp"):
        fit(TASKS + "batchnorm", tmp_path / strategy, strategy=strategy, **options)
        reported = read_metrics(tmp_path / strategy)[-1]["eval_loss"]
        assert reported == pytest.approx(_single_process_eval_loss(tmp_path / strategy), rel=1e-6)
    ddp, fsdp = load_model(tmp_path / "ddp"), load_model(tmp_path / "fsdp")
    assert_same_weights(fsdp, ddp)
    fit(TASKS + "batchnorm", tmp_path / "resumed", strategy="fsdp", **{**options, "max_epochs": 1})
    fit(TASKS + "batchnorm", tmp_path / "resumed", strategy="fsdp", **options)
    assert_same_weights(load_model(tmp_path / "resumed"), fsdp, exact=True)


@pytest.mark.slow
def test_a_slow_rank_is_named_in_the_straggler_report(tmp_path, capfd):
    summary = fit(TASKS + "slow_data", tmp_path, env={"SLOW_RANK": "1", "SLOW_SECONDS": "0.003"}, max_epochs=1,
                  workers=0)
    (record,) = read_metrics(tmp_path)
    assert record["data_s"]["slowest_rank"] == 1 and record["data_s"]["max"] > 2
    assert record["collective_s"]["slowest_rank"] == 0  # rank 0 waited for rank 1
    assert set(record["stragglers"]) == {"1"} and record["stragglers"]["1"] >= 1.5
    assert summary["stragglers"].startswith("rank 1 (1/1 epochs")
    assert "stragglers" in capfd.readouterr().out
    # goodput counts rank 0's wait for rank 1 (at least its extra data time) as waiting, not as steps
    from ddptrain.observe.goodput import PARTS, account, read_timeline

    found = account(read_timeline(tmp_path))
    assert record["straggler_wait_s"] >= record["data_s"]["max"] - record["data_s"]["min"] - 0.5
    assert found["waiting_s"] >= record["straggler_wait_s"] > 1, (found, record)
    assert sum(found[f"{name}_s"] for name in PARTS) == pytest.approx(found["wall_s"], rel=0.01)


@pytest.mark.slow
def test_throughput_is_reported_in_tokens_tflops_and_mfu_and_profile_writes_a_trace_of_3_steps(tmp_path, capfd):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, size=200_000, dtype=np.uint16).tofile(tokens)
    summary = fit(TASKS + "token_file_lm", tmp_path / "run", env={"TOKEN_FILE": str(tokens)}, max_steps=12,
                  batch_size=8, profile=3, peak_tflops=0.5)
    (record,) = read_metrics(tmp_path / "run")
    assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 64, rel=0.01)
    assert record["tflops"] > 0 and record["mfu"] == pytest.approx(record["tflops"] / (0.5 * 2), abs=1e-4)
    assert summary["tokens_per_s"] == record["tokens_per_s"]
    for rank in (0, 1):
        trace = json.loads((tmp_path / "run" / "profile" / f"rank-{rank}.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert len(steps) == 3, steps
    out, err = capfd.readouterr()
    assert "USDT" not in out + err and "Warning" not in out + err, err  # the profiler keeps the console clean


def _tally_an_epoch(rank, world):
    """Rank r's parts of 4 steps' losses are (r + 1) x [1, skipped, 3, 5]; then rank 1's weight
    goes bad."""
    import time

    from ddptrain.comm import DistContext, local_tensors
    from ddptrain.errors import NonFiniteError
    from ddptrain.observe.metrics import EpochLosses, GradNorms, RankTimings
    from ddptrain.observe.step_records import StepRecords, StepWindow
    from ddptrain.observe.throughput import FlopCount, TrainingClock
    from ddptrain.progress import Progress
    from ddptrain.resilience.guard import NonFiniteGuard
    from ddptrain.tally import EpochTally

    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), "gloo")
    model = torch.nn.Linear(3, 1)
    params = list(model.parameters())
    progress = Progress(steps_per_epoch=4)
    optimizer, clock = torch.optim.SGD(params, lr=0.5), TrainingClock()
    records = StepRecords(StepWindow(ctx.device, 0), ctx, progress, clock, FlopCount(), optimizer,
                          tokens_per_sample=None, peak_tflops=None, write=lambda record: None)
    tally = EpochTally(
        ctx=ctx, progress=progress, losses=EpochLosses(ctx.device, 4, carries=rank == 0),
        grad_norms=GradNorms(ctx.device, 4, local_tensors, carries=rank == 0), timings=RankTimings(params),
        flops=FlopCount(), guard=NonFiniteGuard(1), params=params,
        optimizer=optimizer, average=None, newest_snapshot=lambda: "snapshots/step_00000003.pt",
        tokens_per_sample=None, peak_tflops=None, records=records, clock=clock)
    since = tally.epoch_began()
    for part in (1.0, None, 3.0, 5.0):
        progress.step_done(8)
        tally.step_done(None if part is None else torch.tensor(part * (rank + 1)))
    records = [tally.epoch_record(0, since, samples=32, samples_skipped=0)]
    tally.next_epoch()
    progress.step_done(8)
    tally.step_done(torch.tensor(1.0))
    since = (time.perf_counter(), tally.clock.now(), 4, 0)
    records.append(tally.epoch_record(1, since, samples=8, partial="--max-steps"))
    with torch.no_grad():
        params[0][0, 0] = math.nan if rank == 1 else params[0][0, 0]
    try:
        tally.reduce()
    except NonFiniteError as error:
        return records, str(error)
    return records, None


def test_an_epochs_tally_sums_every_ranks_loss_once_and_stops_at_a_bad_weight_on_any_rank():
    """tally.py on 2 gloo ranks: the record's loss is the mean over the steps taken of the ranks'
    summed parts, the skipped step is named, first_step_at comes once, and a non-finite weight
    on one rank stops every rank, naming the snapshot to go back to."""
    for rank, (records, error) in enumerate(run_on_ranks(2, _tally_an_epoch)):
        first, second = records
        assert first["train_loss"] == pytest.approx((1 + 3 + 5) * (1 + 2) / 3)  # 3 steps taken of 4
        assert first["skipped_steps"] == [2] and first["samples"] == 32 and first["samples_skipped"] == 0
        assert first["kind"] == "epoch" and first["step"] == 4 and first["lr"] == 0.5
        assert "first_step_at" in first and "first_step_at" not in second
        assert second["epoch"] == 1 and second["step"] == 5 and second["partial"] is True
        assert second["ended_by"] == "--max-steps" and second["train_loss"] == pytest.approx(1 + 1)
        assert "skipped_steps" not in second  # epoch 0's skip stays epoch 0's
        assert error is not None and "weights stopped being finite before step 5" in error, rank
        assert "snapshots/step_00000003.pt" in error
