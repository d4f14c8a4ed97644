"""Memory and speed of --strategy ddp and fsdp on a ~34M-parameter MLP (32 blocks of 1024x1024)
with AdamW, 2 ranks, CPU: ddptrain at its defaults (CPU ranks under mimalloc, launch/allocator.py),
fsdp under glibc's allocator (DDPTRAIN_ALLOCATOR=system), fsdp with --lean-cpu-memory under glibc,
and the hand-written FSDP2 loop of `ddptrain bench` (`fully_shard` per block, mp.spawn) under
glibc and under mimalloc with ddptrain's settings (FSDP2 itself, with none of ddptrain around it).

    python benchmarks/fsdp_memory.py [--reps 3] [--no-glibc] [--try-env MIMALLOC_PURGE_DELAY=100]

samples/s: the steady rate of the bench's step clock (bench/clock.py: every contender's loss ticks
it; the first 5 steps left out). Peak RSS: the largest process of the job over its life (getrusage
of the children, in a fresh wrapper per run); training peak: the same during training only
(metrics.jsonl's peak_rss_mb at the last epoch's record, before the final snapshot and model.pt;
the loop's own reading after its last step, before it gathers the whole weights).
Model state: parameters + gradients + optimizer state of the largest ddptrain rank (metrics.jsonl).
Medians over the repetitions, whose order rotates; the ranges are the spread.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ddptrain.bench.clock import steady_rate
from ddptrain.launch.allocator import MIMALLOC_SETTINGS, mimalloc_path

STEPS = 32  # 2 epochs of 512 samples at 2 x 16
TRAIN = [sys.executable, "-m", "ddptrain", "train", "--task", "ddptrain.bench.jobs:bench_task", "--nproc", "2",
         "--max-epochs", "2", "--batch-size", "16", "--save-seconds", "0"]
LOOP = [sys.executable, "-m", "ddptrain.bench.loops", "--loop", "loop", "--job", "fsdp", "--nproc", "2",
        "--epochs", "2"]
SYSTEM = {"DDPTRAIN_ALLOCATOR": "system"}
VARIANTS = {"ddp": (TRAIN + ["--strategy", "ddp"], {}),
            "fsdp": (TRAIN + ["--strategy", "fsdp"], {}),
            "fsdp, glibc": (TRAIN + ["--strategy", "fsdp"], SYSTEM),
            "fsdp --lean-cpu-memory, glibc": (TRAIN + ["--strategy", "fsdp", "--lean-cpu-memory"], SYSTEM),
            "hand-written fully_shard loop": (LOOP, {})}
MIMALLOC = mimalloc_path()  # the hand-written loop under ddptrain's allocator too (the wheel is Linux's)
if MIMALLOC is not None:
    VARIANTS["hand-written loop, mimalloc"] = (LOOP, {**MIMALLOC_SETTINGS, "LD_PRELOAD": str(MIMALLOC)})
# Runs the job and prints the largest peak RSS among the processes it started (KiB on Linux).
WRAPPER = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run(command: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        clock = Path(out) / "clock.json"
        place = ["--out", out] if command is LOOP else ["--run-dir", out]
        done = subprocess.run([sys.executable, "-c", WRAPPER, *command, *place], check=True, capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                              "DDPTRAIN_BENCH_JOB": "fsdp", "DDPTRAIN_BENCH_CLOCK": str(clock),
                                              "DDPTRAIN_BENCH_STEPS": str(STEPS), **env})
        figures = {"samples_per_s": steady_rate(json.loads(clock.read_text()), 32),
                   "rss_mb": int(done.stdout.split()[-1]) / 1024, "state_mb": float("nan"),
                   "training_rss_mb": float("nan")}
        metrics, loop_peaks = Path(out) / "metrics.jsonl", list(Path(out).glob("training_peak_rss_mb.*"))
        if loop_peaks:
            figures["training_rss_mb"] = max(float(p.read_text()) for p in loop_peaks)
        if metrics.exists():
            last = json.loads(metrics.read_text().splitlines()[-1])
            figures["state_mb"] = last["memory_mb"]["model_state_mb"]["max"]
            figures["training_rss_mb"] = last["memory_mb"]["peak_rss_mb"]["max"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--try-env", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="one more fsdp contender at the defaults plus these variables (repeatable)")
    parser.add_argument("--glibc", action=argparse.BooleanOptionalAction, default=True,
                        help="the two glibc contenders (--no-glibc: leave them out, a quicker run)")
    args = parser.parse_args()
    if not args.glibc:
        for name in [n for n in VARIANTS if "glibc" in n]:
            del VARIANTS[name]
    for spec in args.try_env:
        VARIANTS[f"fsdp {spec}"] = (TRAIN + ["--strategy", "fsdp"], dict(kv.split("=", 1) for kv in spec.split(",")))
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        turn = rep % len(VARIANTS)
        for name in list(VARIANTS)[turn:] + list(VARIANTS)[:turn]:
            results[name].append(run(*VARIANTS[name]))
            print(f"  rep {rep} {name:32s} {results[name][-1]}", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    loop = median["hand-written fully_shard loop"]["samples_per_s"]
    print(f"\n{'contender':32s} {'samples/s (min-max)':>20s} {'vs loop':>7s} {'model state MB':>15s} "
          f"{'peak RSS MB (min-max)':>22s} {'RSS vs ddp':>11s} {'training peak MB':>17s} {'vs ddp':>7s}")
    for name, figures in median.items():
        rates, peaks = [r["samples_per_s"] for r in results[name]], [r["rss_mb"] for r in results[name]]
        rate = f"{figures['samples_per_s']:.1f} ({min(rates):.1f}-{max(rates):.1f})"
        peak = f"{figures['rss_mb']:,.0f} ({min(peaks):,.0f}-{max(peaks):,.0f})"
        speed, memory = figures["samples_per_s"] / loop, figures["rss_mb"] / median["ddp"]["rss_mb"]
        training = figures["training_rss_mb"] / median["ddp"]["training_rss_mb"]
        print(f"{name:32s} {rate:>20s} {speed:7.2f} {figures['state_mb']:15,.1f} {peak:>22s} {memory:11.2f} "
              f"{figures['training_rss_mb']:17,.0f} {training:7.2f}")


if __name__ == "__main__":
    main()
