"""Process-group setup for one rank: device, backend, threads, the store, init and teardown.

The tutorial's ``ddp_setup`` hard-codes nccl, ``cuda.set_device`` and port 12355; here the
device and backend follow what the machine has, and the address comes from the launcher.

The rank connects to the job's key-value store (the TCPStore that ``init_process_group``
would create) *before* it builds its task, and the process group is built on that store.
The watchdog (resilience/watchdog.py) uses its own connection to the same store from the first second
of a rank's life, so a rank that hangs or fails during start-up is noticed and named too.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..comm import BACKSTOP_EXTRA_S, CollectiveMarks, DistContext
from ..errors import ConfigError
from ..resilience import flight
from .environments import Environment, TorchrunEnvironment, detect

SETTLE_S = 0.1  # seconds gloo's threads get to let go of the last collective (settle_gloo)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device_kind(device: str, backend: str, local_world_size: int) -> tuple[str, str]:
    """(``cpu``|``cuda``, ``gloo``|``nccl``) for the settings; ConfigError if impossible."""
    gpus = cuda_count()
    if device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda: no CUDA GPU is visible here; use --device cpu or auto")
    if device == "cuda" and gpus < local_world_size:
        raise ConfigError(f"--device cuda: {local_world_size} local ranks but {gpus} GPUs; "
                          f"use --nproc {gpus} or --device cpu")
    if device == "auto":
        device = "cuda" if gpus >= local_world_size > 0 else "cpu"
    if backend == "nccl" and (device != "cuda" or not dist.is_nccl_available()):
        raise ConfigError("--backend nccl needs CUDA GPUs and an NCCL build of torch; "
                          "use --backend gloo or auto")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    return device, backend


def check_comm_hook(hook: str, backend: str) -> None:
    if hook == "bf16" and backend != "nccl":
        raise ConfigError("--comm-hook bf16 needs the nccl backend (torch's hook refuses gloo); "
                          "use --comm-hook fp16 on CPU")


def set_cpu_threads(local_world_size: int) -> None:
    """Share the cores between the local ranks, unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


def uses_agent_store() -> bool:
    """torchrun's agent hosts the store and every rank is its client (torch's own rule)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def hosts_store(env: Environment) -> bool:
    """Whether this rank's process serves the job's store (rank 0, unless torchrun's agent does)."""
    return not uses_agent_store() and env.rank == 0


def is_loopback(addr: str) -> bool:
    """A loopback address written as one (127.0.0.1, ::1). Not ``localhost``: a client may resolve
    it to the other family than the one the server listens on."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def loopback_listener(addr: str, port: int) -> tuple[int, int] | None:
    """(file descriptor, port) of a socket listening on ``addr:port`` (port 0: the OS picks one)
    when ``addr`` is a loopback address, for a TCPStore server to serve on (its
    ``master_listen_fd``); None elsewhere. A store left to listen by itself serves on every
    interface (``*:PORT``); a job whose every rank is on this machine needs loopback alone."""
    if not is_loopback(addr):
        return None
    listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(4096)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return listener.detach(), port  # the store owns the socket now


def store_server(addr: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore server at ``addr:port``, on loopback alone where ``addr`` is loopback. Made
    ``multi_tenant``: a store torch creates later on the same port in this process (the elastic
    agent's rendezvous, ``init_process_group``) is this one."""
    listening = loopback_listener(addr, port)
    fd, port = listening if listening is not None else (None, port)
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True, master_listen_fd=fd)


def connect_store(env: Environment, timeout_s: float) -> dist.Store:
    """The job's store: rank 0 hosts it (or torchrun's agent does); the others connect. In a
    process group someone else started (Ray Train's workers: ``init_process_group("env://")``),
    rank 0's process already serves the store at MASTER_ADDR:MASTER_PORT: every rank connects.

    ``wait_for_workers=False``: rank 0 does not block here until every rank has connected,
    so its watchdog runs while a late rank is still starting (and can name it)."""
    timeout = datetime.timedelta(seconds=timeout_s + BACKSTOP_EXTRA_S)
    if hosts_store(env) and not dist.is_initialized():
        return store_server(env.master_addr, env.master_port, timeout_s + BACKSTOP_EXTRA_S, env.world_size)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                         timeout=timeout, wait_for_workers=False, multi_tenant=True)


