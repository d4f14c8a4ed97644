"""``ddptrain env``: what a user pastes into a bug report."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch
import torch.distributed as dist

from .. import __version__
from .environments import detect

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST")


def environment_report() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "ddptrain": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                     "mpi": dist.is_mpi_available()},
        "cpu_count": os.cpu_count(),
        "launcher": detect().describe(),
        "launcher_variables": {k: os.environ[k] for k in LAUNCHER_VARS if k in os.environ},
    }
