"""A task's own settings (``--task-opt n_layer=4``, a settings file's ``[task-opt]`` table,
``fit(task_opt={"n_layer": 4})``): parsed into names and values, held as one canonical text (the
setting's value: config.json, the math fingerprint and the run's default name hold it), and read
by the task's factory with the type of its default (``RunConfig.task_option``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse(text: str, where: str = "--task-opt") -> dict[str, str]:
    """``"n_embd=128,n_layer=4"`` as ``{"n_embd": "128", "n_layer": "4"}``; one line for a pair
    that is not NAME=VALUE or a name given twice."""
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not name.isidentifier():
            raise ConfigError(f"{where} {item!r}: give NAME=VALUE, a name such as n_layer and its value (n_layer=4)")
        if name in pairs:
            raise ConfigError(f"{where}: {name} is given twice ({pairs[name]!r} and {value!r}); keep one")
        pairs[name] = value
    return pairs


def joined(pairs: Mapping[str, Any], where: str = "--task-opt") -> str:
    """The canonical text of ``pairs``: sorted by name, booleans as true/false."""
    def text(name: str, value: Any) -> str:
        shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if "," in shown or not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{where} {name}: give a number, true/false or text without commas, got {value!r}")
        return shown
    for name in pairs:
        if not str(name).isidentifier():
            raise ConfigError(f"{where} {name!r}: a task option's name is a Python name, such as n_layer")
    return ",".join(f"{name}={text(name, value)}" for name, value in sorted(pairs.items()))


def canonical(value: Any, where: str = "--task-opt") -> str:
    """A given value (text of NAME=VALUE pairs, a list of them, a table) as the canonical text."""
    if isinstance(value, Mapping):
        return joined(value, where)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} needs NAME=VALUE pairs (n_layer=4,n_embd=128), got {value!r}")
    return joined(parse(value, where), where)


def typed(name: str, text: str, default: Any) -> Any:
    """The option's text as its default's type (text as it is when the default is None or text)."""
    try:
        if isinstance(default, bool):
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            return text.lower() in TRUE
        if isinstance(default, (int, float)):
            return type(default)(text)
    except ValueError:
        kind = {bool: "true or false", int: "a whole number", float: "a number"}[type(default)]
        raise ConfigError(f"--task-opt {name}={text}: the task reads {name} as {kind} (its default is "
                          f"{default!r})") from None
    return text


def without_resumable(fingerprint: dict[str, Any], resumable: list[str]) -> dict[str, Any]:
    """A math fingerprint without the task options its factory read as resumable (a resume compares
    the rest): the key left out where none remains, as a fingerprint with no options has it."""
    if not resumable or "task_opt" not in fingerprint:
        return fingerprint
    kept = joined({name: value for name, value in parse(fingerprint["task_opt"]).items() if name not in resumable})
    rest = {key: value for key, value in fingerprint.items() if key != "task_opt"}
    return {**rest, "task_opt": kept} if kept else rest
