"""The run's settings, one module per job:

- ``roles.py``: what a setting is to a run (math, identity, operation), declared beside its field;
- ``sections.py``: the settings by concern, each field with its help, type, default and role;
- ``run_config.py``: ``RunConfig``, every section together, frozen;
- ``fingerprint.py``: what the roles decide: the math fingerprint, a resume's refused changes,
  the run's identity and default run dir;
- ``parsing.py``: flags, settings files and keyword arguments into a ``RunConfig``, one conversion;
- ``checks.py``: the checks a ``RunConfig`` passes before anything starts (one line each).

Nothing here imports torch: ``ddptrain train``'s parser and checks run before it is imported.
"""

from __future__ import annotations

from .run_config import BUILT, RunConfig, global_batch, unset_settings
from .sections import (
    ADAM_BETAS,
    ADAM_EPS,
    DEFAULT_EPOCHS,
    FIELDS,
    GLOBAL_DEFAULTS,
    LOG_EVERY,
    LOG_TIMES,
    OPTIMIZER_SETTINGS,
    OUTER_LR,
    OUTER_MOMENTUM,
    ROLES,
    SECTION_OF,
    SECTIONS,
    SYNC_EVERY,
    TRACKERS,
    EvaluationSettings,
    LaunchSettings,
    ObservationSettings,
    OptimizerSettings,
    ParallelSettings,
    ResilienceSettings,
    Section,
    SnapshotSettings,
    TrainingSettings,
    flag,
    section_purpose,
    watched_metric,
)

__all__ = ["ADAM_BETAS", "ADAM_EPS", "BUILT", "DEFAULT_EPOCHS", "FIELDS", "GLOBAL_DEFAULTS", "LOG_EVERY", "LOG_TIMES",
           "OPTIMIZER_SETTINGS", "OUTER_LR", "OUTER_MOMENTUM", "ROLES", "SECTIONS", "SECTION_OF", "SYNC_EVERY",
           "TRACKERS", "EvaluationSettings", "LaunchSettings", "ObservationSettings", "OptimizerSettings",
           "ParallelSettings", "ResilienceSettings", "RunConfig", "Section", "SnapshotSettings", "TrainingSettings",
           "flag", "global_batch", "section_purpose", "unset_settings", "watched_metric"]
