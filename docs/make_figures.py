"""Regenerate the pictures and the console capture under docs/ from real runs.

    .venv/bin/python docs/make_figures.py

- curves.png, digits-console.txt: `ddptrain train --task digits` on 2 CPU ranks.
- sampler.png: the sample indices each of 2 ranks receives in two epochs, with and
  without `set_epoch` (the very DistributedSampler subclass the ranks use).
- equivalence.png: the loss of 1 rank x batch 64 against 2 ranks x batch 32.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DistributedSampler, TensorDataset  # noqa: E402

DOCS = Path(__file__).parent
DDPTRAIN = [sys.executable, "-m", "ddptrain"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(run_dir: Path, *flags: str) -> str:
    done = subprocess.run([*DDPTRAIN, "train", "--run-dir", str(run_dir), *flags], env=ENV,
                          capture_output=True, text=True, check=True)
    return done.stdout


def digits(tmp: Path) -> None:
    console = train(tmp / "digits", "--task", "digits", "--nproc", "2", "--plot")
    (DOCS / "digits-console.txt").write_text(console)
    shutil.copy(tmp / "digits" / "curves.png", DOCS / "curves.png")


def sampler_picture() -> None:
    data = TensorDataset(torch.zeros(64, 1))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, reshuffle in zip(axes, (True, False)):
        for epoch in (0, 1):
            for rank, marker in ((0, "o"), (1, "s")):
                sampler = DistributedSampler(data, num_replicas=2, rank=rank, seed=0)
                sampler.set_epoch(epoch if reshuffle else 0)
                indices = list(sampler)
                ax.scatter([epoch * 32 + i for i in range(32)], indices, s=14, marker=marker,
                           label=f"rank {rank}" if epoch == 0 else None, color=f"C{rank}")
        ax.axvline(31.5, color="grey", lw=0.8, ls="--")
        ax.set_title("set_epoch(epoch) each epoch" if reshuffle else "set_epoch never called")
        ax.set_xlabel("position in the rank's stream (epoch 0 | epoch 1)")
    axes[0].set_ylabel("sample index (64 samples)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(DOCS / "sampler.png", dpi=110)
    plt.close(fig)


def equivalence_picture(tmp: Path) -> None:
    runs = {"1 rank x batch 64": ("1", "64"), "2 ranks x batch 32": ("2", "32")}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (label, (nproc, batch)), style in zip(runs.items(), ("-o", "--x")):
        run_dir = tmp / f"eq{nproc}"
        train(run_dir, "--nproc", nproc, "--batch-size", batch, "--max-epochs", "20")
        losses = [json.loads(line)["train_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        ax.plot(range(len(losses)), losses, style, label=label, markersize=5)
    ax.set_xlabel("epoch")
    ax.set_ylabel("train loss (MSE)")
    ax.set_yscale("log")
    ax.set_title("the regression job: same global batch, same curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "equivalence.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        digits(Path(tmp))
        sampler_picture()
        equivalence_picture(Path(tmp))
    print("wrote", ", ".join(p.name for p in sorted(DOCS.glob("*.png"))), "and digits-console.txt")
