"""How the model is spread over the ranks, and how its state is read and written: a base
(base.py) and its strategies, DDP (ddp.py), FSDP2 (fsdp.py: fsdp, and hsdp on a 2-D mesh) and
FSDP2 with tensor parallelism (tensor_parallel.py, --tp); precision; DDP's comm hooks."""

from __future__ import annotations

from ..comm import DistContext
from ..settings import ParallelSettings
from .base import Strategy


def make_strategy(parallel: ParallelSettings, ctx: DistContext, precision: str = "fp32",
                  torchft: bool = False) -> Strategy:
    """The strategy of ``parallel`` (--strategy and its knobs), with --precision and whether this job
    is one of torchft's replica groups (whose --sync meetings are torchft's, not a mesh of its ranks)."""
    kind: type[Strategy]
    if parallel.tp > 1:  # (settings/checks.py: with fsdp only)
        from .tensor_parallel import TensorParallelStrategy
        kind = TensorParallelStrategy
    elif parallel.strategy in ("fsdp", "hsdp"):
        from .fsdp import FSDPStrategy, HSDPStrategy  # FSDP2's imports only for these runs
        kind = HSDPStrategy if parallel.strategy == "hsdp" else FSDPStrategy
    else:
        from .ddp import DDPStrategy
        kind = DDPStrategy
    return kind(parallel, ctx, precision, torchft)
