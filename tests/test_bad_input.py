"""Bad input: one line on stderr, exit status 2, no rank started, no traceback."""

import contextlib

import pytest

from ddptrain.cli import main

from conftest import clean_env, ddptrain


@pytest.mark.parametrize("args,words", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--batch-size", "abc"], "--batch-size needs a whole number"),
    (["--max-epochs", "-1"], "--max-epochs must be 0 or more"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--nproc", "many"], "--nproc must be a number or 'auto'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--task", "nosuchtask"], "unknown task"),
    (["--task", "ddptrain_test_tasks:nope"], "has no function 'nope'"),
    (["--task", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs CUDA"),
    (["--lr", "-0.1"], "--lr must be a finite number >= 0"),
    (["--lr", "nan"], "--lr must be a finite number >= 0"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--keep", "0"], "--keep must be at least 1"),
    (["--resume", "/no/such/snapshot.pt"], "no such snapshot file"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--comm-hook", "bf16", "--device", "cpu"], "--comm-hook bf16 needs the nccl backend"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
])
def test_bad_flag_is_one_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) if _is_argparse_error(words) else contextlib.nullcontext() as raised:
        code = main(["train", *args])
    code = raised.value.code if raised else code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err


def _is_argparse_error(words: str) -> bool:
    return any(w in words for w in ("unrecognized", "invalid choice", "needs a"))


def test_unwritable_run_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--run-dir", str(blocker / "run")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_real_command_exit_2_for_batch_larger_than_a_ranks_share(tmp_path):
    """Checked inside the ranks (it needs the data set): still one line and exit 2."""
    result = ddptrain("train", "--nproc", "2", "--batch-size", "2000", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["ddptrain: error: --batch-size 2000 is larger than a rank's share of the data "
                     "(2048 samples / 2 ranks = 1024); use --batch-size 1024 or less"], result.stderr
    assert not (tmp_path / "r" / "model.pt").exists()


def test_real_command_unknown_flag(tmp_path):
    result = ddptrain("train", "--max_epochs", "2", "--bogus", env=clean_env())
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ddptrain train: error: unrecognized arguments: --bogus (see ddptrain train --help)"]


def test_busy_master_port_is_one_line(monkeypatch, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        assert main(["train", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "Address already in use" in err and "unset MASTER_PORT" in err and len(err.splitlines()) == 1
