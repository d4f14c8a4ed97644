"""Who started this process? One small class per launcher, each with a ``detect()``.

Modelled on Lightning Fabric's cluster environments: each reads its launcher's variables
and answers by properties: rank, world size, local rank, the master's address, and whether
ddptrain starts the ranks itself (``starts_ranks``: no launcher, or a Kubeflow pod) as node
``node_rank`` of ``nodes``. Callers ask those, never which class they hold. ``detect`` picks
the first that matches.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .slurm_lists import expand_hostlist, expand_tasks_per_node


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks ddptrain starts on this machine meet those of the job's other machines."""

    run_id: str
    local_addr: str  # this machine's address as the others reach it
    configs: dict[str, object]  # torch's rendezvous options
    own_endpoint: bool  # ddptrain alone chose MASTER_ADDR:MASTER_PORT: check it can listen there first


class Environment:
    """This process's place in the job, as its launcher describes it. ``starts_ranks``: no launcher
    started the ranks, so ddptrain starts ``--nproc`` of them here (launch/local.py) as node
    ``node_rank`` of ``nodes``; otherwise this process is rank ``rank`` of ``world_size``."""

    name = "base"
    starts_ranks = False
    # The variables the messages name (each launcher spells them its own way), and what they count.
    rank_var, world_var, local_rank_var = "RANK", "WORLD_SIZE", "LOCAL_RANK"
    too_few = "{count_var}={count}: the world needs at least one rank"
    outside = "{index_var}={index} is outside the world ({count_var}={count}): ranks are 0 to {last}"
    lowest_port, port_advice = 1, "; set it to a free port, or unset it where ddptrain may choose one"

    def __init__(self, env: Mapping[str, str] | None = None, local_rank_arg: int | None = None):
        self.env = dict(os.environ if env is None else env)
        self.local_rank_arg = local_rank_arg

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    # Every property below describes this process's place in the job; a process that starts the
    # ranks is the launcher of this machine's ranks: rank 0 of its own world of 1.
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def local_world_size(self) -> int:
        return 1

    @property
    def nodes(self) -> int:
        """The machines the job spans (where ddptrain starts the ranks: the ones it meets)."""
        return -(-self.world_size // self.local_world_size)

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def master_addr(self) -> str:
        raise NotImplementedError

    @property
    def master_port(self) -> int:
        raise NotImplementedError

    def validate(self) -> None:
        """ConfigError naming the variable when this launcher's variables cannot describe a place."""
        if self.starts_ranks:  # this machine's place among the job's machines
            self._check_place(self.node_rank, self.nodes, self.rank_var, self.world_var)
        else:
            for name in ("rank", "world_size", "local_rank", "local_world_size", "master_port"):
                getattr(self, name)  # each property names its variable when it cannot be read
            self._check_place(self.rank, self.world_size, self.rank_var, self.world_var)
            if not 0 <= self.local_rank < self.local_world_size:
                raise ConfigError(f"{self.local_rank_var}={self.local_rank} is outside this node's "
                                  f"{self.local_world_size} rank(s): local ranks are 0 to {self.local_world_size - 1}")
        if not self.lowest_port <= self.master_port <= 65535:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port ({self.lowest_port}-65535)"
                              f"{self.port_advice}")
        check_resolvable(self.master_addr, "MASTER_ADDR")

    def _check_place(self, index: int, count: int, index_var: str, count_var: str) -> None:
        if count < 1:
            raise ConfigError(self.too_few.format(count_var=count_var, count=count))
        if not 0 <= index < count:
            raise ConfigError(self.outside.format(index_var=index_var, index=index, count_var=count_var,
                                                  count=count, last=count - 1))

    def shared_store_warning(self) -> str | None:
        """A line to print at start about how this launcher was set up, or None."""
        return None

    def start_line(self, nproc: int) -> str | None:
        """Where ddptrain starts the ranks: a line saying where this machine's fit in, or None."""
        return None

    def rendezvous(self, timeout: float) -> Rendezvous:
        """Where ddptrain starts the ranks: how they meet the job's other machines' (``timeout``:
        how long every machine has to join)."""
        raise NotImplementedError(f"{self.name}: its launcher starts the ranks")

    def join_failed(self, timeout: float) -> str | None:
        """The line for a rendezvous that timed out (None: torch's error says it)."""
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
    """No launcher: ddptrain starts the ranks itself (launch/local.py), meeting at
    MASTER_ADDR:MASTER_PORT when set (port 0, the default: the OS picks a free one)."""

    name = "local"
    starts_ranks = True
    lowest_port, port_advice = 0, "; unset it to let the OS pick a free one"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    @property
    def master_addr(self) -> str:
        return self.env.get("MASTER_ADDR", "127.0.0.1")

    @property
    def master_port(self) -> int:
        return self._int("MASTER_PORT") if "MASTER_PORT" in self.env else 0

    def rendezvous(self, timeout: float) -> Rendezvous:
        return Rendezvous(str(uuid.uuid4()), self.master_addr, {}, own_endpoint=True)


