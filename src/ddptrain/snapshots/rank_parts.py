"""Each rank's own part of a snapshot: its random states and its per-rank components (a stream's
reading position), written by that rank to a small file of its own and read back by that rank alone.

Up to 0.6 every snapshot all-gathered every rank's random states to every rank (64 KiB a rank:
1.07 GB received by each rank at 16,384 ranks, every snapshot) and gathered the data positions
on rank 0. A part costs each rank the same whatever the world size: one file written (~16 KB),
no payload sent (one barrier follows), and on resume one file read
(benchmarks/snapshot_world.py measures both at 2 to 16,384 ranks).

Where the parts lie (``ranks/rank-R-of-W.pt``; the world size in the name lets whoever commits
a snapshot to a store know how many it waits for):
- a DCP folder's inside it: ``step-N/ranks/``, written into ``.step-N.partial/ranks/`` before
  the rank's shards, so the folder is renamed complete with them;
- a file snapshot's beside it: ``step-N.pt`` and ``step-N.ranks/``, every part written before
  the collective after which rank 0 writes the file: a committed file implies its parts.

Snapshots of format 2 (0.1 to 0.6) hold the lists by rank in their metadata: ``read_part``
reads those too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..run_dir import snapshot_name
from . import files
from .dcp import partial_folder

FOLDER = "ranks"
PART_NAME = re.compile(r"^rank-(\d+)-of-(\d+)\.pt$")


def part_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def parts_folder(snapshot: Path) -> Path:
    """The folder of a snapshot's parts: inside a DCP folder (final or ``.partial``), beside a file."""
    if snapshot.suffix == ".pt":
        return snapshot.with_name(f"{snapshot.stem}.{FOLDER}")
    return snapshot / FOLDER


def write_part(directory: Path, step: int, sharded: bool, rank: int, world_size: int,
               part: dict[str, Any]) -> Path:
    """This rank's part of the snapshot after ``step``, atomically (files.atomic_save)."""
    snapshot = partial_folder(directory, step) if sharded else directory / snapshot_name(step)
    folder = parts_folder(snapshot)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / part_name(rank, world_size)
    files.atomic_save(part, path)
    return path


def read_part(snapshot: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s part of the snapshot at ``snapshot`` whose metadata is ``state``: its file,
    or (format 2) its entries of the lists by rank; None when the snapshot has none for it."""
    world_size = int(state["world_size"])
    if rank >= world_size:
        return None
    if "rng" in state:  # format 2: gathered into the metadata
        return {key: value[rank] for key, value in state.items()
                if key in ("rng", *PER_RANK_OF_FORMAT_2) and isinstance(value, list)}
    path = parts_folder(snapshot) / part_name(rank, world_size)
    if not path.is_file():
        return None
    try:
        part = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - truncated or foreign: as good as absent (the caller says what it costs)
        return None
    return part if isinstance(part, dict) else None


# the per-rank components 0.1-0.6 gathered: a stream's position, the replica groups' optimizers
PER_RANK_OF_FORMAT_2 = ("data", "group_optimizers")


def expected_parts(names: list[str]) -> list[str]:
    """The part names a snapshot needs, from any one of them (``rank-R-of-W.pt``): all W."""
    for name in names:
        found = PART_NAME.match(name.rsplit("/", 1)[-1])
        if found:
            world_size = int(found.group(2))
            return [part_name(rank, world_size) for rank in range(world_size)]
    return []
