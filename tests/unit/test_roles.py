"""Every setting's role (settings/roles.py) holds, for every setting, with no list kept by hand:
a math setting changes the fingerprint and a resume refuses the change, in both directions; any
other leaves the fingerprint alone, and does not move what a probe of the math can see (the
optimizer's hyper-parameters, the rate at every step, the samples of every step); a setting that
names the run changes its default run dir, any other keeps it. Fingerprints written by 0.6 match."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from ddptrain.data.sampling import StepSampler
from ddptrain.errors import ConfigError
from ddptrain.optim import build_optimizer, build_schedule, run_steps
from ddptrain.settings import FIELDS, ROLES, RunConfig, flag, sections
from ddptrain.settings.checks import validate
from ddptrain.settings.fingerprint import default_run_dir, fingerprint_changes
from ddptrain.settings.parsing import field_type
from ddptrain.settings.roles import NEVER, Role, identity, operation, setting
from ddptrain.settings.roles import math as math_role
from ddptrain.settings.sections import Section
from ddptrain.snapshots import files

# A text setting has no value to derive: these are valid others (a new text setting without one
# fails test_every_setting_has_another_value, which names it).
TEXT_VALUES = {"task": "digits", "run_dir": "runs/elsewhere", "betas": "0.9,0.95", "nproc": "2",
               "lighthouse": "http://127.0.0.1:29510", "resume": "never", "keep_best": "eval_accuracy",
               "init_from": "runs/pretrained", "tracker": "csv", "task_opt": "n_layer=4"}


def other_value(name: str):
    """A value of setting ``name`` other than its default, from its type and choices: the first
    that the settings' checks accept (a fraction's 2 is refused, its 0.5 is not), else the first."""
    field, kind = FIELDS[name], field_type(name)
    if field.metadata["choices"]:
        return next(choice for choice in field.metadata["choices"] if choice != field.default)
    if kind is bool:
        return not field.default
    if kind is str:
        return TEXT_VALUES[name]
    if kind is int:
        candidates = [3, 1] if field.default is None else [field.default + 1, field.default + 2, 1]
    else:
        candidates = [0.5, 0.25] if field.default is None else [field.default * 2 or 0.5, field.default / 2, 0.5, 0.25]
    candidates = [value for value in candidates if value != field.default]
    for value in candidates:
        try:
            validate(RunConfig(**{name: value}))
        except ConfigError:
            continue
        return value
    return candidates[0]


def in_play(name: str) -> RunConfig:
    """The default settings, changed where setting ``name``'s role says it would not count."""
    unless = ROLES[name].unless
    if not unless:
        return RunConfig()
    first, values = next(iter(unless.items()))
    choices = [other_value(first), *(FIELDS[first].metadata["choices"] or ())]
    return RunConfig(**{first: next(value for value in choices if value not in values)})


MATH = [name for name, role in ROLES.items() if role.fingerprinted]
NOT_MATH = [name for name, role in ROLES.items() if not role.fingerprinted]


def test_every_setting_declares_a_role_and_has_another_value():
    assert all(isinstance(role, Role) for role in ROLES.values()) and set(ROLES) == set(FIELDS)
    for name in FIELDS:
        assert other_value(name) != FIELDS[name].default, name
    assert {"lr", "seed", "task", "max_epochs", "ema"} <= set(MATH) and {"strategy", "save_every"} <= set(NOT_MATH)


def test_a_setting_without_a_role_stops_the_settings_from_loading():
    with pytest.raises(TypeError, match="role"):
        setting("a setting", default=0)  # type: ignore[call-arg]  # (role is required)

    @dataclasses.dataclass(frozen=True)
    class Loose(Section):
        SECTION = "loose"
        decay_fraction: float = dataclasses.field(default=0.2, metadata={"help": "no role"})

    with pytest.raises(TypeError, match="decay_fraction declare no role"):
        sections.roles_of({**sections.FIELDS, "decay_fraction": dataclasses.fields(Loose)[0]})


