"""``ddptrain plan``: a few ranks of the target world, run through the fake process group, hold
and send what real ranks do; it refuses what would fail at scale; it leaves nothing behind.

Plans run in a spawned process (the ``planner`` fixture, as make_plan runs them): a fake world
leaves torch's state behind in its process, which a real job forked from it afterwards trips on
(plan/job.plan_ranks). The plan's figures are checked three ways against reality: (1) the
same measurement on real gloo ranks (``measure_rank`` in a real 2- and 4-rank group): every
figure equal; (2) the collectives per step of test_costs.py's table, which that file checks
against real runs' profiler traces; (3) the snapshot files a real run writes, per rank, within 5%.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing

import pytest
import torch

from ddptrain.api import prepare
from ddptrain.comm import DistContext
from ddptrain.plan.hardware import Hardware
from ddptrain.plan.job import make_plan, steady_step
from ddptrain.plan.rank import Target, measure_rank, plan_rank
from helpers.commands import clean_env, ddptrain_cli, fit
from helpers.costs import by_kind_and_size
from helpers.ranks import run_on_ranks

DIGITS = {"task": "digits", "optimizer": "adamw"}
WIDE = {"task": "plan_tasks:wide_mlp", "optimizer": "adamw"}
REAL = {  # id: (options, ranks)
    "ddp-accum2": ({**DIGITS, "grad_accum": 2}, 2),
    "fsdp": ({**DIGITS, "strategy": "fsdp"}, 2),
    "hsdp-2x2-accum2": ({**DIGITS, "strategy": "hsdp", "replicas": 2, "grad_accum": 2}, 4),
    "fsdp-tp2-2x2-accum2": ({"task": "tp_tasks:blocks", "strategy": "fsdp", "tp": 2, "grad_accum": 2}, 4),
}


@pytest.fixture(scope="module")
def planner():
    """A spawned process to plan ranks in (a fresh interpreter: nothing of the fake world stays here)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _planned(planner: concurrent.futures.Executor, *args, **kwargs) -> dict:
    """``_plan_rank(*args, **kwargs)`` in the planner's process; a --tp rank in a fresh one of its
    own, as make_plan plans each rank (plan/job.plan_ranks: DTensor's caches of one fake rank's
    meshes would serve the next)."""
    if args[0].get("tp", 1) == 1:
        return planner.submit(_plan_rank, *args, **kwargs).result()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        return fresh.submit(_plan_rank, *args, **kwargs).result()


def _plan_rank(options: dict, world: int, rank: int, per_node: int | None = None, env: dict | None = None,
               fake: bool = False, device: str = "cuda") -> dict:
    """(In the planner's process.) Rank ``rank`` of a plan of ``options`` on ``world`` ranks, as a dict."""
    import os

    os.environ.update(env or {})
    cfg, factory = prepare(None, options)
    figures = plan_rank(cfg, factory, Target(world, per_node or world, device), rank, _steps(options), fake)
    return dataclasses.asdict(figures)


def _steps(options: dict) -> int:
    return steady_step(options.get("strategy", "ddp")) + 1


def _measured_on_real_ranks(rank: int, world: int, options: dict, device: str = "cuda") -> dict:
    """Rank ``rank`` of a real gloo group, its optimizer stepping as on ``device`` (as the plan's:
    a plan is for cuda unless told --device cpu)."""
    cfg, factory = prepare(None, options)
    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), "gloo")
    return dataclasses.asdict(measure_rank(cfg, factory, ctx, _steps(options), device=device))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REAL))
def test_each_planned_rank_holds_and_sends_what_a_real_rank_does(planner, case):
    """Parameters, gradients, optimizer state, activations, snapshot entries, data shares and
    the collectives of a steady step: the fake group's rank r equals a real gloo group's rank r."""
    options, world = REAL[case]
    real = run_on_ranks(world, _measured_on_real_ranks, options)
    for rank in range(world):
        planned = _planned(planner, options, world, rank)
        peaks = planned.pop("allocated_peak_bytes"), real[rank].pop("allocated_peak_bytes")
        assert planned == real[rank], {k: (planned[k], real[rank][k]) for k in planned if planned[k] != real[rank][k]}
        assert planned["optimizer_bytes"] > 0 and planned["collectives"]
        # The peak: DDP's the same; FSDP's up to 15% above the plan on gloo, whose collectives
        # allocate what the fake group's do not (12 MB over an 88 MB peak, plan_tasks:wide_mlp)
        if options.get("strategy", "ddp") == "ddp":
            assert peaks[0] == peaks[1], peaks
        else:
            assert peaks[0] <= peaks[1] <= 1.15 * peaks[0], peaks


