"""The bench's step clock: throughput measured inside the training processes, the same way
for every contender.

Each contender's loss calls ``tick()`` once per optimizer step (its loss is computed once per
step), so the time between two ticks is one whole step as that trainer runs it: data, forward,
backward, communication, optimizer, and whatever the trainer does between steps (epoch ends,
metrics, snapshots). Rank 0 writes the ticks to DDPTRAIN_BENCH_CLOCK once it has
DDPTRAIN_BENCH_STEPS of them (unset: the clock does nothing). ``steady_rate`` leaves out the
first ``WARMUP_STEPS`` steps (first-call costs: allocations, lazy initialisation, imports).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

WARMUP_STEPS = 5


def clock() -> Callable[[], None]:
    """A ``tick`` for this process: records on rank 0 when the bench asked for a clock."""
    path, wanted = os.environ.get("DDPTRAIN_BENCH_CLOCK"), int(os.environ.get("DDPTRAIN_BENCH_STEPS", "0"))
    ticks: list[float] = []

    def tick() -> None:
        if not path or _rank() != 0 or len(ticks) >= wanted:
            return
        ticks.append(time.perf_counter())
        if len(ticks) == wanted:
            Path(path).write_text(json.dumps(ticks))

    return tick


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def steady_rate(ticks: list[float], samples_per_step: int) -> float:
    """Samples per second over the steps after the warm-up (NaN: too few steps to say)."""
    skip = min(WARMUP_STEPS, max(0, len(ticks) // 2 - 1))
    steps = len(ticks) - 1 - skip
    if steps < 1 or ticks[-1] <= ticks[skip]:
        return float("nan")
    return steps * samples_per_step / (ticks[-1] - ticks[skip])
