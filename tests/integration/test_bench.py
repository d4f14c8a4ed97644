"""``ddptrain bench``: the peers' table and its plumbing (figures are not asserted: a smoke run
measures nothing; the benchmark itself is a script, not a timed test)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from ddptrain.bench.jobs import JOBS
from helpers.commands import BIN, assert_ok, run


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("job "))
    for column in ("steady samples/s (min-max)", "vs loop", "command samples/s", "1-epoch wall (min-max)",
                   "vs fastest peer", "final loss"):
        assert column in lines[header]
    return [line.split() for line in lines[header + 2:] if line.split() and line.split()[0] in JOBS]


@pytest.mark.slow
def test_bench_with_peers_prints_one_table_of_the_same_jobs(tmp_path):
    """The benchmark's plumbing on GPT-2 (every contender's DDP code, on batches of byte tokens) and
    FSDP (every contender's sharding code): every contender ran, ended at the loss of the others,
    and its step clock measured it (its figures are not asserted: a smoke run measures nothing)."""
    # find_spec, not import: importing Lightning in the test process sets environment variables
    if not all(importlib.util.find_spec(peer) for peer in ("lightning", "accelerate", "transformers")):
        pytest.skip("the bench and hf extras (pip install 'ddptrain[bench,hf]') are not installed")
    contenders = ["loop", "ddptrain", "lightning", "accelerate"]
    result = run([str(BIN / "ddptrain"), "bench", "--smoke", "--peers", "--reps", "1", "--jobs", "gpt2,fsdp",
                  "--contenders", ",".join(contenders), "--out", str(tmp_path)], timeout=600)
    assert_ok(result)
    rows = _table(result.stdout)
    assert [(r[0], r[1]) for r in rows] == [(job, c) for job in ("gpt2", "fsdp") for c in contenders]
    for job in ("gpt2", "fsdp"):
        assert f"{job}: every contender ended at the same loss: yes" in result.stdout
    assert "gpt2: steady tokens/s (64 per sample): loop " in result.stdout
    saved = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(saved) == 8 and all(r["wall_1_epoch_s"] > 0 and r["same_loss_as_all"] for r in saved)
    assert all(math.isfinite(r["steady_samples_per_s"]) and r["steady_samples_per_s"] > 0 for r in saved), saved
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_names_missing_peers_in_one_line_and_runs_the_per_step_variants(tmp_path):
    hide = "import sys; sys.modules['lightning'] = sys.modules['accelerate'] = None; from ddptrain.cli import main; "
    result = run([str(BIN / "python"), "-c", hide + "sys.exit(main(sys.argv[1:]))", "bench", "--smoke", "--peers",
                  "--reps", "1", "--jobs", "tutorial", "--contenders", "loop-grad-norm,ddptrain-skip,ddptrain-no-fr",
                  "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    missing = [line for line in result.stdout.splitlines() if "not installed" in line]
    assert missing == ["ddptrain bench: lightning and accelerate not installed (pip install 'ddptrain[bench]'): "
                       "their rows are left out"]
    assert sorted(r[1] for r in _table(result.stdout)) == ["ddptrain-no-fr", "ddptrain-skip", "loop-grad-norm"]
    assert "tutorial: every contender ended at the same loss: yes" in result.stdout


@pytest.mark.slow
def test_bench_floor_prints_both_floors_and_ddptrains_1_epoch_command_side_by_side(tmp_path):
    result = run([str(BIN / "ddptrain"), "bench", "--floor", "--reps", "2", "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    rows = {line.split("  ")[0].strip(): line.split() for line in result.stdout.splitlines()
            if line.startswith(("floor ", "training floor ", "ddptrain 1 epoch"))}
    assert rows["floor"][-2] == "1.00" and rows["training floor"][-1] == "1.00", result.stdout
    assert float(rows["training floor"][-2]) > 1.0 and float(rows["ddptrain 1 epoch"][-2]) > 1.0, result.stdout
    walls = json.loads((tmp_path / "floor.json").read_text())["walls_s"]
    assert [len(walls[name]) for name in ("floor", "training floor", "ddptrain 1 epoch")] == [2, 2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("stop,ranks,workers", [("hang", 256, 4), ("die", 32, 1)])
def test_the_control_plane_benchmark_names_the_rank_that_stopped(tmp_path, stop, ranks, workers):
    """benchmarks/control_plane.py's smoke run: N of ddptrain's watchdogs on one TCPStore take
    steps, the last one hangs (or dies: its heartbeats end and its connection closes), rank 0's
    judge names it (the figures are the script's business)."""
    script = Path(__file__).parents[2] / "benchmarks" / "control_plane.py"
    result = run([str(BIN / "python"), str(script), "--ranks", str(ranks), "--workers", str(workers), "--stop", stop,
                  "--steady-s", "1", "--timeout", "2", "--capacity-procs", "2", "--capacity-clients", "2",
                  "--capacity-probes", "1", "--json", str(tmp_path / "cp.json")], timeout=300)
    assert_ok(result)
    (row,) = json.loads((tmp_path / "cp.json").read_text())["rows"]
    assert row["ranks"] == ranks and row["stop"] == stop and row["named_right"] and row["ops_per_s"] > 0, row
    assert 2 <= row["named_s"] < 2 + 2 * 0.5 + 5, row  # --timeout + 2 periods, and a busy machine's slack
    assert any(line.split()[:1] == [str(ranks)] for line in result.stdout.splitlines()), result.stdout
    assert f"the last rank {'hung' if stop == 'hang' else 'died'}" in result.stdout
    # rank 0's hang summary (on the workers' stderr): a hung rank answers with its stack, a dead one cannot
    answer = "was in (innermost call last):" if stop == "hang" else "did not answer: it never started"
    assert f"ddptrain: rank {ranks - 1} {answer}" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_the_control_plane_start_up_benchmark_times_each_part_of_a_ranks_start():
    """benchmarks/control_plane_startup.py's smoke run: 32 simulated ranks start a bare store
    client, ddptrain's board, the watchdog with idle threads and the watchdog, each timed."""
    script = Path(__file__).parents[2] / "benchmarks" / "control_plane_startup.py"
    result = run([str(BIN / "python"), str(script), "--ranks", "32", "--workers", "1", "--reps", "1"], timeout=300)
    assert_ok(result)
    rows = {line[:16].strip(): line[16:].split() for line in result.stdout.splitlines()[2:]}
    assert list(rows) == ["client", "board", "idle threads", "watchdog"], result.stdout
    assert all(float(row[0]) > 0 for row in rows.values()), result.stdout
