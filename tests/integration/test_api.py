"""ddptrain.fit: the command line's path from Python, in a script, under torchrun, in-process."""

import concurrent.futures
import logging
import os
import signal

import pytest

import ddptrain
from ddptrain import ConfigError
from ddptrain.launch.local import QUIETED_LOGGERS
from helpers.commands import BIN, REPO, assert_ok, assert_same_weights, clean_env, fit, load_model, run

EXAMPLES = REPO / "examples"


@pytest.mark.slow
def test_fit_from_a_script_under_torchrun_and_the_command_line_train_the_same_weights(tmp_path):
    """examples/tutorial_script.py: its factory lives in the script's __main__."""
    script = [str(EXAMPLES / "tutorial_script.py"), "--max_epochs", "2", "--batch_size", "16"]
    plain = run([str(BIN / "python"), *script, "--run_dir", str(tmp_path / "script")])
    assert_ok(plain)
    assert "final train loss" in plain.stdout
    torchrun = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", *script,
                    "--run_dir", str(tmp_path / "torchrun")])
    assert_ok(torchrun)
    assert torchrun.stdout.count("final train loss") == 1  # rank 0 gets the summary, rank 1 {}
    command = run([str(BIN / "ddptrain"), "train", "--task", "tutorial_script:load_train_objs", "--nproc", "2",
                   "--max-epochs", "2", "--batch-size", "16", "--run-dir", str(tmp_path / "cli")], cwd=EXAMPLES)
    assert_ok(command)
    reference = load_model(tmp_path / "cli")
    for name in ("script", "torchrun"):
        assert_same_weights(load_model(tmp_path / name), reference, exact=True)


def _factory(cfg):  # a factory defined where fit() is called
    return ddptrain.tasks.regression_task(cfg)


@pytest.mark.slow
def test_fit_in_process_returns_the_summary_and_leaves_the_process_as_it_was(tmp_path):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    levels = {name: logging.getLogger(name).level for name in QUIETED_LOGGERS}
    environ = dict(os.environ)
    summary = fit(_factory, tmp_path, max_epochs=2)
    assert dict(os.environ) == environ  # TORCHINDUCTOR_CACHE_DIR too (torch sets it on importing dynamo)
    assert summary["epochs"] == 2 and summary["steps"] == 64 and summary["train_loss"] > 0
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # Ctrl-C works as before
    assert {name: logging.getLogger(name).level for name in levels} == levels  # torch's logs as before
    # (the no_leaked_environment fixture fails the test if fit() left a variable behind)


@pytest.mark.slow
def test_settings_files_and_config_json_reproduce_a_run(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('task = "digits"\nmax-epochs = 2\nbatch-size = 16\nlr-schedule = "cosine"\n')
    fit("digits", tmp_path / "first", config=str(toml))
    fit("digits", tmp_path / "again", config=str(tmp_path / "first" / "config.json"), resume="never")
    assert_same_weights(load_model(tmp_path / "again"), load_model(tmp_path / "first"), exact=True)
    with pytest.raises(ConfigError, match="'max-epochs' needs a whole number"):
        toml.write_text('max-epochs = "two"\n')
        fit("digits", tmp_path / "bad", config=str(toml))


@pytest.mark.slow
def test_the_tutorial_scripts_run_twice_in_the_same_folder(tmp_path):
    """A learner runs the tutorial's scripts again: the second run starts afresh, it never
    blames storage (the first run's files are moved aside, named in one line)."""
    spawn = [str(BIN / "python"), str(EXAMPLES / "ddp_gpus.py"), "--max_epochs", "1", "--run_dir", "r1"]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(EXAMPLES / "ddp_gpus_torchrun.py"),
                "--max_epochs", "1", "--run_dir", "r2"]
    def twice(command: list[str]) -> tuple:
        return run(command, cwd=tmp_path), run(command, cwd=tmp_path)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # two folders, OS-picked ports
        results = list(pool.map(twice, (spawn, torchrun)))
    for first, second in results:
        for result in (first, second):
            assert_ok(result)
            assert "storage" not in result.stderr
        assert "moved the earlier run's files to" in second.stdout
    assert len(list(tmp_path.glob("r*/previous-*"))) == 2


@pytest.mark.slow
def test_the_launch_script_runs_under_torch_distributed_launch(tmp_path):
    from ddptrain import free_port

    result = run([str(BIN / "python"), "-m", "torch.distributed.launch", "--use-env", "--nproc-per-node=2",
                  f"--master-port={free_port()}", str(EXAMPLES / "ddp_gpus_torchrun.py"), "--max_epochs", "1",
                  "--run_dir", str(tmp_path)], env=clean_env())
    assert_ok(result)
    assert load_model(tmp_path)["weight"].shape == (1, 20)
