"""The tutorial's mp.spawn script, corrected, on ddptrain's Trainer.

    python examples/ddp_gpus.py --max_epochs 5 --batch_size 32

One process per GPU (2 CPU processes when there is none). What changed from the notes:
a free port instead of 12355, gloo/CPU without GPUs, the same seeded data on every rank,
MSE instead of cross_entropy (which is 0 for one output), no hang when a rank fails.
Run it twice: each run starts afresh (resume="never"); the earlier run's files are moved
aside, named in one line.
"""

import argparse
import os

import torch
import torch.multiprocessing as mp

from ddptrain import RunConfig, Trainer, free_port, process_group
from ddptrain.tasks import regression_task


def ddp_setup(rank: int, world_size: int):
    """Rank `rank` of `world_size` joins the process group (nccl on GPUs, else gloo)."""
    return process_group(rank, world_size)


def main(rank: int, world_size: int, max_epochs: int, batch_size: int, run_dir: str):
    cfg = RunConfig(max_epochs=max_epochs, batch_size=batch_size, run_dir=run_dir, resume="never")
    with ddp_setup(rank, world_size) as ctx:
        torch.manual_seed(cfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
        task = regression_task(cfg)  # 2048 samples x 20 features, identical on every rank
        trainer = Trainer(task, cfg, ctx)
        trainer.train(max_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DDP training with mp.spawn")
    parser.add_argument("--max_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--run_dir", default="runs/ddp_gpus")
    args = parser.parse_args()
    world_size = torch.cuda.device_count() or 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(main, args=(world_size, args.max_epochs, args.batch_size, args.run_dir), nprocs=world_size)
