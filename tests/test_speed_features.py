"""The speed features change speed, not results: fast path, accumulation, precision, hooks, compile."""

import json

import pytest
import torch

from conftest import BIN, assert_ok, assert_same_weights, ddptrain, load_model, run

EPOCHS = ["--max-epochs", "2"]


def _losses(run_dir):
    return [json.loads(line)["train_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32")
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--run-dir", str(run_dir)))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_dataloader_path_gives_bitwise_the_fast_path_weights(tmp_path, fp32_run, workers):
    result = ddptrain("train", *EPOCHS, "--nproc", "2", "--task", "ddptrain_test_tasks:regression_via_dataloader",
                      "--workers", workers, "--run-dir", str(tmp_path))
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), load_model(fp32_run), exact=True)


@pytest.mark.slow
def test_grad_accumulation_equals_the_big_batch(tmp_path):
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--batch-size", "8", "--grad-accum", "4",
                       "--run-dir", str(tmp_path / "accum")))
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--batch-size", "32", "--run-dir", str(tmp_path / "big")))
    assert_same_weights(load_model(tmp_path / "accum"), load_model(tmp_path / "big"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_is_close_to_fp32(tmp_path, fp32_run, precision):
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--precision", precision, "--run-dir", str(tmp_path)))
    low, full = _losses(tmp_path), _losses(fp32_run)
    assert all(torch.isfinite(torch.tensor(low)))
    assert low == pytest.approx(full, rel=1e-2)
    assert low != full  # autocast really ran in lower precision


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_comm_hooks_train(tmp_path, fp32_run, hook):
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--comm-hook", hook, "--run-dir", str(tmp_path)))
    losses = _losses(tmp_path)
    assert losses[1] < losses[0]
    assert losses == pytest.approx(_losses(fp32_run), rel=2e-2)


@pytest.mark.slow
def test_clip_grad_static_graph_and_bucket_size_train(tmp_path):
    assert_ok(ddptrain("train", *EPOCHS, "--nproc", "2", "--clip-grad", "0.5", "--static-graph",
                       "--bucket-cap-mb", "1", "--run-dir", str(tmp_path)))
    losses = _losses(tmp_path)
    assert losses[1] < losses[0]


@pytest.mark.slow
def test_compile_trains_and_saves_plain_keys(tmp_path):
    assert_ok(ddptrain("train", "--max-epochs", "1", "--nproc", "2", "--compile", "--run-dir", str(tmp_path)))
    model = torch.nn.Linear(20, 1)
    model.load_state_dict(load_model(tmp_path))  # no "_orig_mod." prefixes


@pytest.mark.slow
def test_unused_parameters_error_names_the_flag_and_the_flag_works(tmp_path):
    task = ["--task", "ddptrain_test_tasks:unused_parameters", "--nproc", "2", "--max-epochs", "1"]
    failed = ddptrain("train", *task, "--run-dir", str(tmp_path / "a"))
    assert failed.returncode == 1 and "pass --find-unused-parameters" in failed.stderr
    assert_ok(ddptrain("train", *task, "--find-unused-parameters", "--run-dir", str(tmp_path / "b")))


@pytest.mark.slow
def test_bench_smoke_prints_the_table(tmp_path):
    """The benchmark's plumbing: its figures are not asserted, its table's shape is."""
    result = run([str(BIN / "ddptrain"), "bench", "--smoke", "--reps", "1", "--jobs", "tutorial", "--ranks", "1,2",
                  "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("job "))
    for column in ("samples/s (min-max)", "vs bare", "vs floor", "first step", "scaling"):
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 2:header + 8]]
    expected = [("tutorial", n, c) for n in "12" for c in ("floor", "bare", "ddptrain")]
    assert [(r[0], r[1], r[2]) for r in rows] == expected
    saved = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(saved) == 6 and all(r["samples_per_s"] > 0 and r["first_step_s"] > 0 for r in saved)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
