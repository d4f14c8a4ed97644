"""How the model is spread over the ranks, and how its state is read and written: a base
(base.py) and its strategies, DDP (ddp.py) and FSDP2 (fsdp.py); precision; DDP's comm hooks."""

from __future__ import annotations

from ..comm import DistContext
from ..config import RunConfig
from .base import Strategy


def make_strategy(cfg: RunConfig, ctx: DistContext) -> Strategy:
    if cfg.strategy == "fsdp":
        from .fsdp import FSDPStrategy  # FSDP2's imports only for fsdp runs
        return FSDPStrategy(cfg, ctx)
    from .ddp import DDPStrategy
    return DDPStrategy(cfg, ctx)
