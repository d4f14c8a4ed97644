"""ddptrain plan's estimates (plan/estimate.py) and its pure parts: in-process, milliseconds."""

from __future__ import annotations

import math

import pytest
import torch

from ddptrain.errors import ConfigError
from ddptrain.observe.goodput import restart_goodput
from ddptrain.plan.estimate import (
    Hardware,
    agreement_collectives,
    collective_seconds,
    control_plane,
    goodput,
    snapshot_collectives,
    snapshot_interval_s,
    snapshot_seconds,
    step_seconds,
    steps_per_agreement,
    wire_bytes,
)
from ddptrain.plan.job import chosen_ranks, peak_bytes, refusals, with_global_batch
from ddptrain.plan.memory import LiveTensors
from ddptrain.plan.rank import RankFigures, Target
from ddptrain.resilience.watchdog import beat_period, verdict_period
from ddptrain.settings import RunConfig, SnapshotSettings


def test_ring_collectives_send_what_the_ring_algorithms_do():
    assert wire_bytes("all_reduce", 1000, 4, 4) == 2 * 4000 * 3 / 4
    assert wire_bytes("all_gather", 1000, 4, 4) == 4000 * 3 / 4  # 1000: the whole output
    assert wire_bytes("reduce_scatter", 250, 4, 4) == 1000 * 3  # 250: this rank's shard of the same 1000
    assert wire_bytes("all_reduce", 1000, 4, 1) == 0  # a group of one sends nothing


