"""The collectives a planned rank starts, counted as torch dispatches them (``CollectiveCount``):
their kind, elements and dtype, and the group each runs over (its size, and whether its ranks
share a node), read from the process group the op is given, not modelled from the strategy. So
HSDP's gathers inside a replica group, its all-reduce across the groups, ``--sync``'s inner
group and ``--tp``'s all-reduces inside a tensor-parallel group are each timed on their own link.

Two families of ops carry collectives: c10d's (``dist.all_reduce``, FSDP's gathers and
reduce-scatters), given the process group itself, and the functional collectives DTensor's
tensor parallelism starts (``_c10d_functional``), given its name.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# The c10d ops every collective ends in (a functional one too, inside it: a profiler's trace
# records both, so tests/helpers/costs.py reads these alone), by kind.
C10D_KINDS = {"c10d::allreduce_": "all_reduce", "c10d::broadcast_": "broadcast", "c10d::_allgather_base_": "all_gather",
              "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::allgather_": "all_gather",
              "c10d::reduce_scatter_": "reduce_scatter", "c10d::barrier": "barrier"}
# A dispatch mode sees the functional op and not the c10d op inside it.
KINDS = {**C10D_KINDS,
         "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_": "all_reduce",
         "_c10d_functional::all_gather_into_tensor": "all_gather",
         "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
         "_c10d_functional::all_to_all_single": "all_to_all", "_c10d_functional::broadcast": "broadcast",
         "_c10d_functional::broadcast_": "broadcast"}
# The functional ops given their input where c10d's are given the output: an all-gather's whole
# output is its input times the group, a reduce-scatter's shard its input over the group.
GROWS = {"_c10d_functional::all_gather_into_tensor"}
SHRINKS = {"_c10d_functional::reduce_scatter_tensor"}


@dataclasses.dataclass(frozen=True)
class Group:
    """The ranks a collective runs over, as the plan times it."""

    size: int
    in_node: bool  # every rank of it on one node (its bytes go over the node's links)
    world: bool  # the whole world (the default group, or one of all of its ranks)


class CollectiveCount(TorchDispatchMode):
    """The collectives started on this thread while it is active, by kind, elements (of the
    first tensor given: an all-gather's whole output, a reduce-scatter's shard, tests/helpers/
    costs.py's reading of a profiler trace), dtype and group. (torch's profiler sees them too,
    but records every op of the step: at 4,096 ranks FSDP's copy-out ran 136,000 of them, and
    reading them back took 24 s of a 29 s plan.) ``per_node``: the ranks a node holds (the
    target's --nproc-per-node), None: every group is taken as inside a node."""

    def __init__(self, per_node: int | None = None) -> None:
        super().__init__()
        self.per_node = per_node
        self.found: collections.Counter[tuple[str, int, torch.dtype, Group]] = collections.Counter()
        self._groups: dict[str, Group] = {}  # by the process group's name (a world's ranks read once)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        kind = KINDS.get(name)
        if kind is not None:
            first = args[0]
            while isinstance(first, (list, tuple)):  # the list ops: the first tensor of the first list
                first = first[0]
            group = self._group(_process_group(func, args, kwargs))
            elements = first.numel()
            if name in GROWS:
                elements *= group.size
            elif name in SHRINKS:
                elements //= group.size
            self.found[(kind, elements, first.dtype, group)] += 1
        return func(*args, **(kwargs or {}))

    def _group(self, pg: dist.ProcessGroup) -> Group:
        known = self._groups.get(pg.group_name)
        if known is None:
            ranks = dist.get_process_group_ranks(pg)
            nodes = {rank // self.per_node for rank in ranks} if self.per_node else {0}
            known = Group(len(ranks), len(nodes) == 1, len(ranks) == dist.get_world_size())
            self._groups[pg.group_name] = known
        return known

    def table(self) -> dict[str, dict[str, Any]]:
        """By kind, then the largest first; keyed ``kind[elements]``, and ``@size`` for a group
        that is not the world's."""
        ordered = sorted(self.found.items(),
                         key=lambda item: (item[0][0], -item[0][1], str(item[0][2]), item[0][3].size))
        return {key(kind, elements, group): {
                    "kind": kind, "elements": elements, "dtype": str(dtype).removeprefix("torch."), "count": count,
                    "bytes": elements * dtype.itemsize, "group": group.size, "in_node": group.in_node}
                for (kind, elements, dtype, group), count in ordered}


def key(kind: str, elements: int, group: Group) -> str:
    return f"{kind}[{elements}]" if group.world else f"{kind}[{elements}]@{group.size}"


def _process_group(func: Any, args: Any, kwargs: Any) -> dist.ProcessGroup:
    """The process group a collective op is given: c10d's as an argument, the functional ones' by name."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name in ("process_group", "group_name"):
            value = args[index] if index < len(args) else (kwargs or {})[argument.name]
            if isinstance(value, str):
                from torch.distributed.distributed_c10d import _resolve_process_group

                return _resolve_process_group(value)  # type: ignore[arg-type]  # (a GroupName is a str)
            return dist.ProcessGroup.unbox(value)
    return dist.group.WORLD  # type: ignore[return-value]  # (every op in KINDS names its group)
