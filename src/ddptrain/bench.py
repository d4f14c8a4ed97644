"""``ddptrain bench``: ddptrain against hand-written DDP loops, side by side in one run.

Every measurement is a fresh process tree started the way its users start it (the loops
with the tutorial's ``mp.spawn``, ddptrain with ``ddptrain train``). Contenders alternate
within each repetition, so the machine's drift hits all of them alike; figures are medians
with their min-max. Throughput is steady state: samples of epochs 1..E-1 over the time from
the end of epoch 0 to the end of the last (so per-epoch work such as snapshots counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench_loops import JOBS

CONTENDERS = ("floor", "bare", "ddptrain")


def run_once(contender: str, job: str, nproc: int, epochs: int, env: dict[str, str]) -> dict[str, float]:
    """One training run; returns samples/s (steady state) and seconds from command to first step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if contender == "ddptrain":
            command = [sys.executable, "-m", "ddptrain", "train", "--task", "ddptrain.bench_loops:bench_task",
                       "--nproc", str(nproc), "--max-epochs", str(epochs), "--batch-size", "32",
                       "--run-dir", tmp, "--resume", "never", "--no-progress"]
        else:
            command = [sys.executable, "-m", "ddptrain.bench_loops", "--loop", contender, "--job", job,
                       "--nproc", str(nproc), "--epochs", str(epochs), "--out", str(out)]
        started = time.time()
        done = subprocess.run(command, env={**env, "DDPTRAIN_BENCH_JOB": job}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{contender} {job} x{nproc} failed:\n{done.stderr[-2000:]}")
        if contender == "ddptrain":
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            first_step_at, ends = records[0]["first_step_at"], [r["time"] for r in records]
            per_epoch = records[0]["samples"]
        else:
            result = json.loads(out.read_text())
            first_step_at, ends, per_epoch = result["first_step_at"], result["epoch_ends"], result["samples_per_epoch"]
    return {"samples_per_s": per_epoch * (len(ends) - 1) / (ends[-1] - ends[0]),
            "first_step_s": first_step_at - started}


def measure(jobs: list[str], ranks: list[int], reps: int, epochs: dict[str, int],
            env: dict[str, str], log: Any = print) -> list[dict[str, Any]]:
    runs = []
    for rep in range(reps):
        for job in jobs:
            for nproc in ranks:
                order = CONTENDERS[rep % 3:] + CONTENDERS[:rep % 3]  # rotate who goes first
                for contender in order:
                    figures = run_once(contender, job, nproc, epochs[job], env)
                    runs.append({"job": job, "ranks": nproc, "contender": contender, "rep": rep, **figures})
                    log(f"  rep {rep} {job:8s} x{nproc} {contender:8s} {figures['samples_per_s']:10,.0f} samples/s"
                        f"  first step {figures['first_step_s']:.2f} s")
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["job"], r["ranks"]) for r in runs}, key=lambda k: (list(JOBS).index(k[0]), k[1]))
    for job, nproc in keys:
        group = {c: [r for r in runs if (r["job"], r["ranks"], r["contender"]) == (job, nproc, c)] for c in CONTENDERS}
        median = {c: statistics.median(r["samples_per_s"] for r in group[c]) for c in CONTENDERS}
        for contender in CONTENDERS:
            rates = [r["samples_per_s"] for r in group[contender]]
            rows.append({
                "job": job, "ranks": nproc, "contender": contender,
                "samples_per_s": median[contender], "min": min(rates), "max": max(rates),
                "vs_bare": median[contender] / median["bare"], "vs_floor": median[contender] / median["floor"],
                "first_step_s": statistics.median(r["first_step_s"] for r in group[contender]),
            })
    for row in rows:  # weak scaling: 2 ranks at the same per-rank batch against 1 rank
        single = next((r for r in rows if (r["job"], r["contender"], r["ranks"]) == (row["job"], row["contender"], 1)),
                      None)
        row["scaling"] = row["samples_per_s"] / (row["ranks"] * single["samples_per_s"]) if single else None
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'job':9s} {'ranks':>5s} {'contender':9s} {'samples/s (min-max)':>28s} {'vs bare':>8s} "
              f"{'vs floor':>8s} {'first step':>10s} {'scaling':>8s}")
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = f"{r['samples_per_s']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f})"
        scaling = f"{r['scaling']:.2f}" if r["scaling"] is not None and r["ranks"] > 1 else ""
        lines.append(f"{r['job']:9s} {r['ranks']:5d} {r['contender']:9s} {spread:>28s} {r['vs_bare']:8.2f} "
                     f"{r['vs_floor']:8.2f} {r['first_step_s']:9.2f}s {scaling:>8s}")
    return "\n".join(lines)


def draw_chart(rows: list[dict[str, Any]], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart not drawn: matplotlib is not installed"
    groups = sorted({(r["job"], r["ranks"]) for r in rows}, key=lambda k: (list(JOBS).index(k[0]), k[1]))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.4), squeeze=False)
    for ax, (job, nproc) in zip(axes[0], groups):
        mine = [r for r in rows if (r["job"], r["ranks"]) == (job, nproc)]
        values = [r["samples_per_s"] for r in mine]
        errors = [[v - r["min"] for v, r in zip(values, mine)], [r["max"] - v for v, r in zip(values, mine)]]
        ax.bar([r["contender"] for r in mine], values, yerr=errors, color=["#999", "#69c", "#e83"], capsize=3)
        ax.set_title(f"{job}, {nproc} rank{'s' if nproc > 1 else ''}")
        ax.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddptrain bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every measurement (default 3)")
    parser.add_argument("--jobs", default="tutorial,mlp", help="comma-separated: tutorial, mlp")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--tutorial-epochs", type=int, default=20)
    parser.add_argument("--mlp-epochs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny data and 2 epochs: checks the plumbing only")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    args = parser.parse_args(argv)
    jobs, ranks = args.jobs.split(","), [int(n) for n in args.ranks.split(",")]
    epochs = {"tutorial": args.tutorial_epochs, "mlp": args.mlp_epochs}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.smoke:
        epochs = {job: 2 for job in epochs}
        env["DDPTRAIN_BENCH_SMOKE"] = "1"
    print(f"ddptrain bench: {args.reps} reps of {jobs} at {ranks} ranks, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
          f"{os.cpu_count()} CPUs", flush=True)
    rows = summarize(measure(jobs, ranks, args.reps, epochs, env, log=lambda m: print(m, flush=True)))
    table = format_table(rows)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"rows": rows, "argv": argv, "cpus": os.cpu_count()}, indent=2))
    note = draw_chart(rows, out / "bench.png")
    print(note or f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0
