"""What ``ddptrain bench`` measures ddptrain against, on the same job, launched the way each
one's users launch it:

- ``loop``: the tutorial's hand-written DDP loop, corrected: DataLoader + DistributedSampler
  + DDP, started with ``mp.spawn``.
- ``lightning``: a LightningModule and ``Trainer(strategy="ddp")`` (Lightning starts the ranks).
- ``accelerate``: the same loop on ``Accelerator`` (``prepare``, ``backward``), under torchrun.

Every contender seeds the same model, trains on the same samples in the same order
(DistributedSampler, seed 0, batch 32 per rank, SGD lr 1e-3, MSE) and rank 0 saves the final
weights to ``OUT/model.pt``, so the benchmark can check they all ended at the same loss.

    python -m ddptrain.bench.loops --loop loop --job tutorial --nproc 2 --epochs 3 --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..tasks.protocol import Task
from ..tasks.regression import regression_data

# job -> (samples, hidden width or 0 for the tutorial's Linear(20, 1))
JOBS = {"tutorial": (2048, 0), "mlp": (8192, 1024)}
SMOKE_SAMPLES = 256
BATCH, LR, SEED = 32, 1e-3, 0


def job_model(job: str) -> torch.nn.Module:
    width = JOBS[job][1]
    if not width:
        return torch.nn.Linear(20, 1)
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


def job_data(job: str) -> TensorDataset:
    samples = SMOKE_SAMPLES if os.environ.get("DDPTRAIN_BENCH_SMOKE") else JOBS[job][0]
    return regression_data(SEED, samples)


def bench_task(cfg: Any) -> Task:
    """The job named by DDPTRAIN_BENCH_JOB as a ddptrain task (``--task ddptrain.bench.loops:bench_task``)."""
    job = os.environ.get("DDPTRAIN_BENCH_JOB", "tutorial")
    return Task(model=job_model(job), train_set=job_data(job), loss_fn=F.mse_loss, defaults={"lr": LR})


def final_loss(job: str, weights: dict[str, torch.Tensor]) -> float:
    """The full data set's MSE under the final weights: the same job ends at the same loss."""
    model = job_model(job)
    model.load_state_dict(weights)
    inputs, targets = job_data(job).tensors
    with torch.no_grad():
        return F.mse_loss(model(inputs), targets).item()


def _sampler_and_loader(data: TensorDataset, world: int, rank: int) -> tuple[DistributedSampler, DataLoader]:
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=SEED)
    return sampler, DataLoader(data, batch_size=BATCH, sampler=sampler)


def _save(model: torch.nn.Module, out: str) -> None:
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(out) / "model.pt")


# --- the tutorial's loop, with mp.spawn ------------------------------------------------------------
def _loop_rank(rank: int, world: int, job: str, epochs: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(SEED)
    model = DDP(job_model(job))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler, loader = _sampler_and_loader(job_data(job), world, rank)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xs, ys in loader:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(xs), ys).backward()
            optimizer.step()
    if rank == 0:
        _save(model.module, out)
    dist.barrier()  # rank 0 hosts the store: nobody tears down while another still talks to it
    dist.destroy_process_group()


def run_loop(job: str, nproc: int, epochs: int, out: str) -> None:
    import torch.multiprocessing as mp

    from ..comm import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(_loop_rank, args=(nproc, job, epochs, out), nprocs=nproc)


# --- Lightning -------------------------------------------------------------------------------------
def run_lightning(job: str, nproc: int, epochs: int, out: str) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.model = job_model(job)

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            return F.mse_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> DataLoader:  # Lightning calls set_epoch on the sampler
            return _sampler_and_loader(job_data(job), self.trainer.world_size, self.trainer.global_rank)[1]

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=nproc, strategy="ddp", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module)
    if trainer.global_rank == 0:
        _save(module.model, out)


# --- Accelerate (under torchrun) ---------------------------------------------------------------------
def run_accelerate(job: str, epochs: int, out: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    model = job_model(job)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler, loader = _sampler_and_loader(job_data(job), accelerator.num_processes, accelerator.process_index)
    model, optimizer = accelerator.prepare(model, optimizer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xs, ys in loader:
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(F.mse_loss(model(xs), ys))
            optimizer.step()
    if accelerator.is_main_process:
        _save(accelerator.unwrap_model(model), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", choices=("loop", "lightning", "accelerate"), required=True)
    parser.add_argument("--job", choices=tuple(JOBS), required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.loop == "loop":
        run_loop(args.job, args.nproc, args.epochs, args.out)
    elif args.loop == "lightning":
        run_lightning(args.job, args.nproc, args.epochs, args.out)
    else:
        run_accelerate(args.job, args.epochs, args.out)


if __name__ == "__main__":
    sys.exit(main())


def mlp34m_task(cfg: Any) -> Task:
    """A ~34M-parameter MLP (32 blocks of 1024x1024) with AdamW: ddp against fsdp memory
    (benchmarks/fsdp_memory.py). FSDP holds a block or two whole besides its shards, so
    the blocks are a fraction of the model, as in a transformer."""
    width, blocks = 1024, 32
    model = torch.nn.Sequential(torch.nn.Linear(20, width),
                                *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                  for _ in range(blocks)],
                                torch.nn.Linear(width, 1))
    samples = int(os.environ.get("DDPTRAIN_BENCH_SAMPLES", "512"))
    return Task(model=model, train_set=regression_data(cfg.seed, samples), loss_fn=F.mse_loss,
                defaults={"optimizer": "adamw", "lr": 1e-4})
