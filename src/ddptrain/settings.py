"""Where settings come from: flags, a settings file (``--config FILE.toml`` or a run's own
``config.json``) and ``ddptrain.fit(**options)`` all become a ``RunConfig`` (config.py) here,
each value converted to its field's type by ``coerce``, so every way of giving a setting
accepts and refuses the same values, with the same one-line errors.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from .config import BUILT, FIELDS, RunConfig, nearest_flag
from .errors import ConfigError


def field_type(name: str) -> type:
    """A field's value type, without the ``| None``."""
    hint = typing.get_type_hints(RunConfig)[name]
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


_KIND_NAMES = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def coerce(name: str, value: Any, where: str) -> Any:
    """``value`` as field ``name``'s type; ConfigError naming ``where`` (a flag, a key) if it is not one."""
    kind = field_type(name)
    optional = FIELDS[name].default is None
    if value is None and optional:
        return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is str and isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)  # nproc = 2 in a file means "2"
        if FIELDS[name].metadata["many"] and isinstance(value, (list, tuple)) and all(
                isinstance(v, str) for v in value):
            return ",".join(value)  # tracker = ["mlflow", "csv"]
        if isinstance(value, str) and kind in (int, float):
            return kind(value)
        raise ValueError
    except ValueError:
        raise ConfigError(f"{where} needs {_KIND_NAMES[kind]}, got {value!r}") from None


def setting_name(key: str) -> str:
    """A field's name from any spelling of it: ``--max-epochs``, ``max-epochs``, ``max_epochs``."""
    return key.removeprefix("--").replace("-", "_")


def from_options(options: Mapping[str, Any], where: str = "option") -> RunConfig:
    """A RunConfig from ``{field name or flag name: value}``; ConfigError for unknown names or bad values."""
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in options.items():
        name = setting_name(key)
        if name not in FIELDS:
            close = nearest_flag(name)
            hint = f" (did you mean {close}?)" if close else ""
            raise ConfigError(f"{where} {key!r} is not a ddptrain setting{hint}; "
                              "`ddptrain train --help` lists them")
        if name in spelled:
            raise ConfigError(f"{where} {spelled[name]!r} and {key!r} are the same setting; keep one of them")
        spelled[name] = key
        values[name] = coerce(name, value, f"{where} {key!r}")
    choices = {n: f.metadata["choices"] for n, f in FIELDS.items() if f.metadata["choices"]}
    for name, value in values.items():
        if name in choices and value is not None and value not in choices[name]:
            raise ConfigError(f"{where} {name!r} must be one of {', '.join(choices[name])}, got {value!r}")
    return RunConfig(**values)


def read_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a TOML file (keys are flag names) or a run's own config.json."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror}); give a TOML file "
                          "or a run's config.json") from None
    try:
        settings = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"--config {path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'} "
                          f"({str(error).splitlines()[0]})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"--config {path}: expected a table of settings")
    if path.suffix == ".json":  # a run's config.json: what it built is a record, not a setting
        settings.pop(BUILT, None)
    nested = [k for k, v in settings.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"--config {path}: [{nested[0]}] is a table; ddptrain settings are "
                          "top-level keys such as max-epochs = 5")
    return settings
