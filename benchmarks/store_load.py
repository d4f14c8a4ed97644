"""The store's side of benchmarks/control_plane.py: its TCPStore server in a process of its own,
a probe client's latency, and the store's capacity (processes of client threads issuing a
heartbeat's ``set`` and a verdict poll's ``check`` as fast as they can).

This file is also the server's and the capacity probes' processes (``--serve PORT``,
``--hammer PORT CLIENTS SECONDS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"


# --- the store server (a process of its own) -------------------------------------------------
def serve(port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, None, True, wait_for_workers=False, use_libuv=True)
    print(json.dumps({"libuv": bool(getattr(store, "libuvBackend", False))}), flush=True)
    while True:
        time.sleep(3600)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, int, bool]:
    """The store's server in a process of its own: (the process, its port, whether it runs libuv)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True)
    libuv = json.loads(server.stdout.readline())["libuv"]  # type: ignore[union-attr]
    return server, port, libuv


def probe_latency(store: object, seconds: float, until: threading.Event | None = None) -> list[float]:
    """Milliseconds of a ``set`` and a ``get`` by one more client, every 20 ms, for ``seconds``
    or until ``until`` is set."""
    found, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and not (until is not None and until.is_set()):
        started = time.perf_counter()
        store.set("bench/probe", "x")  # type: ignore[attr-defined]
        store.get("bench/probe")  # type: ignore[attr-defined]
        found.append((time.perf_counter() - started) * 1000 / 2)
        time.sleep(0.02)
    return found


def hammer(port: int, clients: int, seconds: float) -> None:
    """A capacity probe's process: ``clients`` threads, each on its own client, issue store
    operations as fast as they can for ``seconds``; prints how many they got through."""
    import torch.distributed as dist

    counts = [0] * clients
    stores = [dist.TCPStore(HOST, port, None, False) for _ in range(clients)]
    print("ready", flush=True)
    sys.stdin.readline()  # every process starts at once
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        while time.monotonic() < stop:  # a heartbeat and a verdict poll, as the watchdogs issue them
            stores[i].set(f"bench/cap/{os.getpid()}/{i}", "x" * 40)  # (a set alone is not answered:
            stores[i].check(["bench/verdict"])  # the check after it waits for the server)
            counts[i] += 2
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("count", sum(counts), flush=True)


def capacity(port: int, procs: int, clients: int, seconds: float) -> float:
    """Store operations a second that ``procs`` processes of ``clients`` client threads get through.
    (Several processes, so one process's GIL is not what is measured: on this 2-core machine
    1 x 16, 2 x 8, 4 x 8 and 8 x 4 clients gave medians of 87,000 to 94,000, the cores shared by
    the server and its clients being the limit; one probe alone ranged 69,000 to 104,000.)"""
    hammers = [subprocess.Popen([sys.executable, __file__, "--hammer", str(port), str(clients), str(seconds)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    for proc in hammers:
        proc.stdout.readline()  # type: ignore[union-attr]  # its clients connected
    started = time.monotonic()
    for proc in hammers:
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    counts = [int(proc.stdout.readline().split()[1]) for proc in hammers]  # type: ignore[union-attr]
    elapsed = time.monotonic() - started
    for proc in hammers:
        proc.wait()
    return sum(counts) / elapsed


def measured_capacity(procs: int, clients: int, probes: int, seconds: float = 3.0) -> list[float]:
    """``probes`` capacity probes of a fresh store server, one after another (their median is the
    capacity the load is read against; their range says how steady it was)."""
    server, port, _ = start_server()
    try:
        return [capacity(port, procs, clients, seconds) for _ in range(probes)]
    finally:
        server.kill()
        server.wait()


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--hammer"]:
        hammer(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
