"""Snapshot size and commit time (torch.save + fsync + rename + folder fsync) for the
tutorial's model and a ~100 MB model, each with its SGD-momentum optimizer state.

    python benchmarks/snapshot_io.py [--reps 5] [--dir /tmp/snapshot-io]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddptrain.snapshots import files as snapshot


def state_for(model: torch.nn.Module) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, model[0].in_features if isinstance(model, torch.nn.Sequential) else 20)).sum().backward()
    optimizer.step()  # creates the momentum buffers
    return {"format_version": snapshot.FORMAT_VERSION, "model": snapshot.cpu_copy(model.state_dict()),
            "optimizer": snapshot.cpu_copy(optimizer.state_dict())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    models = {
        "tutorial Linear(20, 1)": torch.nn.Linear(20, 1),
        # 25M parameters = 100 MB of fp32 weights (+100 MB of momentum buffers)
        "MLP 20-5000-5000-1 (~100 MB weights)": torch.nn.Sequential(
            torch.nn.Linear(20, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 5000), torch.nn.ReLU(),
            torch.nn.Linear(5000, 1)),
    }
    folder = Path(args.dir or tempfile.mkdtemp(prefix="snapshot-io-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{'model':40s} {'weights MB':>10s} {'file MB':>8s} {'commit ms median (min-max)':>28s}")
    for name, model in models.items():
        state = state_for(model)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        times = []
        for rep in range(args.reps):
            started = time.perf_counter()
            progress = {"epoch": 0, "step_in_epoch": rep, "global_step": rep}
            path = snapshot.write_snapshot({**state, "progress": progress}, folder, keep=1)
            times.append((time.perf_counter() - started) * 1000)
        size = path.stat().st_size / 1e6
        print(f"{name:40s} {weights:10.1f} {size:8.2f} "
              f"{statistics.median(times):12.1f} ({min(times):.1f}-{max(times):.1f})")
        for leftover in folder.glob("step-*.pt"):
            leftover.unlink()


if __name__ == "__main__":
    main()
