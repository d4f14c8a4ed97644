"""Memory and speed of --strategy ddp and fsdp on a ~34M-parameter MLP (32 blocks of 1024x1024)
with AdamW, 2 ranks, through `ddptrain train`: fsdp as it is, with --lean-cpu-memory (glibc's
mmap threshold fixed at 1 MiB), and with torch's THP_MEM_ALLOC_ENABLE=1 (large CPU tensors
aligned to 2 MiB huge pages; read when torch starts, so it is set for the whole command).

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

VARIANTS = {"ddp": (["--strategy", "ddp"], {}), "fsdp": (["--strategy", "fsdp"], {}),
            "fsdp --lean-cpu-memory": (["--strategy", "fsdp", "--lean-cpu-memory"], {}),
            "fsdp, THP_MEM_ALLOC_ENABLE=1": (["--strategy", "fsdp"], {"THP_MEM_ALLOC_ENABLE": "1"})}


def run(flags: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "-m", "ddptrain", "train", "--task", "ddptrain.bench.jobs:mlp34m_task",
                        "--nproc", "2", "--max-epochs", "2", "--batch-size", "16", "--save-seconds", "0",
                        "--run-dir", run_dir, *flags], check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env})
        last = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()][-1]
    return {"samples_per_s": last["samples_per_s"], "state_mb": last["memory_mb"]["model_state_mb"]["max"],
            "rss_mb": last["memory_mb"]["peak_rss_mb"]["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        turn = rep % len(VARIANTS)
        for name in list(VARIANTS)[turn:] + list(VARIANTS)[:turn]:
            results[name].append(run(*VARIANTS[name]))
            print(f"  rep {rep} {name:32s} {results[name][-1]}", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"\n{'strategy':32s} {'samples/s (min-max)':>20s} {'vs fsdp':>7s} {'model state MB':>15s} "
          f"{'peak RSS MB':>12s} {'RSS vs ddp':>11s}")
    for name, figures in median.items():
        rates = [r["samples_per_s"] for r in results[name]]
        rate = f"{figures['samples_per_s']:.1f} ({min(rates):.1f}-{max(rates):.1f})"
        speed, memory = (figures["samples_per_s"] / median["fsdp"]["samples_per_s"],
                         figures["rss_mb"] / median["ddp"]["rss_mb"])
        print(f"{name:32s} {rate:>20s} {speed:7.2f} {figures['state_mb']:15,.1f} {figures['rss_mb']:12,.0f} "
              f"{memory:11.2f}")


if __name__ == "__main__":
    main()
