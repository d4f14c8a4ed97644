"""`ddptrain plan`'s figures against a real gloo group of the same size: every figure a planned
rank reports (bytes held, activations, snapshot entries, data shares, collectives, the peak),
side by side with the same rank's in a real group on this machine.

    python benchmarks/plan_vs_real.py --world 8

The suite checks 2 and 4 ranks (tests/integration/test_plan.py); this runs a larger world once,
which a 2-core machine can, slowly. Prints one line per job and rank: the figures that differ
(none, where the plan is exact), the peaks and the collectives.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import torch

from ddptrain.api import prepare
from ddptrain.comm import DistContext
from ddptrain.plan.job import steady_step
from ddptrain.plan.rank import Target, measure_rank, plan_rank

sys.path[:0] = [str(Path(__file__).parents[1] / "tests")]
from helpers.ranks import run_on_ranks  # noqa: E402  (the suite's real-group runner)

JOBS = {"fsdp": {"task": "digits", "optimizer": "adamw", "strategy": "fsdp"},
        "ddp-accum2": {"task": "digits", "optimizer": "adamw", "grad_accum": 2}}


def _steps(options: dict[str, Any]) -> int:
    return steady_step(options.get("strategy", "ddp")) + 1


def real(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank`` of a real gloo group, measured as the plan measures (its optimizer as on cuda)."""
    cfg, factory = prepare(None, options)
    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), "gloo")
    return dataclasses.asdict(measure_rank(cfg, factory, ctx, _steps(options), device="cuda"))


def planned(options: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """(In a spawned process: a fake world leaves torch's state behind.) The plan's rank ``rank``."""
    cfg, factory = prepare(None, options)
    return dataclasses.asdict(plan_rank(cfg, factory, Target(world, world), rank, _steps(options)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8, help="ranks of the real group and the plan (default: 8)")
    args = parser.parse_args()
    for job, options in JOBS.items():
        measured = run_on_ranks(args.world, real, options)
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            for rank in (0, args.world - 1):
                plan, got = pool.submit(planned, options, args.world, rank).result(), measured[rank]
                differ = {k: (plan[k], got[k]) for k in plan if plan[k] != got[k]}
                collectives = sorted((k, v["count"]) for k, v in plan["collectives"].items())
                print(f"{job} rank {rank} of {args.world}: differs {differ or 'in nothing'}; peak planned "
                      f"{plan['allocated_peak_bytes']:,} B, real {got['allocated_peak_bytes']:,} B; "
                      f"collectives {collectives}")


if __name__ == "__main__":
    main()