def init_device(device_kind: str, env: Environment) -> torch.device:
    if device_kind == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        return device
    set_cpu_threads(env.local_world_size)
    return torch.device("cpu")


@contextmanager
def joined(env: Environment, device_kind: str, backend: str, timeout_s: float, store: dist.Store,
           watchdog: CollectiveMarks) -> Iterator[DistContext]:
    """Join the job's process group on ``store`` for the duration of the block.

    On success every rank leaves the group. After an error it is left as it is: tearing
    down a group whose peer died can block forever (gloo waits for the peer's half of a
    pending operation), and a failed rank exits at once anyway (launch/rank.py).

    A group that exists already (Ray Train starts its workers' group before the user's
    function runs) is used as it is, and left to its owner: never initialised or destroyed here."""
    device = init_device(device_kind, env)
    env.export()
    if dist.is_initialized():
        check_existing_group(env)
        yield DistContext(env.rank, env.world_size, env.local_rank, env.local_world_size, device,
                          dist.get_backend(), watchdog)
        return
    flight.enable()  # the watchdog names each rank's collective when they hang
    with watchdog.waiting("start-up: joining the process group"):
        dist.init_process_group(
            backend=backend, store=dist.PrefixStore("default_pg", store), rank=env.rank,
            world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s + BACKSTOP_EXTRA_S),
            device_id=device if device_kind == "cuda" else None,
        )
    yield DistContext(env.rank, env.world_size, env.local_rank, env.local_world_size, device, backend, watchdog)
    dist.destroy_process_group()  # not reached after an error: see above


def check_existing_group(env: Environment) -> None:
    """The group this process is already in must be the job the launcher's variables describe."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (env.rank, env.world_size):
        raise ConfigError(f"this process is already in a process group as rank {rank} of {world}, but "
                          f"{env.rank_var}={env.rank} {env.world_var}={env.world_size} say otherwise; start "
                          "ddptrain in a group whose ranks match its launcher's variables")


@contextmanager
def process_group(rank: int | None = None, world_size: int | None = None, *, device: str = "auto",
                  backend: str = "auto", timeout: float = 300.0) -> Iterator[DistContext]:
    """The tutorial's ``ddp_setup`` for scripts that build a ``Trainer`` themselves.

    Under torchrun, ``torch.distributed.launch --use-env`` or srun, call it with no
    arguments: the launcher's variables say who this process is. With ``mp.spawn``, pass
    ``rank`` and ``world_size`` and set ``MASTER_ADDR``/``MASTER_PORT`` before spawning
    (``free_port()`` finds a port)."""
    if rank is None:
        env = detect()
    else:
        env = TorchrunEnvironment({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                                   "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                   "MASTER_PORT": os.environ.get("MASTER_PORT", "29500")})
    from ..resilience.watchdog import Watchdog

    env.validate()
    device_kind, backend = resolve_device_kind(device, backend, env.local_world_size)
    store = connect_store(env, timeout)
    watchdog = Watchdog(env, timeout, run_dir=None, hosts_store=hosts_store(env)).start()
    try:
        with joined(env, device_kind, backend, timeout, store, watchdog) as ctx:
            yield ctx
            settle_gloo()
    except BaseException as error:
        watchdog.report_failure(error)  # the other ranks stop now instead of at the timeout
        raise
    finally:
        watchdog.stop()


def settle_gloo() -> None:
    """Let gloo's worker threads drop the last collective's work before the script goes on to
    exit. A gloo thread frees a finished work's tensors after the waiting rank has moved on, and
    freeing a tensor that Python once held takes the GIL. DDP keeps the process group alive past
    ``destroy_process_group`` (torch 2.13), so its threads are joined at interpreter exit, by a
    main thread that holds the GIL: a thread still waiting for the GIL then deadlocks the exit
    (seen under load with examples/ddp_gpus_torchrun.py). The barrier makes the last collective
    one every rank has finished; the sleep releases the GIL while the threads let go of it."""
    dist.barrier()
    time.sleep(SETTLE_S)


