"""Goodput projected to 1,024 and 16,384 ranks from the costs measured on this machine
(docs/fault-tolerance.md): a plain restart from snapshots at Young/Daly's best interval, and
torchft's replica groups, at Llama 3's failure rate (419 unexpected interruptions in 54 days
on 16,384 GPUs: one per ~50,700 GPU-hours).

    python benchmarks/goodput_projection.py [--snapshot-s 0.01] [--write-s 0.05] [--restart-s 2.6]
        [--stall-s 2.05] [--heal-s 3] [--groups 8] [--ranks 256,1024,4096,16384]

The costs default to benchmarks/fault_tolerance.py's medians here (a tiny model on 2 CPU
cores); ``--restart-s 600 --heal-s 600 --snapshot-s 5 --write-s 300`` stand for a large job
(a 10-minute start, a snapshot that blocks 5 s and is written in 5 minutes): assumptions, not
measurements.
"""

import argparse

from ddptrain.observe.goodput import replica_goodput, restart_goodput
from ddptrain.progress import best_interval_s

GPU_HOURS_PER_FAILURE = 54 * 24 * 16_384 / 419  # Llama 3 405B (Dubey et al. 2024, table 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot-s", type=float, default=0.01, help="a snapshot's blocking time")
    parser.add_argument("--write-s", type=float, default=0.05, help="a snapshot's write, behind the training")
    parser.add_argument("--restart-s", type=float, default=2.6, help="a failure's cost to a restart: detection, "
                        "start-up, restore (not the steps redone)")
    parser.add_argument("--stall-s", type=float, default=2.05, help="torchft: the healthy groups' wait at a failure")
    parser.add_argument("--heal-s", type=float, default=3.0, help="torchft: the failed group's restart and heal")
    parser.add_argument("--groups", type=int, default=8, help="torchft: replica groups")
    parser.add_argument("--ranks", default="256,1024,4096,16384")
    args = parser.parse_args()
    print(f"costs: snapshot {args.snapshot_s:g} s blocking, {args.write_s:g} s written, restart "
          f"{args.restart_s:g} s, torchft stall {args.stall_s:g} s and heal {args.heal_s:g} s with {args.groups} "
          f"groups; one failure per {GPU_HOURS_PER_FAILURE:,.0f} GPU-hours")
    print(f"{'ranks':>7} {'job MTTF':>10} {'best interval':>14} {'restart':>8} {'restart, 30 min':>16} "
          f"{'torchft':>8}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        mttf = GPU_HOURS_PER_FAILURE / ranks * 3600
        best = best_interval_s(mttf, args.snapshot_s, args.write_s)
        print(f"{ranks:>7,} {mttf / 3600:>8.2f} h {best:>12.0f} s "
              f"{restart_goodput(mttf, best, args.snapshot_s, args.restart_s):>8.4f} "
              f"{restart_goodput(mttf, 1800, args.snapshot_s, args.restart_s):>16.4f} "
              f"{replica_goodput(mttf, args.groups, args.stall_s, args.heal_s):>8.4f}")


if __name__ == "__main__":
    main()
