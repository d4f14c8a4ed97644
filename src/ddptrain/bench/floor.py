"""``ddptrain bench --floor``: the start-up floors of a multi-rank CPU job on this machine, next to
ddptrain's 1-epoch command of the tutorial job, measured side by side.

- ``floor``: what no multi-rank program can avoid: a Python process imports torch, forks the
  ranks, each joins a gloo group over a TCP store, runs one all-reduce and leaves.
- ``training floor``: what no PyTorch training job can avoid on top: each rank also wraps the
  tutorial's ``Linear(20, 1)`` in DDP, makes an SGD optimizer and takes one step. Both import
  ``torch._dynamo`` (``DistributedDataParallel.__init__`` reads its config, and
  ``torch.optim.Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``, which
  imports it on first call): about a second here, and the floor does not pay it.

Commands alternate within each repetition (the machine's drift hits all alike); figures are
medians with their min-max, and the ratios are of the medians.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FLOOR_SCRIPT = """
import os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=n)
    if TRAIN:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(20, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model(torch.ones(32, 20)).sum().backward()
        optimizer.step()
    else:
        dist.all_reduce(torch.ones(1))
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another still talks to it
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank, args=(int(sys.argv[1]), port), nprocs=int(sys.argv[1]), start_method="fork")
"""


FLOORS = ("floor", "training floor")


def commands(nproc: int, run_dir: str) -> dict[str, list[str]]:
    return {
        "floor": [sys.executable, "-c", "TRAIN = False" + FLOOR_SCRIPT, str(nproc)],
        "training floor": [sys.executable, "-c", "TRAIN = True" + FLOOR_SCRIPT, str(nproc)],
        "ddptrain 1 epoch": [sys.executable, "-m", "ddptrain", "train", "--max-epochs", "1", "--nproc", str(nproc),
                             "--run-dir", run_dir, "--resume", "never", "--no-progress"],
    }


def measure(nproc: int, reps: int, env: dict[str, str], log: Any = print) -> dict[str, list[float]]:
    walls: dict[str, list[float]] = {name: [] for name in (*FLOORS, "ddptrain 1 epoch")}
    for rep in range(reps):
        turn = rep % len(walls)
        for name in list(walls)[turn:] + list(walls)[:turn]:
            with tempfile.TemporaryDirectory() as run_dir:
                started = time.perf_counter()
                done = subprocess.run(commands(nproc, run_dir)[name], env=env, capture_output=True, text=True)
                wall = time.perf_counter() - started
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{done.stderr[-2000:]}")
            walls[name].append(wall)
            log(f"  rep {rep} {name:17s} {wall:5.2f} s")
    return walls


def format_table(walls: dict[str, list[float]]) -> str:
    floors = {name: statistics.median(walls[name]) for name in FLOORS}
    lines = [f"{'command':17s} {'wall (min-max)':>22s} {'vs floor':>8s} {'vs training floor':>17s}", "-" * 67]
    for name, values in walls.items():
        median = statistics.median(values)
        lines.append(f"{name:17s} {f'{median:.2f} s ({min(values):.2f}-{max(values):.2f})':>22s} "
                     f"{median / floors['floor']:8.2f} {median / floors['training floor']:17.2f}")
    lines.append("floor: import torch, fork the ranks, gloo over a TCP store, one all-reduce, exit")
    lines.append("training floor: the same, then DDP(Linear(20, 1)), an SGD optimizer and one step in each rank "
                 "(torch._dynamo imported, as in every torch training job)")
    return "\n".join(lines)
