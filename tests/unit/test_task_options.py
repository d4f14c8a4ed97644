"""A task's own settings (--task-opt NAME=VALUE): the same setting from flags, a settings file's
[task-opt] table and fit's keyword; read by the factory typed as its default; one it never reads
refused; in the fingerprint, the run's name and config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain import Task
from ddptrain.cli import build_parser, given_options
from ddptrain.errors import ConfigError
from ddptrain.observe.report import config_json
from ddptrain.settings import RunConfig
from ddptrain.settings.fingerprint import default_run_dir, fingerprint_changes
from ddptrain.settings.parsing import from_options, read_run_config, read_settings_file
from ddptrain.snapshots.restore import Snapshot, resumed_config
from ddptrain.tasks import build

CANONICAL = "dropout=0.1,n_layer=4,tied=true"


def _flags(*args: str) -> RunConfig:
    return from_options(given_options(build_parser().parse_args(["train", *args])))


def test_the_options_given_as_flags_a_table_or_a_keyword_are_one_setting(tmp_path):
    assert _flags("--task-opt", "n_layer=4", "--task-opt", "tied=true,dropout=0.1").task_opt == CANONICAL
    (tmp_path / "run.toml").write_text('max-steps = 5\n[task-opt]\nn_layer = 4\ndropout = 0.1\ntied = true\n')
    assert from_options(read_settings_file(tmp_path / "run.toml")).task_opt == CANONICAL
    assert RunConfig(task_opt=CANONICAL) == from_options({"task_opt": {"tied": True, "n_layer": 4, "dropout": 0.1}})


@pytest.mark.parametrize("given,said", [
    (["--task-opt", "n_layer"], "'n_layer': give NAME=VALUE"),
    (["--task-opt", "n_layer=4", "--task-opt", "n_layer=6"], "n_layer is given twice ('4' and '6'); keep one"),
    (["--task-opt", "4=n_layer"], "'4=n_layer': give NAME=VALUE"),
])
def test_a_pair_that_is_not_one_is_refused_in_one_line(given, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", *given])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and said in err and "\n" not in err, err


def _factory(reads: dict):
    def factory(cfg) -> Task:
        reads.update({name: cfg.task_option(name, default) for name, default in
                      (("n_layer", 2), ("dropout", 0.0), ("tied", False), ("dataset", None))})
        return Task(model=torch.nn.Linear(2, 1), train_set=torch.utils.data.TensorDataset(torch.zeros(4, 2),
                                                                                            torch.zeros(4, 1)),
                    loss_fn=torch.nn.functional.mse_loss)
    return factory


def test_the_factory_reads_each_option_as_its_default_s_type():
    reads: dict = {}
    build(RunConfig(task_opt=CANONICAL + ",dataset=owt"), _factory(reads))
    assert reads == {"n_layer": 4, "dropout": 0.1, "tied": True, "dataset": "owt"}
    build(RunConfig(), _factory(reads))
    assert reads == {"n_layer": 2, "dropout": 0.0, "tied": False, "dataset": None}
    with pytest.raises(ConfigError, match=r"^--task-opt n_layer=four: the task reads n_layer as a whole number"):
        build(RunConfig(task_opt="n_layer=four"), _factory(reads))


def test_an_option_the_factory_never_reads_is_refused_with_the_nearest_it_reads():
    with pytest.raises(ConfigError) as refused:
        build(RunConfig(task="mine:task", task_opt="n_layr=4"), _factory({}))
    assert str(refused.value) == ("--task-opt n_layr: the task mine:task does not read this option (did you mean "
                                  "n_layer? it reads dataset, dropout, n_layer, tied); drop it or spell it as the "
                                  "task does")


def test_the_options_are_math_they_name_the_run_and_config_json_gives_them_back(tmp_path):
    four, six = RunConfig(task_opt="n_layer=4"), RunConfig(task_opt="n_layer=6")
    assert fingerprint_changes(four.math_fingerprint(2), six.math_fingerprint(2)) == \
        ["task_opt: 'n_layer=4' -> 'n_layer=6'"]
    assert "task_opt" not in RunConfig().math_fingerprint(2)  # older runs' fingerprints match where none is given
    assert len({default_run_dir(cfg) for cfg in (four, six, RunConfig())}) == 3
    # config.json: the options back, and a setting the task's own optimizer left unused (null) reads as unset
    (tmp_path / "config.json").write_text(config_json(six.settings(), {"optimizer": {}}, unused=("betas",)))
    assert json.loads((tmp_path / "config.json").read_text())["betas"] is None
    assert read_run_config(tmp_path) == six


def test_an_option_the_task_reads_as_resumable_may_change_on_resume_and_no_other():
    """cfg.task_option(NAME, DEFAULT, resumable=True): the task's word that it changes no weight
    (a data folder that moved); a resume compares the rest of the options, as before. What the
    factory read carries through the config's later changes (the task's defaults filled in)."""
    def snapshot(options: str) -> Snapshot:
        fingerprint = RunConfig(task_opt=options, lr=0.1).math_fingerprint(2)
        return Snapshot(Path("step-000000004.pt"), {"world_size": 2, "progress": {"global_step": 4},
                                                     "fingerprint": fingerprint})
    cfg = RunConfig(task_opt="data_dir=/mnt/new,n_layer=4")
    assert (cfg.task_option("data_dir", "", resumable=True), cfg.task_option("n_layer", 2)) == ("/mnt/new", 4)
    cfg = cfg.replace(lr=0.1)
    assert cfg.task_options_resumable() == ["data_dir"] and cfg.task_options_unread() == []
    assert resumed_config(snapshot("data_dir=/mnt/old,n_layer=4"), cfg, 2, print) == cfg
    assert resumed_config(snapshot("n_layer=4"), cfg, 2, print) == cfg  # (given now, not then)
    with pytest.raises(ConfigError, match=r"\(task_opt: 'n_layer=6' -> 'n_layer=4'\)"):
        resumed_config(snapshot("data_dir=/mnt/old,n_layer=6"), cfg, 2, print)
