"""A snapshot's size, planned from one rank's state: that rank's part of it (a file is rank 0's;
a DCP folder's entries go to the ranks DCP's dedup gives them), the whole of it and DCP's
.metadata among it, and the save plan each rank sends rank 0 (plan/rank.py measures them).

Each takes ``saved``, the model's and the optimizer's state as the strategy gives them
(``saved_state``: read once per rank, a sharded optimizer's state dict being costly at scale).
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map_only

from ..comm import DistContext
from ..parallel.base import Strategy


def saved_state(strategy: Strategy, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a snapshot saves of the weights: the model's and the optimizer's state dicts."""
    state = strategy.state(module, optimizer)
    return {"model": state["model"], "optimizer": state["optimizer"]}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, else the tensor)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def rank_part(saved: dict[str, Any], strategy: Strategy, ctx: DistContext) -> int:
    """This rank's part of a snapshot, as serialised. A file snapshot is rank 0's alone (the whole
    model and optimizer). A DCP folder holds each rank's entries, each saved on its own: its shards,
    and of the entries several ranks hold (hsdp's shards, which every replica group holds; the
    optimizer's settings and step counts, which every rank does) those DCP's dedup gives it
    (``_dcp_share``). (Each rank also writes its part, its random generators' states: measure_rank.)
    ``saved``: the model's and the optimizer's state as the strategy gives them (``saved_state``)."""
    if strategy.snapshot_format == "file":
        return serialised(saved) if ctx.is_main else 0
    entries = [entry for part in ("model", "optimizer") for entry in _entries(saved[part])]
    return _dcp_share(entries, ctx, getattr(strategy, "group_size", ctx.world_size))


# DCP's .metadata, measured (torch 2.13: 9 snapshots of 4 models under FSDP and HSDP on 2 and 4
# ranks, 5.6-69.6 KB, each within 5%): a pickle of every entry (its name, once as a key and once
# in the planner's data) and of every chunk written (a shard's offsets and sizes, and where in
# which file its record lies). A chunk is a sharded entry's shard with rows, or a replicated tensor.
METADATA_BYTES, METADATA_PER_ENTRY, METADATA_PER_CHUNK = 1_400, 86, 154


def whole(saved: dict[str, Any], strategy: Strategy) -> tuple[int, int]:
    """The whole snapshot but the ranks' own parts, from this rank's state and the sharding rule
    (no other rank run), and DCP's .metadata among it. A file snapshot is rank 0's file, the same
    state on every rank (sized without serialising its data). A DCP folder holds each entry once
    (an entry several ranks hold is written by one: DCP's dedup): a sharded one as its shards with
    rows, each a record of its own in its rank's file; and the .metadata (modelled above)."""
    if strategy.snapshot_format == "file":
        return serialised(saved, data=False), 0
    total = chunks = names = 0
    named = _named_entries(saved)
    for name, entry in named:
        names += len(name)
        if hasattr(entry, "to_local"):
            shards, shard = _written_shards(entry), local(entry)
            record = serialised(shard) - tensor_bytes(shard)  # a shard's own: torch.save's header and pickle
            total += entry.numel() * entry.element_size() + shards * record
            chunks += shards
        else:
            total += serialised(entry)
            chunks += isinstance(entry, torch.Tensor)
    metadata = METADATA_BYTES + METADATA_PER_ENTRY * len(named) + names + METADATA_PER_CHUNK * chunks
    return total + metadata, metadata


def dcp_plan_bytes(saved: dict[str, Any], strategy: Strategy, ctx: DistContext) -> int:
    """This rank's save plan as DCP pickles it to gather it to rank 0 (DefaultSavePlanner's local
    plan: a write item per entry, no collective); 0 for a file snapshot."""
    if strategy.snapshot_format == "file":
        return 0
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(saved, is_coordinator=ctx.is_main)
    return len(pickle.dumps(planner.create_local_plan()))


def _written_shards(entry: Any) -> int:
    """The chunks DCP writes of a DTensor: torch.chunk's cut of its sharded dimension over the N
    ranks it is sharded across gives ceil(rows / N) rows to each in turn, and none to the last
    ones where rows run out; their empty shards, all at the same offset, are one chunk (DCP's
    dedup: a 1-row matrix over 4 ranks is 2 chunks)."""
    shards = math.prod(entry.device_mesh.size(i) for i, p in enumerate(entry.placements) if p.is_shard())
    dims = [p.dim for p in entry.placements if p.is_shard()]
    rows = entry.shape[dims[0]] if dims else 0
    if not dims or rows == 0:
        return 1
    with_rows = -(-rows // -(-rows // shards))
    return with_rows + (with_rows < shards)


def _dcp_share(entries: list[Any], ctx: DistContext, group_size: int) -> int:
    """Bytes of ``entries`` (this rank's, in state-dict order) that this rank writes. DCP's
    ``dedup_save_plans`` gives an entry several ranks hold to the one with the least planned so
    far (by storage bytes), taking rank 0's entries first, then each next rank's new ones. Here
    rank 0's entries are taken to be this rank's in size. A shard is held by the ranks of its
    column (rank mod ``group_size``); anything else by every rank."""
    world, mine = ctx.world_size, ctx.rank % group_size
    planned = [0] * world

    def place(entry: Any, holders: range) -> int:
        chosen = min(holders, key=planned.__getitem__)
        planned[chosen] += tensor_bytes(entry) if isinstance(entry, torch.Tensor) else 1
        return chosen

    total = 0
    for entry in entries:  # rank 0's: its shards (column 0) and every replicated entry
        holders = range(0, world, group_size) if hasattr(entry, "to_local") else range(world)
        if place(entry, holders) == ctx.rank:
            total += serialised(local(entry) if hasattr(entry, "to_local") else entry)
    if mine:  # this rank's column's shards, first met in rank ``mine``'s plan
        for entry in entries:
            if hasattr(entry, "to_local") and place(entry, range(mine, world, group_size)) == ctx.rank:
                total += serialised(local(entry))
    return total


def _entries(tree: Any) -> list[Any]:
    """A state dict's entries as DCP saves them: dicts and lists holding containers or tensors
    are opened, anything else is one entry (a list of parameter ids, a learning rate)."""
    return [entry for _, entry in _named_entries(tree)]


def _named_entries(tree: Any, name: str = "") -> list[tuple[str, Any]]:
    """(_entries), each with the name DCP gives it: the keys and indices on its way, joined by dots."""
    def under(key: Any) -> str:
        return f"{name}.{key}" if name else str(key)

    if isinstance(tree, dict):
        return [named for key, value in tree.items() for named in _named_entries(value, under(key))]
    if isinstance(tree, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in tree):
        return [named for index, value in enumerate(tree) for named in _named_entries(value, under(index))]
    return [(name, tree)]


def serialised(value: Any, data: bool = True) -> int:
    """Bytes of ``torch.save(value)`` (a fake tensor's: its storage's bytes, which are not there;
    without ``data``, every tensor's so: the same size, none of the copying)."""
    absent = []

    def stand_in(tensor: torch.Tensor) -> torch.Tensor:
        if data and not is_fake(tensor):
            return tensor
        absent.append(tensor.untyped_storage().nbytes())
        return torch.empty(0, dtype=tensor.dtype)

    buffer = io.BytesIO()
    torch.save(tree_map_only(torch.Tensor, stand_in, value), buffer)
    return buffer.tell() + sum(absent)
