"""Run a function on N real gloo ranks (forked from the test process) and collect results."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddptrain import free_port


def _rank_main(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on each of ``world`` ranks; their return values, by rank."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(world, free_port(), out, fn, args), nprocs=world,
                           start_method="fork")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
