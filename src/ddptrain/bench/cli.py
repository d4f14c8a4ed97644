"""``ddptrain bench``: ddptrain against a hand-written DDP loop (and, with ``--peers``,
Lightning and Accelerate) on the same jobs, side by side in one run.

Every measurement is a whole command, started the way its users start it (bench/loops.py).
Per repetition and job, each contender runs a 1-epoch command and a (1+E)-epoch command:
the first's wall is what a user waits for a short job, and samples/s is the extra samples
divided by the extra wall (so start-up cancels out, and everything per epoch counts: ddptrain's
metrics lines, loss reads, snapshots). Contenders alternate within each repetition, so the
machine's drift hits all alike; figures are medians with their min-max. Every contender
trains the same model on the same samples in the same order, so all must end at the same
loss: the table shows it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .loops import JOBS, SMOKE_SAMPLES, final_loss

# ddptrain-skip: ddptrain with --skip-nonfinite 1, the non-finite guard's per-step mode (a check and
# a one-element all-reduce every step); ddptrain's default guard costs no per-step work.
BASE = ("loop", "ddptrain", "ddptrain-skip")
PEERS = ("lightning", "accelerate")


def command(contender: str, job: str, nproc: int, epochs: int, out: str) -> list[str]:
    python = sys.executable
    if contender.startswith("ddptrain"):
        return [python, "-m", "ddptrain", "train", "--task", "ddptrain.bench.loops:bench_task", "--nproc", str(nproc),
                "--max-epochs", str(epochs), "--batch-size", "32", "--run-dir", out, "--resume", "never",
                "--no-progress", *(["--skip-nonfinite", "1"] if contender == "ddptrain-skip" else [])]
    loop = ["-m", "ddptrain.bench.loops", "--loop", contender, "--job", job, "--epochs", str(epochs), "--out", out]
    if contender == "accelerate":  # Accelerate's multi-process CPU runs are torchrun's (it sets the world size)
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *loop]
    return [python, *loop, "--nproc", str(nproc)]


def run_once(contender: str, job: str, nproc: int, epochs: int, env: dict[str, str], log: Any = print
             ) -> tuple[float, float]:
    """(wall seconds of the whole command, full-data loss of its final weights). A failed
    run is tried once more (and said so): one crash of a contender is not the benchmark's end."""
    import torch

    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            done = subprocess.run(command(contender, job, nproc, epochs, out),
                                  env={**env, "DDPTRAIN_BENCH_JOB": job}, capture_output=True, text=True)
            wall = time.perf_counter() - started
            if done.returncode == 0:
                return wall, final_loss(job, torch.load(Path(out) / "model.pt", weights_only=True))
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        log(f"  {contender} {job} failed ({error}); " + ("trying once more" if attempt == 1 else "giving up"))
    raise RuntimeError(f"{contender} {job} x{nproc} failed twice:\n{done.stderr[-3000:]}")


def measure(contenders: list[str], jobs: list[str], nproc: int, reps: int, epochs: dict[str, int],
            env: dict[str, str], log: Any = print) -> list[dict[str, Any]]:
    runs = []
    samples = {job: SMOKE_SAMPLES if env.get("DDPTRAIN_BENCH_SMOKE") else JOBS[job][0] for job in jobs}
    for rep in range(reps):
        for job in jobs:
            turn = rep % len(contenders)
            for contender in contenders[turn:] + contenders[:turn]:  # rotate who goes first
                short, loss = run_once(contender, job, nproc, 1, env, log)
                long = short
                if epochs[job]:  # (a smoke run checks the plumbing: one command each)
                    long, loss = run_once(contender, job, nproc, 1 + epochs[job], env, log)
                # the extra samples over the extra wall (not measurable when the longer run was no longer)
                rate = epochs[job] * samples[job] / (long - short) if long > short else float("nan")
                runs.append({"job": job, "contender": contender, "rep": rep, "wall_1_epoch_s": short,
                             "samples_per_s": rate, "final_loss": loss})
                log(f"  rep {rep} {job:8s} {contender:13s} {rate:10,.0f} samples/s  1-epoch wall {short:5.2f} s  "
                    f"loss {loss:.6g}")
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for job in dict.fromkeys(r["job"] for r in runs):
        mine = [r for r in runs if r["job"] == job]
        contenders = list(dict.fromkeys(r["contender"] for r in mine))
        median = {c: {k: _median([r[k] for r in mine if r["contender"] == c])
                      for k in ("samples_per_s", "wall_1_epoch_s", "final_loss")} for c in contenders}
        peers = [c for c in contenders if c in PEERS]
        fastest_peer = min((median[c]["wall_1_epoch_s"] for c in peers), default=None)
        losses = [median[c]["final_loss"] for c in contenders]
        same_loss = (max(losses) - min(losses)) <= 1e-4 * max(abs(x) for x in losses)
        for contender in contenders:
            of = [r for r in mine if r["contender"] == contender]
            rows.append({
                "job": job, "contender": contender, **median[contender],
                "samples_per_s_range": [min(r["samples_per_s"] for r in of), max(r["samples_per_s"] for r in of)],
                "wall_range": [min(r["wall_1_epoch_s"] for r in of), max(r["wall_1_epoch_s"] for r in of)],
                "vs_loop": (median[contender]["samples_per_s"] / median["loop"]["samples_per_s"]
                            if "loop" in median else None),
                "wall_vs_fastest_peer": median[contender]["wall_1_epoch_s"] / fastest_peer if fastest_peer else None,
                "same_loss_as_all": same_loss,
            })
    return rows


