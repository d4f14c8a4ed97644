"""``ddptrain bench``: ddptrain against hand-written loops (and, with ``--peers``, Lightning
and Accelerate) on the same jobs (bench/jobs.py), side by side in one run.

Every contender runs as whole commands, started the way its users start them (bench/loops.py).
Per repetition and job, each contender runs a 1-epoch command and a (1+E)-epoch command, and
three figures come out:
- steady samples/s, measured inside the processes: rank 0's step clock (bench/clock.py) times
  every step of the (1+E)-epoch run, and the steps after the warm-up give the rate (start-up,
  imports and first-call costs left out; epoch ends, metrics and snapshots kept in);
- command samples/s: the extra samples of the longer command over its extra wall, so start-up
  cancels out and everything per epoch counts;
- the 1-epoch command's wall: what a user waits for a short job.
Contenders alternate within each repetition, so the machine's drift hits all alike; figures are
medians with their min-max. Every contender trains the same model on the same samples in the
same order, so all must end at the same loss: the table shows it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .clock import steady_rate
from .jobs import JOBS, Job, final_loss

# ddptrain-skip: ddptrain with --skip-nonfinite 1, the non-finite guard's per-step mode (a check and
# a one-element all-reduce every step); ddptrain's default guard costs no per-step work.
# ddptrain-ema: ddptrain with --ema 0.999 (a fused lerp over the weights every step). Both run on
# the small jobs, where a per-step cost shows, as does loop-grad-norm: the hand-written loop plus
# ddptrain's per-step gradient norm (its ratio to loop is what grad_norm costs; ddptrain has no off
# switch for it).
# ddptrain-no-fr (asked for by name only): ddptrain with torch's Flight Recorder off, which ddptrain
# turns on to name the collectives of a hang (resilience/flight.py): ddptrain's ratio to it is that cost.
# ddptrain-no-log (by name too): ddptrain without step records (--log-every 0): ddptrain's ratio to it
# is what the default step records cost (an all-reduce and a line every 10 steps).
BASE = ("loop", "loop-grad-norm", "ddptrain", "ddptrain-skip", "ddptrain-ema")
PEERS = ("lightning", "accelerate")
PER_STEP = {"ddptrain-skip": ["--skip-nonfinite", "1"], "ddptrain-ema": ["--ema", "0.999"],
            "ddptrain-no-log": ["--log-every", "0"]}
CONTENDER_ENV = {"ddptrain-no-fr": {"TORCH_FR_BUFFER_SIZE": "0"}}
BY_NAME = (*CONTENDER_ENV, "ddptrain-no-log")
SMALL_ONLY = (*PER_STEP, *BY_NAME, "loop-grad-norm")  # the contenders that run on SKIP_JOBS only
SKIP_JOBS = ("tutorial", "mlp")  # the jobs the per-step variants run on
DEFAULT_EPOCHS = {"tutorial": 60, "mlp": 3, "gpt2": 10, "fsdp": 2}  # E: the longer command's extra epochs


def command(contender: str, job: Job, nproc: int, epochs: int, out: str, device: str = "cpu") -> list[str]:
    python = sys.executable
    if contender.startswith("ddptrain"):
        return [python, "-m", "ddptrain", "train", "--task", "ddptrain.bench.jobs:bench_task", "--nproc", str(nproc),
                "--max-epochs", str(epochs), "--batch-size", str(job.batch), "--run-dir", out, "--resume", "never",
                "--no-progress", "--device", device,
                *(["--strategy", "fsdp"] if job.sharded else []),
                *PER_STEP.get(contender, [])]
    loop = ["-m", "ddptrain.bench.loops", "--loop", contender, "--job", job.name, "--epochs", str(epochs), "--out", out]
    if contender == "accelerate":  # Accelerate's multi-process CPU runs are torchrun's (it sets the world size)
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *loop]
    return [python, *loop, "--nproc", str(nproc)]


def run_once(contender: str, job: Job, nproc: int, epochs: int, env: dict[str, str], log: Any = print
             ) -> tuple[float, float, list[float]]:
    """(wall seconds of the whole command, full-data loss of its final weights, rank 0's step
    ticks). A failed run is tried once more (and said so): one crash of a contender is not the
    benchmark's end."""
    import torch

    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            clock = Path(out) / "clock.json"
            steps = epochs * job.steps_per_epoch(nproc, smoke=bool(env.get("DDPTRAIN_BENCH_SMOKE")))
            started = time.perf_counter()
            device = env.get("DDPTRAIN_BENCH_DEVICE", "cpu")
            done = subprocess.run(command(contender, job, nproc, epochs, out, device), capture_output=True, text=True,
                                  env={**env, **CONTENDER_ENV.get(contender, {}), "DDPTRAIN_BENCH_JOB": job.name,
                                       "DDPTRAIN_BENCH_CLOCK": str(clock), "DDPTRAIN_BENCH_STEPS": str(steps)})
            wall = time.perf_counter() - started
            if done.returncode == 0:
                ticks = json.loads(clock.read_text()) if clock.exists() else []
                return wall, final_loss(job, torch.load(Path(out) / "model.pt", weights_only=True)), ticks
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        log(f"  {contender} {job.name} failed ({error}); " + ("trying once more" if attempt == 1 else "giving up"))
    raise RuntimeError(f"{contender} {job.name} x{nproc} failed twice:\n{done.stderr[-3000:]}")


