"""What ``ddptrain bench`` measures ddptrain against: hand-written DDP loops, launched the
tutorial's way (``mp.spawn``), and the benchmark jobs as a ddptrain task.

- ``bare``: the tutorial's loop, corrected: DataLoader + DistributedSampler + DDP.
- ``floor``: no DataLoader, no framework: index tensors, forward, backward, step.

Run one as ``python -m ddptrain.bench_loops --loop bare --job tutorial --nproc 2 --out r.json``.
Rank 0 writes ``{"first_step_at": t, "epoch_ends": [t0, t1, ...], "samples_per_epoch": n}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .tasks.protocol import Task
from .tasks.regression import regression_data

# job -> (samples, hidden width or 0 for the tutorial's Linear(20, 1)). The MLP job is
# compute-bound, so its samples/s does not depend on the epoch's length: 16,384 samples
# (not 65,536) keep a 3-repetition benchmark near ten minutes on 2 cores.
JOBS = {"tutorial": (2048, 0), "mlp": (16384, 1024)}
SMOKE_SAMPLES = 512


def job_model(job: str) -> torch.nn.Module:
    width = JOBS[job][1]
    if not width:
        return torch.nn.Linear(20, 1)
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


def job_samples(job: str) -> int:
    return SMOKE_SAMPLES if os.environ.get("DDPTRAIN_BENCH_SMOKE") else JOBS[job][0]


def bench_task(cfg: Any) -> Task:
    """The job named by DDPTRAIN_BENCH_JOB as a ddptrain task (``--task ddptrain.bench_loops:bench_task``)."""
    job = os.environ.get("DDPTRAIN_BENCH_JOB", "tutorial")
    return Task(model=job_model(job), train_set=regression_data(cfg.seed, job_samples(job)), loss_fn=F.mse_loss)


class _NotInMemory(torch.utils.data.Dataset):
    """The same samples behind a plain Dataset: ddptrain takes the DataLoader path."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.inner[index]


def bench_task_via_dataloader(cfg: Any) -> Task:
    """``bench_task`` through the DataLoader path (benchmarks/gpu_check.sh compares the two)."""
    task = bench_task(cfg)
    task.train_set = _NotInMemory(task.train_set)
    return task


def _rank(rank: int, world: int, port: int, loop: str, job: str, epochs: int, batch: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    data = regression_data(0, job_samples(job))
    model = DDP(job_model(job))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler) if loop == "bare" else None
    first_step_at, epoch_ends = None, []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = loader if loader is not None else _index_batches(data, sampler, batch)
        for xs, ys in batches:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(xs), ys).backward()
            optimizer.step()
            first_step_at = first_step_at or time.time()
        epoch_ends.append(time.time())
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"first_step_at": first_step_at, "epoch_ends": epoch_ends,
                       "samples_per_epoch": len(data)}, handle)
    dist.destroy_process_group()


def _index_batches(data: TensorDataset, sampler: DistributedSampler, batch: int):
    order = torch.tensor(list(sampler))
    for chunk in order.split(batch):
        yield tuple(t[chunk] for t in data.tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", choices=("bare", "floor"), required=True)
    parser.add_argument("--job", choices=tuple(JOBS), required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.nproc, port, args.loop, args.job, args.epochs, args.batch_size, args.out),
             nprocs=args.nproc)


if __name__ == "__main__":
    main()
