"""What a setting's role (roles.py) decides, derived for every setting at once: the math fingerprint
a snapshot holds and a resume must match, the changes a resume is refused for, and the run's
identity, which names its default run dir.

Nothing here names a setting: a new one is fingerprinted, compared and named by its role alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..run_dir import default_name
from .roles import NEVER, Role
from .sections import FIELDS, ROLES

if TYPE_CHECKING:
    from .run_config import RunConfig

# The math settings, and the role behind each key a fingerprint can hold (the batch size and
# torchft's replica groups share one: the global batch).
MATH: dict[str, Role] = {name: role for name, role in ROLES.items() if role.fingerprinted}
ROLE_OF_KEY: dict[str, Role] = {role.key or name: role for name, role in MATH.items()}


def math_fingerprint(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The settings a snapshot must share with the run that resumes it: every math setting in play
    under ``cfg`` (``unless``), as its role reads it, but those at their ``omitted_at``.
    ``world_size``: the data-parallel ranks (RunConfig.data_ranks: the world, or its --tp groups)."""
    values: dict[str, Any] = {}
    for name, role in MATH.items():
        if not role.in_play(cfg):
            continue
        value = role.value(cfg, world_size) if role.value is not None else getattr(cfg, name)
        if role.omitted_at is not NEVER and value == role.omitted_at:
            continue
        values[role.key or name] = value
    return values


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"name: saved -> current"`` for every math setting a resume would change. A key missing on
    one side is at its ``omitted_at`` there; missing from an older snapshot, a setting held only
    ``since`` a later version is not asked about; missing from ``current``, one out of play now is
    not compared (the setting that put it out of play is, and differs)."""
    changes = []
    for key in dict.fromkeys([*current, *saved]):
        role = ROLE_OF_KEY.get(key)
        omitted_at = NEVER if role is None else role.omitted_at
        if key in saved and key in current:
            before, after = saved[key], current[key]
        elif omitted_at is not NEVER:
            before, after = saved.get(key, omitted_at), current.get(key, omitted_at)
        elif key in current and not (role is not None and role.since):
            before, after = None, current[key]
        else:  # held only since a later version, out of play now, or a key this version does not know
            continue
        if before != after:
            changes.append(f"{key}: {before!r} -> {after!r}")
    return changes


def identity(cfg: RunConfig) -> dict[str, Any]:
    """The settings that say which run this is (``names_run``), those set to other than their
    default, so a setting a later version adds, left at its default, keeps every run's default run dir."""
    return {name: value for name, value in cfg.settings().items()
            if ROLES[name].names_run and value != FIELDS[name].default}


def default_run_dir(cfg: RunConfig) -> str:
    """``runs/TASK-HASH``: the same settings give the same folder, other settings another."""
    return default_name(cfg.task, identity(cfg))