def contenders_of(job: str, contenders: list[str]) -> list[str]:
    return [c for c in contenders if c not in SMALL_ONLY or job in SKIP_JOBS]


def measure(contenders: list[str], jobs: list[str], nproc: int, reps: int, epochs: dict[str, int],
            env: dict[str, str], log: Any = print) -> list[dict[str, Any]]:
    runs = []
    for rep in range(reps):
        for name in jobs:
            job, mine = JOBS[name], contenders_of(name, contenders)
            samples, per_step = job.size(smoke=bool(env.get("DDPTRAIN_BENCH_SMOKE"))), job.batch * nproc
            turn = rep % len(mine)
            for contender in mine[turn:] + mine[:turn]:  # rotate who goes first
                short, loss, ticks = run_once(contender, job, nproc, 1, env, log)
                long = short
                if epochs[name]:
                    long, loss, ticks = run_once(contender, job, nproc, 1 + epochs[name], env, log)
                # the extra samples over the extra wall (not measurable when the longer run was no longer)
                rate = epochs[name] * samples / (long - short) if long > short else float("nan")
                steady = steady_rate(ticks, per_step)
                runs.append({"job": name, "contender": contender, "rep": rep, "wall_1_epoch_s": short,
                             "samples_per_s": rate, "steady_samples_per_s": steady, "final_loss": loss,
                             "tokens_per_sample": job.tokens_per_sample})
                log(f"  rep {rep} {name:8s} {contender:13s} steady {steady:10,.1f} samples/s  command {rate:10,.1f} "
                    f"samples/s  1-epoch wall {short:5.2f} s  loss {loss:.6g}")
    return runs


FIGURES = ("steady_samples_per_s", "samples_per_s", "wall_1_epoch_s", "final_loss")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for job in dict.fromkeys(r["job"] for r in runs):
        mine = [r for r in runs if r["job"] == job]
        contenders = list(dict.fromkeys(r["contender"] for r in mine))
        of = {c: [r for r in mine if r["contender"] == c] for c in contenders}
        median = {c: {k: _median([r[k] for r in of[c]]) for k in FIGURES} for c in contenders}
        peers = [c for c in contenders if c in PEERS]
        fastest_peer = min((median[c]["wall_1_epoch_s"] for c in peers), default=None)
        losses = [median[c]["final_loss"] for c in contenders]
        same_loss = (max(losses) - min(losses)) <= 1e-4 * max(abs(x) for x in losses)
        for contender in contenders:
            row = {"job": job, "contender": contender, **median[contender],
                   "tokens_per_sample": of[contender][0]["tokens_per_sample"], "same_loss_as_all": same_loss,
                   "wall_vs_fastest_peer": (median[contender]["wall_1_epoch_s"] / fastest_peer
                                            if fastest_peer else None)}
            for key in ("steady_samples_per_s", "samples_per_s", "wall_1_epoch_s"):
                row[key + "_range"] = _range([r[key] for r in of[contender]])
            for key in ("steady_samples_per_s", "samples_per_s"):
                row[key + "_vs_loop"] = median[contender][key] / median["loop"][key] if "loop" in median else None
            rows.append(row)
    return rows


def _median(values: list[float]) -> float:
    finite = [v for v in values if v == v]  # NaN: a rate too small to measure
    return statistics.median(finite) if finite else float("nan")


def _range(values: list[float]) -> list[float]:
    finite = [v for v in values if v == v]
    return [min(finite), max(finite)] if finite else [float("nan"), float("nan")]


