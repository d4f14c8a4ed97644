"""``--sync local-sgd | diloco``: replica groups that meet every ``--sync-every`` steps, not every step.

The ranks split into ``--replicas`` groups of consecutive ranks (default: one per node), the
``("across", "inside")`` dimensions of a 2-D device mesh. Inside a group DDP all-reduces the
gradients every step, as it always does; across the groups nothing travels between syncs. Every
``--sync-every`` optimizer steps, before an evaluation and after the last step (each of those
is of one model; evaluations between syncs add syncs, at the same steps in every run):

- ``local-sgd``: the groups average their weights (torch's ``model_averaging.average_parameters``:
  one all-reduce of every trainable parameter, flattened);
- ``diloco`` (Douillard et al. 2023): each group's change since the last sync is its
  pseudo-gradient; their mean (one all-reduce, flattened) is the gradient of an outer SGD with
  Nesterov momentum over the last synced weights, and its result is every group's new weights.

Each rank takes part in exactly one cross-group all-reduce per sync, with the rank at the same
place in every other group. The inner optimizers keep their own state per group.

Snapshots are taken at syncs only (a snapshot asked for between two syncs waits for the next),
where every group holds the same weights: the snapshot's model is the last synced weights, the
outer optimizer's momentum is in it (``state_dict``), and so is every group's inner optimizer
(``GroupOptimizers``), so a killed run resumes exactly. What a stop signal stops between syncs
resumes from the sync before it.

Under ``--fault-tolerance torchft`` the groups are torchft's replica groups, jobs of their own,
and a sync is their meeting at the lighthouse (``SemiSync``'s docstring; docs/slow-links.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from ..comm import CollectiveMarks, DistContext
from ..errors import ConfigError
from ..settings import ParallelSettings
from .base import replica_groups

SYNC = "the replica groups' sync (--sync {kind})"


class ReplicaMesh:
    """The groups: ``replicas`` groups of ``size`` consecutive ranks; ``inside`` is this rank's
    group's process group, ``across`` the one joining it to the same place in the other groups."""

    def __init__(self, parallel: ParallelSettings, ctx: DistContext) -> None:
        self.replicas, self.size = replica_groups(parallel, ctx)  # one per node by default
        if self.replicas < 2:
            raise ConfigError(f"--sync {parallel.sync} needs 2 or more replica groups, and this job has one (one per "
                              "node by default); run on several nodes, or set --replicas R to split the ranks")
        self.index = ctx.rank // self.size  # this rank's group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (self.replicas, self.size), mesh_dim_names=("across", "inside"))
        self.across, self.inside = mesh.get_group("across"), mesh.get_group("inside")


class GroupsMeeting(Protocol):
    """torchft's replica groups (resilience/replicas.py), each a job of its own, as SemiSync meets them."""

    def meet(self, step: int,
             contribution: Callable[[bool], tuple[torch.Tensor, bool]]) -> tuple[torch.Tensor, int] | None: ...