def _median(values: list[float]) -> float:
    finite = [v for v in values if v == v]  # NaN: a rate too small to measure
    return statistics.median(finite) if finite else float("nan")


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'job':9s} {'contender':13s} {'samples/s (min-max)':>27s} {'vs loop':>7s} "
              f"{'1-epoch wall (min-max)':>23s} {'vs fastest peer':>15s} {'final loss':>11s}")
    lines = [header, "-" * len(header)]
    for r in rows:
        rate = f"{r['samples_per_s']:,.0f} ({r['samples_per_s_range'][0]:,.0f}-{r['samples_per_s_range'][1]:,.0f})"
        wall = f"{r['wall_1_epoch_s']:.2f} s ({r['wall_range'][0]:.2f}-{r['wall_range'][1]:.2f})"
        peer = f"{r['wall_vs_fastest_peer']:.2f}" if r["wall_vs_fastest_peer"] else ""
        vs_loop = f"{r['vs_loop']:.2f}" if r["vs_loop"] is not None else ""
        lines.append(f"{r['job']:9s} {r['contender']:13s} {rate:>27s} {vs_loop:>7s} {wall:>23s} {peer:>15s} "
                     f"{r['final_loss']:11.6g}")
    for job in dict.fromkeys(r["job"] for r in rows):
        same = all(r["same_loss_as_all"] for r in rows if r["job"] == job)
        lines.append(f"{job}: every contender ended at the same loss: {'yes' if same else 'NO'} "
                     "(same model, samples, order and optimizer)")
    lines.append("ddptrain-skip: ddptrain with --skip-nonfinite 1 (a finiteness check and agreement every step)")
    return "\n".join(lines)


def draw_chart(rows: list[dict[str, Any]], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart not drawn: matplotlib is not installed"
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    fig, axes = plt.subplots(2, len(jobs), figsize=(4.2 * len(jobs), 6.4), squeeze=False)
    for column, job in enumerate(jobs):
        mine = [r for r in rows if r["job"] == job]
        names = [r["contender"] for r in mine]
        colors = ["#e83" if n.startswith("ddptrain") else "#69c" if n == "loop" else "#999" for n in names]
        for row, (key, spread, label) in enumerate((("samples_per_s", "samples_per_s_range", "samples/s"),
                                                    ("wall_1_epoch_s", "wall_range", "1-epoch command wall (s)"))):
            ax = axes[row][column]
            values = [r[key] for r in mine]
            errors = [[v - r[spread][0] for v, r in zip(values, mine)],
                      [r[spread][1] - v for v, r in zip(values, mine)]]
            ax.bar(names, values, yerr=errors, color=colors, capsize=3)
            ax.set_title(f"{job}: {label}", fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def floor_main(args: argparse.Namespace) -> int:
    from . import floor

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"ddptrain bench --floor: {args.reps} rep(s) at {args.nproc} ranks, {os.cpu_count()} CPUs", flush=True)
    walls = floor.measure(args.nproc, args.reps, env, log=lambda m: print(m, flush=True))
    print("\n" + floor.format_table(walls))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps({"walls_s": walls, "nproc": args.nproc, "cpus": os.cpu_count()},
                                               indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddptrain bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every measurement (default 3)")
    parser.add_argument("--jobs", default="tutorial,mlp", help="comma-separated: tutorial, mlp")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--tutorial-epochs", type=int, default=60, help="extra epochs of the tutorial job (default 60)")
    parser.add_argument("--mlp-epochs", type=int, default=3, help="extra epochs of the MLP job (default 3)")
    parser.add_argument("--peers", action="store_true", help="add Lightning and Accelerate rows (pip install "
                        "'ddptrain[bench]')")
    parser.add_argument("--contenders", default=None, help="comma-separated subset of loop, ddptrain, ddptrain-skip "
                        "(and lightning, accelerate with --peers); default: all")
    parser.add_argument("--smoke", action="store_true", help="tiny data, 1-epoch commands only: checks the plumbing")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    parser.add_argument("--floor", action="store_true", help="instead: the start-up floor of a CPU job here (import "
                        "torch, fork the ranks, gloo, one all-reduce) next to ddptrain's 1-epoch command")
    args = parser.parse_args(argv)
    if args.floor:
        return floor_main(args)
    jobs = args.jobs.split(",")
    epochs = {"tutorial": args.tutorial_epochs, "mlp": args.mlp_epochs}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.smoke:
        epochs = {job: 0 for job in epochs}
        env["DDPTRAIN_BENCH_SMOKE"] = "1"
    contenders = list(BASE)
    if args.peers:
        missing = [peer for peer in PEERS if not installed(peer)]
        if missing:
            print(f"ddptrain bench: {' and '.join(missing)} not installed (pip install 'ddptrain[bench]'): "
                  f"{'its' if len(missing) == 1 else 'their'} rows are left out", flush=True)
        contenders += [peer for peer in PEERS if peer not in missing]
    if args.contenders:
        wanted = args.contenders.split(",")
        unknown = sorted(set(wanted) - set(BASE) - set(PEERS))
        if unknown:
            parser.error(f"--contenders: unknown {', '.join(unknown)}")
        contenders = [c for c in contenders if c in wanted]
    print(f"ddptrain bench: {args.reps} rep(s) of {jobs} at {args.nproc} ranks, contenders {contenders}, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, {os.cpu_count()} CPUs", flush=True)
    runs = measure(contenders, jobs, args.nproc, args.reps, epochs, env, log=lambda m: print(m, flush=True))
    rows = summarize(runs)
    print("\n" + format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"rows": rows, "runs": runs, "argv": argv, "cpus": os.cpu_count()},
                                               indent=2))
    note = draw_chart(rows, out / "bench.png")
    print(note or f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0
