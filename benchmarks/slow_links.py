"""Training across a slow link: every-step DDP, local SGD and DiLoCo between two "nodes".

Each node is a network namespace holding one torchrun agent and its rank(s); the two are joined
by a veth pair, throttled on both ends by a token bucket (``tc qdisc ... tbf rate 50mbit burst
32kbit latency 400ms``; netem is not available here), or left unthrottled. Every method trains
the same job for the same number of steps (``--steps``, the same global batch), so each has seen
the same samples at the end, where the evaluation is (after the last sync: one model):

- samples/s: the run's own figure (metrics.jsonl's summary: training samples over training time),
  and its ratio to every-step DDP's on the same link;
- wall s: the whole command's, start-up and evaluation included, and its ratio to DDP's (what a
  user waits: local SGD at H=100, 50x DDP's training rate on the throttled link, took 0.10x its
  wall, and on the fast link, 3.5x the rate, 0.79x the wall: the start-up is most of a short job);
- bytes sent per sample: both veth ends' transmitted bytes over the run (the rendezvous, the
  watchdogs' heartbeats and the gradients or syncs), divided by the samples trained;
- eval loss after those samples, and its ratio to DDP's.

The link's own throughput is measured first (a TCP stream from one namespace to the other,
``--probe-s`` seconds). The job: the digits data set with a wider MLP (``--width``; 64 -> W ->
W -> 10: 0.3M parameters at W 512, 1.2 MB of fp32 gradients a step), AdamW inside.

Needs root (``ip netns``, ``tc``); it removes its namespaces when it ends.

    sudo python benchmarks/slow_links.py --steps 300 --every 10,50,100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NODES = (("ddpt-a", "ddpt-va", "10.77.0.1"), ("ddpt-b", "ddpt-vb", "10.77.0.2"))
PORT = 29611
REPO = Path(__file__).resolve().parents[1]


# --- the job (imported by the ranks: --task slow_links:wide_digits) ----------------------------
def wide_digits(cfg):  # type: ignore[no-untyped-def]
    """ddptrain's digits task with a wider MLP (SLOW_LINKS_WIDTH, default 512)."""
    import torch

    from ddptrain.tasks import digits_task

    task = digits_task(cfg)
    width = int(os.environ.get("SLOW_LINKS_WIDTH", "512"))
    torch.manual_seed(cfg.seed)
    task.model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                     torch.nn.ReLU(), torch.nn.Linear(width, 10))
    return task


# --- the link ----------------------------------------------------------------------------------
def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


@contextlib.contextmanager
def two_nodes(rate: str | None) -> Iterator[None]:
    """The namespaces and the veth pair between them, throttled to ``rate`` (tbf) when given."""
    (a, va, ip_a), (b, vb, ip_b) = NODES
    teardown()
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, ip in NODES:
            sh("ip", "link", "set", dev, "netns", ns)
            sh(*in_ns(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev))
            sh(*in_ns(ns, "ip", "link", "set", dev, "up"))
            sh(*in_ns(ns, "ip", "link", "set", "lo", "up"))
            if rate:
                sh(*in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
                          "latency", "400ms"))
        yield
    finally:
        teardown()


