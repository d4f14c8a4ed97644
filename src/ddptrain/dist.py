"""Process-group setup for one rank: device, backend, threads, init and teardown.

The tutorial's ``ddp_setup`` hard-codes nccl, ``cuda.set_device`` and port 12355; here the
device and backend follow what the machine has, and the address comes from the launcher.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError
from .environments import Environment

# The first collectives (DDP's broadcast of rank 0's weights) wait for every rank to build
# its task, which can take long on a busy machine; the configured timeout applies after.
STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job, as the trainer needs it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """The tutorial's ``[GPU:0]`` / ``[CPU:1]`` prefix."""
        kind = "GPU" if self.device.type == "cuda" else "CPU"
        return f"[{kind}:{self.rank}]"


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device_kind(device: str, backend: str, local_world_size: int) -> tuple[str, str]:
    """(``cpu``|``cuda``, ``gloo``|``nccl``) for the flags; ConfigError if impossible."""
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


@contextmanager
def process_group(env: Environment, device: str, backend: str, timeout_s: float) -> Iterator[DistContext]:
    """Join the job's process group for the duration of the block, and always leave it."""
    device_kind, backend = resolve_device_kind(device, backend, env.local_world_size)
    if device_kind == "cuda":
        torch_device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
        set_cpu_threads(env.local_world_size)
    env.export()
    dist.init_process_group(
        backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size,
        timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
        device_id=torch_device if device_kind == "cuda" else None,
    )
    try:
        yield DistContext(env.rank, env.world_size, env.local_rank, env.local_world_size,
                          torch_device, backend)
    finally:
        dist.destroy_process_group()


def apply_step_timeout(timeout_s: float) -> None:
    """After start-up, collectives fail after the configured timeout instead of the long one."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:  # private in torch 2.x; without it the start-up timeout stays
        setter(datetime.timedelta(seconds=timeout_s))