@pytest.mark.parametrize("name", MATH)
def test_changing_a_math_setting_changes_the_fingerprint_and_a_resume_refuses_it_both_ways(name):
    base = in_play(name)
    changed = base.replace(**{name: other_value(name)})
    before, after = base.math_fingerprint(2), changed.math_fingerprint(2)
    assert before != after, f"{flag(name)} is declared math() but its change leaves the fingerprint alone"
    key = ROLES[name].key or name
    assert any(line.startswith(f"{key}:") for line in fingerprint_changes(before, after)), name
    assert any(line.startswith(f"{key}:") for line in fingerprint_changes(after, before)), name
    with pytest.raises(files.SnapshotError, match=f"taken with other settings .*{key}"):
        files.check_fingerprint(before, after, Path("s"))


@pytest.mark.parametrize("name", NOT_MATH)
def test_changing_any_other_setting_leaves_the_fingerprint_alone(name):
    base = RunConfig()
    changed = base.replace(**{name: other_value(name)})
    assert base.math_fingerprint(2) == changed.math_fingerprint(2), name


def math_probe(cfg: RunConfig, steps_per_epoch: int = 6) -> tuple:
    """What a run's math visibly depends on, without a process group: the optimizer's
    hyper-parameters, the learning rate at every step of the run (and a few past its end), and
    the samples of every step of two epochs on each of two ranks."""
    cfg = cfg.with_task_defaults({})
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    optimizer = build_optimizer(params, cfg.optim)
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    total = run_steps(cfg.training, steps_per_epoch)
    schedule = build_schedule(optimizer, cfg.optim, total)
    rates = []
    for _ in range(min(total or 40, 40) + 3):
        rates.append(optimizer.param_groups[0]["lr"])
        if schedule is not None:
            optimizer.step()
            schedule.step()
    samples = []
    for rank in range(2):
        sampler = StepSampler(45, 2, rank, cfg.batch_size, cfg.grad_accum, cfg.seed)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            samples.append([(m.indices.tolist(), m.samples) for m in sampler.micro_batches(sampler.order())])
    return repr(hyper), rates, samples


@pytest.mark.parametrize("name", NOT_MATH)
def test_no_other_setting_moves_the_math_a_probe_sees(name):
    """What catches a wrong role: a schedule's setting declared operation() changes the rate."""
    base = RunConfig(lr_schedule="cosine", warmup_steps=2, max_epochs=3, optimizer="adamw")
    assert math_probe(base) == math_probe(base.replace(**{name: other_value(name)})), (
        f"{flag(name)} is declared {ROLES[name].kind}() but changes the math: declare it math() in its section")


def test_the_probe_sees_a_schedule_setting():
    base = RunConfig(lr_schedule="cosine", warmup_steps=2, max_epochs=3)
    for name, value in (("min_lr", 1e-4), ("warmup_steps", 3), ("max_epochs", 4), ("seed", 1), ("betas", "0.8,0.9")):
        assert math_probe(base.replace(optimizer="adamw")) != math_probe(base.replace(optimizer="adamw",
                                                                                      **{name: value})), name


@pytest.mark.parametrize("name", list(FIELDS))
def test_a_setting_names_the_run_exactly_when_its_role_says(name):
    base = RunConfig()
    renamed = default_run_dir(base) != default_run_dir(base.replace(**{name: other_value(name)}))
    assert renamed == ROLES[name].names_run, name


def test_omitted_and_later_settings_are_not_asked_of_older_snapshots():
    for name, role in ROLES.items():
        if role.omitted_at is not NEVER:  # at that value: out of the fingerprint (older snapshots match)
            assert (role.key or name) not in in_play(name).replace(**{name: role.omitted_at}).math_fingerprint(2)
    later = [name for name, role in ROLES.items() if role.since]
    assert set(later) == {"ema", "ema_every", "keep_best", "replicas"}
    for name in later:  # a snapshot written before the setting was held: not asked about it
        current = in_play(name).replace(**{name: other_value(name)}).math_fingerprint(2)
        older = {k: v for k, v in current.items() if k != name}
        assert fingerprint_changes(older, current) == [], name


