"""Where settings come from: flags, a settings file (``--config FILE.toml`` or a run's own
``config.json``) and ``ddptrain.fit(**options)`` all become a ``RunConfig`` (run_config.py) here,
each value converted to its field's type by ``coerce``, so every way of giving a setting
accepts and refuses the same values, with the same one-line errors.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from ..errors import ConfigError
from . import nanogpt_config, task_options
from .nanogpt_config import MODEL_KEYS
from .run_config import BUILT, RunConfig
from .sections import FIELDS, SECTION_OF, SECTIONS, flag

_SECTION_CLASSES = {kind.SECTION: kind for kind in SECTIONS}


def field_type(name: str) -> type:
    """A field's value type, without the ``| None``."""
    hint = typing.get_type_hints(_SECTION_CLASSES[SECTION_OF[name]])[name]
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


_KIND_NAMES = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def coerce(name: str, value: Any, where: str) -> Any:
    """``value`` as field ``name``'s type; ConfigError naming ``where`` (a flag, a key) if it is not one."""
    kind = field_type(name)
    optional = FIELDS[name].default is None
    if FIELDS[name].metadata["pairs"]:
        return task_options.canonical(value, where)
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
            said = hint_for(name)
            hint = f" ({said})" if said else ""
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


def read_run_config(run_dir: str | os.PathLike[str]) -> RunConfig:
    """The settings a run was made with, from its config.json (the task's options with them: a
    sampling script rebuilds the run's model from them)."""
    path = Path(run_dir) / "config.json"
    return from_options(read_settings_file(path), f"{path}:")


def read_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Settings from a TOML file (keys are flag names, at the top or in their section's table:
    ``[snapshots]`` then ``save-every = 100``), a run's own config.json, or a nanoGPT config file
    (``config/*.py``: nanogpt_config.py says how; what it leaves out is said on stderr)."""
    path = Path(path)
    if path.suffix == ".py":  # a nanoGPT config file: read as data, never run
        settings, notes = nanogpt_config.read(path)
        for note in notes:
            print(f"ddptrain: --config {path}: {note}", file=sys.stderr)
        return settings
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
        # null: a setting the run did not use (the optimizer's, where its task built its own), so
        # no value of it to give back (its default stands)
        settings = {key: value for key, value in settings.items()
                    if not (value is None and key in FIELDS and FIELDS[key].default is not None)}
    return _flattened(settings, f"--config {path}")


def _flattened(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """A settings file's keys at the top, its sections' tables opened: each key once, in its own section."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if not isinstance(value, dict) or FIELDS.get(setting_name(key), None) is FIELDS["task_opt"]:
            flat[key] = value  # (a [task-opt] table is the task's options, not a section)
            continue
        if key not in _SECTION_CLASSES:
            raise ConfigError(f"{where}: [{key}] is not a section of ddptrain's settings; the sections are "
                              f"{', '.join(_SECTION_CLASSES)} (or write its keys at the top, such as max-epochs = 5)")
        for name, inner in value.items():
            owner = SECTION_OF.get(setting_name(name))
            if owner is not None and owner != key:
                raise ConfigError(f"{where}: {name} is a setting of [{owner}], not of [{key}]; move it there")
            if name in flat:  # (other spellings of one setting: from_options names them)
                raise ConfigError(f"{where}: {name} is given twice, at the top and in [{key}]; keep one")
            flat[name] = inner  # (a name no section has: from_options names it, with its nearest)
    return flat


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
    "default_root_dir": "run_dir", "report_to": "tracker", "wandb_log": "tracker",
}

# Names other trainers use whose answer is not one flag (docs/from-nanogpt.md's and
# docs/from-other-trainers.md's tables: tests/unit/test_foreign_names.py reads every row).
ANSWERS_ELSEWHERE = {
    "always_save_checkpoint": "snapshots are always written: --save-seconds and --save-every say how often, "
                              "--keep-best eval_loss keeps the best evaluation's weights apart",
    "init_from": "run the same command again to resume its run; --init-from FOLDER|model.pt|FILE.safetensors "
                 "starts a new run from weights",
    "resume_from_checkpoint": "run the same command again: it resumes from its run dir's newest snapshot "
                              "(--run-dir)",
    "eval_only": "--max-epochs 0 evaluates the model and ends",
    "bf16": "--precision bf16", "fp16": "--precision fp16",
    "devices": "--nproc N ranks on this machine (or torchrun --nproc-per-node N)",
    "num_nodes": "start the ranks of several machines with torchrun --nnodes N or srun (docs/multinode.md)",
}


def hint_for(name: str) -> str | None:
    """What to say of a setting name ddptrain does not have: ``did you mean --log-every?`` for a
    mistyped or borrowed one, what to do where the answer is not one flag, or None."""
    key = name.strip().lstrip("-").replace("-", "_")
    if key in ANSWERS_ELSEWHERE:
        return ANSWERS_ELSEWHERE[key]
    if key in MODEL_KEYS:
        return (f"{key} is your model's or data's own: --task-opt {key}=VALUE, read by your task's factory as "
                f"cfg.task_option({key!r}, DEFAULT)")
    close = nearest_flag(name)
    return f"did you mean {close}?" if close else None


def nearest_flag(name: str) -> str | None:
    """The flag a mistyped or borrowed setting name most likely meant (``--log_interval`` ->
    ``--log-every``), or None when none is close."""
    import difflib

    key = name.strip().lstrip("-").replace("-", "_")
    if key in NAMES_ELSEWHERE:
        return flag(NAMES_ELSEWHERE[key])
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
    return flag(close[0]) if close else None
