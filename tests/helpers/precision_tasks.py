"""Task factories about precision and the device (``--task precision_tasks:FUNC``): what dtype
the loss sees under mixed precision, and CUDA's host syncs (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from ddptrain import Task

from ddptrain_test_tasks import mlp_regression
from kills import _rank


def host_syncs_counted(cfg) -> Task:
    """The MLP regression task with CUDA's sync debug mode on (benchmarks/gpu_check.sh): every
    operation that makes the host wait for the GPU warns, each time, with the Python line that
    asked for it, so the log counts a step's host syncs and says where they are."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        what = "host sync" if "synchronizing CUDA operation" in str(message) else category.__name__
        print(f"{what} at {filename}:{lineno}: {str(message).splitlines()[0]}", file=sys.stderr)

    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        warnings.showwarning = show
    return mlp_regression(cfg)


def dtypes_seen(cfg) -> Task:
    """The MLP regression task; at its first step each rank writes to DTYPES_SEEN/rank-N.json the
    dtype of a weight inside the forward and of the output the loss receives."""
    task, seen = mlp_regression(cfg), {}

    def note_weight(module, args, out) -> None:
        seen.setdefault("weight", str(module.weight.dtype))
    task.model[0].register_forward_hook(note_weight)

    def loss(output, target):
        if "output" not in seen:
            seen["output"] = str(output.dtype)
            Path(os.environ["DTYPES_SEEN"], f"rank-{_rank()}.json").write_text(json.dumps(seen))
        return F.mse_loss(output, target)
    task.loss_fn = loss
    return task
