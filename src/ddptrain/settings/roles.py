"""What a setting is to a run, declared beside its field: its role. Everything that depends on it
is derived from these declarations (fingerprint.py), never from a list kept by hand.

Three roles, each a promise:

- ``math()``: the setting changes what the weights become. It is in the math fingerprint every
  snapshot holds, so a resume under another value is refused in one line (an exact resume is the
  first promise); and it names the run (its default run dir) unless ``names_run=False``.
- ``identity()``: the setting says which run this is (the default run dir is named after it) but
  leaves the math alone, so a resume may change it: the ranks' layout, the wrapping's options.
- ``operation()``: how the run is operated and watched (when it saves, evaluates and logs, where
  its files go, how long it waits): neither fingerprinted nor naming the run; a resume may change it.

A new setting takes one of the three in its ``setting(...)`` call (the argument is required), and
tests/unit/test_roles.py proves for every setting that its role holds: changing a math setting
changes the fingerprint and a resume refuses it, changing any other does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

NEVER = object()  # ``omitted_at``'s "never left out"


@dataclasses.dataclass(frozen=True)
class Role:
    """A setting's role (built by ``math``, ``identity`` or ``operation``)."""

    kind: str  # "math", "identity" or "operation"
    names_run: bool  # part of the run's identity: its default run dir's name
    # --- math only: how the setting enters the fingerprint
    key: str | None = None  # the fingerprint's key, when not the setting's own name
    value: Callable[[Any, int], Any] | None = None  # (cfg, world_size) -> the value held, when not the setting's
    unless: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)  # out of play where the run's
    omitted_at: Any = NEVER  # left out of fingerprints at this value: snapshots from before the setting match
    since: str | None = None  # the version whose snapshots first held it: older ones are not asked about it

    @property
    def fingerprinted(self) -> bool:
        return self.kind == "math"

    def in_play(self, cfg: Any) -> bool:
        """Whether the setting counts under ``cfg``'s other settings (``unless`` does not hold)."""
        return not self.unless or any(getattr(cfg, name) not in values for name, values in self.unless.items())


def math(*, names_run: bool = True, key: str | None = None, value: Callable[[Any, int], Any] | None = None,
         unless: Mapping[str, Any] | None = None, omitted_at: Any = NEVER, since: str | None = None) -> Role:
    """A setting that changes the math: fingerprinted, and a resume must keep it.

    ``names_run``: False for a setting that a continued run changes (its length) or that a later
    version added to the fingerprint without renaming runs that use it. ``key`` and ``value``: the
    fingerprint holds ``value(cfg, world_size)`` under ``key`` (the global batch for the batch
    size; a resolved default). ``unless``: {setting: value or values} under which it does not
    count (``--sync-every`` under ``--sync every-step``). ``omitted_at``: fingerprints leave it out
    at this value (its default), so a snapshot written before it existed matches it there, and
    only there. ``since``: snapshots written before this version do not hold it and are not asked
    about it (a setting that joined the fingerprint later, with no value older runs all had)."""
    cases = {name: values if isinstance(values, tuple) else (values,) for name, values in (unless or {}).items()}
    return Role("math", names_run, key, value, cases, omitted_at, since)


def identity() -> Role:
    """A setting that names the run but leaves the math alone: a resume may change it."""
    return Role("identity", names_run=True)


def operation() -> Role:
    """A setting of how the run is operated and watched: neither fingerprinted nor naming the run."""
    return Role("operation", names_run=False)


def setting(help: str, *, role: Role, choices: tuple[str, ...] | None = None, alias: str | None = None,
            many: bool = False, pairs: bool = False, task_default: Any = NEVER, **kw: Any) -> Any:
    """A setting: a dataclass field with what cli.py turns into a flag, and its ``role``.
    ``many``: a comma-separated list (a list in a settings file or a keyword argument).
    ``pairs``: NAME=VALUE pairs, comma-separated (a flag given again adds to them; a table in a
    settings file, a dict as a keyword argument); held as ``task_pairs.joined`` writes them.
    ``task_default``: a task may choose the default (``Task.defaults``); this is the one used when
    neither the user nor the task does."""
    meta = {"help": help, "choices": choices, "alias": alias, "many": many or pairs, "pairs": pairs, "role": role}
    if task_default is not NEVER:
        meta["task_default"] = task_default
    return dataclasses.field(metadata=meta, **kw)
