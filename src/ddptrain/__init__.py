"""ddptrain: PyTorch DistributedDataParallel training that works the same in every launch mode."""

from __future__ import annotations

__version__ = "0.1.0"

from .config import ConfigError, RunConfig  # noqa: E402
from .tasks.protocol import Task  # noqa: E402

__all__ = ["ConfigError", "RunConfig", "Task", "Trainer", "__version__"]


def __getattr__(name: str):  # Trainer pulls in torch.distributed; import it on first use
    if name == "Trainer":
        from .trainer import Trainer
        return Trainer
    raise AttributeError(name)
