"""What ``ddptrain bench`` measures ddptrain against, on the same job (bench/jobs.py), launched
the way each one's users launch it:

- ``loop``: the tutorial's hand-written loop, corrected: DataLoader + DistributedSampler +
  DDP, started with ``mp.spawn``; on the ``fsdp`` job, FSDP2 written by hand (``fully_shard``
  on each block, then the root), as torchtitan does it.
- ``loop-grad-norm``: that loop plus ddptrain's per-step gradient norm (observe/metrics.py's
  GradNorms: one fused norm kernel into a slot on the device, no host sync), read once at the
  end: its ratio to ``loop`` is what logging ``grad_norm`` costs a step.
- ``lightning``: a LightningModule and ``Trainer(strategy="ddp")`` (Lightning starts the
  ranks); on the ``fsdp`` job, ``ModelParallelStrategy`` with ``fully_shard`` in
  ``configure_model`` (Lightning's FSDP2 path: its ``strategy="fsdp"`` refuses CPUs).
- ``accelerate``: the same loop on ``Accelerator`` (``prepare``, ``backward``), under torchrun.
  On CPUs Accelerate's FSDP plugin quietly gives DDP, so on the ``fsdp`` job the model is
  sharded by hand with ``fully_shard`` and Accelerate prepares the optimizer and runs backward
  (the closest CPU equivalent).

Rank 0 of every contender saves the whole final weights to ``OUT/model.pt``, so the benchmark
can check they all ended at the same loss; every loss ticks the step clock (bench/clock.py).

    python -m ddptrain.bench.loops --loop loop --job tutorial --nproc 2 --epochs 3 --out DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from .clock import clock
from .jobs import JOBS, SEED, Job, bench_device, blocks_of


def _sampler_and_loader(job: Job, world: int, rank: int) -> tuple[DistributedSampler, DataLoader]:
    data = job.train_set()
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=SEED)
    return sampler, DataLoader(data, batch_size=job.batch, sampler=sampler)


def _shard(model: torch.nn.Module, mesh: Any = None) -> None:
    """FSDP2 as its documentation and torchtitan apply it: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _whole_weights(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (every rank calls it: a sharded model is gathered)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return cast(dict[str, torch.Tensor],
                    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _save(weights: dict[str, torch.Tensor], out: str) -> None:
    torch.save(weights, Path(out) / "model.pt")


def _note_training_peak(out: str, rank: int) -> None:
    """This rank's peak RSS in MB so far (training, before the whole weights are gathered) into
    ``OUT/training_peak_rss_mb.<rank>``, as ddptrain's metrics.jsonl has it (benchmarks/fsdp_memory.py)."""
    from ..observe.metrics import peak_rss_mb

    (Path(out) / f"training_peak_rss_mb.{rank}").write_text(str(peak_rss_mb()))


# --- the hand-written loop, with mp.spawn -----------------------------------------------------------
def _loop_rank(rank: int, world: int, job_name: str, epochs: int, out: str, grad_norm: bool = False) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..comm import local_tensors, no_tensors
    from ..observe.metrics import GradNorms

    job, tick, device = JOBS[job_name], clock(), bench_device(rank)
    if device.type == "cuda":  # the tutorial's GPU loop: one GPU per rank, nccl, batches moved per step
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    torch.manual_seed(SEED)
    model = job.model().to(device)
    if job.sharded:
        _shard(model)
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = job.optimizer(model.parameters())
    sampler, loader = _sampler_and_loader(job, world, rank)
    counted = local_tensors if job.sharded or rank == 0 else no_tensors
    norms = GradNorms(device, len(loader), counted) if grad_norm else None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = [part.to(device, non_blocking=True) for part in batch]
            optimizer.zero_grad(set_to_none=True)
            tick()
            job.loss(model, batch).backward()
            if norms is not None:
                norms.add([p.grad for p in model.parameters() if p.grad is not None])
            optimizer.step()
        if norms is not None:  # the epoch's figure, as ddptrain's record has it (one host sync an epoch)
            norms.figures(norms.local_squares())
            norms.reset()
    _note_training_peak(out, rank)
    weights = _whole_weights(model if job.sharded else cast(torch.nn.Module, model.module), job.sharded)
    if rank == 0:
        _save(weights, out)
    dist.barrier()  # rank 0 hosts the store: nobody tears down while another still talks to it
    dist.destroy_process_group()


def run_loop(job: str, nproc: int, epochs: int, out: str, grad_norm: bool = False) -> None:
    import torch.multiprocessing as mp

    from ..comm import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(_loop_rank, args=(nproc, job, epochs, out, grad_norm), nprocs=nproc)


# --- Lightning -------------------------------------------------------------------------------------
def run_lightning(job_name: str, nproc: int, epochs: int, out: str) -> None:
    import lightning as L

    job, tick = JOBS[job_name], clock()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.model = job.model()

        def configure_model(self) -> None:  # ModelParallelStrategy: shard here, on the strategy's mesh
            if job.sharded:
                _shard(self.model, self.device_mesh["data_parallel"])  # type: ignore[index]  # set by then

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            tick()
            return job.loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return job.optimizer(self.parameters())

        def train_dataloader(self) -> DataLoader:  # Lightning calls set_epoch on the sampler
            return _sampler_and_loader(job, self.trainer.world_size, self.trainer.global_rank)[1]

    if job.sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=nproc, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    module = Module()
    trainer = L.Trainer(accelerator=bench_device(0).type, devices=nproc, strategy=strategy, max_epochs=epochs,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module)
    weights = _whole_weights(module.model, job.sharded)
    if trainer.global_rank == 0:
        _save(weights, out)
    trainer.strategy.barrier()  # as the hand-written loop: nobody leaves while rank 0 still saves
    if dist.is_initialized():
        dist.destroy_process_group()


# --- Accelerate (under torchrun) ---------------------------------------------------------------------
def run_accelerate(job_name: str, epochs: int, out: str) -> None:
    from accelerate import Accelerator

    job, tick = JOBS[job_name], clock()
    accelerator = Accelerator(cpu=bench_device(0).type == "cpu")
    torch.manual_seed(SEED)
    model = job.model().to(accelerator.device)
    sampler, loader = _sampler_and_loader(job, accelerator.num_processes, accelerator.process_index)
    if job.sharded:  # sharded by hand (see the module's docstring); Accelerate would wrap it in DDP
        _shard(model)
        optimizer = accelerator.prepare(job.optimizer(model.parameters()))
    else:
        model, optimizer = accelerator.prepare(model, job.optimizer(model.parameters()))
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = [part.to(accelerator.device, non_blocking=True) for part in batch]
            optimizer.zero_grad(set_to_none=True)
            tick()
            accelerator.backward(job.loss(model, batch))
            optimizer.step()
    weights = _whole_weights(model if job.sharded else accelerator.unwrap_model(model), job.sharded)
    if accelerator.is_main_process:
        _save(weights, out)
    # As the hand-written loop: nobody tears down while another still talks to the store rank 0
    # hosts. Without it, rank 1 left while rank 0 saved, and aborted at exit beside a CPU hog
    # ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", choices=("loop", "loop-grad-norm", "lightning", "accelerate"), required=True)
    parser.add_argument("--job", choices=tuple(JOBS), required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.loop in ("loop", "loop-grad-norm"):
        run_loop(args.job, args.nproc, args.epochs, args.out, grad_norm=args.loop == "loop-grad-norm")
    elif args.loop == "lightning":
        run_lightning(args.job, args.nproc, args.epochs, args.out)
    else:
        run_accelerate(args.job, args.epochs, args.out)


if __name__ == "__main__":
    main()
