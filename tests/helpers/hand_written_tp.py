"""A hand-written loop of test_costs.py's --tp job, the reference its collectives are counted
against: tp_tasks' model split by its plan with torch's parallelize_module on a (world / 2, 2)
mesh's "tp" dimension, then fully_shard (FSDP2's defaults) on each block and the root over its
"dp" dimension; plain SGD, ``ACCUM`` micro-batches of 8 a step with the gradient sync held back
on all but the last (``set_requires_gradient_sync(False)``), as a torchtitan-style loop writes it.
Profiled as ``ddptrain train --profile 7`` profiles (a warm-up step, then 7 active ones, shapes
recorded): rank 0's trace lands in OUT/profile/rank-0.json.

    torchrun --nproc-per-node 4 tests/helpers/hand_written_tp.py OUT
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).parent))
from block_tasks import DIM, SEQUENCE, Model  # noqa: E402 (beside this file)
from tp_tasks import PLAN  # noqa: E402

ACCUM, BATCH, STEPS, PROFILED = 2, 8, 9, 7


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Model()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for pattern, style in PLAN.items()
            for name, _ in model.named_modules() if fnmatch.fnmatchcase(name, pattern)}
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(STEPS * ACCUM * world, BATCH, SEQUENCE, DIM)
    targets = inputs[:, :, :, :3].sum(dim=(2, 3)).unsqueeze(-1) / 4
    written = out / "profile" / "rank-0.json"
    written.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=PROFILED, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(written)) if rank == 0 else None) as profiler:
        for step in range(STEPS):
            for micro in range(ACCUM):
                model.set_requires_gradient_sync(micro == ACCUM - 1)
                index = (step * ACCUM + micro) * world + mesh["dp"].get_local_rank()
                F.mse_loss(model(inputs[index]), targets[index]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
