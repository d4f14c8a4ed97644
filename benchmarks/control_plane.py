"""The control plane at N ranks: ddptrain's watchdogs (heartbeats, verdict polls, rank 0's
judge) against one real TCPStore, with N simulated ranks on this machine.

Each simulated rank is ddptrain's own ``Watchdog`` (resilience/watchdog.py) with its own store
connection and thread, as in a real rank; only the training is simulated: a driver thread per
worker process marks every rank's gradient all-reduce (``arrive``/``depart``) every
``--step-s``. The ranks live as threads in ``--workers`` processes; the store's server runs in
a process of its own, so its CPU time and memory are its own.

Per N, three phases:
1. start-up: once every worker process has started (imported torch), every rank connects to
   the store at once, as ranks do after a rendezvous (``Board``: one client, its info key), and
   publishes its first heartbeat; a probe client's latency meanwhile;
2. steady: ``--steady-s`` seconds of steps; the store operations the watchdogs issue (counted
   on their clients), the store server's CPU, and the latency of a probe client's ``set`` and
   ``get`` (as a heartbeat sees the store) every 20 ms;
3. a hang: the last rank stops taking steps while every other rank enters the next all-reduce
   (``--stop die``: the last rank dies instead, as a SIGKILLed one looks to the store: its
   heartbeats stop, its connection closes, it answers nothing and never leaves);
   the time until rank 0's judge posts its verdict (the goal: ``--timeout`` + 2 heartbeat
   periods, watchdog.beat_period at that size), and
   until every worker process has acted on it and exited (the verdict's propagation).

Then the store's capacity: ``--capacity-probes`` probes, each ``--capacity-procs`` processes of
``--capacity-clients`` client threads issuing a heartbeat's ``set`` and a verdict poll's
``check`` as fast as they can, so the steady load reads as a fraction of the probes' median
(the store's side of these measures: benchmarks/store_load.py).

    python benchmarks/control_plane.py --ranks 256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from store_load import HOST, measured_capacity, probe_latency, start_server

LABEL = "the gradient all-reduce"
STOPS = {"hang": "hung", "die": "died"}  # --stop: what the last rank does
HANG_STEP = 1_000_000  # the step every simulated rank stands at when the hang begins
# How long the workers may take to act on a hang's verdict and exit: 3.3-3.8 s at 4,096 ranks, 25-51 s
# at Python's default switch interval (SWITCH_INTERVAL_S), minutes with 512 ranks a process (below).
EXIT_WAIT_S = 300
# Simulated ranks a worker process holds at most: each is two threads, and a process of 1,000 threads
# (512 ranks) spent minutes in its interpreter's lock after a hang's verdict (gdb: 1,032 of 1,079
# threads waiting in take_gil): 4,096 ranks in 8 processes exited in 165-183 s, in 16 in 68 s,
# in 32 in 4 s (2026-12-05). A real rank is a process of its own.
RANKS_PER_WORKER = 256
# The interpreter's switch interval in a worker process (Python's default: 5 ms). A thread that wants the
# interpreter's lock forces its holder to drop it after this long; with 512 threads a process, most of them
# waking for a store call, those forced hand-offs convoyed: 4,096 watchdogs started in 5.5-15.1 s at 5 ms,
# 2.3-3.3 s at 50 ms, 18.6-36.8 s at 0.5 ms (control_plane_startup.py, 2026-12-05). A real rank's two
# watchdog threads share their process with its main thread alone; the threads here block on sockets
# (which lets the lock go at once) far sooner than 50 ms, so this only spares them a convoy a real rank has not.
SWITCH_INTERVAL_S = 0.05


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


# --- a worker: some of the simulated ranks ---------------------------------------------------
class Counting:
    """A store client that counts the operations issued through it (the watchdog's own)."""

    def __init__(self, store: object) -> None:
        self._store, self.ops = store, 0

    def __getattr__(self, name: str) -> object:
        method = getattr(self._store, name)

        def counted(*args: object, **kwargs: object) -> object:
            self.ops += 1
            return method(*args, **kwargs)
        return counted

    def close(self) -> None:
        """Drop the client (its last reference): its connection closes."""
        self._store = None


def work(port: int, world: int, first: int, last: int, timeout: float, step_s: float) -> None:
    from ddptrain.resilience.watchdog import Watchdog

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    say = lambda *words: print(*words, flush=True)  # noqa: E731 - the orchestrator reads lines
    say("ready", time.time())
    sys.stdin.readline()  # "go": every worker has imported torch; the ranks connect at once, as after a rendezvous

    def start(rank: int) -> Watchdog:  # every real rank connects at once: so do these, 64 at a time
        env = SimpleNamespace(rank=rank, world_size=world, master_addr=HOST, master_port=port)
        dog = Watchdog(env, timeout, run_dir=None).start()
        dog.board.store = Counting(dog.board.store)  # type: ignore[union-attr]  # started: it has a board
        return dog
    with ThreadPoolExecutor(max_workers=64) as pool:
        dogs = list(pool.map(start, range(first, last)))
    counters = [dog.board.store for dog in dogs]
    say("connected", time.time())
    hang, how = threading.Event(), []

    def die(dog: Watchdog) -> None:
        """The rank as a SIGKILL leaves it, seen from the store: no heartbeat, answer or leave again."""
        dog.finished.set()  # its two threads end at their next wake (neither leaves the board)
        dog.thread.join()  # type: ignore[union-attr]  # started
        dog.board = None
        counters[dogs.index(dog)].close()  # type: ignore[union-attr]  # counting

    def drive() -> None:
        step = 0
        while not hang.wait(step_s):
            step += 1
            for dog in dogs:
                dog.arrive(LABEL, step)
                dog.depart()
        # The hang: every rank but the last enters the next all-reduce and stays. The workers' drivers
        # started apart, so their counts of steps differ: real ranks are in step, so these are put in step.
        for dog in dogs:
            dog.arrivals = HANG_STEP
            if dog.rank != world - 1:
                dog.arrive(LABEL, HANG_STEP + 1)
            elif how == ["die"]:
                die(dog)
    threading.Thread(target=drive, daemon=True).start()
    for line in sys.stdin:
        if line.startswith("count"):
            say("count", sum(counter.ops for counter in counters))  # type: ignore[union-attr]  # counting
        elif line.split()[0] in ("hang", "die"):
            how.append(line.split()[0])
            hang.set()
    time.sleep(3600)  # a verdict's watchdog ends this process


# --- the orchestrator ------------------------------------------------------------------------
def read_number(worker: subprocess.Popen, word: str, errors: str) -> float:
    """The number after ``word`` on the worker's next line; a worker that ended instead is named."""
    line = worker.stdout.readline().split()  # type: ignore[union-attr]
    if line[:1] == [word]:
        return float(line[1])
    worker.wait(timeout=30)
    raise worker_ended(worker, f"before it said {word!r}", errors)


def check_workers(procs: list[subprocess.Popen], errors: str, doing: str) -> None:
    """Raise if a worker has ended (before the hang, none should)."""
    for worker in procs:
        if worker.poll() is not None:
            raise worker_ended(worker, doing, errors)


def worker_ended(worker: subprocess.Popen, doing: str, errors: str) -> RuntimeError:
    """A worker that ended, with the error its watchdogs recorded (a watchdog that finds the
    store silent for longer than it allows ends its whole process, the worker's 512 ranks)."""
    recorded = [json.load(open(os.path.join(errors, name)))["message"]["message"]  # noqa: SIM115
                for name in sorted(os.listdir(errors))]
    return RuntimeError(f"a worker ended (exit {worker.returncode}) {doing}: "
                        f"{'; '.join(recorded) or 'it recorded no error'}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(n: int, workers: int, timeout: float, step_s: float, steady_s: float,
            stop: str = "hang") -> dict[str, float | int | bool]:
    import torch.distributed as dist

    server, port, libuv = start_server()
    client = dist.TCPStore(HOST, port, None, False)
    cpu0 = cpu_seconds(server.pid)
    bounds = [n * w // workers for w in range(workers + 1)]
    errors = tempfile.mkdtemp(prefix="control-plane-")  # a watchdog that gives up says why here
    procs = [subprocess.Popen([sys.executable, __file__, "--work", *map(str, (port, n, bounds[w], bounds[w + 1],
                                                                               timeout, step_s))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "TORCHELASTIC_ERROR_FILE": os.path.join(errors, f"worker-{w}.json")})
             for w in range(workers) if bounds[w] < bounds[w + 1]]
    started, startup_latencies = threading.Event(), []  # the store's answers while the ranks start
    prober = threading.Thread(target=lambda: startup_latencies.extend(probe_latency(client, 3600, started)))
    try:
        for p in procs:
            read_number(p, "ready", errors)
        prober.start()
        go = time.time()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        connected = [read_number(p, "connected", errors) for p in procs]
        keys = [f"ddptrain/hb/{r}" for r in range(n)]
        while not client.check(keys):
            check_workers(procs, errors, "while the ranks published their first heartbeats")
            time.sleep(0.02)
        started.set()
        prober.join()
        startup = {"connect_s": max(connected) - go, "first_beats_s": time.time() - go,
                   "startup_p99_ms": percentile(startup_latencies, 0.99), "startup_max_ms": max(startup_latencies)}
        print(f"{n} ranks: connected in {startup['connect_s']:.2f} s, every first heartbeat in "
              f"{startup['first_beats_s']:.2f} s; the store's answers meanwhile p99 "
              f"{startup['startup_p99_ms']:.1f} ms, at most {startup['startup_max_ms']:.1f} ms",
              file=sys.stderr, flush=True)

        def count() -> int:
            check_workers(procs, errors, "while the ranks took steps")
            for p in procs:
                p.stdin.write("count\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            return sum(int(p.stdout.readline().split()[1]) for p in procs)  # type: ignore[union-attr]
        ops0, cpu1, t0 = count(), cpu_seconds(server.pid), time.monotonic()
        latencies = probe_latency(client, steady_s)
        ops1, cpu2, t1 = count(), cpu_seconds(server.pid), time.monotonic()
        stopped = time.monotonic()
        for p in procs:
            p.stdin.write(f"{stop}\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        while not client.check(["ddptrain/verdict"]):
            time.sleep(0.01)
        named_s = time.monotonic() - stopped
        verdict = json.loads(client.get("ddptrain/verdict"))
        for p in procs:
            p.wait(timeout=EXIT_WAIT_S)
        propagated_s = time.monotonic() - stopped - named_s
        rss = rss_mib(server.pid)
        server.kill()
        server.wait()
        return {"ranks": n, "stop": stop, "libuv": libuv, **startup, "ops_per_s": (ops1 - ops0) / (t1 - t0),
                "server_cpu_pct": 100 * (cpu2 - cpu1) / (t1 - t0), "server_cpu_startup_s": cpu1 - cpu0,
                "server_rss_mib": rss, "latency_p50_ms": statistics.median(latencies),
                "latency_p99_ms": percentile(latencies, 0.99), "named_s": named_s,
                "named_right": verdict.get("culprits") == [n - 1], "propagated_s": propagated_s,
                "verdict": {"kind": verdict.get("kind"), "culprits": len(verdict.get("culprits", [])),
                            "first_culprits": verdict.get("culprits", [])[:8]}}
    finally:  # a worker that failed leaves the others and the server running otherwise
        started.set()
        if prober.is_alive():
            prober.join()
        for proc in [*procs, server]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def table(rows: list[dict], capacities: list[float], timeout: float) -> str:
    from ddptrain.resilience.watchdog import beat_period

    capacity_ops = statistics.median(capacities)
    head = (f"{'ranks':>6} {'connect s':>9} {'1st beats s':>11} {'ops/s':>8} {'of capacity':>11} {'server CPU':>10} "
            f"{'RSS MiB':>7} {'p50 ms':>7} {'p99 ms':>7} {'named s':>8} {'goal s':>6} {'right':>5} {'exit s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ranks']:>6} {r['connect_s']:>9.2f} {r['first_beats_s']:>11.2f} {r['ops_per_s']:>8,.0f} "
                     f"{r['ops_per_s'] / capacity_ops:>10.1%} {r['server_cpu_pct']:>9.0f}% {r['server_rss_mib']:>7.0f} "
                     f"{r['latency_p50_ms']:>7.2f} {r['latency_p99_ms']:>7.2f} {r['named_s']:>8.2f} "
                     f"{timeout + 2 * beat_period(timeout, r['ranks']):>6g} "
                     f"{'yes' if r['named_right'] else 'NO':>5} {r['propagated_s']:>7.2f}")
    lines.append(f"store capacity here: {capacity_ops:,.0f} ops/s (set+check; the median of {len(capacities)} probes, "
                 f"{min(capacities):,.0f} to {max(capacities):,.0f}); libuv backend: "
                 f"{'yes' if all(r['libuv'] for r in rows) else 'no'}; goal for 'named s': --timeout {timeout:g} "
                 f"+ 2 heartbeat periods at that size; the last rank {STOPS[rows[0]['stop']]}")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--work"]:
        port, world, first, last = map(int, sys.argv[2:6])
        work(port, world, first, last, float(sys.argv[6]), float(sys.argv[7]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="256,1024,4096", help="comma-separated N (default 256,1024,4096)")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"processes holding the simulated ranks (default: one per {RANKS_PER_WORKER}, at least 8)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the watchdog's --timeout (default 5)")
    parser.add_argument("--stop", choices=sorted(STOPS), default="hang",
                        help="what the last rank does: hangs (the default) or dies")
    parser.add_argument("--step-s", type=float, default=0.1, help="a simulated step's time (default 0.1)")
    parser.add_argument("--steady-s", type=float, default=10.0, help="the steady phase's length (default 10)")
    parser.add_argument("--capacity-procs", type=int, default=2, help="processes per capacity probe (default 2)")
    parser.add_argument("--capacity-clients", type=int, default=8, help="client threads per probe process (default 8)")
    parser.add_argument("--capacity-probes", type=int, default=5, help="capacity probes; the median counts (default 5)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for n in map(int, args.ranks.split(",")):
        workers = args.workers or max(8, -(-n // RANKS_PER_WORKER))
        rows.append(measure(n, workers, args.timeout, args.step_s, args.steady_s, args.stop))
        print(json.dumps(rows[-1]), flush=True)
    capacities = measured_capacity(args.capacity_procs, args.capacity_clients, args.capacity_probes)
    print()
    print(table(rows, capacities, args.timeout))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "capacity_ops": statistics.median(capacities), "capacities": capacities,
                       "args": vars(args)}, out, indent=2)
    return 0 if all(r["named_right"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
