"""What a step costs, as tests: the collectives each optimizer step starts, read from the
``--profile`` trace of rank 0, must be what a hand-written loop of the same job pays, plus
ddptrain's documented extras, and nothing more. Equal weights cannot show an extra
collective (the sum is linear): these counts can.

The job: the tutorial's Linear(20, 1) (21 parameters: one DDP bucket, one FSDP unit) on 2
ranks, batch 8, long epochs. Steps 2 and 3 hold one-off costs (DDP's bucket rebuild, the stop
agreement finding its interval), so the counts are of the steps after them; the stop agreement
(3 numbers, about twice a second) may land in one of them on a slow machine and is counted apart.

What a hand-written loop pays per optimizer step of K micro-batches:
- DDP with ``no_sync`` on the first K-1: one all-reduce per gradient bucket;
- FSDP2 (``fully_shard``'s defaults) with ``set_requires_gradient_sync(False)`` on the first
  K-1: for the root unit (this model, whole) one all-gather of its parameters in each
  micro-batch's forward (kept gathered for the backward), one reduce-scatter.
(Measured: the same job as a hand-written torchrun script, profiled the same way.)
- HSDP (FSDP2 on a 2-D mesh, ``--strategy hsdp --replicas 2``): FSDP's collectives inside each
  replica group, plus one all-reduce of the reduced shard across the groups; the same
  ``set_requires_gradient_sync(False)`` holds back both. On 2 ranks each group is one rank,
  whose parameters need no gathering: one all-reduce a step is all. (Measured too: ``fully_shard``
  on a 2x2 and a 2x1 ``init_device_mesh``, spawned, profiled the same way.)
- TP x FSDP (``--tp 2`` on a 2x2 mesh): the hand-written loop is a script run beside it
  (tests/helpers/hand_written_tp.py), and the counts are compared with its, not written here.
ddptrain's extras (README "What a step costs"): an iterable training set adds one all-reduce
of 1 number (the step's sample count, overlapped with the backward); ``--skip-nonfinite`` one
all-reduce of 1 number (every rank's verdict); the step records (``--log-every N``) one
asynchronous all-reduce of 3N numbers a closed window (each step's loss, gradient norm and
whether it was skipped), a task's own step figures (Task.step_figures: 2 numbers each, a max's
1 + 1 per rank) and the FLOPs per step, only beside the stop agreement (about twice a second) or
inside an epoch's or a snapshot's reduction.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import multiprocessing
import sys

import pytest

from ddptrain.resilience.stop_signals import CHECK_SECONDS
from helpers.commands import TESTS, assert_ok, clean_env, fit, run
from helpers.costs import STOP_AGREEMENT, by_kind_and_size, collectives_per_step, pop_step_records, step_seconds

TASKS = "ddptrain_test_tasks:"
GRADIENTS_DDP = {"all_reduce[21]": 1}  # one bucket of the 21 parameters
HSDP = {"strategy": "hsdp", "replicas": 2}


def _fsdp(micro_batches: int) -> dict[str, int]:
    return {"all_gather[42]": micro_batches, "reduce_scatter[21]": 1}  # the model is FSDP's root unit


CASES = {  # id: (fit's options, the collectives of one step)
    "ddp": ({}, GRADIENTS_DDP),
    "ddp-accum2-task-figures": ({"task": "figure_tasks:regression_figures", "grad_accum": 2}, GRADIENTS_DDP),
    "ddp-accum4": ({"grad_accum": 4}, GRADIENTS_DDP),
    "ddp-accum4-skip-nonfinite": ({"grad_accum": 4, "skip_nonfinite": 3}, {**GRADIENTS_DDP, "all_reduce[1]": 1}),
    "ddp-stream-accum3": ({"task": TASKS + "stream", "grad_accum": 3}, {**GRADIENTS_DDP, "all_reduce[1]": 1}),
    "fsdp": ({"strategy": "fsdp"}, _fsdp(1)),
    "fsdp-accum4": ({"strategy": "fsdp", "grad_accum": 4}, _fsdp(4)),
    "fsdp-stream-accum3": ({"strategy": "fsdp", "task": TASKS + "stream", "grad_accum": 3},
                           {**_fsdp(3), "all_reduce[1]": 1}),
    "hsdp-2-ranks-accum4": ({**HSDP, "grad_accum": 4}, {"all_reduce[21]": 1}),
    "hsdp-4-ranks-accum4": ({**HSDP, "grad_accum": 4, "nproc": 4}, {**_fsdp(4), "all_reduce[21]": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_step_starts_the_collectives_a_hand_written_loop_does_and_no_more(tmp_path, case):
    options, per_step = CASES[case]
    options = {"task": "regression", "batch_size": 8, **options}
    task = options.pop("task")
    figures = 2 + 3 + 2 if "figures" in task else 0  # mean, max (1 + 2 ranks), sum: figure_tasks.FIGURES
    steady = _profiled_steps(task, tmp_path, figures, **options)
    assert steady == [collections.Counter(per_step)] * 5, steady


@pytest.mark.slow
def test_a_tp_step_starts_the_collectives_a_hand_written_tp_loop_does_and_no_more(tmp_path):
    """--tp 2 with fsdp on 4 ranks (a 2 x 2 mesh), 2 micro-batches a step: the same collectives
    as tests/helpers/hand_written_tp.py, the same job written with torch's parallelize_module and
    fully_shard by hand and profiled the same way, run here: the tensor-parallel all-reduces of
    every micro-batch's forward and backward, FSDP's all-gathers, one reduce-scatter per unit."""
    options = {"strategy": "fsdp", "tp": 2, "batch_size": 8, "grad_accum": 2}
    steady = _profiled_steps("tp_tasks:blocks", tmp_path / "ddptrain", nproc=4, **options)
    reference = tmp_path / "hand-written"
    assert_ok(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   str(TESTS / "helpers" / "hand_written_tp.py"), str(reference)], env=clean_env(OMP_NUM_THREADS="1")))
    hand_written = collectives_per_step(reference)[2:]
    assert len(hand_written) == 5 and hand_written[0] and all(step == hand_written[0] for step in hand_written)
    assert steady == hand_written, (steady[0], hand_written[0])
    # and ddptrain plan's count of the same job's step, on the fake group (a fresh process: plan/job.py)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        planned = fresh.submit(_planned_step, {"task": "tp_tasks:blocks", **options}, 4).result()
    assert planned == steady[0], (planned, steady[0])


def _planned_step(options: dict, world: int) -> collections.Counter:
    """(In a spawned process.) The collectives ddptrain plan counts in rank 0's step of ``options``."""
    from ddptrain.api import prepare
    from ddptrain.plan.rank import Target, plan_rank

    cfg, factory = prepare(None, options)
    return by_kind_and_size(plan_rank(cfg, factory, Target(world, world, "cpu"), 0, steps=1).collectives)


