"""The plan of a job: the real job, as a few chosen ranks of the world it will run on, before it runs.

Each chosen rank runs the real task factory, strategy, data split, step and optimizer for a few
steps through torch's fake process group (rank.py), on this machine's CPU: what it holds and
sends is measured. The estimates at the target scale (estimate.py) start from those figures.
What would fail at scale is refused, one line each, exit 2 (``refusals``). Nothing is written:
no process group is joined, no run dir made, no snapshot read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, TextIO

from ..errors import ConfigError
from ..settings import RunConfig
from .estimate import (
    HEADROOM,
    agreement_collectives,
    collective_seconds,
    control_plane,
    goodput,
    snapshot_collectives,
    snapshot_interval_s,
    snapshot_seconds,
    step_seconds,
    steps_per_agreement,
)
from .hardware import Hardware
from .memory import available_memory
from .progress import Progress, listen
from .rank import RankFigures, Target, plan_rank


def with_global_batch(cfg: RunConfig, target: Target, global_batch: int | None) -> RunConfig:
    """``--global-batch``: the batch per rank that keeps it at the target's ranks and accumulation
    (its data-parallel ranks: under --tp, a tensor-parallel group counts once)."""
    if global_batch is None:
        return cfg
    ranks = cfg.data_ranks(target.world_size)
    per_rank, rest = divmod(global_batch, ranks * cfg.grad_accum)
    if rest or not per_rank:
        unit = ranks * cfg.grad_accum
        over, example = _data_ranks(cfg, target.world_size), max(1, global_batch // unit) * unit
        raise ConfigError(f"--global-batch {global_batch:,} does not divide over {over} x --grad-accum "
                          f"{cfg.grad_accum}; choose a multiple of {unit:,} (e.g. {example:,}), or another "
                          "--grad-accum")
    return cfg.replace(batch_size=per_rank)


def chosen_ranks(text: str, world_size: int) -> list[int]:
    """``--ranks 0,-1``: rank numbers, negative ones from the end."""
    ranks = []
    for part in text.split(","):
        try:
            number = int(part)
        except ValueError:
            raise ConfigError(f"--ranks {text}: not a list of rank numbers (e.g. 0,-1: the first and the last)") \
                from None
        rank = number + world_size if number < 0 else number
        if not 0 <= rank < world_size:
            raise ConfigError(f"--ranks {text}: rank {number} is outside the {world_size:,} ranks")
        ranks.append(rank)
    return sorted(set(ranks))


def steady_step(strategy: str) -> int:
    """The first step (from 0) whose collectives are those of every later one: DDP rebuilds its
    buckets in its second step (rank 0 broadcasts their order); FSDP's and HSDP's steps are alike
    from the first (their first and second steps' figures compared equal, every one, with AdamW,
    accumulation, bf16, clipping, --skip-nonfinite, --ema), so one step is their plan: GPT-2's
    at 16,384 ranks spent 26 s of its 77 s in a second step. (A stream's first step is not
    steady under any strategy: plan/rank.py runs it twice.)"""
    return 2 if strategy == "ddp" else 0


def make_plan(cfg: RunConfig, factory: Any, target: Target, ranks: list[int], hw: Hardware,
              steps: int | None = None, fake: bool = False, shown: TextIO | None = None) -> dict[str, Any]:
    """The plan: each chosen rank's figures, and the estimates at the target scale (``fake``:
    with fake tensors, for a model that does not fit this machine; ``shown``: where the ranks'
    progress goes while they are planned)."""
    if cfg.fault_tolerance == "torchft":
        raise ConfigError("ddptrain plan: with --fault-tolerance torchft each replica group is a job of its own; "
                          "plan one group (its --world-size) without --fault-tolerance")
    steps = steps or steady_step(cfg.strategy) + 1
    figures = plan_ranks(cfg, factory, target, ranks, steps, fake, shown)
    heaviest = max(figures, key=peak_bytes)
    collectives = _timed(list(heaviest.collectives.values()), hw)  # (each over the group it was given)
    # the stop agreement and the step records' sum, every few steps (as many as the step's time makes)
    agree_every = steps_per_agreement(step_seconds(heaviest.flops_per_step, collectives, hw)["step_s_serial"])
    world, in_node = target.world_size, target.nnodes == 1
    per_agreement = _timed(agreement_collectives(world, in_node, agree_every, heaviest.log_every,
                                                 max(f.window_numbers for f in figures)), hw)
    timing = step_seconds(heaviest.flops_per_step, collectives, hw, per_agreement, agree_every)
    total_snapshot = _snapshot_total(target, figures)
    per_snapshot = _timed(snapshot_collectives(cfg.strategy != "ddp", world, in_node,
                                               max(f.dcp_plan_bytes for f in figures),
                                               max(f.dcp_metadata_bytes for f in figures)), hw)
    snapshot = snapshot_seconds(max(f.snapshot_bytes for f in figures), total_snapshot, hw, per_snapshot)
    job_mttf_s = cfg.mttf_hours * 3600 if cfg.mttf_hours else hw.rank_mttf_hours * 3600 / target.world_size
    interval = snapshot_interval_s(cfg.snapshots, timing["step_s_serial"], snapshot, job_mttf_s)
    unwritten = snapshot_interval_s(cfg.snapshots, timing["step_s_serial"], snapshot, job_mttf_s, writes=False)
    plane = control_plane(target.world_size, cfg.timeout)
    # a restart: the failure's detection, the start, the restore (reading what was written)
    restart_s = plane["failure_to_exit_s"] + hw.start_seconds + snapshot["write_s"]
    return {
        "target": {"world_size": target.world_size, "nnodes": target.nnodes, "nproc_per_node": target.nproc_per_node,
                   "device": target.device, "strategy": cfg.strategy, "tp": cfg.tp, "batch_size": cfg.batch_size,
                   "grad_accum": cfg.grad_accum, "data_ranks": cfg.data_ranks(target.world_size),
                   "global_batch": cfg.global_batch(cfg.data_ranks(target.world_size)),
                   "steps_planned": max(f.steps_run for f in figures)},
        "hardware": dataclasses.asdict(hw),
        "ranks": [{**dataclasses.asdict(f), "peak_bytes": peak_bytes(f)} for f in figures],
        "collectives_per_step": collectives,
        "collectives_per_agreement": {"every_steps": agree_every, "collectives": per_agreement},
        "collectives_per_snapshot": per_snapshot,
        "time": {**timing, **snapshot, "snapshot_interval_s": interval, "snapshot_total_bytes": total_snapshot,
                 "dcp_metadata_bytes": max(f.dcp_metadata_bytes for f in figures),
                 "job_mttf_s": job_mttf_s, "restart_s": restart_s,
                 "goodput": goodput(job_mttf_s, interval, snapshot, restart_s)},
        "control_plane": plane,
        "notes": notes(cfg, target, figures) + ([
            f"snapshots by time every {interval:.3g} s, the time a snapshot's write takes at --write-gbs "
            f"{hw.write_gbs:g}: {'Young' + chr(39) + 's interval' if cfg.mttf_hours else '--save-seconds'} "
            f"({unwritten:.3g} s) would have each wait for the one before"] if interval > unwritten else []),
    }


# What a planned rank's memory grows by per rank of the world it is planned in, measured here (the
# regression job: peak 356 MB at 65,536 ranks, 895 MB at 1,048,576): torch keeps the world's ranks
# in dicts in every process (init_process_group alone: 83 MB at a million ranks, 653 MB at ten).
BYTES_PER_WORLD_RANK = 600


def check_world_fits_here(world_size: int, ranks_at_once: int, available: int | None) -> None:
    """ConfigError (one line) for a world too large to simulate on this machine: its planned ranks
    would need more than the memory ``available`` (bytes; None: unknown, not checked)."""
    needed = world_size * BYTES_PER_WORLD_RANK * ranks_at_once
    if available is not None and needed > available:
        most = available // (BYTES_PER_WORLD_RANK * ranks_at_once)
        alone = f" ({available // BYTES_PER_WORLD_RANK:,} planning one rank: --ranks 0)" if ranks_at_once > 1 else ""
        raise ConfigError(f"--world-size {world_size:,}: its {ranks_at_once} planned rank(s) would need about "
                          f"{needed / 1e9:,.0f} GB here for the world alone (torch keeps about "
                          f"{BYTES_PER_WORLD_RANK} bytes a rank of the world in each), above this machine's "
                          f"{available / 1e9:.0f} GB available; plan at most {most:,} ranks here{alone}")


def plan_ranks(cfg: RunConfig, factory: Any, target: Target, ranks: list[int], steps: int,
               fake: bool = False, shown: TextIO | None = None) -> list[RankFigures]:
    """Each chosen rank planned in a fresh process of its own, as many at once as there are cores.

    Fresh, because a planned rank leaves torch's process-wide state behind: a real FSDP job forked
    afterwards from a process that had planned one wrote a snapshot that DCP refused, its ranks'
    shards overlapping; and a --tp rank planned after another in one process ran its all-reduces
    on the first one's groups (DTensor's caches of sharding decisions hold a mesh, and a
    DeviceMesh compares equal to another of the same shape whatever its rank and groups): one rank
    a process, even where the ranks outnumber the cores. Forked from this process, which never
    joins a fake world: a spawned one paid 4-5 CPU-seconds of imports a rank, the most of a small
    model's plan (plan --fit plans a dozen layouts). Every process is forked before the progress
    thread starts (a fork beside a running thread can deadlock the child); each waits its turn
    (``turns``: one a core). At once, because each is a whole model's steps: GPT-2's two ranks
    took 74 s one after the other here, on 2 cores, and 58 s side by side. ``shown``: where to say
    what each is doing, every few seconds (a terminal)."""
    import multiprocessing
    import os

    workers = max(1, min(len(ranks), os.cpu_count() or 1))
    check_world_fits_here(target.world_size, workers, available_memory())
    threads = max(1, (os.cpu_count() or 1) // workers)
    fork = multiprocessing.get_context("fork")
    said = fork.Queue() if shown is not None else None
    turns = fork.Semaphore(workers)
    planners = []
    for rank in ranks:
        reader, writer = fork.Pipe(duplex=False)
        process = fork.Process(target=_planner, args=(writer, turns, threads, said, cfg, factory, target, rank,
                                                      steps, fake), daemon=True, name=f"ddptrain-plan-rank-{rank}")
        process.start()
        writer.close()
        planners.append((rank, process, reader))
    with Progress(said, ranks, shown) if shown is not None else contextlib.nullcontext():
        return [_planned(rank, process, reader) for rank, process, reader in planners]


def _planner(writer: Any, turns: Any, threads: int, said: Any, *plan: Any) -> None:
    """A planned rank's process: its turn, its threads, where it says what it is doing
    (plan/progress.py), then its figures, or its error with the traceback, to the planning one."""
    import traceback

    import torch

    with turns:
        torch.set_num_threads(threads)
        listen(said)
        try:
            outcome: Any = plan_rank(*plan)
        except BaseException as error:  # noqa: BLE001 - every error goes back to the planning process
            outcome = (error, traceback.format_exc())
        try:
            writer.send(outcome)
        except Exception:  # noqa: BLE001 - an error that does not pickle: its text
            writer.send((RuntimeError(str(outcome[1])), outcome[1]))


def _planned(rank: int, process: Any, reader: Any) -> RankFigures:
    """Rank ``rank``'s figures from its process; its error raised here (a ConfigError as it is:
    one line), with its traceback beside it."""
    try:
        outcome = reader.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"ddptrain plan: the process planning rank {rank} ended without its figures "
                           f"(exit {process.exitcode}; killed for memory?)") from None
    process.join()
    if isinstance(outcome, RankFigures):
        return outcome
    error, text = outcome
    if isinstance(error, ConfigError):
        raise error
    raise error from RuntimeError(f"in the process planning rank {rank}:\n{text}")


def peak_bytes(f: RankFigures) -> int:
    """The most this rank needs at once: the most bytes of tensors it held at once in a steady
    step (measured: plan/memory.py), times the allocator's headroom (HEADROOM). (The sum of what
    it holds, its activations and FSDP's gathered parameters fell short by what the step makes
    and drops: on the CPU's path, AdamW's temporaries alone were 48 MB of a 148 MB peak.)"""
    return int(f.allocated_peak_bytes * HEADROOM)


def _timed(collectives: list[dict[str, Any]], hw: Hardware) -> list[dict[str, Any]]:
    """Each collective with its time and the algorithm NCCL would pick (estimate.collective_seconds)."""
    timed = []
    for c in collectives:
        seconds, algorithm = collective_seconds(c, hw)
        timed.append({**c, "seconds": seconds, "algorithm": algorithm})
    return timed


def _snapshot_total(target: Target, figures: list[RankFigures]) -> int:
    """A whole snapshot's bytes: rank 0's file, or every entry once and DCP's .metadata (summed
    by the sharding rule: plan/snapshot_size.whole); and every rank's part (its random
    generators' states: snapshots/rank_parts.py)."""
    return max(f.snapshot_whole_bytes for f in figures) + max(f.generator_bytes for f in figures) * target.world_size


