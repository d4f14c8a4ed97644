"""``--strategy ddp``: every rank holds the whole model; DDP all-reduces gradients in buckets
during backward (with torch's communication hooks, ``--comm-hook``)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ConfigError
from ..tasks.protocol import Task
from .base import Strategy, checkpoint_blocks, find_blocks, move_to, no_blocks_error
from .hooks import register_comm_hook
from .semi_sync import ReplicaMesh


class DDPStrategy(Strategy):
    needs_every_gradient = False  # find_unused_parameters and static_graph cope without
    replica_mesh: ReplicaMesh | None = None  # --sync local-sgd|diloco: DDP inside each replica group

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        """DDP across ranks (inside each replica group under --sync local-sgd|diloco)."""
        move_to(module, self.ctx.device)
        self.shares_buffers = self.ctx.world_size > 1 and any(True for _ in module.buffers())
        if self.parallel.activation_checkpointing:
            blocks = find_blocks(module, task)
            if not blocks:
                raise no_blocks_error("--activation-checkpointing")
            checkpoint_blocks(module, blocks)
        model: torch.nn.Module = torch.compile(module) if self.parallel.compile else module  # type: ignore[assignment]  # compile's stub says callable; a module's is one
        # Every rank's gradients meet (group None), unless this job's ranks are replica groups that
        # sync every --sync-every steps (under torchft, each group is a job of its own: all of this one).
        group, alone = None, self.ctx.world_size == 1
        if self.parallel.sync != "every-step" and not self.torchft:
            self.replica_mesh = ReplicaMesh(self.parallel, self.ctx)
            group, alone = self.replica_mesh.inside, self.replica_mesh.size == 1
        if alone:  # nobody to talk to every step: DDP would only add its overhead
            return model
        ddp = DDP(
            model,
            process_group=group,
            device_ids=[self.ctx.device] if self.ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            forward_sync_buffers=False,  # the Trainer shares rank 0's buffers once per step (broadcast_buffers)
            static_graph=self.parallel.static_graph,
            find_unused_parameters=self.parallel.find_unused_parameters,
            **({"bucket_cap_mb": self.parallel.bucket_cap_mb} if self.parallel.bucket_cap_mb else {}),  # type: ignore[arg-type]  # one keyword, not DDP's every parameter
        )
        register_comm_hook(ddp, self.parallel.comm_hook)
        self.needs_every_gradient = not (self.parallel.find_unused_parameters or self.parallel.static_graph)
        # A sum of two rounds the same in either order: the layout matters past 2 ranks only. (torch
        # keeps the first layout for good when it looks for unused parameters: no rebuild.)
        ranks = self.ctx.world_size if self.replica_mesh is None else self.replica_mesh.size
        self.settles_buckets = ranks > 2 and not self.parallel.find_unused_parameters
        return ddp

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Accumulation micro-batches before the last: gradients stay local (DDP's ``no_sync``,
        which must hold the micro-batch's forward: DDP decides there whether the backward reduces)."""
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    # DDP's reducer waits for every parameter's gradient: one that gets none fails the *next*
    # step, naming parameter indices at the end of a long traceback. Named here instead.
    def check_gradients(self, module: torch.nn.Module) -> None:
        if self.needs_every_gradient:
            missing = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
            if missing:
                raise unused_error(missing, "in the first step")

    def explain(self, error: RuntimeError, module: torch.nn.Module, step: int) -> Exception | None:
        """DDP's "Parameter indices which did not receive grad for rank R: 3 4", with names."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(error))
        if found is None:
            return None
        trainable = [name for name, p in module.named_parameters() if p.requires_grad]
        names = [trainable[int(i)] for i in found.group(1).split() if int(i) < len(trainable)] or ["(unnamed)"]
        return unused_error(names, f"at step {step}")


def unused_error(names: list[str], when: str) -> ConfigError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return ConfigError(f"parameter(s) {shown} got no gradient {when}; use them in the loss, set "
                       "requires_grad=False on them, or pass --find-unused-parameters")
