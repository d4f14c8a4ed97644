"""The tutorial's torchrun script, corrected, on ddptrain's Trainer.

    torchrun --nproc-per-node=2 examples/ddp_gpus_torchrun.py --max_epochs 5 --batch_size 32
    python -m torch.distributed.launch --use-env --nproc-per-node=2 \
        examples/ddp_gpus_torchrun.py --max_epochs 5 --batch_size 32

The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; process_group()
only reads them. (`ddptrain train` does all of this for you, under any launcher.)
"""

import argparse

import torch

from ddptrain import RunConfig, Trainer, process_group
from ddptrain.tasks import regression_task


def main(max_epochs: int, batch_size: int, run_dir: str):
    cfg = RunConfig(max_epochs=max_epochs, batch_size=batch_size, run_dir=run_dir, resume="never")
    with process_group() as ctx:
        torch.manual_seed(cfg.seed)
        trainer = Trainer(regression_task(cfg), cfg, ctx)
        trainer.train(max_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DDP training under torchrun")
    parser.add_argument("--max_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--run_dir", default="runs/ddp_gpus_torchrun")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)  # legacy launch
    args = parser.parse_args()
    main(args.max_epochs, args.batch_size, args.run_dir)