def notes(cfg: RunConfig, target: Target, figures: list[RankFigures]) -> list[str]:
    """What is worth knowing and not wrong: uneven shares, idle evaluation ranks."""
    found = []
    shares = {f.train_samples for f in figures if f.train_samples is not None}
    if len(shares) > 1:
        found.append(f"training shares differ by up to {max(shares) - min(shares):,} samples an epoch (the epoch's "
                     "last step is short; each step is still the mean of what is in it)")
    idle = [f.rank for f in figures if f.eval_samples == 0]
    ranks = _data_ranks(cfg, target.world_size)
    if idle:
        found.append(f"rank(s) {', '.join(map(str, idle))} hold no evaluation batch: the evaluation set has fewer "
                     f"batches of {cfg.batch_size} than the {ranks} (exact, but idle"
                     + (", running repeats to keep FSDP's all-gathers matched)" if cfg.strategy != "ddp" else ")"))
    if cfg.comm_hook == "powersgd":
        found.append("--comm-hook powersgd: counted as its warm-up's plain all-reduces (its first 10 steps)")
    if cfg.sync != "every-step":
        found.append(f"--sync {cfg.sync}: the meetings every --sync-every steps are not in the steps counted")
    if cfg.tp > 1 and target.nproc_per_node % cfg.tp:
        found.append(f"--tp {cfg.tp} does not divide --nproc-per-node {target.nproc_per_node}: some tensor-parallel "
                     "groups span two nodes, and every layer's all-reduces cross the slower link (choose a --tp that "
                     "divides the ranks of a node)")
    return found