def test_a_step_is_between_full_overlap_and_none():
    one_gb = {"kind": "all_gather", "elements": 10**9 // 4, "bytes": 10**9, "count": 2, "group": 2}
    hw = Hardware(tflops=100, link_gbps=80, node_gbps=800, latency_us=0)  # (bandwidth alone: latency below)
    t = step_seconds(10**14, [{**one_gb, "in_node": False}], hw)
    assert t["compute_s"] == pytest.approx(1.0) and t["communication_s"] == pytest.approx(2 * 0.5 * 8 / 80)
    assert t["step_s_overlapped"] == pytest.approx(1.0) and t["step_s_serial"] == pytest.approx(1.1)
    inside = step_seconds(0, [{**one_gb, "in_node": True}], hw)
    assert inside["communication_s"] == pytest.approx(t["communication_s"] / 10)


def test_a_snapshot_blocks_its_copy_and_writes_behind():
    s = snapshot_seconds(2 * 10**9, 64 * 10**9, Hardware(copy_gbs=20, write_gbs=8))
    assert s == {"blocking_s": pytest.approx(0.1), "write_s": pytest.approx(8.0), "snapshot_collectives_s": 0}
    # its collectives: the barrier on the training's path, DCP's behind it in the writer's thread
    hw = Hardware(copy_gbs=20, write_gbs=8, latency_us=5)
    timed = [{**c, "seconds": collective_seconds(c, hw)[0]}
             for c in snapshot_collectives(True, 1024, False, plan_bytes=100_000, metadata_bytes=10**6)]
    assert [c["kind"] for c in timed] == ["barrier", "gather", "scatter", "gather", "broadcast"]
    with_them = snapshot_seconds(2 * 10**9, 64 * 10**9, hw, timed)
    assert with_them["blocking_s"] == pytest.approx(0.1 + timed[0]["seconds"])
    assert with_them["write_s"] == pytest.approx(8.0 + sum(c["seconds"] for c in timed[1:]))
    # DCP's plans through rank 0's link: 1,023 x 100 KB at 400 Gb/s, after a ring of sizes
    assert timed[1]["seconds"] == pytest.approx(1023 * 5e-6 + 1023 * 100_000 * 8 / 400e9)
    assert [c["kind"] for c in snapshot_collectives(False, 1024, False, 0, 0)] == ["barrier"]  # a file snapshot


def test_a_collective_costs_its_steps_latency_and_its_bytes_and_takes_the_faster_algorithm():
    """A ring all-reduce over N ranks: 2(N - 1) steps; NCCL's tree: 2 log2 N steps, each rank
    sending its buffer about twice. The stop agreement's 3 numbers over 16,384 ranks: 164 ms by
    a ring, 140 us by a tree, which NCCL picks; a 1 GB all-reduce over 8 ranks: the ring."""
    hw = Hardware(link_gbps=400, node_gbps=3600, latency_us=5)

    def timed(kind: str, elements: int, group: int, in_node: bool = False) -> tuple[float, str]:
        return collective_seconds({"kind": kind, "elements": elements, "bytes": 4 * elements, "group": group,
                                   "in_node": in_node}, hw)

    assert timed("all_reduce", 3, 16384) == (pytest.approx(2 * 14 * 5e-6, rel=0.01), "tree")
    ring = 2 * 16383 * 5e-6
    assert ring == pytest.approx(0.164, rel=0.01) and timed("all_reduce", 3, 16384)[0] < ring / 1000
    seconds, algorithm = timed("all_reduce", 250_000_000, 8, in_node=True)
    assert algorithm == "ring" and seconds == pytest.approx(14 * 5e-6 + 2 * 1e9 * 7 / 8 * 8 / 3600e9)
    # a ring all-gather: N - 1 steps, the others' shares once
    assert timed("all_gather", 16384 * 1000, 16384) == (pytest.approx(16383 * 5e-6 + 16383 * 4000 * 8 / 400e9),
                                                          "ring")
    assert timed("barrier", 1, 16384) == (pytest.approx(2 * 14 * 5e-6, rel=0.01), "tree")  # an all-reduce of one
    assert timed("all_reduce", 1000, 1) == (0.0, "-")  # a group of one: nothing


def test_the_agreement_comes_every_half_second_of_steps_with_the_step_records_beside_it():
    assert steps_per_agreement(0.001) == 500 and steps_per_agreement(2.0) == 1 and steps_per_agreement(1e-6) == 1000
    stop, records = agreement_collectives(16384, False, steps=500, log_every=10, window_numbers=3 * 10 + 2)
    assert (stop["kind"], stop["elements"], records["kind"]) == ("all_reduce", 3, "all_reduce")
    assert records["elements"] == 50 * 32 + 1 and records["bytes"] == 8 * records["elements"]  # float64
    # a step's share: the agreement's two all-reduces over its steps
    hw = Hardware(latency_us=5)
    alone = step_seconds(0, [], hw)["communication_s"]
    shared = step_seconds(0, [], hw, [stop, records], 500)["communication_s"]
    assert alone == 0 and shared == pytest.approx(sum(collective_seconds(c, hw)[0] for c in (stop, records)) / 500)


def test_snapshot_intervals_follow_the_checkpointer():
    snapshot = {"blocking_s": 0.5, "write_s": 3.0}
    steps = SnapshotSettings(save_every=100, save_seconds=0)
    assert snapshot_interval_s(steps, 0.2, snapshot, 3600) == pytest.approx(20.0)
    stretched = SnapshotSettings(save_every=0, save_seconds=10)  # at most 2% of training: 50 x 0.5 s
    assert snapshot_interval_s(stretched, 0.2, snapshot, 3600) == pytest.approx(25.0)
    young = SnapshotSettings(save_every=0, save_seconds=60, mttf_hours=2)
    assert snapshot_interval_s(young, 0.2, snapshot, 7200) == pytest.approx(math.sqrt(2 * 0.5 * 7200))
    assert snapshot_interval_s(SnapshotSettings(save_every=0, save_seconds=0), 0.2, snapshot, 3600) == math.inf
    assert goodput(3600, math.inf, snapshot, 60) is None
    assert goodput(3600, 20, snapshot, 60) == restart_goodput(3600, 20, 0.5, 60)
    # a write longer than the interval by time: the interval is the write's (the checkpointer
    # lengthens it once a snapshot has waited), by --mttf-hours' Young's rule as by --save-seconds
    slow = {"blocking_s": 0.001, "write_s": 47.8}
    assert snapshot_interval_s(SnapshotSettings(mttf_hours=3), 0.2, slow, 3 * 3600) == pytest.approx(47.8)
    assert snapshot_interval_s(SnapshotSettings(mttf_hours=3), 0.2, slow, 3 * 3600, writes=False) == pytest.approx(
        math.sqrt(2 * 0.001 * 3 * 3600))
    assert snapshot_interval_s(SnapshotSettings(save_seconds=10), 0.2, slow, 3600) == pytest.approx(47.8)


def test_the_control_plane_is_the_watchdog_s_periods():
    small, large = control_plane(64, 300), control_plane(16384, 5)
    assert small["heartbeats_per_s"] == 64 / beat_period(300, 64) and small["polls_per_s"] == 64 / 0.5
    assert large["polls_per_s"] == 16384 / verdict_period(16384) == 16384 / 2.0
    assert large["beat_period_s"] == beat_period(5, 16384) and large["failure_to_exit_s"] == 2.5


def test_the_ranks_and_the_global_batch_given():
    assert chosen_ranks("0,-1", 1024) == [0, 1023] and chosen_ranks("5,5,2", 8) == [2, 5]
    for text in ("0,x", "8", "-9"):
        with pytest.raises(ConfigError, match="--ranks"):
            chosen_ranks(text, 8)
    cfg = RunConfig(grad_accum=2)
    assert with_global_batch(cfg, Target(1024, 8), 8192).batch_size == 4
    with pytest.raises(ConfigError, match="choose a multiple of 2,048"):
        with_global_batch(cfg, Target(1024, 8), 3000)
    assert with_global_batch(cfg, Target(1024, 8), None) is cfg


def _figures(**changes) -> RankFigures:
    base = dict(rank=0, parameters=10, parameter_bytes=1000, gradient_bytes=1000, optimizer_bytes=2000,
                buffer_bytes=0, activation_bytes=5000, gathered_bytes=1000, snapshot_bytes=3000, generator_bytes=10,
                snapshot_whole_bytes=3000, dcp_metadata_bytes=0, dcp_plan_bytes=0, log_every=10, window_numbers=30,
                flops_per_step=10, collectives={}, steps_per_epoch=4, train_samples=100, stand_ins=0,
                eval_samples=None, eval_batches=0, eval_repeats=0, allocated_peak_bytes=12000,
                steps_run=1)
    return RankFigures(**{**base, **changes})


def test_the_peak_is_the_measured_one_with_the_allocator_s_headroom():
    assert peak_bytes(_figures(allocated_peak_bytes=10000)) == int(10000 * 1.10)


def test_live_tensors_count_each_storage_once_until_freed_and_follow_resizes():
    """What the plan's peak is read from (plan/memory.py): the storages held when it begins,
    every op's new ones until freed, and storages resized in place (as FSDP frees and refills
    its whole parameters), at their most."""
    resize = torch.UntypedStorage.resize_
    held = torch.zeros(1000)  # 4,000 bytes
    with LiveTensors([held, held[:10]]) as live:  # a view of it: the same storage, once
        first = torch.ones(2000)  # 12,000 bytes alive
        second = first * 2  # 20,000
        del first  # 12,000
        refilled = torch.empty(0)
        refilled.untyped_storage().resize_(40_000)  # 52,000: the most
        live.optimizer_begins()
        refilled.untyped_storage().resize_(0)  # 12,000
        del second
    assert (live.peak, live.live, live.before_optimizer) == (52_000, 4_000, 52_000)
    assert torch.UntypedStorage.resize_ is resize  # given back on leaving


def test_refusals_name_each_problem_in_a_line():
    plan = {"target": {"world_size": 64}, "ranks": [{"rank": 0, "train_samples": 3, "peak_bytes": 2 * 10**9},
                                                      {"rank": 63, "train_samples": 0, "peak_bytes": 10**9}],
            "time": {"snapshot_interval_s": 1.0, "write_s": 4.5}}
    found = refusals(plan, RunConfig(save_every=10), Hardware(memory_per_rank_gb=1.5))
    assert [line.split(" ")[0:2] for line in found] == [["rank", "63"], ["a", "rank"], ["--save-every", "10"]]
    assert "raise --save-every to at least 46" in found[2]
    assert refusals(plan | {"ranks": plan["ranks"][:1]}, RunConfig(), Hardware()) == []


def test_a_world_too_large_to_simulate_here_is_refused_with_what_it_would_need():
    from ddptrain.plan.job import BYTES_PER_WORLD_RANK, check_world_fits_here

    check_world_fits_here(16_384, 2, 2 * 10**9)  # the docs' largest plans: a few MB of world
    check_world_fits_here(10**9, 2, None)  # (no MemAvailable: not checked)
    with pytest.raises(ConfigError, match=r"--world-size 1,000,000,000: .* plan at most 1,666,666 ranks here "
                                          r"\(3,333,333 planning one rank: --ranks 0\)"):
        check_world_fits_here(10**9, 2, 2 * 10**9)
    assert BYTES_PER_WORLD_RANK * 10**6 < 10**9  # a million ranks fit in a GB (measured: 895 MB, the whole rank)


def test_the_plan_s_progress_line_groups_the_ranks_by_what_they_are_doing():
    import io
    import queue

    from ddptrain.plan.progress import Progress

    progress = Progress(queue.Queue(), [0, 1, 2, 3, 4, 5, 6, 100], io.StringIO())
    start = progress.started
    for rank in (0, 1, 2, 3, 4, 5):
        progress.phases[rank] = ("at step 1 of 3", start + 1 + rank)
    progress.phases[100] = ("done", start + 2)
    progress.waiting -= {0, 1, 2, 3, 4, 5, 100}
    assert progress.line(start + 9.2) == ("ddptrain plan, 9 s: ranks 0, 1, 2, 3 and 2 more at step 1 of 3 (8 s); "
                                          "rank 100 done (7 s); rank 6 not started yet")
