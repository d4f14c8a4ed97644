"""From what a planned rank holds and sends (rank.py) to time at the target scale: the step's
compute and communication, a snapshot's blocking copy and write, the control plane's load, and
the expected goodput. First-order models, each named where it is used; the figures they start
from are the user's (``ddptrain plan --tflops ...``) or the defaults below, printed with the plan.
"""

from __future__ import annotations

import math
from typing import Any

from ..observe.goodput import restart_goodput
from ..progress import best_interval_s
from ..resilience.watchdog import PERIOD_S, beat_period, verdict_period
from .hardware import Hardware

GB = 1e9
HEADROOM = 1.10  # the allocator's slack over the tensors' own bytes (fragmentation, workspaces)
MAX_SNAPSHOT_SHARE = 0.02  # snapshots/checkpointer.py: by time, at most 2% of training on the step's path


def wire_bytes(kind: str, elements: int, element_bytes: int, group: int) -> float:
    """Bytes one rank sends for a collective over ``group`` ranks (ring algorithms): an all-reduce
    sends its buffer twice over, less a share; an all-gather (``elements``: the whole output)
    and a reduce-scatter (``elements``: this rank's shard) each the other ranks' shares once."""
    if group <= 1:
        return 0.0
    size = elements * element_bytes
    if kind == "all_reduce":
        return 2 * size * (group - 1) / group
    if kind == "all_gather":
        return size * (group - 1) / group
    if kind == "reduce_scatter":
        return size * (group - 1)
    return float(size)  # broadcast (pipelined), barrier


def step_seconds(flops: int, collectives: list[dict[str, Any]], hw: Hardware) -> dict[str, float]:
    """A step's compute (FLOPs at --tflops) and communication (each collective's bytes at its
    link's bandwidth: inside a node when its group fits in one), and the step between full
    overlap (the longer of the two) and none (their sum)."""
    compute = flops / (hw.tflops * 1e12)
    comm = sum(c["count"] * wire_bytes(c["kind"], c["elements"], c["bytes"] // max(c["elements"], 1), c["group"])
               * 8 / ((hw.node_gbps if c["in_node"] else hw.link_gbps) * 1e9) for c in collectives)
    return {"compute_s": compute, "communication_s": comm, "step_s_overlapped": max(compute, comm),
            "step_s_serial": compute + comm}


def snapshot_seconds(rank_bytes: int, total_bytes: int, hw: Hardware) -> dict[str, float]:
    """What a snapshot blocks (each rank's copy off the device; the writes go on behind the
    training) and how long the write takes (the whole snapshot through the file system)."""
    return {"blocking_s": rank_bytes / (hw.copy_gbs * GB), "write_s": total_bytes / (hw.write_gbs * GB)}


def snapshot_interval_s(settings: Any, step_s: float, snapshot: dict[str, float], job_mttf_s: float,
                        writes: bool = True) -> float:
    """Seconds of training between snapshots as checkpointer.py spaces them: --save-every's
    steps, and by time --save-seconds stretched to 50x the blocking time, or Young's interval
    under --mttf-hours, either no shorter than a write (the next snapshot would wait for it:
    the checkpointer lengthens the interval once it has waited); the sooner of the two.
    ``writes=False``: by time as if a write took no time (what the write lengthened, for the note)."""
    intervals = []
    write_s = snapshot["write_s"] if writes else 0.0
    if settings.save_every:
        intervals.append(settings.save_every * step_s)
    if settings.mttf_hours:
        intervals.append(best_interval_s(job_mttf_s, snapshot["blocking_s"], write_s))
    elif settings.save_seconds:
        intervals.append(max(settings.save_seconds, snapshot["blocking_s"] / MAX_SNAPSHOT_SHARE, write_s))
    return min(intervals) if intervals else math.inf


def control_plane(world_size: int, timeout_s: float) -> dict[str, float]:
    """The job's store at this size (resilience/watchdog.py, board.py): each rank's heartbeat (at
    most one a beat period, when it changed) and verdict poll; rank 0's judge reads every
    heartbeat in two requests a beat period. Beyond 1,024 ranks the polls slow in proportion to
    the ranks (up to every 2 s), and the heartbeats where --timeout is short (up to every 5 s)."""
    beat, poll = beat_period(timeout_s, world_size), verdict_period(world_size)
    return {"beat_period_s": beat, "verdict_period_s": poll, "heartbeats_per_s": world_size / beat,
            "polls_per_s": world_size / poll, "judge_requests_per_s": 2 / beat,
            "requests_per_s": world_size / beat + world_size / poll + 2 / beat,
            "failure_to_exit_s": poll + PERIOD_S}


def goodput(job_mttf_s: float, interval_s: float, snapshot: dict[str, float], restart_s: float) -> float | None:
    """observe/goodput.restart_goodput: Young/Daly's first-order model of a job that restarts
    from its newest snapshot (None: no snapshots before the end, so a failure starts over)."""
    if math.isinf(interval_s):
        return None
    return restart_goodput(job_mttf_s, interval_s, snapshot["blocking_s"], restart_s)