def _data_ranks(cfg: RunConfig, world_size: int) -> str:
    """'1,024 ranks', or under --tp '512 data-parallel groups (--tp 2)': what the samples are shared over."""
    if cfg.tp == 1:
        return f"{world_size:,} ranks"
    return f"{cfg.data_ranks(world_size):,} data-parallel groups (--tp {cfg.tp})"


def refusals(plan: dict[str, Any], cfg: RunConfig, hw: Hardware) -> list[str]:
    """What would fail or waste the job at its scale, one line each (empty: none)."""
    found, world = [], plan["target"]["world_size"]
    for rank in plan["ranks"]:
        if rank["train_samples"] == 0:
            found.append(f"rank {rank['rank']} has no training sample in an epoch: the set is too small for "
                         f"{_data_ranks(cfg, world)} x --grad-accum {cfg.grad_accum}; use fewer ranks, less "
                         "--grad-accum, or more data")
            break
    peak = max(rank["peak_bytes"] for rank in plan["ranks"])
    if hw.memory_per_rank_gb is not None and peak > hw.memory_per_rank_gb * 1e9:
        found.append(f"a rank needs {peak / 1e9:.3g} GB at its peak, above --memory-per-rank {hw.memory_per_rank_gb:g}"
                     "; shard it (--strategy fsdp), split its layers too (--tp, docs/tensor-parallel.md), lower "
                     "--batch-size with more --grad-accum, or add --activation-checkpointing")
    t = plan["time"]
    if cfg.save_every and t["snapshot_interval_s"] < t["write_s"]:
        found.append(f"--save-every {cfg.save_every} starts a snapshot every {t['snapshot_interval_s']:.3g} s, "
                     f"but one takes {t['write_s']:.3g} s to write at --write-gbs {hw.write_gbs:g}; raise "
                     f"--save-every to at least {int(cfg.save_every * t['write_s'] / t['snapshot_interval_s']) + 1}")
    return found
