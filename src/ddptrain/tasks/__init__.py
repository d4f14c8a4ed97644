"""Tasks: what to train. A task factory takes the resolved RunConfig and returns a Task.

Built-ins are ``regression`` (the tutorial's job) and ``digits`` (a real data set);
``--task MODULE:FUNC`` loads a factory of your own with the same signature.
"""

from __future__ import annotations

import difflib
import importlib
import os
import random
import sys
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ConfigError
from ..settings import RunConfig
from .digits import digits_task, load_digits, stratified_split
from .protocol import Task, TaskFactory, check_task
from .regression import regression_data, regression_task

__all__ = ["Task", "TaskFactory", "build", "resolve_factory", "BUILTIN", "regression_task",
           "regression_data", "digits_task", "load_digits", "stratified_split"]

BUILTIN: dict[str, TaskFactory] = {"regression": regression_task, "digits": digits_task}


def resolve_factory(name: str) -> TaskFactory:
    """The factory for ``--task``; ConfigError (one line) when it cannot be found."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ConfigError(f"--task {name}: unknown task; use one of {', '.join(BUILTIN)} "
                          "or MODULE:FUNC for a factory of your own")
    module_name, func_name = name.split(":", 1)
    if not (all(part.isidentifier() for part in module_name.split(".")) and func_name.isidentifier()):
        raise ConfigError(f"--task {name}: not MODULE:FUNC (e.g. my_tasks:make_task, a module on "
                          "PYTHONPATH or in the current folder, and a function in it)")
    if os.getcwd() not in sys.path:  # like `python -m`, find modules in the current folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"--task {name}: cannot import {module_name!r} ({error}); "
                          "is it on PYTHONPATH or in the current folder?") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise ConfigError(f"--task {name}: module {module_name!r} has no function {func_name!r}")
    return factory


def build(cfg: RunConfig, factory: Callable[[RunConfig], Task] | None = None) -> Task:
    """Build the task on this rank. Seeded so every rank gets the same weights and data, whichever
    generator the factory draws from: torch's, Python's ``random`` or numpy's global one."""
    factory = factory or resolve_factory(cfg.task)
    seed_everything(cfg.seed)
    task = factory(cfg)
    check_task(task, cfg.task)
    unread = cfg.task_options_unread()
    if unread:
        read = cfg.task_options_read()
        near = difflib.get_close_matches(unread[0], read, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        reads = f"it reads {', '.join(read)}" if read else "it reads none (cfg.task_option(NAME, DEFAULT))"
        raise ConfigError(f"--task-opt {unread[0]}: the task {cfg.task} does not read this option ({hint}{reads}); "
                          "drop it or spell it as the task does")
    return task


def seed_everything(seed: int) -> None:
    """torch's, Python's and numpy's global generators from ``seed`` (numpy takes 32 bits)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
