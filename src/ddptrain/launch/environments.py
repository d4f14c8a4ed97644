"""Who started this process? One small class per launcher, each with a ``detect()``.

Modelled on Lightning Fabric's cluster environments: each reads its launcher's variables
and answers rank, world size, local rank and the master's address. ``detect`` picks the
first that matches; ``LocalEnvironment`` means no launcher, so ddptrain starts the ranks.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError


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

    def validate(self) -> None:
        """ConfigError naming the variable when this launcher's variables cannot describe a rank."""
        for name in ("rank", "world_size", "local_rank", "local_world_size", "master_port"):
            getattr(self, name)  # each property names its variable when it cannot be read
        if self.world_size < 1:
            raise ConfigError(f"{self.world_var}={self.world_size}: the world needs at least one rank")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"{self.rank_var}={self.rank} is outside the world ({self.world_var}="
                              f"{self.world_size}): ranks are 0 to {self.world_size - 1}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"{self.local_rank_var}={self.local_rank} is outside this node's "
                              f"{self.local_world_size} rank(s): local ranks are 0 to {self.local_world_size - 1}")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port (1-65535); "
                              "set it to a free port, or unset it where ddptrain may choose one")
        check_resolvable(self.master_addr, "MASTER_ADDR")

    # The variables the messages name (each launcher spells them its own way).
    rank_var, world_var, local_rank_var = "RANK", "WORLD_SIZE", "LOCAL_RANK"

    def shared_store_warning(self) -> str | None:
        """A line to print at start about how this launcher was set up, or None."""
        return None

    def _int(self, name: str) -> int:
        value = self.env[name]
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a whole number; the launcher sets it, "
                              f"or unset it to let ddptrain start the ranks") from None

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
        return self._int("RANK")

    @property
    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    @property
    def local_rank(self) -> int:
        # torch.distributed.launch without --use-env passes --local-rank=N instead.
        if "LOCAL_RANK" in self.env:
            return self._int("LOCAL_RANK")
        return self.local_rank_arg if self.local_rank_arg is not None else 0

    @property
    def local_world_size(self) -> int:
        return self._int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in self.env else self.world_size

    @property
    def master_addr(self) -> str:
        return self.env["MASTER_ADDR"]

    @property
    def master_port(self) -> int:
        return self._int("MASTER_PORT")

    def shared_store_warning(self, agent_args: list[str] | None = None) -> str | None:
        """A line for an elastic range (``--nnodes MIN:MAX``) under torch's shared rendezvous
        store: shrinking works, but a node that comes back waits on a store that never names
        the new round's rank 0, and both agents fail 60 s later (pytorch/pytorch#135712).
        ``agent_args``: torchrun's command line (default: the parent process's)."""
        if self.env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or not torchrun's agent
        nodes = elastic_nodes(agent_args if agent_args is not None else parent_args())
        if nodes is None or nodes[0] == nodes[1]:
            return None
        return (f"warning: torchrun --nnodes {nodes[0]}:{nodes[1]} without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
                "a node that leaves can never rejoin (torch's shared rendezvous store, pytorch/pytorch#135712); "
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every node (docs/multinode.md)")


def parent_args() -> list[str]:
    """The parent process's command line (torchrun's, for its workers); [] where unreadable."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def elastic_nodes(args: list[str]) -> tuple[int, int] | None:
    """``(min, max)`` of torchrun's ``--nnodes MIN:MAX`` (or ``--nnodes=MIN:MAX``), else None."""
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--nnodes=") else (
            args[i + 1] if arg == "--nnodes" and i + 1 < len(args) else None)
        if value is not None and ":" in value:
            low, _, high = value.partition(":")
            if low.isdigit() and high.isdigit():
                return int(low), int(high)
    return None


class SlurmEnvironment(Environment):
    """One task per rank started by ``srun``: rank and world size come from Slurm."""

    name = "slurm"
    rank_var, world_var, local_rank_var = "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        # SLURM_STEP_NUM_TASKS is set for srun job steps; a batch script itself (where
        # SLURM_NTASKS describes the allocation, not this process) does not count.
        return all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                                      "SLURM_JOB_NODELIST"))

    @property
    def rank(self) -> int:
        return self._int("SLURM_PROCID")

    @property
    def world_size(self) -> int:
        return self._int("SLURM_STEP_NUM_TASKS")

    @property
    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID") if "SLURM_LOCALID" in self.env else 0

    @property
    def local_world_size(self) -> int:
        name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in self.env else "SLURM_TASKS_PER_NODE"
        node = self._int("SLURM_NODEID") if "SLURM_NODEID" in self.env else 0
        try:
            counts = expand_tasks_per_node(self.env.get(name, "1"))
        except ValueError as error:
            raise ConfigError(f"{name}: {error}") from None
        if not 0 <= node < len(counts):
            raise ConfigError(f"SLURM_NODEID={node} but {name}={self.env.get(name)!r} lists {len(counts)} node(s)")
        return counts[node]

    @property
    def master_addr(self) -> str:
        """MASTER_ADDR if set, else the first host of this job step (srun's own node list),
        else of the job."""
        if "MASTER_ADDR" in self.env:
            return self.env["MASTER_ADDR"]
        name = "SLURM_STEP_NODELIST" if self.env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        try:
            return expand_hostlist(self.env[name])[0]
        except (ValueError, IndexError):
            raise ConfigError(f"{name}={self.env[name]!r} is not a Slurm host list; "
                              "set MASTER_ADDR to the first node's address") from None

    @property
    def master_port(self) -> int:
        if "MASTER_PORT" in self.env:
            return self._int("MASTER_PORT")
        # Every task of the job derives the same port; different jobs get different ones.
        job_id = self._int("SLURM_JOB_ID") if "SLURM_JOB_ID" in self.env else 0
        return 15000 + job_id % 20000


