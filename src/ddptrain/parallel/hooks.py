"""DDP communication hooks by name: torch's own, registered on the wrapped model."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

# PowerSGD runs plain all-reduce for this many steps before compressing (its warm-up).
POWERSGD_START_ITER = 10


def register_comm_hook(model: DDP, name: str) -> None:
    """``none`` keeps DDP's all-reduce; ``fp16``/``bf16`` halve the bytes sent; ``powersgd``
    sends a rank-1 approximation with error feedback (its state is not in snapshots, so a
    resumed PowerSGD run is close to, not bitwise, the uninterrupted one)."""
    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=POWERSGD_START_ITER)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
