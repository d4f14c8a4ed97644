"""From what a planned rank holds and sends (rank.py) to time at the target scale: the step's
compute and communication, a snapshot's blocking copy and write, the control plane's load, and
the expected goodput. First-order models, each named where it is used; the figures they start
from are the user's (``ddptrain plan --tflops ...``) or the defaults below, printed with the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..observe.goodput import restart_goodput
from ..progress import best_interval_s
from ..resilience.stop_signals import CHECK_SECONDS, MAX_INTERVAL
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


def collective_seconds(collective: dict[str, Any], hw: Hardware) -> tuple[float, str]:
    """One collective's time and the algorithm NCCL would run it with: each of its steps costs
    --latency-us, its bytes go at its link's bandwidth (inside a node when its group fits in one).
    A ring over N ranks takes N - 1 steps one way (an all-gather, a reduce-scatter, a pipelined
    broadcast) and 2(N - 1) for an all-reduce; NCCL's tree all-reduce 2 log2 N steps, each rank
    sending its buffer about twice: NCCL picks the faster (a tree for small messages over many
    ranks: 3 numbers over 16,384 ranks are 164 ms by a ring and 140 us by a tree at 5 us a step).
    A barrier is an all-reduce of one number. An object gathered to one rank (DCP's plans:
    torch's gather_object) or scattered from it first all-gathers every rank's size (a ring),
    then moves N - 1 ranks' payloads through that rank's link."""
    group, kind = collective["group"], collective["kind"]
    if group <= 1:
        return 0.0, "-"
    size, latency = collective["bytes"], hw.latency_us * 1e-6
    per_byte = 8 / ((hw.node_gbps if collective["in_node"] else hw.link_gbps) * 1e9)
    if kind in ("all_reduce", "barrier"):
        ring = 2 * (group - 1) * latency + wire_bytes("all_reduce", collective["elements"], 1, group) * (
            size / max(collective["elements"], 1)) * per_byte
        tree = 2 * math.ceil(math.log2(group)) * latency + 2 * size * per_byte
        return (ring, "ring") if ring <= tree else (tree, "tree")
    if kind in ("gather", "scatter"):
        return (group - 1) * latency + (group - 1) * size * per_byte, "direct"
    element_bytes = size // max(collective["elements"], 1)
    return (group - 1) * latency + wire_bytes(kind, collective["elements"], element_bytes, group) * per_byte, "ring"


def step_seconds(flops: int, collectives: list[dict[str, Any]], hw: Hardware,
                 per_agreement: Sequence[dict[str, Any]] = (), steps_per_agreement: int = 1) -> dict[str, float]:
    """A step's compute (FLOPs at --tflops) and communication (its collectives, and the stop
    agreement's and the step records' a share: they run once every ``steps_per_agreement``
    steps), and the step between full overlap (the longer of the two) and none (their sum)."""
    compute = flops / (hw.tflops * 1e12)
    comm = sum(c["count"] * collective_seconds(c, hw)[0] for c in collectives)
    comm += sum(c["count"] * collective_seconds(c, hw)[0] for c in per_agreement) / steps_per_agreement
    return {"compute_s": compute, "communication_s": comm, "step_s_overlapped": max(compute, comm),
            "step_s_serial": compute + comm}


def steps_per_agreement(step_s: float) -> int:
    """resilience/stop_signals.py: the stop and snapshot agreement (and the step records' sum
    beside it) comes every CHECK_SECONDS of steps, at most every MAX_INTERVAL steps."""
    return min(MAX_INTERVAL, max(1, int(CHECK_SECONDS / max(step_s, 1e-6))))


def agreement_collectives(world_size: int, in_node: bool, steps: int, log_every: int,
                          window_numbers: int) -> list[dict[str, Any]]:
    """What one agreement every ``steps`` steps starts (tests/integration/test_costs.py counts
    them in real runs): the agreement itself, 3 numbers; the step records' windows closed since
    the last (``window_numbers`` each: 3 a step, a task's own step figures) and the FLOPs per
    step, summed over every rank."""
    windows = max(1, steps // max(log_every, 1))
    records = windows * window_numbers + 1
    return [{"kind": "all_reduce", "elements": 3, "dtype": "float32", "count": 1, "bytes": 12,
             "group": world_size, "in_node": in_node, "what": "the stop and snapshot agreement"},
            {"kind": "all_reduce", "elements": records, "dtype": "float64", "count": 1, "bytes": 8 * records,
             "group": world_size, "in_node": in_node, "what": "the step records' sum"}]


def snapshot_collectives(sharded: bool, world_size: int, in_node: bool, plan_bytes: int,
                         metadata_bytes: int) -> list[dict[str, Any]]:
    """What one snapshot starts: ddptrain's barrier once every rank's part is written; under
    FSDP and HSDP DCP's own (torch.distributed.checkpoint's central plan, in the writer's thread):
    every rank's save plan gathered to rank 0 (measured: its pickle), the global plans scattered
    back and the write results gathered (modelled: about a plan's size each), and the .metadata
    broadcast to every rank (the result of DCP's finish)."""
    barrier = {"kind": "barrier", "elements": 1, "dtype": "float32", "count": 1, "bytes": 4, "group": world_size,
               "in_node": in_node, "what": "once every rank's part is written"}
    if not sharded:
        return [barrier]

    def objects(kind: str, payload: int, what: str) -> dict[str, Any]:
        return {"kind": kind, "elements": payload, "dtype": "uint8", "count": 1, "bytes": payload,
                "group": world_size, "in_node": in_node, "what": what}

    return [barrier, objects("gather", plan_bytes, "DCP's save plans, to rank 0"),
            objects("scatter", plan_bytes, "DCP's global plans, from rank 0: about a plan each"),
            objects("gather", plan_bytes, "DCP's write results, to rank 0: about a plan each"),
            objects("broadcast", metadata_bytes, "DCP's .metadata, to every rank")]


def snapshot_seconds(rank_bytes: int, total_bytes: int, hw: Hardware,
                     collectives: Sequence[dict[str, Any]] = ()) -> dict[str, float]:
    """What a snapshot blocks (each rank's copy off the device, and the barrier after every rank's
    part; the writes go on behind the training) and how long the write takes (the whole snapshot
    through the file system, and DCP's collectives in the writer's thread)."""
    on_path = sum(c["seconds"] for c in collectives if c["kind"] == "barrier")
    behind = sum(c["seconds"] for c in collectives if c["kind"] != "barrier")
    return {"blocking_s": rank_bytes / (hw.copy_gbs * GB) + on_path,
            "write_s": total_bytes / (hw.write_gbs * GB) + behind, "snapshot_collectives_s": on_path + behind}


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