class LocalEnvironment(Environment):
    """No launcher: ddptrain starts the ranks itself (launch/local.py)."""

    name = "local"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    rank = 0
    local_rank = 0
    world_size = 1
    local_world_size = 1

    @property
    def master_addr(self) -> str:
        return self.env.get("MASTER_ADDR", "127.0.0.1")

    @property
    def master_port(self) -> int:
        return self._int("MASTER_PORT") if "MASTER_PORT" in self.env else 0

    def validate(self) -> None:
        """Where the local ranks meet: MASTER_ADDR/MASTER_PORT when set (0: the OS picks a port)."""
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port (0-65535); unset it "
                              "to let the OS pick a free one")
        check_resolvable(self.master_addr, "MASTER_ADDR")


class PyTorchJobPod(LocalEnvironment):
    """A pod of a Kubeflow PyTorchJob (the training operator's v1 API). The operator sets
    torchrun's names to other meanings: ``WORLD_SIZE`` is the number of pods, ``RANK`` this pod's
    index, ``MASTER_ADDR:MASTER_PORT`` the master pod's service; torchrun's own variables
    (``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``) are absent. ddptrain then starts ``--nproc`` ranks
    in this pod as node ``RANK`` of ``WORLD_SIZE`` (launch/local.py), meeting the other pods at
    ``MASTER_ADDR:MASTER_PORT``. ``KUBERNETES_SERVICE_HOST`` (in every pod) tells it from a
    script that sets the four variables for one rank by hand, which stays one rank."""

    name = "pytorchjob"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return (TorchrunEnvironment.detect(env) and "KUBERNETES_SERVICE_HOST" in env
                and not any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK")))

    rank_var, world_var = "RANK", "WORLD_SIZE"

    @property
    def pod(self) -> int:
        return self._int("RANK")

    @property
    def pods(self) -> int:
        return self._int("WORLD_SIZE")

    @property
    def master_addr(self) -> str:
        return self.env["MASTER_ADDR"]

    def validate(self) -> None:
        if self.pods < 1:
            raise ConfigError(f"WORLD_SIZE={self.pods}: a PyTorchJob has at least one pod")
        if not 0 <= self.pod < self.pods:
            raise ConfigError(f"RANK={self.pod} is outside the PyTorchJob's {self.pods} pod(s) (WORLD_SIZE): "
                              f"pod indices are 0 to {self.pods - 1}")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port (1-65535)")
        check_resolvable(self.master_addr, "MASTER_ADDR")

    def own_address(self) -> str:
        """This pod's address as the other pods reach it: the one its route to the master uses."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((self.master_addr, self.master_port))  # no packet: a UDP connect only routes
            return probe.getsockname()[0]

    def describe(self) -> dict[str, object]:
        return {"launcher": self.name, "pod": self.pod, "pods": self.pods, "master_addr": self.master_addr,
                "master_port": self.master_port}


ENVIRONMENTS: tuple[type[Environment], ...] = (PyTorchJobPod, TorchrunEnvironment, SlurmEnvironment,
                                               LocalEnvironment)


def detect(env: Mapping[str, str] | None = None, local_rank_arg: int | None = None) -> Environment:
    """The environment of this process: torchrun first (it may run inside srun), then Slurm.

    Half a launcher's variables (RANK without WORLD_SIZE, say) is a ConfigError, not a
    silent local launch."""
    env = os.environ if env is None else env
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if ("RANK" in env or "WORLD_SIZE" in env) and not TorchrunEnvironment.detect(env):
        missing = [k for k in launcher_vars if k not in env]
        given = [k for k in ("RANK", "WORLD_SIZE") if k in env]
        raise ConfigError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a launcher "
                          f"sets all of {', '.join(launcher_vars)}; set the rest, or unset "
                          f"{' and '.join(given)} to let ddptrain start the ranks")
    for cls in ENVIRONMENTS:
        if cls.detect(env):
            return cls(env, local_rank_arg)
    raise AssertionError("LocalEnvironment always matches")


def check_resolvable(host: str, name: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"{name}={host!r} is not a known host or address; "
                          "give the address of the rank-0 machine") from None


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
        if "[" in item or "]" in item:
            raise ValueError(f"cannot read Slurm host list {item!r}")
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    names: list[str] = []
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
