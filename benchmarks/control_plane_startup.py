"""Where the control plane's start-up goes at N simulated ranks: the same start as
control_plane.py's (one process per RANKS_PER_WORKER ranks, every rank connecting at once once
every process has imported torch), timed to the last rank started, for what each rank starts:

- ``client``: a bare TCPStore client (torch's floor: a rendezvous opens one per rank too);
- ``board``: ddptrain's ``Board``, the watchdog's client and its two start-up requests;
- ``idle threads``: ``Watchdog.start()`` with its two threads' loops emptied (the threads'
  start alone);
- ``watchdog``: ``Watchdog.start()`` as a rank runs it (its heartbeat and store-silence threads).

Each variant runs ``--reps`` times against a fresh store (served from the script's process); the table gives the median,
the range and the ratio to the floor's median. A simulated rank's threads share their worker
process's interpreter lock with 255 others (handed over every ``SWITCH_INTERVAL_S``, as in
control_plane.py), which a real rank (a process of its own) does not.

    python benchmarks/control_plane_startup.py --ranks 4096 --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from control_plane import HOST, RANKS_PER_WORKER, SWITCH_INTERVAL_S

VARIANTS = ("client", "board", "idle threads", "watchdog")


def work(port: int, world: int, first: int, last: int, variant: str) -> None:
    """A worker process: its ranks start ``variant`` at once on "go"; says when the last one has."""
    import torch.distributed as dist

    from ddptrain.resilience.board import Board
    from ddptrain.resilience.watchdog import Watchdog

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as control_plane.py's workers
    if variant == "idle threads":
        Watchdog._run = Watchdog._watch_store = lambda self: None  # type: ignore[method-assign]

    def start(rank: int) -> object:
        if variant == "client":
            return dist.TCPStore(HOST, port, None, False, timeout=datetime.timedelta(seconds=60))
        if variant == "board":
            return Board(HOST, port, rank, world)
        env = SimpleNamespace(rank=rank, world_size=world, master_addr=HOST, master_port=port)
        return Watchdog(env, 5.0, run_dir=None).start()
    print("ready", flush=True)
    sys.stdin.readline()  # "go"
    with ThreadPoolExecutor(max_workers=64) as pool:  # as control_plane.py starts its ranks
        started = list(pool.map(start, range(first, last)))
    print("started", time.time(), len(started), flush=True)
    sys.stdin.readline()  # "end"
    os._exit(0)  # (the watchdogs' threads are daemons: nothing to join)


def run_once(n: int, workers: int, variant: str) -> float:
    """Seconds from "go" until every one of the ``n`` ranks has started ``variant``, against a
    fresh store served from this process (its libuv loop is a thread of its own)."""
    import torch.distributed as dist

    server = dist.TCPStore(HOST, 0, None, True, wait_for_workers=False)
    port = server.port
    bounds = [n * w // workers for w in range(workers + 1)]
    procs = [subprocess.Popen([sys.executable, __file__, "--work", str(port), str(n), str(bounds[w]),
                               str(bounds[w + 1]), variant], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for w in range(workers)]
    try:
        for proc in procs:
            assert proc.stdout.readline().startswith("ready")  # type: ignore[union-attr]
        go = time.time()
        for proc in procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        done = [float(proc.stdout.readline().split()[1]) for proc in procs]  # type: ignore[union-attr]
        for proc in procs:
            proc.stdin.write("end\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        return max(done) - go
    finally:
        for proc in procs:
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=None, help=f"default: one per {RANKS_PER_WORKER} ranks")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        port, world, first, last, variant = args.work
        return work(int(port), int(world), int(first), int(last), variant)
    workers = args.workers or max(1, -(-args.ranks // RANKS_PER_WORKER))
    times = {variant: [run_once(args.ranks, workers, variant) for _ in range(args.reps)] for variant in VARIANTS}
    floor = statistics.median(times["client"])
    print(f"{args.ranks} ranks in {workers} processes, every rank starting at once; {args.reps} runs each")
    print(f"{'each rank starts':<16} {'median s':>9} {'range s':>13} {'x client':>9}")
    for variant, found in times.items():
        spread = f"{min(found):.2f}-{max(found):.2f}"
        print(f"{variant:<16} {statistics.median(found):>9.2f} {spread:>13} {statistics.median(found) / floor:>9.1f}")


if __name__ == "__main__":
    main()
