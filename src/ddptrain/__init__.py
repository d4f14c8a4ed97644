"""ddptrain: PyTorch DistributedDataParallel training that works the same in every launch mode.

The public API (docs/api.md): ``fit`` trains a task from Python the way ``ddptrain train``
does; ``Task`` describes what to train; ``RunConfig`` holds the settings; ``Trainer`` and
``process_group`` are for scripts that start their ranks themselves (the tutorial's shape).
"""

from __future__ import annotations

__version__ = "0.7.1"  # what a user has: CHANGELOG.md says what each version added, changed and broke

from .errors import ConfigError  # noqa: E402

__all__ = ["ConfigError", "RunConfig", "Stopped", "Task", "Trainer", "TrainingFailed", "__version__",
           "fit", "free_port", "process_group"]

_LAZY = {  # imported on first use: these pull in torch (RunConfig does not, but `ddptrain`'s start need not pay it)
    "RunConfig": ("config", "RunConfig"), "Task": ("tasks.protocol", "Task"), "Trainer": ("trainer", "Trainer"),
    "fit": ("api", "fit"), "TrainingFailed": ("errors", "TrainingFailed"),
    "Stopped": ("errors", "Stopped"), "process_group": ("launch.group", "process_group"),
    "free_port": ("comm", "free_port"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attribute)
    raise AttributeError(name)
