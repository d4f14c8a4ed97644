"""What a step costs in collectives, read from the traces ``--profile N`` writes: each
collective this rank started, by kind and size, in each profiled optimizer step."""

from __future__ import annotations

import collections
import json
from pathlib import Path

# the c10d ops that are collectives, by kind: one table for ddptrain plan and these tests
from ddptrain.plan.collectives import C10D_KINDS as KINDS


def _numel(dims) -> int:
    """Elements of a collective's first input (a tensor, or a list of tensors for the list ops)."""
    while dims and isinstance(dims[0], list):
        dims = dims[0]
    size = 1
    for d in dims or []:
        size *= d
    return size


def _events(run_dir: Path, rank: int) -> list[dict]:
    trace = json.loads((Path(run_dir) / "profile" / f"rank-{rank}.json").read_text())
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])


def step_seconds(run_dir: Path, rank: int = 0) -> list[float]:
    """Each profiled step's time from its start to the next one's (the last: its own span), in
    seconds: what the stop agreement measures when it spaces its checks."""
    steps = [e for e in _events(run_dir, rank) if e["name"].startswith("ProfilerStep")]
    ends = [after["ts"] for after in steps[1:]] + [steps[-1]["ts"] + steps[-1]["dur"]]
    return [(end - step["ts"]) / 1e6 for step, end in zip(steps, ends)]


def collectives_per_step(run_dir: Path, rank: int = 0) -> list[collections.Counter]:
    """For each profiled step, a Counter of ``"kind[elements]"`` this rank started in it (the
    ops are recorded on the calling thread when called, so each lands in the step that called it)."""
    events = _events(run_dir, rank)
    steps = [e for e in events if e["name"].startswith("ProfilerStep")]
    ops = [e for e in events if e["name"] in KINDS]
    return [collections.Counter(f"{KINDS[e['name']]}[{_numel(e['args'].get('Input Dims'))}]" for e in ops
                                if step["ts"] <= e["ts"] < step["ts"] + step["dur"]) for step in steps]


STOP_AGREEMENT = "all_reduce[3]"  # resilience/stop_signals.py: 3 numbers, about twice a second


def pop_step_records(steps: list[collections.Counter], every: int, figures: int = 0) -> int:
    """Take the step records' all-reduces (--log-every ``every``: each closed window's 3·every
    numbers and ``figures`` numbers of the task's own figures, and the FLOPs per step) out of each
    step's collectives, asserting that they ran only where the stop agreement ran
    (observe/step_records.py); returns how many there were."""
    found = 0
    for step in steps:
        sizes = [key for key in step if key.startswith("all_reduce[")
                 and (int(key[len("all_reduce["):-1]) - 1) % (3 * every + figures) == 0 and key != STOP_AGREEMENT
                 and int(key[len("all_reduce["):-1]) > 1]
        records = sum(step.pop(size) for size in sizes)
        assert not records or STOP_AGREEMENT in step, f"a step record's all-reduce away from the stop agreement: {step}"
        found += records
    return found


def by_kind_and_size(collectives: dict[str, dict]) -> collections.Counter:
    """A plan's collectives (``RankFigures.collectives``) as this file reads a trace: by kind and
    elements, whatever their group (the plan keys one not the world's with ``@size``)."""
    counts: collections.Counter = collections.Counter()
    for c in collectives.values():
        counts[f"{c['kind']}[{c['elements']}]"] += c["count"]
    return counts
