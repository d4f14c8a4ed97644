"""Settings: one frozen RunConfig from flags, files and keyword arguments (no process needed)."""

import dataclasses
import json

import pytest
import torch

from ddptrain import ConfigError, RunConfig
from ddptrain.api import prepare
from ddptrain.cli import build_parser, given_options
from ddptrain.settings import SECTIONS
from ddptrain.settings.fingerprint import default_run_dir
from ddptrain.tasks.protocol import check_loss, check_pair, split_loss


def test_a_config_never_changes_once_made():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 64  # type: ignore[misc]
    assert cfg.with_task_defaults({"lr": 0.1}).lr == 0.1 and cfg.lr is None


def test_flags_files_and_keywords_become_the_same_config(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('max-epochs = 7\nbatch_size = 16\nlr = 0.01\ntask = "digits"\nprogress = false\n')
    from_file, _ = prepare(None, {}, str(toml))
    from_flags, _ = prepare(None, given_options(build_parser().parse_args(
        ["train", "--max-epochs", "7", "--batch-size", "16", "--lr", "0.01", "--task", "digits", "--no-progress"])))
    from_keywords, _ = prepare("digits", {"max_epochs": 7, "batch_size": 16, "lr": 0.01, "progress": False})
    assert from_file == from_flags == from_keywords


def test_flags_override_the_file(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("max-epochs = 7\nseed = 3\n")
    args = build_parser().parse_args(["train", "--config", str(toml), "--max-epochs", "2"])
    cfg, _ = prepare(None, given_options(args), args.config)
    assert (cfg.max_epochs, cfg.seed) == (2, 3)


def test_a_runs_config_json_is_accepted_as_a_settings_file(tmp_path):
    cfg = RunConfig(task="digits", max_epochs=3, lr=0.002, optimizer="adamw", run_dir="runs/x")
    (tmp_path / "config.json").write_text(cfg.to_json())
    again, _ = prepare(None, {}, str(tmp_path / "config.json"))
    assert again == cfg


def test_default_run_dir_is_stable_for_the_same_settings_and_distinct_for_others():
    base = RunConfig(task="digits", lr=0.01)
    assert default_run_dir(base) == default_run_dir(RunConfig(task="digits", lr=0.01))
    assert default_run_dir(base).startswith("runs/digits-")
    assert default_run_dir(base) != default_run_dir(RunConfig(task="digits", lr=0.02))
    assert default_run_dir(base) != default_run_dir(RunConfig(task="digits", lr=0.01, seed=1))
    tuned = RunConfig(task="digits", lr=0.01, init_from="runs/pretrained")  # what it started from
    assert len({default_run_dir(c) for c in (base, tuned, RunConfig(task="digits", lr=0.01, init_from="b.pt"))}) == 3
    # more epochs, another timeout or resume mode: the same run, continued
    same = RunConfig(task="digits", lr=0.01, max_epochs=50, timeout=10, resume="never", progress=True)
    assert default_run_dir(same) == default_run_dir(base)
    assert default_run_dir(RunConfig(task="my_tasks:make")).startswith("runs/my_tasks.make-")


def test_config_json_records_every_setting():
    recorded = json.loads(RunConfig().to_json())
    assert set(recorded) == {f.name for section in SECTIONS for f in dataclasses.fields(section)}


@pytest.mark.parametrize("options,words", [
    ({"bogus": 1}, "'bogus' is not a ddptrain setting"),
    ({"max_epochs": "five"}, "'max_epochs' needs a whole number"),
    ({"lr": True}, "'lr' needs a number"),
    ({"strategy": "zero"}, "'strategy' must be one of ddp, fsdp"),
])
def test_bad_keyword_options_raise_config_error(options, words):
    with pytest.raises(ConfigError, match=words):
        prepare("regression", options)


@pytest.mark.parametrize("check,value,words", [
    (check_pair, {"x": 1}, r"loss_fn needs \(inputs, target\) batches, but a batch is a dict; .* step_fn"),
    (check_pair, (1, 2, 3), "a batch is a tuple of 3"),
    (lambda loss: check_loss(loss, "step_fn"), torch.ones(4), r"step_fn returned a tensor of shape \(4,\) and "
     "dtype float32, not a scalar"),
    (lambda loss: check_loss(loss, "loss_fn"), torch.tensor(3), r"shape \(\) and dtype int64, not a scalar floating"),
    (lambda loss: check_loss(loss, "step_fn"), 0.5, "returned a float, not a loss tensor"),
    (lambda loss: check_loss(loss, "step_fn"), torch.tensor(0.5), r"does not depend on any trainable parameter "
     r"\(detached"),
    (lambda value: split_loss(value, "step_fn", check=True), (torch.tensor(2.0, requires_grad=True), "n"),
     r"returned \(Tensor, str\); the pair form is \(loss_sum, count\)"),
])
def test_batches_and_losses_that_break_the_task_contract_are_named(check, value, words):
    with pytest.raises(ConfigError, match=words):
        check(value)
    check_pair((torch.ones(1), torch.ones(1)))
    check_loss(torch.tensor(0.5, requires_grad=True), "loss_fn")
    loss = torch.tensor(3.0, requires_grad=True)
    assert split_loss(loss, "step_fn", check=True) == (loss, None)
    assert split_loss((loss, 7), "step_fn", check=True) == (loss, 7)


def test_one_setting_spelled_twice_in_a_settings_file_is_refused(tmp_path):
    (tmp_path / "both.toml").write_text("max_epochs = 2\nmax-epochs = 3\n")
    with pytest.raises(ConfigError, match=r"'max_epochs' and 'max-epochs' are the same setting; keep one"):
        prepare("regression", {}, str(tmp_path / "both.toml"))
    (tmp_path / "one.toml").write_text("max-epochs = 3\n")
    assert prepare("regression", {"max_epochs": 4}, str(tmp_path / "one.toml"))[0].max_epochs == 4  # flags win


@pytest.mark.parametrize("given", ["csv,,mlflow", "csv,", " , "])
def test_an_empty_tracker_name_is_one_line(given):
    with pytest.raises(ConfigError, match=r"^--tracker .*: an empty tracker name; give names separated by single"):
        prepare("regression", {"tracker": given})


def test_torchft_replica_groups_share_the_data_and_count_in_the_global_batch():
    from ddptrain.comm import DistContext
    from ddptrain.resilience.replicas import data_context
    from ddptrain.settings.checks import validate

    cfg = RunConfig(fault_tolerance="torchft", replica_group=1, replica_groups=3, batch_size=4, grad_accum=2)
    validate(cfg)
    ctx = DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cpu"),
                      backend="gloo")
    data = data_context(cfg.resilience, ctx)
    assert (data.rank, data.world_size) == (3, 6)  # group 1's rank 1 of 3 groups of 2
    alone = data_context(RunConfig().resilience, ctx)
    assert (alone.rank, alone.world_size) == (1, 2)
    assert cfg.global_batch(2) == 4 * 2 * 2 * 3 and RunConfig(batch_size=4).global_batch(2) == 8
    assert default_run_dir(cfg) != default_run_dir(dataclasses.replace(cfg, replica_group=0))  # a folder per group
    for bad, message in ((dict(replica_groups=0), "--replica-groups must be at least 1"),
                         (dict(replica_group=-1), "--replica-group must be 0 to 2"),
                         (dict(fault_tolerance="none"), "--replica-group belongs to --fault-tolerance torchft"),
                         (dict(strategy="hsdp"), "works with --strategy ddp for now")):
        with pytest.raises(ConfigError, match=message):
            validate(dataclasses.replace(cfg, **bad))


def test_the_run_identity_holds_only_the_settings_given_so_new_settings_keep_old_run_dirs():
    assert RunConfig(task="digits", lr=0.01, max_epochs=3).identity() == {"task": "digits", "lr": 0.01}
    assert RunConfig().identity() == {} and RunConfig(seed=0).identity() == {}  # the default, given or not


def test_a_settings_file_may_hold_its_settings_in_their_sections(tmp_path):
    def settings(text):
        (tmp_path / "run.toml").write_text(text)
        return prepare(None, {}, str(tmp_path / "run.toml"))[0]

    cfg = settings('task = "digits"\n[optim]\nlr = 0.01\n[snapshots]\nsave-every = 100\n')
    assert cfg == RunConfig(task="digits", lr=0.01, save_every=100)
    assert (cfg.snapshots.save_every, cfg.optim.lr, cfg.save_every) == (100, 0.01, 100)
    assert default_run_dir(cfg) == default_run_dir(settings('task = "digits"\nlr = 0.01\nsave-every = 100\n'))
    for text, words in (("[snapshots]\nlr = 0.1\n", r"lr is a setting of \[optim\], not of \[snapshots\]"),
                        ("[bogus]\nlr = 0.1\n", r"\[bogus\] is not a section"),
                        ("lr = 0.1\n[optim]\nlr = 0.2\n", "lr is given twice"),
                        ("[optim]\nlearning_rate = 0.1\n", "did you mean --lr")):
        with pytest.raises(ConfigError, match=words):
            settings(text)


def test_a_config_reads_flat_and_by_section_and_never_changes():
    cfg = RunConfig(task="digits", lr=0.01, save_every=3, strategy="fsdp")
    assert (cfg.lr, cfg.optim.lr, cfg.save_every, cfg.parallel.strategy, cfg.epochs) == (0.01, 0.01, 3, "fsdp", 5)
    changed = dataclasses.replace(cfg, lr=0.5, keep=4)  # flat names, as before the sections
    assert (changed.optim.lr, changed.snapshots.keep, changed.snapshots.save_every, cfg.lr) == (0.5, 4, 3, 0.01)
    assert changed == cfg.replace(lr=0.5, keep=4) and changed.training is cfg.training  # untouched sections shared
    assert RunConfig(snapshots=cfg.snapshots).save_every == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(TypeError, match="bogus"):
        RunConfig(bogus=1)
    with pytest.raises(AttributeError, match="bogus"):
        cfg.bogus  # noqa: B018


def test_the_version_is_one_number_the_command_the_package_and_the_changelog_agree_on(capsys):
    import importlib.metadata
    import re

    import ddptrain
    from ddptrain.cli import main
    from helpers.commands import REPO

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"ddptrain {ddptrain.__version__}"
    assert importlib.metadata.version("ddptrain") == ddptrain.__version__  # pyproject.toml reads it
    newest = re.search(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None and newest.group(1) == ddptrain.__version__
