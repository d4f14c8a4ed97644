"""How the model is spread over the ranks, and how its state is read and written: a base
(base.py) and its strategies, DDP (ddp.py) and FSDP2 (fsdp.py: fsdp, and hsdp on a 2-D mesh);
precision; DDP's comm hooks."""

from __future__ import annotations

from ..comm import DistContext
from ..config import RunConfig
from .base import Strategy


def make_strategy(cfg: RunConfig, ctx: DistContext) -> Strategy:
    if cfg.strategy in ("fsdp", "hsdp"):
        from .fsdp import FSDPStrategy, HSDPStrategy  # FSDP2's imports only for these runs
        return HSDPStrategy(cfg, ctx) if cfg.strategy == "hsdp" else FSDPStrategy(cfg, ctx)
    from .ddp import DDPStrategy
    return DDPStrategy(cfg, ctx)