class SemiSync:
    """Syncs the replica groups every ``--sync-every`` steps; a component of every snapshot.

    The groups are a ``ReplicaMesh`` of this job's ranks, or torchft's replica groups
    (``groups``), jobs of their own that meet at a lighthouse. There a meeting is torchft's
    quorum, and a group that failed between two meetings heals in the next from a live peer.
    Across torchft's groups local SGD runs as DiLoCo does, a pseudo-gradient over the last
    synced weights (the anchor), with an outer SGD of lr 1 and no momentum: a group that healed
    brings zeros, and the mean is over the groups that trained. A meeting not committed (a group
    failed in it) takes every group back to the anchor."""

    def __init__(self, parallel: ParallelSettings, params: list[torch.nn.Parameter], marks: CollectiveMarks,
                 mesh: ReplicaMesh | None = None, groups: GroupsMeeting | None = None) -> None:
        self.kind, self.mesh, self.groups, self.marks = parallel.sync, mesh, groups, marks
        self.every, outer_lr, momentum = parallel.sync_settings
        if self.kind == "local-sgd":
            outer_lr, momentum = 1.0, 0.0
        self.params = [p for p in params if p.requires_grad]  # frozen ones (LoRA's base) never differ
        self.step = 0  # the global step this rank stands after
        self.synced_step = 0  # the global step after which the groups last held the same weights
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        if self.kind == "diloco" or groups is not None:  # the last synced weights, and the outer optimizer over them
            self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
            self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)

    def synced(self, global_step: int) -> bool:
        """Whether every group holds the same weights after ``global_step``."""
        return global_step == self.synced_step

    def after_step(self, global_step: int) -> bool:
        """Call after every optimizer step on every rank: True when this step ended in a sync."""
        self.step = global_step
        if global_step % self.every:
            return False
        self.sync(global_step)
        return True

    def sync(self, global_step: int, start: bool = False) -> None:
        """The groups meet (every rank, after the same step). ``start``: torchft's groups meet
        before their first step too, where a restarted group heals from the others."""
        if self.synced(global_step) and not start:
            return
        self.step = global_step
        with self.marks.waiting(SYNC.format(kind=self.kind), global_step), torch.no_grad():
            if self.groups is not None:
                self._meet(start)
            elif self.outer is None:
                average_parameters(iter(self.params), self.mesh.across)  # type: ignore[union-attr]  # no groups: a mesh
            else:
                self._outer_step(self._mesh_mean())
        self.synced_step = self.step  # (after a heal, the peer's)

    def _changes(self) -> torch.Tensor:
        """This group's pseudo-gradient since the last sync, flattened."""
        return _flatten_dense_tensors([anchor - param for anchor, param in zip(self.anchor, self.params)])

    def _mesh_mean(self) -> torch.Tensor:
        assert self.mesh is not None
        flat = self._changes()
        dist.all_reduce(flat, group=self.mesh.across)
        return flat.div_(self.mesh.replicas)

    def _meet(self, start: bool) -> None:
        """torchft's groups: one meeting; the outer step when any group brought a change."""
        assert self.groups is not None

        def contribution(healed: bool) -> tuple[torch.Tensor, bool]:
            counts = not (start or healed)  # (at the start, nobody trained since the anchor)
            flat = self._changes()
            return (flat if counts else flat.zero_()), counts

        met = self.groups.meet(self.step, contribution)
        if met is not None and met[1] > 0:
            total, counted = met
            self._outer_step(total.div_(counted))
        else:  # not committed: back to the anchor; nobody trained: it is the weights already
            for param, anchor in zip(self.params, self.anchor):
                param.copy_(anchor)

    def _outer_step(self, mean: torch.Tensor) -> None:
        """The outer optimizer's step over the anchor with the groups' mean pseudo-gradient
        (``mean``, flattened); every group's weights become the result."""
        assert self.outer is not None
        for anchor, change in zip(self.anchor, _unflatten_dense_tensors(mean, self.anchor)):
            anchor.grad = change
        self.outer.step()
        for param, anchor in zip(self.params, self.anchor):
            param.copy_(anchor)

    # --- state: a snapshot's, taken at syncs only, where the weights are the last synced ones ----
    def state_dict(self) -> dict[str, Any]:
        state = {"synced_step": self.synced_step, "step": self.step,
                 **({"outer": self.outer.state_dict()} if self.outer else {})}
        if self.step != self.synced_step:  # a heal's state, given by a live peer in a meeting
            state["anchor"] = [anchor.detach() for anchor in self.anchor]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the weights were loaded: in a snapshot, they are the last synced ones."""
        self.synced_step = state.get("synced_step", 0)
        self.step = state.get("step", self.synced_step)
        with torch.no_grad():
            for anchor, synced in zip(self.anchor, state.get("anchor") or self.params):
                anchor.copy_(synced)
        if self.outer is not None and state.get("outer"):
            self.outer.load_state_dict(state["outer"])


class GroupOptimizers:
    """Every replica group's inner optimizer state (a per-rank state of the snapshot: each
    group's first rank gives its own, the others nothing; group 0's is the snapshot's optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mesh: ReplicaMesh, ctx: DistContext) -> None:
        self.optimizer, self.mesh, self.ctx = optimizer, mesh, ctx

    def state_dict(self) -> dict[str, Any]:
        first_of_group = self.ctx.rank % self.mesh.size == 0
        return self.optimizer.state_dict() if first_of_group and self.mesh.index > 0 else {}

    def saved_by(self) -> int:
        """The rank whose part of a snapshot holds this rank's group's state: the group's first."""
        return self.mesh.index * self.mesh.size

    def load_state_dict(self, saved: dict[str, Any] | None, saved_world_size: int) -> None:
        """Each group takes its own; on another world size every group starts from group 0's."""
        if saved_world_size != self.ctx.world_size:
            return
        if saved:
            self.optimizer.load_state_dict(saved)
