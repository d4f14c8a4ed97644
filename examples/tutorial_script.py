"""The tutorial's script, in its own shape (a data set, load_train_objs, main), with
ddptrain doing the distributed part through ddptrain.fit:

    python examples/tutorial_script.py --max_epochs 5 --batch_size 32
    torchrun --nproc-per-node=2 examples/tutorial_script.py --max_epochs 5 --batch_size 32
    cd examples && ddptrain train --task tutorial_script:load_train_objs --max-epochs 5

All three train the same weights, bit for bit (tests/integration/test_api.py checks it).
"""

import argparse

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddptrain


class MyTrainDataset(Dataset):
    """The tutorial's random data set, seeded: every rank holds the same samples."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def load_train_objs(cfg: ddptrain.RunConfig) -> ddptrain.Task:
    """A task factory: every rank calls it (after torch.manual_seed(cfg.seed))."""
    return ddptrain.Task(
        model=torch.nn.Linear(20, 1),
        train_set=MyTrainDataset(2048, cfg.seed),
        loss_fn=F.mse_loss,  # the tutorial's cross_entropy on one output is always 0
        make_optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
    )


def main(total_epochs: int, batch_size: int, run_dir: str | None) -> None:
    summary = ddptrain.fit(load_train_objs, max_epochs=total_epochs, batch_size=batch_size, run_dir=run_dir)
    if summary:  # rank 0 (under torchrun the other ranks get {})
        print(f"final train loss {summary['train_loss']:.4f} after {summary['steps']} steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the tutorial's script on ddptrain.fit")
    parser.add_argument("--max_epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--run_dir", default=None)
    args = parser.parse_args()
    main(args.max_epochs, args.batch_size, args.run_dir)
