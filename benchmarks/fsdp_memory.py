"""Memory and speed of --strategy ddp, fsdp, and fsdp with activation checkpointing, on a
~34M-parameter MLP (32 blocks of 1024x1024) with AdamW, 2 ranks, through `ddptrain train`.

    python benchmarks/fsdp_memory.py [--reps 3]

Model state: parameters + gradients + optimizer state held by the largest rank. Peak RSS: the
largest process's peak resident memory (both from metrics.jsonl's memory_mb). samples/s: the
last epoch's, as metrics.jsonl reports it; medians over the repetitions, which alternate.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"],
            "fsdp + activation checkpointing": ["--strategy", "fsdp", "--activation-checkpointing"]}


def run(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "-m", "ddptrain", "train", "--task", "ddptrain.bench.loops:mlp34m_task",
                        "--nproc", "2", "--max-epochs", "2", "--batch-size", "16", "--save-seconds", "0",
                        "--run-dir", run_dir, *flags], check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        last = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()][-1]
    return {"samples_per_s": last["samples_per_s"], "state_mb": last["memory_mb"]["model_state_mb"]["max"],
            "rss_mb": last["memory_mb"]["peak_rss_mb"]["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        names = list(VARIANTS)[rep % 3:] + list(VARIANTS)[:rep % 3]
        for name in names:
            results[name].append(run(VARIANTS[name]))
            print(f"  rep {rep} {name:32s} {results[name][-1]}", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"\n{'strategy':32s} {'samples/s':>10s} {'model state MB':>15s} {'peak RSS MB':>12s} {'RSS vs ddp':>11s}")
    for name, figures in median.items():
        print(f"{name:32s} {figures['samples_per_s']:10,.0f} {figures['state_mb']:15,.1f} {figures['rss_mb']:12,.0f} "
              f"{figures['rss_mb'] / median['ddp']['rss_mb']:11.2f}")


if __name__ == "__main__":
    main()
