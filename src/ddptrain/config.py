"""The run's configuration: ``RunConfig``, the settings' sections (sections.py) together,
validated once (config_checks.py).

The command line (cli.py), settings files (``--config FILE.toml`` or a run's own
``config.json``) and ``ddptrain.fit(**options)`` all become a ``RunConfig`` through
``settings.from_options``, so a setting's name, type, default and help live in exactly one place.
A ``RunConfig`` never changes once made: later stages derive new ones with
``cfg.replace(...)`` (the task's defaults, a resumed run's batch size), and
``config.json`` records the values really used (flat: a setting's name is unique over the sections).
Here too: what a snapshot must share with the run resuming it (``math_fingerprint``) and what
names a run's default folder (``identity``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError  # also ddptrain.config.ConfigError
from .run_dir import default_name
from .sections import (  # noqa: F401 (the constants: also ddptrain.config's, as before the sections)
    ADAM_BETAS,
    ADAM_EPS,
    DEFAULT_EPOCHS,
    GLOBAL_DEFAULTS,
    LOG_EVERY,
    LOG_TIMES,
    OUTER_LR,
    OUTER_MOMENTUM,
    SECTIONS,
    SYNC_EVERY,
    TRACKERS,
    EvaluationSettings,
    LaunchSettings,
    ObservationSettings,
    OptimizerSettings,
    ParallelSettings,
    ResilienceSettings,
    SnapshotSettings,
    TrainingSettings,
    watched_metric,
)

BUILT = "built"  # config.json's key for what the run built (the optimizer, the schedule): not a setting

# Settings that change the math of a run: a snapshot taken under other values cannot be
# resumed as if nothing happened (snapshots/restore.py compares them).
MATH_FIELDS = ("task", "seed", "lr", "optimizer", "momentum", "weight_decay", "lr_schedule",
               "warmup_steps", "max_epochs", "max_steps", "global_batch", "grad_accum", "precision",
               "clip_grad", "sync_batchnorm", "min_lr", "betas", "eps")

# Settings in the math that fingerprints hold only where they differ from these values (their
# defaults): a snapshot written before they existed, or with them left alone, matches.
MATH_OMITTED_AT = {"min_lr": 0.0, "betas": ADAM_BETAS, "eps": ADAM_EPS}

# Settings a resume keeps too, though snapshots written before them do not hold them, so those
# are not asked about them: the average (--ema) and the figure best/ is judged by (--keep-best),
# which leave the math of the weights alone (not held before 0.5); --replicas under --sync, which
# is in the math but was not held until 2026-12-05.
KEPT_ON_RESUME = ("ema", "ema_every", "keep_best", "replicas")

# Settings that do not define *which* run this is: changing them keeps the default run dir,
# so the same command (or the same command with more epochs) finds its run again.
NOT_IDENTITY = ("run_dir", "resume", "max_epochs", "max_steps", "progress", "tensorboard", "tracker", "plot",
                "log_ranks", "timeout", "max_restarts", "keep", "save_every", "save_seconds", "mttf_hours",
                "eval_every", "eval_every_steps", "workers", "peak_tflops", "profile", "lean_cpu_memory", "keep_best",
                "early_stop", "early_stop_delta", "ema", "ema_every", "lighthouse", "log_every", "eval_batches",
                "final_eval")

# Every setting by its (flag's) name, section by section, and the section that holds it.
FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for s in SECTIONS for f in dataclasses.fields(s)}
SECTION_OF: dict[str, str] = {f.name: s.SECTION for s in SECTIONS for f in dataclasses.fields(s)}
# What a RunConfig reads through to its sections: every setting, and the sections' own resolutions
# (``cfg.epochs`` is ``cfg.training.epochs``), so a task factory reads ``cfg.seed`` as it always did.
_READ_THROUGH = {**{name: s.SECTION for s in SECTIONS for name in vars(s)
                    if not name.startswith("_") and name != "SECTION"}, **SECTION_OF}


@dataclass(frozen=True, init=False)
class RunConfig:
    """Every setting of a run, in its sections. Made from flat settings (``RunConfig(lr=0.1,
    save_every=100)``, as flags, settings files and ``fit(**options)`` give them) or from sections;
    each setting reads flat too (``cfg.lr`` is ``cfg.optim.lr``), which is how a task factory
    sees it. Components are handed their own section (``cfg.snapshots``), not this."""

    training: TrainingSettings
    optim: OptimizerSettings
    parallel: ParallelSettings
    launch: LaunchSettings
    resilience: ResilienceSettings
    snapshots: SnapshotSettings
    evaluation: EvaluationSettings
    observe: ObservationSettings

    def __init__(self, **given: Any) -> None:
        for kind in SECTIONS:
            section = given.pop(kind.SECTION, None) or kind()
            changes = {name: given.pop(name) for name in list(given) if SECTION_OF.get(name) == kind.SECTION}
            object.__setattr__(self, kind.SECTION, dataclasses.replace(section, **changes) if changes else section)
        if given:
            raise TypeError(f"RunConfig has no settings {sorted(given)}")

    def __getattr__(self, name: str) -> Any:  # only for names not found on the object itself
        section = _READ_THROUGH.get(name)
        if section is None:
            raise AttributeError(f"RunConfig has no setting {name!r}")
        return getattr(getattr(self, section), name)

    def settings(self) -> dict[str, Any]:
        """Every setting by its name, flat (config.json's form)."""
        return {name: getattr(getattr(self, section), name) for name, section in SECTION_OF.items()}

    def replace(self, **settings: Any) -> RunConfig:
        """This config with ``settings`` (flat names) changed: ``dataclasses.replace`` by setting."""
        return RunConfig(**{kind.SECTION: getattr(self, kind.SECTION) for kind in SECTIONS}, **settings)

    def with_task_defaults(self, defaults: Mapping[str, Any]) -> RunConfig:
        """Fill settings the user left unset with the task's choices, then the global ones."""
        unknown = set(defaults) - set(GLOBAL_DEFAULTS)
        if unknown:
            raise ConfigError(f"Task.defaults names unknown settings {sorted(unknown)}; "
                              f"allowed: {sorted(GLOBAL_DEFAULTS)}")
        filled = {k: (defaults.get(k, GLOBAL_DEFAULTS[k]) if getattr(self, k) is None
                      else getattr(self, k)) for k in GLOBAL_DEFAULTS}
        return self.replace(**filled)

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over every rank: batch x ranks x accumulation (x replica
        groups under --fault-tolerance torchft, ``world_size`` being one group's)."""
        return global_batch(self.training, world_size, self.resilience.replica_groups)

    def with_run_dir(self) -> RunConfig:
        """This config with its run dir resolved: the given one, else ``default_run_dir``."""
        return self if self.run_dir else self.replace(run_dir=default_run_dir(self))

    def math_fingerprint(self, world_size: int) -> dict[str, Any]:
        """The settings a snapshot must share with the run that resumes it."""
        values = {k: getattr(self, k) for k in MATH_FIELDS if k != "global_batch"}
        values["global_batch"] = self.global_batch(world_size)
        values["max_epochs"] = self.epochs  # as resolved: 0.3's snapshots hold 5, the default
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            del values["max_epochs"], values["max_steps"]  # a longer run only extends a constant schedule
        elif self.max_steps is None:
            del values["max_steps"]  # snapshots from before the setting existed match
        if not self.sync_batchnorm:
            del values["sync_batchnorm"]  # snapshots from before the setting existed match
        for name, default in MATH_OMITTED_AT.items():  # (the same: snapshots from before them match)
            if values[name] == default:
                del values[name]
        if self.sync != "every-step":  # (every-step: snapshots from before the setting existed match)
            every, outer_lr, outer_momentum = self.sync_settings
            # --replicas as given (None: one group per node, which follows the nodes on another world
            # size): another count of groups on the same ranks would load one group's inner optimizer
            # state into another's ranks, or none, and the meetings would average other weights
            values.update(sync=self.sync, sync_every=every, replicas=self.replicas,
                          **({"outer_lr": outer_lr, "outer_momentum": outer_momentum} if self.sync == "diloco" else {}))
        values.update(ema=self.ema, ema_every=self.ema_every if self.ema else 1,
                      keep_best=":".join(watched_metric(self.keep_best)) if self.keep_best.strip() else "")
        return values

    def identity(self) -> dict[str, Any]:
        """The settings that say which run this is (the default run dir is named after them):
        those set to other than their default, so a setting a later version adds, left at its
        default, keeps every run's default run dir."""
        return {name: value for name, value in self.settings().items()
                if name not in NOT_IDENTITY and value != FIELDS[name].default}

    def to_json(self) -> str:
        return json.dumps(self.settings(), indent=2, sort_keys=True)


def global_batch(training: TrainingSettings, world_size: int, replica_groups: int = 1) -> int:
    """Samples per optimizer step over every rank: batch x ranks x accumulation x torchft's replica groups."""
    return training.batch_size * world_size * training.grad_accum * replica_groups


# The built-in optimizer's settings (optim.build_optimizer): a task's make_optimizer replaces them.
OPTIMIZER_SETTINGS = ("optimizer", "momentum", "weight_decay", "betas", "eps")


def unset_settings(cfg: RunConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``cfg`` (as given, before the task's defaults) leaves at their defaults."""
    return tuple(name for name in names if getattr(cfg, name) == FIELDS[name].default)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Other trainers' names for our settings (nanoGPT's config keys, Lightning's and HF Trainer's
# arguments): an unknown flag spelled as there is answered with ours.
NAMES_ELSEWHERE = {
    "log_interval": "log_every", "logging_steps": "log_every", "log_every_n_steps": "log_every",
    "log_freq": "log_every", "eval_iters": "eval_batches", "limit_val_batches": "eval_batches",
    "eval_interval": "eval_every_steps", "eval_steps": "eval_every_steps", "val_check_interval": "eval_every_steps",
    "max_iters": "max_steps", "num_train_epochs": "max_epochs", "learning_rate": "lr",
    "warmup_iters": "warmup_steps", "lr_decay_iters": "max_steps", "decay_lr": "lr_schedule",
    "beta1": "betas", "beta2": "betas", "adam_beta1": "betas", "adam_beta2": "betas", "adam_epsilon": "eps",
    "grad_clip": "clip_grad", "max_grad_norm": "clip_grad", "gradient_clip_val": "clip_grad",
    "gradient_accumulation_steps": "grad_accum", "accumulate_grad_batches": "grad_accum",
    "per_device_train_batch_size": "batch_size", "out_dir": "run_dir", "output_dir": "run_dir",
    "dtype": "precision", "save_steps": "save_every", "lr_scheduler_type": "lr_schedule",
}


def nearest_flag(name: str) -> str | None:
    """The flag a mistyped or borrowed setting name most likely meant (``--log_interval`` ->
    ``--log-every``), or None when none is close."""
    import difflib

    key = name.strip().lstrip("-").replace("-", "_")
    if key in NAMES_ELSEWHERE:
        return flag(NAMES_ELSEWHERE[key])
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
    return flag(close[0]) if close else None


def default_run_dir(cfg: RunConfig) -> str:
    """``runs/TASK-HASH``: the same settings give the same folder, other settings another."""
    return default_name(cfg.task, cfg.identity())