def _profiled_steps(task: str, run_dir, figures: int = 0, **options) -> list[collections.Counter]:
    """The collectives of steps 4 to 8 of ``task`` run with ``options`` (rank 0's, from its
    --profile trace), less the step records' (--log-every 5) and the stop agreement's."""
    fit(task, run_dir, env={"STREAM_SAMPLES": "4000"}, max_steps=9, profile=7, log_every=5, **options)
    steady = collectives_per_step(run_dir)[2:]  # steps 4 to 8
    assert len(steady) == 5
    pop_step_records(steady, every=5, figures=figures)  # (beside the stop agreement only: none of a step's own)
    stops = sum(step.pop(STOP_AGREEMENT, 0) for step in steady)
    # The agreement is spaced by the steps' measured speed (CHECK_SECONDS of steps, measured over
    # the interval before): once in 5 steps at this job's milliseconds a step; on a machine so
    # busy that the profiled steps took up to 0.15 s each, every third step is its design. One
    # more where the interval in force as these 5 began was measured over slower steps before
    # them (4 ranks on 2 cores starting: 2 in 5 steps of up to 0.076 s, once in a fresh clone).
    # An agreement every step, the waste this guards against, is 5.
    slowest = max(step_seconds(run_dir))
    allowed = math.ceil(5 / max(1, int(CHECK_SECONDS / slowest)))
    assert stops <= max(1, allowed) + 1, (f"the stop agreement ran {stops} times in 5 steps of up to "
                                          f"{slowest:.3f} s (at most twice a second)")
    return steady
