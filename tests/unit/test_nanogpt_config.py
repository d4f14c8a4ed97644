"""nanoGPT's own config files (tests/data/nanogpt, as they are in karpathy/nanoGPT) as
``--config FILE.py``: read, never run; training keys to flags, model keys to task options, and a
line for each key left out."""

from __future__ import annotations

from pathlib import Path

from ddptrain.api import prepare
from ddptrain.settings.parsing import from_options, read_settings_file

CONFIGS = Path(__file__).parents[1] / "data" / "nanogpt"


def test_train_shakespeare_char_becomes_flags_and_task_options(capsys):
    settings = read_settings_file(CONFIGS / "train_shakespeare_char.py")
    assert settings == {
        "run_dir": "out-shakespeare-char", "eval_every_steps": 250, "eval_batches": 200, "log_every": 10,
        "batch_size": 64, "lr": 1e-3, "warmup_steps": 100, "min_lr": 1e-4, "grad_accum": 1,
        "max_steps": 5001,  # nanoGPT steps at iterations 0 to max_iters
        "betas": "0.9,0.99", "lr_schedule": "cosine", "eval_at_start": True, "eval_every": 0,
        "task_opt": {"dataset": "shakespeare_char", "block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384,
                     "dropout": 0.2}}
    cfg = from_options(settings)
    assert cfg.task_opt == "block_size=256,dataset=shakespeare_char,dropout=0.2,n_embd=384,n_head=6,n_layer=6"
    said = capsys.readouterr().err.splitlines()
    where = f"ddptrain: --config {CONFIGS / 'train_shakespeare_char.py'}: "
    assert said[0] == (where + "keys this file leaves out take ddptrain's defaults, not nanoGPT train.py's "
                       "(weight_decay 0.1, grad_clip 1.0, decay_lr True there); give them as flags (docs/flags.md) "
                       "where they matter")
    assert [line.removeprefix(where).split(":")[0] for line in said[1:]] == \
        ["always_save_checkpoint", "wandb_project", "wandb_run_name"]


def test_a_statement_that_is_not_a_literal_is_named_and_never_run(tmp_path, capsys):
    """finetune_shakespeare.py imports time and computes wandb_run_name: both skipped, said; train_gpt2.py's
    ``5 * 8`` is arithmetic of literals, taken; a call in a file of one's own is never made."""
    settings = read_settings_file(CONFIGS / "finetune_shakespeare.py")
    assert (settings["lr_schedule"], settings["max_steps"], settings["grad_accum"]) == ("constant", 21, 32)
    err = capsys.readouterr().err
    assert "line 1: skipped (import time): the file is read, never run" in err
    assert "line 8: wandb_run_name skipped: 'ft-' + str(time.time()) is not a literal" in err
    assert "init_from 'gpt2-xl': the same command resumes its run; --init-from FOLDER" in err
    assert read_settings_file(CONFIGS / "train_gpt2.py")["grad_accum"] == 40
    touched = tmp_path / "touched"
    (tmp_path / "mine.py").write_text(f"open({str(touched)!r}, 'w')\nbatch_size = len('abc')\nmax_iters = 9\n")
    assert read_settings_file(tmp_path / "mine.py")["max_steps"] == 10 and not touched.exists()
    assert "batch_size skipped: len('abc') is not a literal" in capsys.readouterr().err


def test_a_nanogpt_config_is_a_settings_file_like_any_other():
    """Through what `ddptrain train --config` and fit(config=...) call; a flag beside it wins."""
    cfg, _ = prepare("regression", {"lr": 0.01}, str(CONFIGS / "train_shakespeare_char.py"))
    assert (cfg.lr, cfg.max_steps, cfg.betas, cfg.eval_at_start) == (0.01, 5001, "0.9,0.99", True)
