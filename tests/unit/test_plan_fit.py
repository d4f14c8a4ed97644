"""ddptrain plan --fit's search (plan/fit.py) without planning: the layouts it tries, in which
order, where it stops, and what it says; in-process, milliseconds (a real search:
tests/integration/test_plan.py)."""

from __future__ import annotations

import pytest

from ddptrain.plan.fit import Layout, _group_outcomes, candidates, format_fit, none_fits
from ddptrain.plan.rank import Target
from ddptrain.settings import RunConfig


def test_the_layouts_keep_the_global_batch_and_split_layers_inside_a_node():
    """2 nodes of 8 at batch 4 x accumulation 1 (global 64): ddp, fsdp, fsdp with each degree that
    divides a node's 8 ranks (its groups count once: the batch per rank times the degree), hsdp
    across the nodes with each degree too; each without checkpointing, then with it, at 1, 2 and 4 times the
    accumulation, where the batch still divides."""
    groups = candidates(RunConfig(batch_size=4), Target(16, 8))
    assert [(g[0].strategy, g[0].tp) for g in groups] == [("ddp", 1), ("fsdp", 1), ("fsdp", 2), ("fsdp", 4),
                                                          ("fsdp", 8), ("hsdp", 1), ("hsdp", 2), ("hsdp", 4),
                                                          ("hsdp", 8)]
    for group in groups:
        for layout in group:
            assert layout.batch_size * layout.grad_accum * 16 // layout.tp == 64, layout
    assert [(lay.activation_checkpointing, lay.batch_size, lay.grad_accum) for lay in groups[0]] == [
        (False, 4, 1), (False, 2, 2), (False, 1, 4), (True, 4, 1), (True, 2, 2), (True, 1, 4)]
    assert [(lay.batch_size, lay.grad_accum) for lay in groups[4] if not lay.activation_checkpointing] == [
        (32, 1), (16, 2), (8, 4)]
    assert all(g[0].strategy != "hsdp" for g in candidates(RunConfig(batch_size=4), Target(8, 8)))  # one node
    assert [lay.grad_accum for lay in candidates(RunConfig(batch_size=1), Target(8, 8))[0]] == [1, 1]  # 1 a rank


def _outcomes(fits: set[tuple[bool, int]]):
    """A planner whose layouts fit where (checkpointed, accumulation) is in ``fits``, and what it was asked."""
    asked: list[tuple[bool, int]] = []

    def planned(layout: Layout) -> dict:
        asked.append((layout.activation_checkpointing, layout.grad_accum))
        return {"fits": (layout.activation_checkpointing, layout.grad_accum) in fits}

    return planned, asked


@pytest.mark.parametrize("fits,asked", [
    ({(False, 1), (True, 1)}, [(False, 1)]),  # fits as given: nothing cheaper to find
    ({(False, 4), (True, 1)}, [(False, 1), (False, 2), (False, 4), (True, 1)]),  # recomputing may beat 4 micro-batches
    ({(False, 2), (True, 2)}, [(False, 1), (False, 2), (True, 1)]),  # ... not at as many
    (set(), [(False, 1), (False, 2), (False, 4), (True, 1), (True, 2), (True, 4)]),  # every one, none fits
])
def test_a_group_stops_at_its_first_fit_and_checkpoints_only_to_save_micro_batches(fits, asked):
    group = candidates(RunConfig(batch_size=4), Target(2, 2))[0]
    planned, seen = _outcomes(fits)
    _group_outcomes(group, planned)
    assert seen == asked


def test_a_layout_the_task_cannot_run_leaves_its_group_out_with_train_s_line():
    group = candidates(RunConfig(batch_size=4), Target(2, 2))[2]  # fsdp --tp 2
    asked = []

    def refused(layout: Layout) -> str:
        asked.append(layout)
        return f"{layout.name()}: --tp 2: the task names no layers to split"

    assert _group_outcomes(group, refused) == "fsdp --tp 2, batch 8 x 1: --tp 2: the task names no layers to split"
    assert len(asked) == 1


def _tried(strategy: str, tp: int, checkpointed: bool, peak_gb: float, step_s: float, state_gb: float,
           fits: bool) -> dict:
    layout = Layout(strategy, tp, checkpointed, 4, 1)
    return {**layout.settings(), "peak_bytes": int(peak_gb * 1e9), "model_state_bytes": int(state_gb * 1e9),
            "activation_bytes": int((peak_gb - state_gb) * 1e9), "step_s_overlapped": step_s,
            "step_s_serial": step_s, "fits": fits, "flags": layout.flags(),
            "refusals": [] if fits else [f"a rank needs {peak_gb:.3g} GB at its peak, above --memory-per-rank 80"]}


def test_none_fits_names_the_most_frugal_layout_and_what_would_shrink_it():
    found = {"world_size": 64, "global_batch": 256, "memory_per_rank_gb": 80.0, "left_out": [], "fitting": [],
             "seconds": 12.0, "tried": [_tried("ddp", 1, False, 150, 1.0, 120, False),
                                        _tried("fsdp", 2, True, 95, 2.0, 10, False)]}
    line = none_fits(found)
    assert line == ("none of the 2 layouts tried fits on 64 ranks at global batch 256: the most frugal, fsdp --tp 2, "
                    "checkpointed, batch 4 x 1, needs 95 GB a rank, 15 GB above --memory-per-rank 80 (model state "
                    "10 GB, activations 85 GB); use a smaller global batch (--global-batch; its activations are per "
                    "sample) or devices with more memory")
    found["tried"][1] = _tried("fsdp", 2, True, 95, 2.0, 60, False)
    assert "use more ranks (its model state, sharded, shrinks with them)" in none_fits(found)
    nothing = {**found, "tried": [], "left_out": ["ddp, batch 4 x 1: --fake-tensors under --strategy ddp: ..."]}
    assert none_fits(nothing) == ("no layout of the job could be planned: ddp, batch 4 x 1: --fake-tensors under "
                                  "--strategy ddp: ...")


def test_the_table_ranks_the_layouts_that_fit_by_step_time_and_gives_the_best_command():
    fast, slow = _tried("fsdp", 2, False, 70, 0.5, 10, True), _tried("fsdp", 1, True, 60, 0.9, 10, True)
    found = {"world_size": 64, "global_batch": 256, "memory_per_rank_gb": 80.0, "seconds": 12.0,
             "tried": [_tried("ddp", 1, False, 150, 0.4, 120, False), slow, fast], "fitting": [fast, slow],
             "left_out": []}
    text = format_fit(found, ["--task", "gpt:task", "--optimizer", "adamw"])
    lines = text.splitlines()
    assert lines[0] == ("ddptrain plan --fit: 3 layouts planned on 64 ranks at global batch 256 in 12 s; 2 fit "
                        "--memory-per-rank 80")
    assert lines[2].startswith("  1. fsdp --tp 2, batch 4 x 1 ") and lines[3].startswith("  2. fsdp, checkpointed")
    assert "do not fit:" in lines and any(line.startswith("  ddp, batch 4 x 1 ") and line.endswith(" a rank")
                                          for line in lines)
    found["tried"][0]["refusals"] = ["rank 63 has no training sample in an epoch: ..."]
    assert "a rank (rank 63 has no training sample in an epoch: ...)" in format_fit(found, [])
    assert lines[-1] == ("best: ddptrain train --task gpt:task --optimizer adamw --strategy fsdp --tp 2 --batch-size 4 "
                         "--grad-accum 1")