def teardown() -> None:
    for ns, _, _ in NODES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def tx_bytes() -> int:
    """Bytes both veth ends have sent so far."""
    return sum(int(subprocess.run(in_ns(ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"),
                                  capture_output=True, text=True, check=True).stdout) for ns, dev, _ in NODES)


PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n / (time.perf_counter() - t0), flush=True)
"""


def link_mbit_s(seconds: float) -> float:
    """A TCP stream from node b to node a for ``seconds``: its rate at the receiver, Mbit/s."""
    (a, _, ip_a), (b, _, _) = NODES
    server = subprocess.Popen(in_ns(a, sys.executable, "-c", PROBE_SERVER, ip_a, str(PORT + 1)),
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    client = (f"import socket,time\nc=socket.create_connection(('{ip_a}',{PORT + 1}))\n"
              f"end=time.time()+{seconds}\nb=bytes(1<<16)\nwhile time.time()<end: c.sendall(b)\nc.close()")
    subprocess.run(in_ns(b, sys.executable, "-c", client), check=True)
    return float(server.stdout.readline()) * 8 / 1e6


# --- a run ---------------------------------------------------------------------------------------
def train(run_dir: Path, steps: int, options: list[str], width: int, timeout_s: float) -> dict[str, float]:
    """One job over the two nodes: its samples/s, bytes sent per sample, eval loss and wall time."""
    path = [str(REPO / "benchmarks"), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_LINKS_WIDTH": str(width), "PYTHONPATH": os.pathsep.join(path)}
    sent, started = tx_bytes(), time.perf_counter()
    procs = []
    for node, (ns, dev, ip) in enumerate(NODES):
        command = in_ns(ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                        "--node-rank", str(node), "--rdzv-backend", "static", "--master-addr", NODES[0][2],
                        "--master-port", str(PORT),
                        "--local-addr", ip, "-m", "ddptrain", "train", "--task", "slow_links:wide_digits",
                        "--max-steps", str(steps), "--eval-every", "0", "--save-seconds", "0", "--keep", "1",
                        "--batch-size", "32", "--timeout", "120", "--resume", "never", "--no-progress",
                        "--run-dir", str(run_dir), *options)
        procs.append(subprocess.Popen(command, env={**env, "GLOO_SOCKET_IFNAME": dev},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    wall_s = time.perf_counter() - started
    if any(p.returncode for p in procs):
        raise SystemExit(f"slow_links: a run failed ({' '.join(options) or 'every-step'}):\n" + "\n".join(outputs))
    from ddptrain.observe.summary import read_metrics, summarize

    samples = steps * 64  # 2 ranks x 32
    evals = [r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r]
    return {"samples_per_s": samples / summarize(run_dir)["wall_time_s"],  # the epochs' training time
            "bytes_per_sample": (tx_bytes() - sent) / samples, "eval_loss": evals[-1], "wall_s": wall_s}


def methods(every: list[int], outer: list[str]) -> list[tuple[str, list[str]]]:
    """Every-step DDP, local SGD at each H, and DiLoCo at each H with each outer lr:momentum."""
    found: list[tuple[str, list[str]]] = [("every-step DDP", [])]
    found += [(f"local-sgd H={h}", ["--sync", "local-sgd", "--sync-every", str(h)]) for h in every]
    for lr, momentum in (pair.split(":") for pair in outer):
        found += [(f"diloco H={h} outer {lr}/{momentum}", ["--sync", "diloco", "--sync-every", str(h), "--outer-lr", lr,
                                                            "--outer-momentum", momentum]) for h in every]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run (64 samples each)")
    parser.add_argument("--every", default="10,50,100", help="the --sync-every values (comma-separated)")
    parser.add_argument("--rates", default="50mbit,none", help="link rates (tbf), comma-separated; none: unthrottled")
    parser.add_argument("--outer", default="0.7:0.9,1.0:0.5",
                        help="DiLoCo's outer LR:MOMENTUM pairs, comma-separated (0.7:0.9: the paper's, the default)")
    parser.add_argument("--width", type=int, default=512, help="the MLP's hidden width")
    parser.add_argument("--probe-s", type=float, default=3.0, help="seconds of the link's throughput probe")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("slow_links: needs root, ip and tc (network namespaces and a tbf qdisc)", file=sys.stderr)
        return 2
    every = [int(h) for h in args.every.split(",")]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="slow-links-") as scratch:
        for rate in args.rates.split(","):
            with two_nodes(None if rate == "none" else rate):
                link = link_mbit_s(args.probe_s)
                print(f"link {rate}: {link:,.1f} Mbit/s measured", flush=True)
                baseline: dict[str, float] = {}
                for name, options in methods(every, args.outer.split(",")):
                    figures = train(Path(scratch) / f"{rate}-{len(rows)}", args.steps, options, args.width,
                                    timeout_s=3600)
                    baseline = baseline or figures
                    rows.append({"link": rate, "link_mbit_s": round(link, 1), "method": name, **figures,
                                 "speed_vs_ddp": figures["samples_per_s"] / baseline["samples_per_s"],
                                 "wall_vs_ddp": figures["wall_s"] / baseline["wall_s"],
                                 "eval_loss_vs_ddp": figures["eval_loss"] / baseline["eval_loss"]})
                    print(row_line(rows[-1]), flush=True)
    print_table(rows, args.steps, args.width)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def row_line(row: dict) -> str:  # type: ignore[type-arg]
    """A table row: training samples/s (the epochs' training time alone) beside the whole command's
    wall (start-up included), each with its ratio to every-step DDP's on the same link."""
    return (f"| {row['link']} ({row['link_mbit_s']:,.0f} Mbit/s) | {row['method']} | {row['samples_per_s']:,.0f} | "
            f"{row['speed_vs_ddp']:.2f}x | {row['wall_s']:.1f} | {row['wall_vs_ddp']:.2f}x | "
            f"{row['bytes_per_sample'] / 1e3:,.1f} | {row['eval_loss']:.4f} | {row['eval_loss_vs_ddp']:.3f} |")


def print_table(rows: list[dict], steps: int, width: int) -> None:  # type: ignore[type-arg]
    print(f"\n{steps} steps of 64 samples (2 nodes x 1 rank x 32), digits with a {width}-wide MLP, AdamW inside")
    print("| link (measured) | method | samples/s (training) | vs DDP | wall s (the command) | vs DDP | "
          "kB sent / sample | eval loss | vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row_line(row))


if __name__ == "__main__":
    sys.exit(main())