def _spread(value: float, spread: list[float], digits: int = 0) -> str:
    return f"{value:,.{digits}f} ({spread[0]:,.{digits}f}-{spread[1]:,.{digits}f})"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None and value == value else ""


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'job':9s} {'contender':13s} {'steady samples/s (min-max)':>27s} {'vs loop':>7s} "
              f"{'command samples/s':>25s} {'vs loop':>7s} {'1-epoch wall (min-max)':>23s} {'vs fastest peer':>15s} "
              f"{'final loss':>11s}")
    lines = [header, "-" * len(header)]
    for r in rows:
        digits = 1 if r["steady_samples_per_s"] < 1000 else 0
        lines.append(f"{r['job']:9s} {r['contender']:13s} "
                     f"{_spread(r['steady_samples_per_s'], r['steady_samples_per_s_range'], digits):>27s} "
                     f"{_ratio(r['steady_samples_per_s_vs_loop']):>7s} "
                     f"{_spread(r['samples_per_s'], r['samples_per_s_range'], digits):>25s} "
                     f"{_ratio(r['samples_per_s_vs_loop']):>7s} "
                     f"{_spread(r['wall_1_epoch_s'], r['wall_1_epoch_s_range'], 2) + ' s':>23s} "
                     f"{_ratio(r['wall_vs_fastest_peer']):>15s} {r['final_loss']:11.6g}")
    for job in dict.fromkeys(r["job"] for r in rows):
        same = all(r["same_loss_as_all"] for r in rows if r["job"] == job)
        lines.append(f"{job}: every contender ended at the same loss: {'yes' if same else 'NO'} "
                     "(same model, samples, order and optimizer)")
        tokens = next(r["tokens_per_sample"] for r in rows if r["job"] == job)
        if tokens:
            rates = ", ".join(f"{r['contender']} {r['steady_samples_per_s'] * tokens / 1000:,.1f}k"
                              for r in rows if r["job"] == job)
            lines.append(f"{job}: steady tokens/s ({tokens} per sample): {rates}")
    lines.append("ddptrain-skip: ddptrain with --skip-nonfinite 1 (a finiteness check and agreement every step); "
                 "ddptrain-ema: ddptrain with --ema 0.999 (the weights' average updated every step); "
                 "loop-grad-norm: the loop plus ddptrain's per-step gradient norm (what grad_norm costs)")
    if any(r["contender"] == "ddptrain-no-fr" for r in rows):
        lines.append("ddptrain-no-fr: ddptrain with torch's Flight Recorder off (TORCH_FR_BUFFER_SIZE=0); ddptrain "
                     "turns it on to name a hang's collectives")
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
        colors = ["#e83" if n.startswith("ddptrain") else "#69c" if n.startswith("loop") else "#999" for n in names]
        for row, (key, label) in enumerate((("steady_samples_per_s", "steady samples/s (in-process)"),
                                            ("wall_1_epoch_s", "1-epoch command wall (s)"))):
            ax = axes[row][column]
            values = [r[key] for r in mine]
            errors = [[v - r[key + "_range"][0] for v, r in zip(values, mine)],
                      [r[key + "_range"][1] - v for v, r in zip(values, mine)]]
            ax.bar(names, values, yerr=errors, color=colors, capsize=3)
            ax.set_title(f"{job}: {label}", fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported: importing Lightning sets variables)."""
    return importlib.util.find_spec(module) is not None


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
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated: {', '.join(JOBS)} (default: all)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--epochs", default="", metavar="JOB=E,...", help="extra epochs E of the longer command, "
                        "per job (default: " + ",".join(f"{k}={v}" for k, v in DEFAULT_EPOCHS.items()) + ")")
    parser.add_argument("--peers", action="store_true", help="add Lightning and Accelerate rows (pip install "
                        "'ddptrain[bench]')")
    parser.add_argument("--contenders", default=None, help="comma-separated subset of loop, loop-grad-norm, "
                        "ddptrain, ddptrain-skip, ddptrain-ema (and lightning, accelerate with --peers; "
                        "ddptrain-no-fr and ddptrain-no-log, by name only); default: all but those two")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every contender trains: "
                        "cuda is one GPU per rank and nccl (default cpu, gloo)")
    parser.add_argument("--smoke", action="store_true", help="tiny data, 1-epoch commands only: checks the plumbing")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    parser.add_argument("--floor", action="store_true", help="instead: the start-up floor of a CPU job here (import "
                        "torch, fork the ranks, gloo, one all-reduce) next to ddptrain's 1-epoch command")
    args = parser.parse_args(argv)
    if args.floor:
        return floor_main(args)
    jobs = args.jobs.split(",")
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"--jobs: unknown {', '.join(unknown)}")
    if "gpt2" in jobs and not installed("transformers"):
        print("ddptrain bench: transformers not installed (pip install 'ddptrain[hf]'): the gpt2 job is left out",
              flush=True)
        jobs.remove("gpt2")
    try:
        epochs = {**DEFAULT_EPOCHS, **{k: int(v) for k, v in (p.split("=") for p in args.epochs.split(",") if p)}}
    except ValueError:
        parser.error(f"--epochs {args.epochs}: give JOB=E pairs, e.g. tutorial=60,mlp=3")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "DDPTRAIN_BENCH_DEVICE": args.device}
    if args.smoke:
        epochs = {job: 0 for job in epochs}
        env["DDPTRAIN_BENCH_SMOKE"] = "1"
        os.environ["DDPTRAIN_BENCH_SMOKE"] = "1"  # (here too: final_loss builds the smoke's model and data)
    contenders = list(BASE)
    if args.peers:
        missing = [peer for peer in PEERS if not installed(peer)]
        if missing:
            print(f"ddptrain bench: {' and '.join(missing)} not installed (pip install 'ddptrain[bench]'): "
                  f"{'its' if len(missing) == 1 else 'their'} rows are left out", flush=True)
        contenders += [peer for peer in PEERS if peer not in missing]
    if args.contenders:
        wanted = args.contenders.split(",")
        unknown = sorted(set(wanted) - set(BASE) - set(PEERS) - set(BY_NAME))
        if unknown:
            parser.error(f"--contenders: unknown {', '.join(unknown)}")
        contenders = [c for c in (*contenders, *BY_NAME) if c in wanted]
    print(f"ddptrain bench: {args.reps} rep(s) of {jobs} at {args.nproc} ranks on {args.device}, "
          f"contenders {contenders}, "
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
