"""``RunConfig``: every section of the settings (sections.py) together, one frozen object.

The command line (cli.py), settings files (``--config FILE.toml`` or a run's own
``config.json``) and ``ddptrain.fit(**options)`` all become a ``RunConfig`` through
``parsing.from_options``, so a setting's name, type, default, help and role live in exactly one
place. A ``RunConfig`` never changes once made: later stages derive new ones with
``cfg.replace(...)`` (the task's defaults, a resumed run's batch size), and ``config.json``
records the values really used (flat: a setting's name is unique over the sections). What a
snapshot must share with the run resuming it, and what names a run's default folder, are
fingerprint.py's, derived from each setting's role.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import fingerprint, task_options
from .sections import (
    FIELDS,
    GLOBAL_DEFAULTS,
    SECTION_OF,
    SECTIONS,
    EvaluationSettings,
    LaunchSettings,
    ObservationSettings,
    OptimizerSettings,
    ParallelSettings,
    ResilienceSettings,
    SnapshotSettings,
    TrainingSettings,
)

BUILT = "built"  # config.json's key for what the run built (the optimizer, the schedule): not a setting

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
        object.__setattr__(self, "_options_read", set())  # the task options its factory read (task_option)
        object.__setattr__(self, "_options_resumable", set())  # those a resume may change

    def task_option(self, name: str, default: Any = None, *, resumable: bool = False) -> Any:
        """The task's own setting ``name`` (--task-opt NAME=VALUE) as ``default``'s type, or
        ``default`` when not given. A task factory reads its options this way: one given that no
        factory read is refused (tasks.build), so a misspelt option never passes silently. Each
        is part of the math a resume must keep, unless ``resumable`` (a data folder that moved,
        a figure only evaluations read): the task's word that changing it changes no weight."""
        self._options_read.add(name)
        if resumable:
            self._options_resumable.add(name)
        given = task_options.parse(self.task_opt)
        return task_options.typed(name, given[name], default) if name in given else default

    def task_options(self) -> dict[str, str]:
        """Every task option given, as text (all count as read: the factory takes them all)."""
        given = task_options.parse(self.task_opt)
        self._options_read.update(given)
        return given

    def task_options_read(self) -> list[str]:
        """The options' names the factory asked for, given or not."""
        return sorted(self._options_read)

    def task_options_resumable(self) -> list[str]:
        """The options the factory read as ``resumable``: a resume may change them."""
        return sorted(self._options_resumable)

    def task_options_unread(self) -> list[str]:
        """The options given that the factory did not read (tasks.build refuses them)."""
        return sorted(set(task_options.parse(self.task_opt)) - self._options_read)

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
        changed = RunConfig(**{kind.SECTION: getattr(self, kind.SECTION) for kind in SECTIONS}, **settings)
        changed._options_read.update(self._options_read)  # what the factory read, and how, carried along
        changed._options_resumable.update(self._options_resumable)
        return changed

    def with_task_defaults(self, defaults: Mapping[str, Any]) -> RunConfig:
        """Fill settings the user left unset with the task's choices, then the global ones."""
        unknown = set(defaults) - set(GLOBAL_DEFAULTS)
        if unknown:
            raise ConfigError(f"Task.defaults names unknown settings {sorted(unknown)}; "
                              f"allowed: {sorted(GLOBAL_DEFAULTS)}")
        filled = {k: (defaults.get(k, GLOBAL_DEFAULTS[k]) if getattr(self, k) is None
                      else getattr(self, k)) for k in GLOBAL_DEFAULTS}
        return self.replace(**filled)

    def global_batch(self, ranks: int) -> int:
        """Samples per optimizer step over every rank: batch x ``ranks`` (the data-parallel ones:
        ``data_ranks``) x accumulation (x replica groups under --fault-tolerance torchft, ``ranks``
        being one group's)."""
        return global_batch(self.training, ranks, self.resilience.replica_groups)

    def data_ranks(self, world_size: int) -> int:
        """The ranks the data is split over: the world, or its --tp groups (a group's ranks see the
        same samples). The global batch and the fingerprint count these."""
        return world_size // self.parallel.tp

    def with_run_dir(self) -> RunConfig:
        """This config with its run dir resolved: the given one, else ``default_run_dir``."""
        return self if self.run_dir else self.replace(run_dir=fingerprint.default_run_dir(self))

    def math_fingerprint(self, ranks: int) -> dict[str, Any]:
        """The settings a snapshot must share with the run that resumes it (fingerprint.py)."""
        return fingerprint.math_fingerprint(self, ranks)

    def identity(self) -> dict[str, Any]:
        """The settings that say which run this is (fingerprint.py): the default run dir is named after them."""
        return fingerprint.identity(self)

    def to_json(self) -> str:
        return json.dumps(self.settings(), indent=2, sort_keys=True)


def global_batch(training: TrainingSettings, world_size: int, replica_groups: int = 1) -> int:
    """Samples per optimizer step over every rank: batch x ranks x accumulation x torchft's replica groups."""
    return training.batch_size * world_size * training.grad_accum * replica_groups


def unset_settings(cfg: RunConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``cfg`` (as given, before the task's defaults) leaves at their defaults."""
    return tuple(name for name in names if getattr(cfg, name) == FIELDS[name].default)
