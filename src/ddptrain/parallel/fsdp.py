"""``--strategy fsdp``: FSDP2 (``fully_shard``) for models that do not fit one device.

Each block (``Task.blocks``, else the members of the model's largest ModuleList or
Sequential) is sharded, then the root: each rank holds 1/W of the parameters, gradients and
optimizer state, and all-gathers a block's parameters just before it runs. Snapshots are
DCP folders written by every rank (snapshots/dcp.py); model.pt is gathered for rank 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..comm import DistContext
from ..console import say
from ..settings import ParallelSettings
from ..tasks.protocol import Task
from .base import Strategy, checkpoint_blocks, find_blocks, move_to, no_blocks_error, replica_groups
from .precision import autocast_dtype


class FSDPStrategy(Strategy):
    snapshot_format = "dcp"

    def __init__(self, parallel: ParallelSettings, ctx: DistContext, precision: str = "fp32",
                 torchft: bool = False) -> None:
        super().__init__(parallel, ctx, precision, torchft)
        self.counts_gradients = True  # each rank's shards: a part of every gradient no other rank holds
        self.forward_syncs = True  # every block's forward all-gathers its parameters

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """--precision is FSDP's mixed-precision policy here (parameters cast once per
        all-gather, gradients reduced in fp32), not autocast."""
        return contextlib.nullcontext()

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        move_to(module, self.ctx.device)
        self.shares_buffers = self.ctx.world_size > 1 and any(True for _ in module.buffers())
        blocks = find_blocks(module, task)
        if not blocks and self.ctx.is_main:  # the root alone: correct, but gathered whole in every forward
            say(f"ddptrain: --strategy {self.parallel.strategy}: the model has no ModuleList or Sequential with "
                "parameters, so it is sharded as one unit (gathered whole for each forward); name its blocks "
                "with Task.blocks to gather one at a time")
        if self.parallel.activation_checkpointing:
            if not blocks:
                raise no_blocks_error("--activation-checkpointing")
            checkpoint_blocks(module, blocks)
            blocks = find_blocks(module, task) if task.blocks is None else blocks
        dtype = autocast_dtype(self.precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        mesh = self.mesh()
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.parallel.reshard_after_forward, mp_policy=policy)
        # The root keeps its parameters gathered from forward to backward (torch's default for it:
        # the backward needs them at once); resharding it too cost an all-gather per micro-batch.
        # The model's output in fp32, as the loss sees it under DDP's autocast: the loss runs on the
        # output and fp32 targets, and CUDA's mse_loss backward refuses a bf16 output beside fp32
        # targets ("Found dtype Float but expected BFloat16", found on an H200; CPU's accepts it).
        root_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=policy.reduce_dtype,
                                           output_dtype=torch.float32 if dtype else None)
        fully_shard(module, mesh=mesh, reshard_after_forward=None, mp_policy=root_policy)
        return torch.compile(module) if self.parallel.compile else module  # type: ignore[return-value]  # compile's stub says callable; a module's is one

    def mesh(self) -> DeviceMesh | None:
        """fsdp: None, fully_shard's default (one dimension over every rank)."""
        return None

    def settle(self, module: torch.nn.Module) -> None:
        """The root keeps its gathered parameters after a forward without a backward (an
        evaluation): they would outlive a swap of the parameters (--ema), so they go."""
        for part in module.modules():
            if isinstance(part, FSDPModule):
                part.reshard()

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Accumulation micro-batches before the last: no reduce-scatter of gradients."""
        module = cast(FSDPModule, getattr(model, "_orig_mod", model))  # fully_shard made it one
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   whole: bool) -> None:
        """Whole tensors (a DDP snapshot) are sharded here; shards from DCP are set as they are.
        torch shards whole optimizer state only when it holds tensors (plain SGD holds none)."""
        if not whole:
            set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            return
        set_model_state_dict(module, state["model"], options=StateDictOptions(full_state_dict=True))
        has_tensors = any(isinstance(v, torch.Tensor) and v.dim() for s in state["optimizer"]["state"].values()
                          for v in s.values())
        set_optimizer_state_dict(module, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=has_tensors))

    def full_model_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """model.pt: every rank helps gather the whole model; rank 0 receives it on CPU."""
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self.ctx.is_main else None


class HSDPStrategy(FSDPStrategy):
    """``--strategy hsdp``: R replica groups of W/R consecutive ranks; each group shards the model
    over its ranks as fsdp does, and the groups hold the same shards. A gradient is
    reduce-scattered inside a group, then all-reduced across the groups (FSDP2 on a 2-D mesh,
    ``("replicate", "shard")``): the all-gathers stay inside a group (a node, by default), only
    the gradients' shards cross between groups. Snapshots are DCP folders as for fsdp, of the
    same global tensors: they resume under fsdp, ddp or another R."""

    def __init__(self, parallel: ParallelSettings, ctx: DistContext, precision: str = "fp32",
                 torchft: bool = False) -> None:
        super().__init__(parallel, ctx, precision, torchft)
        self.replicas, self.group_size = replica_groups(parallel, ctx)  # one per node by default
        self.counts_gradients = ctx.rank < self.group_size  # the first group's shards; the others repeat them

    def mesh(self) -> DeviceMesh | None:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.ctx.device.type, (self.replicas, self.group_size),
                                mesh_dim_names=("replicate", "shard"))

