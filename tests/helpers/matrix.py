"""The combination matrix: every promise checked where features meet.

A case picks one value on every axis (strategy, data shape, DataLoader workers, gradient
accumulation, precision, the world size a resumed run has, the interruption) and a seeded
place for the interruption. Its id says all of it (``fsdp.stream_uneven.w2.a3.fp32.same.
sigkill-r1-m17``), so a failing case is rerun alone with ``make test-matrix CASE=<id>``.

Each case is compared with its reference, the same command uninterrupted: bitwise where the
run resumed on the same world size, allclose on another (bf16: within 5%). Where the data is map-style and fp32,
the reference itself is compared with one rank training the global batch (allclose 1e-5, the
README's exactness promise). Every case also checks that each whole epoch trained every
sample once (metrics.jsonl's ``samples``), one record per epoch, each run's outcome (exit
status or exception) and that no rank of any run is left running.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ddptrain import TrainingFailed
from helpers.commands import BIN, alive, assert_same_weights, clean_env, finish, fit, load_model, read_metrics

AXES: dict[str, tuple[str, ...]] = {
    "strategy": ("ddp", "fsdp", "hsdp"),  # hsdp: --replicas 2, on 2 ranks a 2x1 mesh
    "data": ("map_even", "map_uneven", "stream_even", "stream_uneven", "token_file"),
    "workers": ("w0", "w1", "w2"),
    "accum": ("a1", "a3"),
    "precision": ("fp32", "bf16"),
    "resume_on": ("same", "other"),
    "interruption": ("none", "sigkill", "sigterm", "max_steps", "share_ran_out", "max_epochs"),
}
TASK = "matrix_tasks:matrix"
EPOCHS, BATCH, RANKS, SAVE_EVERY = 3, 8, 2, 3
SIZES = {"map_even": 256, "map_uneven": 250, "stream_even": 256, "stream_uneven": 240, "token_file": 256}


@dataclasses.dataclass(frozen=True)
class Case:
    strategy: str
    data: str
    workers: str
    accum: str
    precision: str
    resume_on: str
    interruption: str
    kill_rank: int = 0
    at: int = 0  # the interruption's place: a micro-batch (sigkill), a step (--max-steps), an epoch

    @property
    def id(self) -> str:
        where = {"sigkill": f"-r{self.kill_rank}-m{self.at}", "max_steps": f"-s{self.at}"}.get(self.interruption, "")
        return ".".join([self.strategy, self.data, self.workers, self.accum, self.precision, self.resume_on,
                         self.interruption + where])

    @classmethod
    def parse(cls, text: str) -> Case:
        *values, last = text.split(".")
        interruption, *where = last.split("-")
        fields = dict(zip(list(AXES)[:-1], values))
        kill_rank = next((int(w[1:]) for w in where if w[0] == "r"), 0)
        at = next((int(w[1:]) for w in where if w[0] in "ms"), 0)
        return cls(**fields, interruption=interruption, kill_rank=kill_rank, at=at)

    # --- what the case's values mean --------------------------------------------------------
    @property
    def grad_accum(self) -> int:
        return int(self.accum[1:])

    @property
    def is_stream(self) -> bool:
        return self.data.startswith("stream")

    def options(self, **more: Any) -> dict[str, Any]:
        replicas = {"replicas": 2} if more.get("strategy", self.strategy) == "hsdp" else {}
        return {"strategy": self.strategy, **replicas, "workers": int(self.workers[1:]), "grad_accum": self.grad_accum,
                "precision": self.precision, "batch_size": BATCH, "max_epochs": EPOCHS, "save_every": SAVE_EVERY,
                "timeout": 60, **more}

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch on 2 ranks (a stream's: until its longest share ends)."""
        if self.is_stream:
            return max(-(-_reader_batches(self, rank) // self.grad_accum) for rank in range(RANKS))
        return -(-SIZES[self.data] // (RANKS * BATCH * self.grad_accum))

    def ran_out_step(self) -> int:
        """The step after which rank 0's share of the stream has run out."""
        return -(-_reader_batches(self, 0) // self.grad_accum)


def _readers(case: Case) -> int:
    return max(1, int(case.workers[1:]))


def _shares(case: Case) -> list[int]:
    """Each reader's share of a stream: ``stream_even`` deals items in turn (data/streams.py),
    ``stream_uneven`` (data_tasks.SquareShares) in proportion to (i+1)²."""
    readers, total = RANKS * _readers(case), SIZES[case.data]
    if case.data == "stream_even":
        return [total // readers + (i < total % readers) for i in range(readers)]
    weights = [(i + 1) ** 2 for i in range(readers)]
    bounds = [total * sum(weights[:i]) // sum(weights) for i in range(readers + 1)]
    return [bounds[i + 1] - bounds[i] for i in range(readers)]


def _reader_batches(case: Case, rank: int) -> int:
    """The batches rank ``rank`` reads in an epoch: each of its readers batches its own share."""
    mine = _shares(case)[rank * _readers(case):(rank + 1) * _readers(case)]
    return sum(-(-n // BATCH) for n in mine)


# --- which cases ---------------------------------------------------------------------------------
def valid(values: dict[str, str]) -> bool:
    """A combination the promises speak of: a stream resumes only on its own world size (its
    shares depend on it), and so does hsdp (its 2 replica groups need 2 ranks); a share runs out
    only in stream_uneven; nothing resumes after none."""
    stream = values["data"].startswith("stream")
    if values["resume_on"] == "other" and (stream or values["strategy"] == "hsdp"
                                           or values["interruption"] in ("none", "share_ran_out")):
        return False
    return values["interruption"] != "share_ran_out" or values["data"] == "stream_uneven"


def _placed(values: dict[str, str], rng: random.Random) -> Case:
    case = Case(**values)
    total_steps = case.steps_per_epoch() * EPOCHS
    if case.interruption == "sigkill":
        # On another world size, only a resume keeps the global batch: killed past the first
        # snapshots (every 3 steps), one is surely committed; on the same, a fresh start is exact too.
        first = 3 * SAVE_EVERY * case.grad_accum if case.resume_on == "other" else 2
        return dataclasses.replace(case, kill_rank=rng.randrange(RANKS),
                                   at=rng.randrange(first, total_steps * case.grad_accum - 1))
    if case.interruption == "max_steps":
        return dataclasses.replace(case, at=rng.randrange(1, total_steps))
    return case


def cases(n: int, seed: int) -> list[Case]:
    """``n`` valid cases: first a greedy cover of every pair of axis values (as far as ``n``
    reaches), then random ones; the same ``(n, seed)`` give the same cases."""
    rng = random.Random(seed)
    names = list(AXES)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in AXES[a] for y in AXES[b]
                 if _pair_possible(a, x, b, y)}
    chosen: list[Case] = []
    while len(chosen) < n:
        candidates = [dict(zip(names, (rng.choice(AXES[a]) for a in names))) for _ in range(200)]
        candidates = [c for c in candidates if valid(c)]
        best = max(candidates, key=lambda c: _covers(c, uncovered))
        uncovered -= {pair for pair in uncovered if _has(best, pair)}
        chosen.append(_placed(best, rng))
    return chosen


def _pair_possible(a: str, x: str, b: str, y: str) -> bool:
    base = {name: values[0] for name, values in AXES.items()}
    options = [dict(base, **{a: x, b: y, **extra}) for extra in (
        {}, {"data": "stream_uneven"}, {"data": "map_even"}, {"interruption": "sigkill"}, {"resume_on": "same"},
        {"data": "map_even", "interruption": "sigkill"}, {"data": "stream_uneven", "resume_on": "same"})]
    return any(valid(o) and o[a] == x and o[b] == y for o in options)


def _has(values: dict[str, str], pair: tuple[tuple[str, str], tuple[str, str]]) -> bool:
    return all(values[axis] == value for axis, value in pair)


def _covers(values: dict[str, str], uncovered: set) -> int:
    return sum(1 for pair in uncovered if _has(values, pair))


def covers_every_value(chosen: list[Case]) -> dict[str, set[str]]:
    """The axis values no case of ``chosen`` takes (empty sets: every value is covered)."""
    return {axis: set(values) - {getattr(c, axis) for c in chosen} for axis, values in AXES.items()}


# --- running a case ------------------------------------------------------------------------------
class Runs:
    """The runs a matrix session shares: each reference is trained once, in ``base``."""

    def __init__(self, base: Path, env: dict[str, str]) -> None:
        self.base, self.env = base, env
        self.done: dict[str, Path] = {}

    def env_for(self, case: Case, **more: str) -> dict[str, str]:
        return {**self.env, "MATRIX_DATA": case.data, **more}

    def reference(self, case: Case) -> Path:
        """The same command as the case's, never interrupted."""
        key = ".".join([case.strategy, case.data, case.workers, case.accum, case.precision])
        if key not in self.done:
            run_dir = self.base / "reference" / key
            fit(TASK, run_dir, env=self.env_for(case), **case.options())
            self.done[key] = run_dir
        return self.done[key]

    def one_rank(self, case: Case) -> Path:
        """One rank training the global batch (the exactness promise's reference)."""
        key = f"one-rank.{case.data}.{case.accum}"
        if key not in self.done:
            run_dir = self.base / "reference" / key
            fit(TASK, run_dir, env=self.env_for(case), nproc=1,
                **case.options(strategy="ddp", workers=0, precision="fp32", batch_size=BATCH * RANKS))
            self.done[key] = run_dir
        return self.done[key]


def run_case(case: Case, runs: Runs, run_dir: Path) -> None:
    """The case's runs and every check on them; an AssertionError says which failed."""
    reference = runs.reference(case)
    _check_records(case, reference)
    if case.interruption == "none":
        if case.precision == "fp32" and not case.is_stream:
            assert_same_weights(load_model(reference), load_model(runs.one_rank(case)))
        return
    resume = {"nproc": 1} if case.resume_on == "other" else {}
    env = runs.env_for(case)
    if case.interruption == "sigkill":
        env = runs.env_for(case, KILL_RANK=str(case.kill_rank), KILL_STEP=str(case.at),
                           KILL_MARKER=str(run_dir / "killed"))
        try:
            fit(TASK, run_dir, env=env, **case.options())
            raise AssertionError("the killed run ended as if nothing happened")
        except TrainingFailed:
            pass
        assert (run_dir / "killed").exists(), "no rank was killed"
        _assert_none_left(run_dir)
    elif case.interruption == "sigterm":
        _stopped_by_sigterm(case, runs, run_dir)
    elif case.interruption in ("max_steps", "share_ran_out"):
        limit = case.at if case.interruption == "max_steps" else case.ran_out_step() + 1
        fit(TASK, run_dir, env=env, **case.options(max_steps=limit))
        assert max(r["step"] for r in read_metrics(run_dir)) == limit
    elif case.interruption == "max_epochs":
        fit(TASK, run_dir, env=env, **case.options(max_epochs=EPOCHS - 1))
        assert [r["epoch"] for r in _epochs(run_dir)] == list(range(EPOCHS - 1))
    fit(TASK, run_dir, env=env, **case.options(), **resume)  # the same command (on another world size)
    _assert_none_left(run_dir)
    _check_records(case, run_dir)
    if case.resume_on == "same":
        assert_same_weights(load_model(run_dir), load_model(reference), exact=True)
    else:  # another world size sums in another order; bf16's rounding follows the batch's shape
        _assert_close(load_model(run_dir), load_model(reference), loose=case.precision == "bf16")


def _assert_close(a: dict[str, Any], b: dict[str, Any], loose: bool) -> None:
    """fp32: allclose (another split of each batch's sum). bf16: each rank's matmuls round at
    its own batch's shape, so only the run as a whole agrees: the weights, all together, within
    5% (L2, relative); a small tensor alone (a bias) can move further."""
    import torch

    if loose:
        flat_a, flat_b = (torch.cat([t.flatten().double() for _, t in sorted(w.items())]) for w in (a, b))
        difference = float((flat_a - flat_b).norm() / flat_b.norm())
        assert difference < 5e-2, f"the weights differ by {difference:.2%} (L2, relative)"
        return
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda detail, key=key: f"{key} differs: {detail}")


def _stopped_by_sigterm(case: Case, runs: Runs, run_dir: Path) -> None:
    """``ddptrain train`` signalled with SIGTERM once its first epoch is logged: it stops at a
    step boundary after a snapshot and exits 143."""
    args = [str(BIN / "ddptrain"), "train", "--task", TASK, "--run-dir", str(run_dir), "--nproc", str(RANKS)]
    for key, value in case.options().items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    env = clean_env(**runs.env_for(case, MATRIX_PACE="0.1"))
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not _epochs(run_dir) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    out, err, late = finish(process, timeout=120)
    assert not late and process.returncode == 143, f"exit {process.returncode}\n{out}\n{err}"
    assert "run the same command to resume" in err + out, err
    _assert_none_left(run_dir)


def _epochs(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(run_dir) if r["kind"] == "epoch"] if path.is_file() else []


def _check_records(case: Case, run_dir: Path) -> None:
    """One record per epoch, in order, each whole epoch every sample once."""
    epochs = _epochs(run_dir)
    assert [r["epoch"] for r in epochs] == list(range(EPOCHS)), [r["epoch"] for r in epochs]
    assert [r["samples"] for r in epochs] == [SIZES[case.data]] * EPOCHS, [r["samples"] for r in epochs]
    if not case.is_stream:
        assert [r["step"] for r in epochs] == [case.steps_per_epoch() * (e + 1) for e in range(EPOCHS)]


def _assert_none_left(run_dir: Path) -> None:
    """No rank of the run still running (pid files stay after a kill; a finished rank removes its own)."""
    deadline = time.monotonic() + 10
    pids = [int(p.read_text()) for p in (run_dir / "pids").glob("rank-*.pid")] if (run_dir / "pids").is_dir() else []
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid) and pid != os.getpid()]
    assert not left, f"ranks left running: {left}"


def reproduce(case: Case) -> str:
    return f"reproduce: make test-matrix CASE={case.id}"