def _allocator_peak(options: dict, world: int, rank: int) -> tuple[int, int]:
    """(In the planner's process.) The plan's peak of rank ``rank``, and the most bytes torch's
    CPU allocator reported held at once over the same rank's build and steps (the profiler's
    memory events: every allocation and free, the fake group's one thread)."""
    from torch.profiler import ProfilerActivity, profile

    from ddptrain.plan.fake_group import as_rank
    from ddptrain.plan.rank import _Run

    cfg, factory = prepare(None, options)
    with as_rank(rank, world), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        run = _Run(cfg, factory, DistContext(rank, world, rank, world, torch.device("cpu"), "fake"), _steps(options),
                   fake=False)
    held = most = 0
    for event in sorted((e for e in trace.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        held += event.nbytes()
        most = max(most, held)
    return run.peak_bytes(), most


@pytest.mark.slow
def test_a_planned_peak_is_what_the_allocator_reports_and_more_than_the_parts_held(planner):
    """Over 3 DDP steps of a 6.2M-parameter MLP with AdamW, the plan's peak (its own count of
    the tensors alive) is within 1% of what torch's allocator reported at its most (148.6 MB
    against 148.7 MB measured): the sum of the parameters, gradients, optimizer state and
    activations (100 MB) falls short by AdamW's temporaries."""
    options = {"task": "plan_tasks:wide_mlp", "optimizer": "adamw"}
    planned, allocated = planner.submit(_allocator_peak, options, 2, 1).result()
    assert math.isclose(planned, allocated, rel_tol=0.01), (planned, allocated)
    parts = planner.submit(_plan_rank, options, 2, 1, device="cpu").result()  # (the allocator's: the CPU's path)
    held = sum(parts[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes"))
    assert planned > 1.3 * held and parts["allocated_peak_bytes"] == planned, (planned, held)


@pytest.mark.slow
def test_a_plan_counts_the_collectives_that_real_runs_were_measured_to_start(planner):
    """Every case of test_costs.py (DDP, FSDP, HSDP on 2 and 4 ranks; accumulation, streams,
    --skip-nonfinite), whose table that file checks against real runs' traces."""
    from integration.test_costs import CASES

    for case, (options, per_step) in CASES.items():
        options = {"task": "regression", "batch_size": 8, **options}
        world = options.pop("nproc", 2)
        found = planner.submit(_plan_rank, options, world, 0, env={"STREAM_SAMPLES": "4000"}).result()["collectives"]
        assert by_kind_and_size(found) == per_step, case


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world", [("ddp", 2), ("fsdp", 2), ("hsdp", 4)])
def test_a_planned_snapshot_is_within_5_percent_of_a_real_one_per_rank(tmp_path, strategy, world):
    options = {**DIGITS, "strategy": strategy, **({"replicas": 2} if strategy == "hsdp" else {})}
    fit(options.pop("task"), tmp_path, nproc=world, max_steps=3, **options)
    from ddptrain.snapshots.rank_parts import part_name, parts_folder

    (written,) = [p for p in (tmp_path / "snapshots").iterdir() if not p.name.endswith(".ranks")]
    real = [(parts_folder(written) / part_name(r, world)).stat().st_size for r in range(world)]  # each rank's part
    if written.is_file():  # ddp: and rank 0's file
        real[0] += written.stat().st_size
    else:  # a DCP folder: and each rank's shards, and rank 0's meta.pt
        real = [size + (written / f"__{r}_0.distcp").stat().st_size for r, size in enumerate(real)]
        real[0] += (written / "meta.pt").stat().st_size
    cfg, factory = prepare(None, {**DIGITS, **options})
    plan = make_plan(cfg, factory, Target(world, world), list(range(world)), Hardware())
    for rank, planned in zip(real, (r["snapshot_bytes"] for r in plan["ranks"])):
        assert math.isclose(planned, rank, rel_tol=0.05, abs_tol=0), (planned, rank, real)
    # the whole, summed by the sharding rule: each rank finds it from its own state alone; DCP's
    # .metadata (modelled) among it
    wholes = [r["snapshot_whole_bytes"] for r in plan["ranks"]]
    assert max(wholes) - min(wholes) <= 0.001 * max(wholes), wholes
    folders = [written, parts_folder(written)] if written.is_file() else [written]
    whole = sum(p.stat().st_size for p in folders if p.is_file()) + sum(
        p.stat().st_size for folder in folders if folder.is_dir() for p in folder.rglob("*") if p.is_file())
    planned = plan["time"]
    assert math.isclose(planned["snapshot_total_bytes"], whole, rel_tol=0.05), (planned["snapshot_total_bytes"], whole)
    metadata = (written / ".metadata").stat().st_size if written.is_dir() else 0
    assert math.isclose(planned["dcp_metadata_bytes"], metadata, rel_tol=0.05), (planned, metadata)


@pytest.mark.slow
def test_fsdp_at_1024_ranks_holds_a_1024th_of_each_sharded_parameter(planner):
    options = {"task": "plan_tasks:wide_mlp", "strategy": "fsdp", "optimizer": "adamw"}
    planned = planner.submit(_plan_rank, options, 1024, 3, 8).result()
    held = planned["parameters"]
    # the whole parameters in flight (its three blocks: the two largest at once) as FSDP's own
    # all-gathers make them, each rank's shard padded to ceil(rows / 1,024) rows: the last layer's
    # one row gathers 1,024 (8.4 MB, where its 2,049 numbers are 8 KB)
    gathers = sorted((c["elements"] for c in planned["collectives"].values() if c["kind"] == "all_gather"),
                     reverse=True)
    assert planned["gathered_bytes"] == 4 * sum(gathers[:2]) == 4 * (6_146_048 + 2_098_176), gathers
    from plan_tasks import wide_mlp

    cfg, _ = prepare(None, options)
    expected = 0
    for p in wide_mlp(cfg).model.parameters():  # torch.chunk's cut of dim 0: ceil(rows / W) to each rank in turn
        chunk = math.ceil(p.shape[0] / 1024)
        rows = max(0, min(chunk, p.shape[0] - 3 * chunk))
        expected += rows * math.prod(p.shape[1:])
    assert held == expected
    numel = sum(p.numel() for p in wide_mlp(cfg).model.parameters())
    assert held < numel / 1000
    # the whole snapshot summed, not extrapolated from a rank: the last rank, which holds none of
    # the 1-row layer, finds what rank 3 does; both at least every parameter and both moments once
    last = planner.submit(_plan_rank, options, 1024, 1023, 8).result()
    assert math.isclose(last["snapshot_whole_bytes"], planned["snapshot_whole_bytes"], rel_tol=0.002)
    assert planned["snapshot_whole_bytes"] - planned["dcp_metadata_bytes"] > 3 * 4 * numel, planned


def _plan(*args: str, **kwargs) -> tuple[int, str, str]:
    result = ddptrain_cli("plan", *args, **kwargs)
    return result.returncode, result.stdout, result.stderr


@pytest.mark.slow
def test_the_command_refuses_what_would_fail_at_scale_one_line_each():
    before = {  # refused before any rank is planned: flags -> what the line says
        ("--world-size", "1024", "--global-batch", "1000"): "does not divide over 1,024 ranks",
        (): "needs the target's size",
        ("--world-size", "12", "--nproc-per-node", "8"): "not a whole number of nodes",
        ("--world-size", "2", "--steps", "2"): "runs at least 3 steps",
        ("--world-size", "4", "--strategy", "hsdp", "--replicas", "3"): "--replicas 3 does not divide",
        # figures no machine has (they divided by zero after the ranks ran, or planned as the default)
        ("--world-size", "8", "--tflops", "0"): "--tflops must be a finite number > 0, got 0",
        ("--world-size", "8", "--link-gbps", "0"): "--link-gbps must be a finite number > 0",
        ("--world-size", "8", "--node-gbps", "-1"): "--node-gbps must be a finite number > 0",
        ("--world-size", "8", "--copy-gbs", "0"): "--copy-gbs must be a finite number > 0",
        ("--world-size", "8", "--write-gbs", "0"): "--write-gbs must be a finite number > 0",
        ("--world-size", "8", "--rank-mttf-hours", "0"): "--rank-mttf-hours must be a finite number > 0",
        ("--world-size", "8", "--start-seconds", "-1"): "--start-seconds must be a number >= 0",
        ("--world-size", "8", "--latency-us", "nan"): "--latency-us must be a finite number > 0, got nan",
        ("--world-size", "8", "--memory-per-rank", "-1"): "--memory-per-rank must be a finite number > 0",
        ("--world-size", "8", "--tflops", "inf"): "--tflops must be a finite number > 0, got inf",
        ("--nnodes", "2", "--nproc-per-node", "0"): "--nproc-per-node must be at least 1, got 0",
        ("--nnodes", "0"): "--nnodes must be at least 1, got 0",
        ("--world-size", "0"): "--world-size must be at least 1, got 0",
        ("--world-size", "8", "--fit"): "--fit ranks the layouts that fit a rank's memory: give --memory-per-rank GB",
        # a world this machine cannot simulate (torch's bookkeeping of a billion ranks: its OOM killer)
        ("--world-size", "1000000000"): "planned rank(s) would need about 1,200 GB here for the world alone",
    }
    for flags, words in before.items():
        code, _, err = _plan("--task", "regression", *flags)
        lines = [line for line in err.splitlines() if line.startswith("ddptrain")]
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, (flags, err)
    # a planned rank whose share of a finite stream is empty: refused (it planned empty epochs forever)
    code, _, err = _plan("--task", "ddptrain_test_tasks:stream", "--world-size", "4096", "--max-steps", "4",
                         env=clean_env(STREAM_SAMPLES="64"), timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("ddptrain")]
    assert code == 2 and len(lines) == 1 and "rank 4,095 has no training sample" in lines[0], err
    # --tp on a task that names no layers to split: the planned rank's own line, as train's
    code, _, err = _plan("--task", "regression", "--world-size", "8", "--strategy", "fsdp", "--tp", "2")
    assert code == 2 and err.startswith("ddptrain: error: --tp 2: the task names no layers to split") \
        and len(err.splitlines()) == 1, err
    # refused from the plan's figures: each its own line, the plan printed too
    code, out, err = _plan("--task", "regression", "--world-size", "4096", "--memory-per-rank", "1e-9",
                           "--save-every", "1", "--write-gbs", "1e-12")
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err and out.startswith("plan: ddp on 4,096 ranks"), err
    assert len(lines) == 3 and all(line.startswith("ddptrain: error: ") for line in lines), err
    for words, line in zip(("rank 4095 has no training sample", "above --memory-per-rank", "raise --save-every"),
                           lines):
        assert words in line, lines


# Flags that train refuses: the plan refuses each with the same line (one check path), the last
# two only once the task is built (a stream's length is unknown; the task names a missing module).
REFUSED_BY_BOTH = [
    ("--batch-size", "0"),
    ("--strategy", "fsdp", "--comm-hook", "fp16"),
    ("--sync", "diloco", "--replicas", "2"),
    ("--keep-best", "eval_loss:most"),
    ("--task", "ddptrain_test_tasks:stream", "--lr-schedule", "cosine"),
    ("--task", "no_such_module:task"),
]


@pytest.mark.slow
def test_the_plan_and_train_refuse_the_same_flags_with_the_same_line(tmp_path):
    env = clean_env(STREAM_SAMPLES="64")
    for number, flags in enumerate(REFUSED_BY_BOTH):
        trained = ddptrain_cli("train", *flags, "--run-dir", str(tmp_path / str(number)), env=env)
        planned = ddptrain_cli("plan", "--world-size", "4", *flags, env=env)
        lines = [[line for line in result.stderr.splitlines() if line.startswith("ddptrain")]
                 for result in (trained, planned)]
        assert (trained.returncode, planned.returncode) == (2, 2), (flags, trained.stderr, planned.stderr)
        assert len(lines[0]) == 1 and lines[0] == lines[1], (flags, lines)
        assert "Traceback" not in trained.stderr + planned.stderr, flags


@pytest.mark.slow
def test_the_plan_leaves_the_run_dir_and_the_folder_as_they_were(tmp_path):
    """A run dir with snapshots: untouched (no file added, changed or moved aside); the folder the
    command ran in: empty after; the report alone on stdout; no process group joined (the fake
    one only: no store, so no MASTER_ADDR needed)."""
    run_dir = tmp_path / "run"
    fit("regression", run_dir, max_steps=2)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    here = tmp_path / "cwd"
    here.mkdir()
    code, out, err = _plan("--task", "regression", "--world-size", "64", "--run-dir", str(run_dir), "--json",
                           cwd=here)
    assert code == 0, err
    plan = json.loads(out)
    assert [r["rank"] for r in plan["ranks"]] == [0, 63] and plan["refusals"] == []
    assert plan["target"]["device"] == "cuda"  # (--device auto: a plan is for GPUs)
    # (a latency-bound all-reduce over 64 ranks: NCCL's tree, 2 x 6 steps of --latency-us 5)
    assert plan["collectives_per_step"] == [{"kind": "all_reduce", "elements": 21, "dtype": "float32", "count": 1,
                                             "bytes": 84, "group": 64, "in_node": False, "algorithm": "tree",
                                             "seconds": pytest.approx(60e-6, rel=0.01)}]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert list(here.iterdir()) == [] and "USDT" not in err


@pytest.mark.slow
def test_the_table_names_idle_evaluation_ranks_and_which_collectives_cross_nodes(capsys):
    """hsdp on 2 nodes of 8: gathers and reduce-scatters inside a node, the all-reduce across."""
    from ddptrain.cli import main

    assert main(["plan", "--task", "digits", "--world-size", "16", "--strategy", "hsdp", "--ranks", "-1"]) == 0
    out = capsys.readouterr().out
    assert "plan: hsdp on 16 ranks (2 node(s) x 8)" in out
    assert "rank(s) 15 hold no evaluation batch" in out and "running repeats" in out
    per_step = out.split("collectives per step")[1].split("\n\n")[0]
    kinds = {line.split(" of ")[0].split(" x ")[1]: line.split(" over ")[1].split(":")[0]
             for line in per_step.splitlines() if line.startswith("  ") and " over " in line}
    assert kinds == {"all_gather": "8 ranks, inside a node", "reduce_scatter": "8 ranks, inside a node",
                     "all_reduce": "2 ranks, between nodes"}, out
    assert "goodput:" in out and "control plane:" in out


@pytest.mark.slow
def test_a_tp_plan_times_each_collective_on_its_group_and_counts_a_rank_s_share_of_the_work(planner):
    """--tp on 2 nodes of 8: the tensor-parallel all-reduces (13 a micro-batch: tp_tasks' plan)
    inside a node over the group, FSDP's gathers and reduce-scatters over the data-parallel ranks
    (every other one: across the nodes); each rank counts its share of the FLOPs (half of fsdp's
    at the same batch per rank: 97% before, the whole split layers on every rank of a group) and
    gathers half as much. A --tp that does not divide a node's ranks: some groups span two nodes,
    said in a note."""
    options = {"task": "tp_tasks:blocks", "strategy": "fsdp"}
    fsdp, tp = (_planned(planner, {**options, **extra}, 16, 3, 8) for extra in ({}, {"tp": 2}))
    assert math.isclose(tp["flops_per_step"], fsdp["flops_per_step"] / 2, rel_tol=0.02), (tp, fsdp)
    assert math.isclose(tp["gathered_bytes"], fsdp["gathered_bytes"] / 2, rel_tol=0.05), (tp, fsdp)
    groups = {(c["kind"], c["group"], c["in_node"]): 0 for c in tp["collectives"].values()}
    for c in tp["collectives"].values():
        groups[(c["kind"], c["group"], c["in_node"])] += c["count"]
    assert groups == {("all_reduce", 2, True): 13, ("all_gather", 8, False): 5, ("reduce_scatter", 8, False): 3}, groups
    assert [k for k in fsdp["collectives"] if "@" in k] == [], fsdp["collectives"]  # (the world's: no group named)
    cfg, factory = prepare(None, {**options, "tp": 4})
    plan = make_plan(cfg, factory, Target(12, 6), [4], Hardware(), steps=1)  # rank 4: the group of ranks 4-7
    assert plan["target"]["data_ranks"] == 3 and plan["target"]["global_batch"] == 3 * 32
    assert {c["in_node"] for c in plan["collectives_per_step"] if c["group"] == 4} == {False}, plan
    assert any(note.startswith("--tp 4 does not divide --nproc-per-node 6: some tensor-parallel groups span two "
                               "nodes") for note in plan["notes"]), plan["notes"]


@pytest.mark.slow
def test_fit_plans_the_layouts_and_ranks_those_that_fit_by_step_time():
    """plan --fit on 2 ranks at global batch 128 (tp_tasks' blocks: ddp, fsdp, fsdp --tp 2; each
    with more accumulation and checkpointing until it fits) under a limit that batch 64 a rank
    does not meet: what fits is under the limit, ranked by step time, the best command first's;
    what does not is over it (or refused), each group planned until its first fit."""
    limit = 0.0008  # GB: 800 KB; ddp's 64 a rank peaks at 1.4 MB, its 16 x 4 at 0.5 MB
    code, out, err = _plan("--fit", "--task", "tp_tasks:blocks", "--world-size", "2", "--device", "cpu", "--ranks",
                           "0", "--batch-size", "64", "--memory-per-rank", str(limit), "--json")
    found = json.loads(out)
    assert code == 0 and found["global_batch"] == 128 and found["left_out"] == [], err
    fitting, tried = found["fitting"], found["tried"]
    assert fitting and len(fitting) < len(tried)
    assert all(t["peak_bytes"] <= limit * 1e9 and not t["refusals"] for t in fitting)
    assert all(t["peak_bytes"] > limit * 1e9 or t["refusals"] for t in tried if not t["fits"])
    assert [t["step_s_serial"] for t in fitting] == sorted(t["step_s_serial"] for t in fitting)
    assert {(t["strategy"], t["tp"]) for t in tried} == {("ddp", 1), ("fsdp", 1), ("fsdp", 2)}
    for t in tried:  # batch x accumulation x groups: the global batch
        assert t["batch_size"] * t["grad_accum"] * 2 // t["tp"] == 128, t
    # a group ends at its first fit without checkpointing; checkpointing is tried below its accumulation
    for group in {(t["strategy"], t["tp"]) for t in tried}:
        plain = [t for t in tried if (t["strategy"], t["tp"]) == group and not t["activation_checkpointing"]]
        assert [t["fits"] for t in plain] == [False] * (len(plain) - 1) + [plain[-1]["fits"]], plain
    # the best command, in text
    code, out, _ = _plan("--fit", "--task", "tp_tasks:blocks", "--world-size", "2", "--device", "cpu", "--ranks", "0",
                         "--batch-size", "64", "--memory-per-rank", str(limit))
    assert out.splitlines()[-1] == "best: ddptrain train --task tp_tasks:blocks --device cpu " + " ".join(
        fitting[0]["flags"]), out


@pytest.mark.slow
def test_a_plan_for_cuda_counts_the_temporaries_of_cuda_s_optimizer_path(planner, capsys):
    """torch's AdamW takes its foreach path on CUDA (one op over every tensor: temporaries the
    size of the whole state) and a per-tensor loop on the CPU (one tensor's). A plan is for cuda
    unless told --device cpu: under DDP its peak is, to the byte, a real gloo rank's whose AdamW
    was told foreach on this CPU; the plan for cpu is a rank's left to torch's CPU default, 2.5 MB
    (18%) lower on 12 blocks of 256 x 256; both hold the same state."""
    from ddptrain.cli import main

    options = {"task": "plan_tasks:deep_mlp", "optimizer": "adamw"}
    assert main(["plan", "--task", options["task"], "--optimizer", "adamw", "--device", "cpu", "--world-size", "2",
                 "--ranks", "0", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"]["device"] == "cpu"  # (--device auto: cuda, test_the_plan_leaves_the_run_dir_...)
    planned = {"cpu": plan["ranks"][0], "auto": planner.submit(_plan_rank, options, 2, 0).result()}
    told_foreach = run_on_ranks(2, _measured_on_real_ranks, {**options, "task": "plan_tasks:deep_mlp_foreach"}, "cpu")
    left_to_cpu = run_on_ranks(2, _measured_on_real_ranks, options, "cpu")
    assert planned["auto"]["allocated_peak_bytes"] == told_foreach[0]["allocated_peak_bytes"]
    assert planned["cpu"]["allocated_peak_bytes"] == left_to_cpu[0]["allocated_peak_bytes"]
    assert planned["auto"]["allocated_peak_bytes"] > 1.1 * planned["cpu"]["allocated_peak_bytes"], planned
    assert planned["auto"]["optimizer_bytes"] == planned["cpu"]["optimizer_bytes"] > 0


@pytest.mark.slow
def test_a_plan_counts_what_the_agreement_and_a_snapshot_send_as_the_world_grows(planner):
    """Beside a step's own collectives: the step records' sum at each stop agreement (3 numbers a
    step of a --log-every window, and a task's own figures: the count test_costs.py's real runs
    see; a max's column a rank grows with the world) and a snapshot's (under FSDP, DCP's save plan
    gathered to rank 0: its pickle, measured on the planned rank; none under DDP's file)."""
    options = {"task": "figure_tasks:regression_figures", "log_every": 5}
    small, large = (planner.submit(_plan_rank, options, world, 0).result() for world in (2, 4096))
    assert small["log_every"] == 5 and small["window_numbers"] == 3 * 5 + 2 + (1 + 2) + 2  # mean, max, sum
    assert large["window_numbers"] == 3 * 5 + 2 + (1 + 4096) + 2
    fsdp = planner.submit(_plan_rank, {**DIGITS, "strategy": "fsdp"}, 2, 0).result()
    assert small["dcp_plan_bytes"] == 0 and fsdp["dcp_plan_bytes"] > 1000, fsdp["dcp_plan_bytes"]


@pytest.mark.slow
def test_each_rank_writes_its_own_generators_whatever_the_world_size(planner):
    """Each rank's part of a snapshot (its random states: snapshots/rank_parts.py) is its own to
    write: rank 0 no longer writes every rank's (1,000 ranks' worth more at 1,024 than at 8)."""
    options = {**DIGITS, "strategy": "ddp"}
    for rank in (0, 5):
        small, large = (planner.submit(_plan_rank, options, world, rank, 8).result() for world in (8, 1024))
        assert large["generator_bytes"] == small["generator_bytes"] > 0
        assert large["snapshot_bytes"] == small["snapshot_bytes"], rank
        assert small["snapshot_bytes"] >= small["generator_bytes"], rank


FAKE_CASES = {"ddp-digits-accum2": ({**DIGITS, "grad_accum": 2}, 8, 0.02),  # id: (options, world, snapshots within)
              "fsdp-wide-mlp": ({**WIDE, "strategy": "fsdp"}, 64, 0.02),
              "hsdp-digits": ({**DIGITS, "strategy": "hsdp", "replicas": 2}, 16, 0.02),
              "fsdp-tp2-blocks": ({"task": "tp_tasks:blocks", "strategy": "fsdp", "tp": 2}, 16, 0.04)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAKE_CASES))
def test_fake_tensors_plan_what_real_ones_do(planner, case):
    """--fake-tensors: every figure of the first and the last rank as with real tensors, but the
    snapshot's serialised sizes, the rank's and the whole (within 2%: 0.1-1.5% measured; tp_tasks'
    blocks within 4%, 3.2% measured under fsdp with --tp or without: 150 KB a rank, in which about
    50 bytes a tensor that are not its data weigh), the generators' (within 1%: 64 B) and the peak
    (within 15%: under DDP, 91 KB above digits' 649 KB with real tensors, not traced; FSDP's within
    124 B)."""
    options, world, snapshots = FAKE_CASES[case]
    for rank in (0, world - 1):
        real, fake = (_planned(planner, options, world, rank, 8, fake=f) for f in (False, True))
        for key, tolerance in (("snapshot_bytes", snapshots), ("snapshot_whole_bytes", snapshots),
                               ("generator_bytes", 0.01), ("allocated_peak_bytes", 0.15)):
            assert math.isclose(fake.pop(key), real.pop(key), rel_tol=tolerance), (key, rank)
        assert fake == real, {k: (fake[k], real[k]) for k in fake if fake[k] != real[k]}


@pytest.mark.slow
def test_a_model_that_does_not_fit_here_is_planned_with_fake_tensors():
    """10 billion parameters (40 GB of float32; this machine has 24 GB) under FSDP on 64 ranks:
    each holds 1/64 of them and the plan ends in seconds; each rank's peak (the 10-billion
    parameter layer gathered whole, and its gradient) is above --memory-per-rank 80: refused."""
    code, out, err = _plan("--task", "plan_tasks:huge_mlp", "--strategy", "fsdp", "--world-size", "64",
                           "--optimizer", "adamw", "--fake-tensors", "--memory-per-rank", "80", "--json")
    ranks = json.loads(out)["ranks"]
    assert all(abs(r["parameters"] * 64 / 10_002_200_001 - 1) < 0.03 for r in ranks), [r["parameters"] for r in ranks]
    assert all(r["optimizer_bytes"] > 2 * r["parameter_bytes"] > 1.2e9 for r in ranks)
    (line,) = err.splitlines()
    assert code == 2 and "above --memory-per-rank 80" in line, err
    assert float(line.split("needs ")[1].split(" GB")[0]) > 80, line


@pytest.mark.slow
def test_ddp_with_fake_tensors_refuses_a_model_whose_buckets_do_not_fit_here_in_one_line():
    """DDP's reducer allocates its gradient buckets in real memory when it wraps the model: for
    10 billion float32 parameters 40 GB, which ended in an allocation's traceback."""
    from ddptrain.plan.memory import available_memory

    code, out, err = _plan("--task", "plan_tasks:huge_mlp", "--world-size", "64", "--fake-tensors", timeout=300)
    available = available_memory()
    assert available is not None
    if available > 45e9:  # (a machine where they fit: planned)
        assert code == 0, err
        return
    lines = [line for line in err.splitlines() if line.startswith("ddptrain")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "DDP allocates its gradient buckets in real memory when it wraps the model (40.0 GB" in lines[0], err


def _plan_on_a_terminal(*args: str) -> tuple[int, str, list[tuple[float, str]]]:
    """The installed command with its stderr on a terminal (a pseudo-terminal): its exit status,
    its stdout, and each stderr line with when it came."""
    import os
    import pty
    import select
    import subprocess
    import time

    from helpers.commands import BIN

    leader, follower = pty.openpty()
    env = clean_env(DDPTRAIN_PLAN_PROGRESS_S="0.5")
    process = subprocess.Popen([str(BIN / "ddptrain"), "plan", *args], stdout=subprocess.PIPE, stderr=follower,
                               stdin=subprocess.DEVNULL, env=env, text=True)
    os.close(follower)
    lines: list[tuple[float, str]] = []
    pending, started = b"", time.monotonic()
    while time.monotonic() - started < 240:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if not ready:
            if process.poll() is not None:
                break
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # (the terminal's last writer is gone)
            break
        if not chunk:
            break
        pending += chunk
        *complete, pending = pending.split(b"\n")
        lines += [(time.monotonic(), line.decode().rstrip("\r")) for line in complete]
    os.close(leader)
    out = process.stdout.read() if process.stdout else ""
    return process.wait(timeout=60), out, lines


@pytest.mark.slow
def test_a_plan_on_a_terminal_says_what_each_rank_is_doing_every_few_seconds_and_nothing_with_json():
    """#77 item 6: a plan said nothing until its end (166 s at 16,384 ranks with fake tensors). On
    a terminal, a line every interval (0.5 s here; 3 s by default) names what each planned rank is
    doing; with --json, stdout is the JSON alone and stderr gets no progress line."""
    flags = ("--world-size", "1024", "--strategy", "fsdp", "--task", "plan_tasks:wide_mlp", "--steps", "3")
    code, out, lines = _plan_on_a_terminal(*flags)
    progress = [(at, line) for at, line in lines if line.startswith("ddptrain plan, ")]
    assert code == 0 and out.startswith("plan: fsdp on 1,024 ranks"), (code, out, lines)
    assert progress, lines
    phases = ("joining the world", "building the task", "wrapping the model (--strategy fsdp)",
              "building the optimizer and the batches", "at step 1 of 3", "at step 2 of 3",
              "at step 3 of 3, measured", "measuring what it holds and writes", "done", "not started yet")
    for _, line in progress:  # ranks 0 and 1023, each doing one of the phases, for so long
        for part in line.split(": ", 1)[1].split("; "):
            who = next((p for p in ("ranks 0, 1023 ", "rank 0 ", "rank 1023 ") if part.startswith(p)), None)
            assert who, line
            what = part[len(who):]
            assert what == "not started yet" or what.rsplit(" (", 1)[0] in phases, line
    assert any(phase in line for _, line in progress for phase in phases[2:-1]), progress
    gaps = [later - earlier for (earlier, _), (later, _) in zip(progress, progress[1:])]
    assert max(gaps, default=0) < 3, gaps
    code, out, lines = _plan_on_a_terminal(*flags, "--json")
    assert code == 0 and json.loads(out)["target"]["world_size"] == 1024
    assert not [line for _, line in lines if line.startswith("ddptrain plan, ")], lines


def _snapshot_costs(world: int, rank: int) -> dict:
    """(In the planner's process.) benchmarks/snapshot_world.py's figures for one snapshot of rank ``rank``."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "snapshot_world.py"
    spec = importlib.util.spec_from_file_location("snapshot_world", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(world, rank, reps=1)


@pytest.mark.slow
def test_a_snapshot_costs_each_rank_one_barrier_and_its_own_part_at_any_world_size(planner):
    """#77 item 1: each rank's random states go to its own part of the snapshot, not through a
    collective: at 2 and at 4,096 (fake) ranks, rank 0 and the last rank start one barrier per
    snapshot, send and receive no payload, and write parts of the same size. (0.6's all-gather of
    the same states, counted the same way, delivers (W - 1) x 64 KiB to each: the count sees it.)"""
    rows = {(world, rank): planner.submit(_snapshot_costs, world, rank).result()
            for world in (2, 4096) for rank in (0, world - 1)}
    for (world, rank), row in rows.items():
        new, old = row["0.7"], row["0.6"]
        (only,) = new["collectives"].items()  # one collective, once
        assert only[0].startswith("barrier[") and only[1] == 1, new
        assert new["sent"] == new["received"] == 0, (world, rank, new)
        assert old["received"] == (world - 1) * 65536, (world, rank, old)
    sizes = {row["0.7"]["part_bytes"] for row in rows.values()}
    assert min(sizes) > 10_000 and max(sizes) - min(sizes) < 64, sizes