class PyTorchJobPod(Environment):
    """A pod of a Kubeflow PyTorchJob (the training operator's v1 API). The operator sets
    torchrun's names to other meanings: ``WORLD_SIZE`` is the number of pods, ``RANK`` this pod's
    index, ``MASTER_ADDR:MASTER_PORT`` the master pod's service; torchrun's own variables
    (``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``) are absent. ddptrain then starts ``--nproc`` ranks
    in this pod as node ``RANK`` of ``WORLD_SIZE`` (launch/local.py), meeting the other pods at
    ``MASTER_ADDR:MASTER_PORT``. ``KUBERNETES_SERVICE_HOST`` (in every pod) tells it from a
    script that sets the four variables for one rank by hand, which stays one rank."""

    name = "pytorchjob"
    starts_ranks = True
    too_few = "{count_var}={count}: a PyTorchJob has at least one pod"
    outside = ("{index_var}={index} is outside the PyTorchJob's {count} pod(s) ({count_var}): "
               "pod indices are 0 to {last}")
    port_advice = ""

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return (TorchrunEnvironment.detect(env) and "KUBERNETES_SERVICE_HOST" in env
                and not any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK")))

    @property
    def node_rank(self) -> int:
        return self._int("RANK")

    @property
    def nodes(self) -> int:
        return self._int("WORLD_SIZE")

    @property
    def master_addr(self) -> str:
        return self.env["MASTER_ADDR"]

    @property
    def master_port(self) -> int:
        return self._int("MASTER_PORT") if "MASTER_PORT" in self.env else 0

    def start_line(self, nproc: int) -> str:
        return (f"ddptrain: a Kubeflow PyTorchJob pod (RANK={self.node_rank} of WORLD_SIZE={self.nodes} pods): "
                f"node {self.node_rank}, {nproc} rank(s) here, {nproc * self.nodes} in all, meeting at "
                f"{self.master_addr}:{self.master_port}")

    def rendezvous(self, timeout: float) -> Rendezvous:
        return Rendezvous(f"ddptrain-{self.master_addr}-{self.master_port}", self.own_address(),
                          {"is_host": self.node_rank == 0, "join_timeout": timeout},  # all pods, or a clear error
                          own_endpoint=False)

    def join_failed(self, timeout: float) -> str:
        return (f"not every pod of the PyTorchJob joined within --timeout {timeout:g} s at "
                f"{self.master_addr}:{self.master_port}: WORLD_SIZE={self.nodes} says {self.nodes} pods; check the "
                "job's replicas (in a PyTorchJob, WORLD_SIZE counts pods, not processes)")

    def own_address(self) -> str:
        """This pod's address as the other pods reach it: the one its route to the master uses."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((self.master_addr, self.master_port))  # no packet: a UDP connect only routes
            return probe.getsockname()[0]

    def describe(self) -> dict[str, object]:
        return {"launcher": self.name, "pod": self.node_rank, "pods": self.nodes, "master_addr": self.master_addr,
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
