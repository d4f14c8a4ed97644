"""What every part of a rank needs of the job: its place in it (``DistContext``), small
object broadcasts, torch's timeout as a backstop, and a free port for scripts.

(Joining and leaving the process group is launch/group.py's business.)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch's own collective timeout is a backstop behind the watchdog, which acts at --timeout
# and names the rank that did not arrive; torch's error would blame the rank that waited.
BACKSTOP_EXTRA_S = 60.0


def round_prefix() -> str:
    """The prefix of ddptrain's keys in the job's store for this round of the job.

    torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) outlives a round, and every rank
    of a round has restarted as often: the restart count names the round. A store that rank 0
    hosts is new each round, and an elastic job's ranks may count restarts differently (a node
    that joins later starts at 0: pytorch/pytorch#135712): there the count must not be used."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"ddptrain/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return "ddptrain/"


class CollectiveMarks:
    """Where this rank is among the job's collectives, for the watchdog (resilience/watchdog.py)
    to judge hangs by. This base marks nothing: one rank, or a job without a watchdog."""

    def arrive(self, label: str, step: int | None = None, timed: bool = True) -> None:
        """This rank enters a collective (every rank enters the same ones in the same order)."""

    def depart(self) -> None:
        """This rank left the collective it entered last."""

    @contextlib.contextmanager
    def waiting(self, label: str, step: int | None = None, timed: bool = True) -> Iterator[None]:
        """``with marks.waiting("the gradient all-reduce", step):`` around a collective. After an
        error the rank is leaving and stays marked inside, which is where it was."""
        self.arrive(label, step, timed)
        yield
        self.depart()

    def take_waited(self) -> float:
        """Seconds spent in timed collectives since the last call."""
        return 0.0

    def phase(self, label: str) -> None:
        """What this rank is doing outside collectives: a start-up stage, or "step N"."""

    def training_begins(self, alone: bool = True) -> None:
        """The training loop starts: from now on a rank that stops moving is a hang (a one-rank
        job's, which no peer waits for, ``alone``: resilience/stall.py)."""

    def training_ends(self) -> None:
        """The training loop is over (the end's writes and waits are not judged)."""

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """An evaluation or a snapshot: time that may outlast a step, not judged as a stall."""
        yield


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job, as the trainer needs it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    watchdog: CollectiveMarks = field(default_factory=CollectiveMarks)  # the rank's watchdog

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """The tutorial's ``[GPU:0]`` / ``[CPU:1]`` prefix."""
        kind = "GPU" if self.device.type == "cuda" else "CPU"
        return f"[{kind}:{self.rank}]"


def apply_step_timeout(timeout_s: float) -> None:
    """After start-up, torch's own timeout backs up the watchdog at the configured value."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:  # private in torch 2.x; without it the start-up timeout stays
        setter(datetime.timedelta(seconds=timeout_s + BACKSTOP_EXTRA_S))


def sum_over_ranks(parts: dict[str, torch.Tensor], marks: CollectiveMarks, label: str,
                   step: int | None = None) -> dict[str, torch.Tensor]:
    """Several named tensors summed over the ranks in one all-reduce (float64, on the first
    one's device): packed into one vector, reduced, and handed back by name on the CPU, in
    their shapes."""
    names = list(parts)
    device = parts[names[0]].device  # the first part's: the others may be host tensors
    flat = torch.cat([parts[name].reshape(-1).to(device, torch.float64) for name in names])
    with marks.waiting(label, step):
        dist.all_reduce(flat)
    pieces = flat.cpu().split([parts[name].numel() for name in names])
    return {name: piece.reshape(parts[name].shape) for name, piece in zip(names, pieces)}


def local_tensors(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every gradient as this rank holds it (a DTensor's local shard): a rank whose squares count."""
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def no_tensors(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """None of them: a rank whose gradients repeat another's (ddp's ranks but rank 0)."""
    return []


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from rank ``src``, on every rank (the argument is ignored elsewhere)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for MASTER_PORT with mp.spawn)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