# Fingerprints as 0.6 wrote them into snapshots (computed by its config.py), with the settings that made them.
WRITTEN_BY_0_6 = [
    ({}, {"task": "regression", "seed": 0, "lr": None, "optimizer": None, "momentum": None, "weight_decay": None,
          "lr_schedule": "constant", "warmup_steps": 0, "grad_accum": 1, "precision": "fp32", "clip_grad": None,
          "global_batch": 64, "ema": 0.0, "ema_every": 1, "keep_best": ""}),
    ({"task": "digits", "optimizer": "adamw", "ema": 0.9, "keep_best": "eval_loss", "log_every": 5, "max_epochs": 2},
     {"task": "digits", "seed": 0, "lr": None, "optimizer": "adamw", "momentum": None, "weight_decay": None,
      "lr_schedule": "constant", "warmup_steps": 0, "grad_accum": 1, "precision": "fp32", "clip_grad": None,
      "global_batch": 64, "ema": 0.9, "ema_every": 1, "keep_best": "eval_loss:min"}),
    ({"lr": 0.01, "lr_schedule": "cosine", "warmup_steps": 5, "max_steps": 100, "grad_accum": 2, "min_lr": 0.001,
      "clip_grad": 1.0, "betas": "0.9,0.95"},
     {"task": "regression", "seed": 0, "lr": 0.01, "optimizer": None, "momentum": None, "weight_decay": None,
      "lr_schedule": "cosine", "warmup_steps": 5, "max_epochs": math.inf, "max_steps": 100, "grad_accum": 2,
      "precision": "fp32", "clip_grad": 1.0, "min_lr": 0.001, "betas": "0.9,0.95", "global_batch": 128, "ema": 0.0,
      "ema_every": 1, "keep_best": ""}),
    ({"sync": "diloco", "sync_every": 4, "replicas": 2, "outer_lr": 1.0, "outer_momentum": 0.5},
     {"task": "regression", "seed": 0, "lr": None, "optimizer": None, "momentum": None, "weight_decay": None,
      "lr_schedule": "constant", "warmup_steps": 0, "grad_accum": 1, "precision": "fp32", "clip_grad": None,
      "global_batch": 64, "sync": "diloco", "sync_every": 4, "replicas": 2, "outer_lr": 1.0, "outer_momentum": 0.5,
      "ema": 0.0, "ema_every": 1, "keep_best": ""}),
    ({"fault_tolerance": "torchft", "replica_groups": 3, "batch_size": 16},
     {"task": "regression", "seed": 0, "lr": None, "optimizer": None, "momentum": None, "weight_decay": None,
      "lr_schedule": "constant", "warmup_steps": 0, "grad_accum": 1, "precision": "fp32", "clip_grad": None,
      "global_batch": 96, "ema": 0.0, "ema_every": 1, "keep_best": ""}),
]


@pytest.mark.parametrize("given,written", WRITTEN_BY_0_6,
                         ids=["defaults", "ema-keep-best", "cosine", "diloco", "torchft"])
def test_a_snapshot_written_by_0_6_resumes_under_the_same_settings_and_no_other(given, written):
    cfg = RunConfig(**given)
    assert fingerprint_changes(written, cfg.math_fingerprint(2)) == []
    assert fingerprint_changes(written, cfg.replace(seed=7).math_fingerprint(2)) == ["seed: 0 -> 7"]
    assert {k: v for k, v in cfg.math_fingerprint(2).items()} == {
        k: v for k, v in written.items() if not (k == "ema_every" and not cfg.ema)}  # (off: out of play now)


def test_dropping_a_flag_left_out_at_its_default_is_refused():
    """--sync-batchnorm and --max-steps are left out of fingerprints at their defaults: dropping them
    on a resume was accepted before 0.7 (the check looked only at the current keys)."""
    taken = RunConfig(sync_batchnorm=True).math_fingerprint(2)
    assert fingerprint_changes(taken, RunConfig().math_fingerprint(2)) == ["sync_batchnorm: True -> False"]
    steps = RunConfig(lr_schedule="cosine", max_steps=100, max_epochs=3)
    assert "max_steps: 100 -> None" in fingerprint_changes(steps.math_fingerprint(2),
                                                           steps.replace(max_steps=None).math_fingerprint(2))


def test_role_helpers_say_what_they_declare():
    assert identity().names_run and not identity().fingerprinted
    assert not operation().names_run and not operation().fingerprinted
    role = math_role(unless={"sync": "every-step"})
    assert role.unless == {"sync": ("every-step",)} and role.fingerprinted and role.names_run
    assert not role.in_play(RunConfig()) and role.in_play(RunConfig(sync="local-sgd"))
