"""The settings moved to ``ddptrain.settings`` in 0.7 (one subpackage: sections, roles, parsing,
checks, fingerprint); ``ddptrain.config.RunConfig`` stays importable for scripts written before."""

from .errors import ConfigError
from .settings import RunConfig

__all__ = ["ConfigError", "RunConfig"]
