"""``ddptrain bench --floor``: the start-up floor of any multi-rank CPU job on this machine, next to
ddptrain's 1-epoch command of the tutorial job, measured side by side.

The floor is what no trainer can avoid: a Python process imports torch, forks the ranks, each
joins a gloo group over a TCP store, runs one all-reduce and leaves. Commands alternate within
each repetition (the machine's drift hits both alike); figures are medians with their min-max,
and the ratio is of the medians.
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
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank, args=(int(sys.argv[1]), port), nprocs=int(sys.argv[1]), start_method="fork")
"""


def commands(nproc: int, run_dir: str) -> dict[str, list[str]]:
    return {
        "floor": [sys.executable, "-c", FLOOR_SCRIPT, str(nproc)],
        "ddptrain 1 epoch": [sys.executable, "-m", "ddptrain", "train", "--max-epochs", "1", "--nproc", str(nproc),
                             "--run-dir", run_dir, "--resume", "never", "--no-progress"],
    }


def measure(nproc: int, reps: int, env: dict[str, str], log: Any = print) -> dict[str, list[float]]:
    walls: dict[str, list[float]] = {"floor": [], "ddptrain 1 epoch": []}
    for rep in range(reps):
        names = list(walls) if rep % 2 == 0 else list(reversed(walls))
        for name in names:
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
    floor = statistics.median(walls["floor"])
    lines = [f"{'command':17s} {'wall (min-max)':>22s} {'vs floor':>8s}", "-" * 49]
    for name, values in walls.items():
        median = statistics.median(values)
        lines.append(f"{name:17s} {f'{median:.2f} s ({min(values):.2f}-{max(values):.2f})':>22s} "
                     f"{median / floor:8.2f}")
    lines.append("floor: import torch, fork the ranks, gloo over a TCP store, one all-reduce, exit")
    return "\n".join(lines)
