"""How the model is spread over the ranks, and how its state is read and written.

- ``ddp``: every rank holds the whole model; DDP all-reduces gradients in buckets during
  backward. Snapshots are one file written by rank 0.
- ``fsdp`` (fsdp.py): FSDP2's ``fully_shard`` on each block, then the root; each rank
  holds a shard of parameters, gradients and optimizer state. Snapshots are DCP folders.

Both can recompute activations in backward (``--activation-checkpointing``) and compile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import ConfigError, RunConfig
from .dist import DistContext
from .hooks import register_comm_hook
from .tasks.protocol import Task


def find_blocks(model: torch.nn.Module, task: Task) -> list[torch.nn.Module]:
    """The task's blocks, else the members of the model's largest ModuleList or Sequential."""
    if task.blocks is not None:
        return list(task.blocks(model))
    containers = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    if not containers:
        return []
    largest = max(containers, key=len)
    return [m for m in largest if any(True for _ in m.parameters())]


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
    """Recompute each block's activations in backward (torch's checkpoint_wrapper, in place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    wanted = {id(b) for b in blocks}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in wanted)


@contextlib.contextmanager
def kept_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Buffers as they were before the block: a stand-in sample (weight 0, see data.py) trains
    nothing and must not move BatchNorm's running statistics either."""
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``--sync-batchnorm``: BatchNorm layers normalise with the statistics of the global batch
    (torch's SyncBatchNorm, which runs on GPUs only: the Trainer refuses it on CPU)."""
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)


def no_blocks_error(what: str) -> ConfigError:
    return ConfigError(f"{what} needs blocks: the model has no ModuleList or Sequential with parameters; "
                       "name them with Task.blocks = lambda model: [...]")


class DDPStrategy:
    name = "ddp"
    snapshot_format = "file"

    def __init__(self, cfg: RunConfig, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.forward_syncs = False  # whether the forward pass itself holds a collective
        self.autocast = True  # --precision is autocast (fsdp: a mixed-precision policy instead)
        self.shares_buffers = False  # the model has buffers and other ranks to share them with
        self.needs_every_gradient = False  # DDP fails a step when a parameter got no gradient

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        """DDP across ranks. One rank has nobody to talk to: DDP would only add its overhead."""
        module.to(self.ctx.device)
        self.shares_buffers = self.ctx.world_size > 1 and any(True for _ in module.buffers())
        if self.cfg.activation_checkpointing:
            blocks = find_blocks(module, task)
            if not blocks:
                raise no_blocks_error("--activation-checkpointing")
            checkpoint_blocks(module, blocks)
        model = torch.compile(module) if self.cfg.compile else module
        if self.ctx.world_size == 1:
            return model
        ddp = DDP(
            model,
            device_ids=[self.ctx.device] if self.ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            forward_sync_buffers=False,  # the Trainer shares rank 0's buffers once per step (broadcast_buffers)
            static_graph=self.cfg.static_graph,
            find_unused_parameters=self.cfg.find_unused_parameters,
            **({"bucket_cap_mb": self.cfg.bucket_cap_mb} if self.cfg.bucket_cap_mb else {}),
        )
        register_comm_hook(ddp, self.cfg.comm_hook)
        self.needs_every_gradient = not (self.cfg.find_unused_parameters or self.cfg.static_graph)
        return ddp

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers to every rank: one broadcast per dtype. (What DDP's own
        ``broadcast_buffers`` does at each synchronising forward; FSDP shares none.)"""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in module.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        with torch.no_grad():
            for buffers in by_dtype.values():
                flat = _flatten_dense_tensors(buffers)
                dist.broadcast(flat, src=0)
                if not self.ctx.is_main:
                    for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers)):
                        buffer.copy_(value)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Accumulation micro-batches before the last: gradients stay local (DDP's no_sync)."""
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def eval_model(self, module: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
        """Evaluation runs the unwrapped module: no DDP hooks, no collectives in forward."""
        return module

    # --- state ----------------------------------------------------------------------------
    # Both strategies speak torch.distributed.checkpoint's state dicts: parameter names as
    # keys, the optimizer's state keyed by parameter name too. So a snapshot written under
    # one strategy (one file of whole tensors, or a DCP folder of shards) loads under the other.
    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model's and the optimizer's state (never called before the first step: see
        Trainer._save; on a fresh optimizer torch initialises its state with a zero step)."""
        model_state, optimizer_state = get_state_dict(module, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   whole: bool) -> None:
        """``whole``: the tensors are whole (a file snapshot), not shards (DCP loaded them into
        this run's own state dicts). On a replicated model both are this rank's tensors."""
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def full_model_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """model.pt: the whole model, CPU tensors, on rank 0 (None elsewhere)."""
        if not self.ctx.is_main:
            return None
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def make_strategy(cfg: RunConfig, ctx: DistContext) -> Any:
    if cfg.strategy == "fsdp":
        from .fsdp import FSDPStrategy
        return FSDPStrategy(cfg, ctx)
    return DDPStrategy(cfg, ctx)
