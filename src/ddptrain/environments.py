"""Who started this process? One small class per launcher, each with a ``detect()``.

Modelled on Lightning Fabric's cluster environments: each reads its launcher's variables
and answers rank, world size, local rank and the master's address. ``detect`` picks the
first that matches; ``LocalEnvironment`` means no launcher, so ddptrain starts the ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping


class Environment:
    name = "base"

    def __init__(self, env: Mapping[str, str] | None = None, local_rank_arg: int | None = None):
        self.env = dict(os.environ if env is None else env)
        self.local_rank_arg = local_rank_arg

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    # Every property below describes this process's place in the job.
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def local_rank(self) -> int:
        raise NotImplementedError

    @property
    def local_world_size(self) -> int:
        raise NotImplementedError

    @property
    def master_addr(self) -> str:
        raise NotImplementedError

    @property
    def master_port(self) -> int:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        return {"launcher": self.name, "rank": self.rank, "world_size": self.world_size,
                "local_rank": self.local_rank, "local_world_size": self.local_world_size,
                "master_addr": self.master_addr, "master_port": self.master_port}

    def export(self) -> None:
        """Set the variables ``init_process_group(init_method='env://')`` reads."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world_size),
                          MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


class TorchrunEnvironment(Environment):
    """torchrun, ``python -m torch.distributed.launch --use-env``, or our own elastic launch."""

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    @property
    def world_size(self) -> int:
        return int(self.env["WORLD_SIZE"])

    @property
    def local_rank(self) -> int:
        # torch.distributed.launch without --use-env passes --local-rank=N instead.
        if "LOCAL_RANK" in self.env:
            return int(self.env["LOCAL_RANK"])
        return self.local_rank_arg if self.local_rank_arg is not None else 0

    @property
    def local_world_size(self) -> int:
        return int(self.env.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def master_addr(self) -> str:
        return self.env["MASTER_ADDR"]

    @property
    def master_port(self) -> int:
        return int(self.env["MASTER_PORT"])


class SlurmEnvironment(Environment):
    """One task per rank started by ``srun``: rank and world size come from Slurm."""

    name = "slurm"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        # SLURM_STEP_NUM_TASKS is set for srun job steps; a batch script itself (where
        # SLURM_NTASKS describes the allocation, not this process) does not count.
        return all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                                      "SLURM_JOB_NODELIST"))

    @property
    def rank(self) -> int:
        return int(self.env["SLURM_PROCID"])

    @property
    def world_size(self) -> int:
        return int(self.env.get("SLURM_STEP_NUM_TASKS", self.env["SLURM_NTASKS"]))

    @property
    def local_rank(self) -> int:
        return int(self.env.get("SLURM_LOCALID", 0))

    @property
    def local_world_size(self) -> int:
        per_node = self.env.get("SLURM_STEP_TASKS_PER_NODE") or self.env.get("SLURM_TASKS_PER_NODE", "1")
        node = int(self.env.get("SLURM_NODEID", 0))
        return expand_tasks_per_node(per_node)[node]

    @property
    def master_addr(self) -> str:
        if "MASTER_ADDR" in self.env:
            return self.env["MASTER_ADDR"]
        nodes = self.env.get("SLURM_STEP_NODELIST") or self.env["SLURM_JOB_NODELIST"]
        return expand_hostlist(nodes)[0]

    @property
    def master_port(self) -> int:
        if "MASTER_PORT" in self.env:
            return int(self.env["MASTER_PORT"])
        # Every task of the job derives the same port; different jobs get different ones.
        job_id = int(self.env.get("SLURM_JOB_ID", "0"))
        return 15000 + job_id % 20000


class LocalEnvironment(Environment):
    """No launcher: ddptrain starts the ranks itself (launch.py)."""

    name = "local"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    rank = 0  # type: ignore[assignment]
    local_rank = 0  # type: ignore[assignment]
    world_size = 1  # type: ignore[assignment]
    local_world_size = 1  # type: ignore[assignment]
    master_addr = "127.0.0.1"  # type: ignore[assignment]

    @property
    def master_port(self) -> int:
        return int(self.env.get("MASTER_PORT", 0))


ENVIRONMENTS: tuple[type[Environment], ...] = (TorchrunEnvironment, SlurmEnvironment, LocalEnvironment)


def detect(env: Mapping[str, str] | None = None, local_rank_arg: int | None = None) -> Environment:
    """The environment of this process: torchrun first (it may run inside srun), then Slurm."""
    env = os.environ if env is None else env
    for cls in ENVIRONMENTS:
        if cls.detect(env):
            return cls(env, local_rank_arg)
    raise AssertionError("LocalEnvironment always matches")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host lists: ``gpu[01-04,07],login1`` -> gpu01 … gpu04, gpu07, login1."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    names = []
    for part in match.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if not bounds:
            raise ValueError(f"cannot read Slurm host list {item!r}")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        names.extend(f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return [host for name in names for host in _expand_item(name + suffix)]


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (Slurm's SLURM_TASKS_PER_NODE form)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if not match:
            raise ValueError(f"cannot read Slurm tasks per node {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
