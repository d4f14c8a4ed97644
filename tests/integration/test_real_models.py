"""Models users bring: a Hugging Face GPT-2 with dict batches, and a CNN with BatchNorm fed by a
Dataset of dicts through DataLoader workers (examples/hf_causal_lm.py, examples/image_classifier.py)."""

import pytest
import torch

from ddptrain import RunConfig, TrainingFailed
from ddptrain.data import EvalBatches
from ddptrain.observe.evaluation import evaluate
from helpers.commands import assert_same_weights, fit, load_model, read_metrics
from helpers.ranks import run_on_ranks

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'ddptrain[hf]') is not installed")
import ddptrain_test_tasks  # noqa: E402 - imports examples/ (after transformers is known to be there)

TASKS = "ddptrain_test_tasks:"
GPT2 = {"max_epochs": 2, "batch_size": 16, "save_every": 4}


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpt2")
    fit(TASKS + "small_gpt2", run_dir, **GPT2)
    return run_dir


@pytest.mark.slow
def test_gpt2_with_dict_batches_learns_on_two_ranks(gpt2_run):
    records = read_metrics(gpt2_run)
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert records[-1]["eval_loss"] < records[0]["eval_loss"]
    assert records[-1]["eval_perplexity"] < 256  # a byte model guessing uniformly: 256


def _gpt2_eval(rank, world):
    torch.manual_seed(0)
    task = ddptrain_test_tasks.small_gpt2(RunConfig(task="gpt2"))
    batches = EvalBatches(task.eval_set, 16, rank, world, torch.device("cpu"), collate_fn=task.collate_fn)
    return evaluate(task.model, batches, task, rank=rank, world_size=world)


@pytest.mark.slow
def test_gpt2_evaluation_is_identical_on_1_2_and_3_ranks():
    single = _gpt2_eval(0, 1)
    assert set(single) == {"loss", "perplexity", "samples"} and single["samples"] == 206
    for world in (2, 3):
        assert all(result == single for result in run_on_ranks(world, _gpt2_eval))


@pytest.mark.slow
def test_gpt2_killed_mid_epoch_then_the_same_call_ends_bitwise_equal(gpt2_run, tmp_path):
    env = {"KILL_RANK": "1", "KILL_STEP": "6", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed, match="rank 1 was killed by SIGKILL"):
        fit(TASKS + "kill_small_gpt2", tmp_path / "run", env=env, **GPT2)
    fit(TASKS + "kill_small_gpt2", tmp_path / "run", env=env, **GPT2)  # dropout's RNG state resumes too
    assert_same_weights(load_model(tmp_path / "run"), load_model(gpt2_run), exact=True)


@pytest.mark.slow
def test_a_dataset_of_dicts_with_collate_fn_and_workers_resumes_bitwise(tmp_path):
    args = {"max_epochs": 2, "workers": 2, "save_every": 10}
    fit(TASKS + "cnn", tmp_path / "straight", **args)
    assert read_metrics(tmp_path / "straight")[-1]["eval_accuracy"] > 0.5
    env = {"KILL_RANK": "0", "KILL_STEP": "31", "KILL_MARKER": str(tmp_path / "killed")}
    with pytest.raises(TrainingFailed):
        fit(TASKS + "kill_cnn", tmp_path / "run", env=env, **args)
    fit(TASKS + "kill_cnn", tmp_path / "run", env=env, **args)
    assert_same_weights(load_model(tmp_path / "run"), load_model(tmp_path / "straight"), exact=True)


def _gpt2_lines_weights(run_dir, env=None, **options):
    fit(TASKS + "gpt2_lines", run_dir, env=env, max_epochs=1, optimizer="sgd", lr=0.1, save_seconds=0, **options)
    return load_model(run_dir)


@pytest.mark.slow
def test_a_token_averaged_loss_with_padding_is_exact_on_any_number_of_ranks(tmp_path):
    """Lines of different lengths, padded; step_fn returns (token loss sum, token count): 2 ranks
    x 4 lines, and 2 x 2 x accumulation 2 under FSDP, train as 1 x 8. The per-batch mean it
    replaces weighs short lines more: it is not."""
    one = _gpt2_lines_weights(tmp_path / "one", nproc=1, batch_size=8)
    assert_same_weights(_gpt2_lines_weights(tmp_path / "two", batch_size=4), one)
    sharded = _gpt2_lines_weights(tmp_path / "fsdp", batch_size=2, grad_accum=2, strategy="fsdp")
    assert_same_weights(sharded, one)  # gradients scaled as DTensors, counts over micro-batches
    means = {"MEAN_PER_BATCH": "1"}
    one_mean = _gpt2_lines_weights(tmp_path / "one_mean", means, nproc=1, batch_size=8)
    two_mean = _gpt2_lines_weights(tmp_path / "two_mean", means, batch_size=4)
    assert max((one_mean[k] - two_mean[k]).abs().max().item() for k in one_mean) > 1e-3
    records = read_metrics(tmp_path / "two")
    assert records[-1]["samples"] == 48 and records[-1]["eval_samples"] > 48  # eval divides by tokens


@pytest.mark.slow
def test_gpt2_on_a_token_file_written_by_the_example_script(tmp_path):
    """examples/write_tokens.py writes a byte-level token file; examples/hf_causal_lm.py
    --tokens trains GPT-2 on it by steps, as a user runs them."""
    from helpers.commands import BIN, REPO, assert_ok, run

    written = run([str(BIN / "python"), str(REPO / "examples" / "write_tokens.py"), "--out", str(tmp_path / "t.bin"),
                   "--repeat", "3"])
    assert_ok(written)
    assert written.stdout.startswith(f"{tmp_path / 't.bin'}: ") and (tmp_path / "t.bin").stat().st_size > 500_000
    trained = run([str(BIN / "python"), str(REPO / "examples" / "hf_causal_lm.py"), "--tokens", str(tmp_path / "t.bin"),
                   "--max_steps", "12", "--batch_size", "8", "--run_dir", str(tmp_path / "run")], timeout=300)
    assert_ok(trained)
    records = read_metrics(tmp_path / "run")
    assert records[-1]["step"] == 12 and records[-1]["partial"] and records[-1]["eval_loss"] < 5.5  # ln 256 = 5.55
