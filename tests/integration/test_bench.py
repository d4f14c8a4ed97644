"""``ddptrain bench``: the peers' table and its plumbing (figures are not asserted: a smoke run
measures nothing; the benchmark itself is a script, not a timed test)."""

import importlib.util
import json

import pytest

from helpers.commands import BIN, assert_ok, run


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("job "))
    for column in ("samples/s (min-max)", "vs loop", "1-epoch wall (min-max)", "vs fastest peer", "final loss"):
        assert column in lines[header]
    return [line.split() for line in lines[header + 2:] if line.startswith("tutorial ")]


@pytest.mark.slow
def test_bench_with_peers_prints_one_table_of_the_same_job(tmp_path):
    """The benchmark's plumbing (its figures are not asserted: a smoke run measures nothing)."""
    # find_spec, not import: importing Lightning in the test process sets environment variables
    if not all(importlib.util.find_spec(peer) for peer in ("lightning", "accelerate")):
        pytest.skip("the bench extra (pip install 'ddptrain[bench]') is not installed")
    result = run([str(BIN / "ddptrain"), "bench", "--smoke", "--peers", "--reps", "1", "--jobs", "tutorial",
                  "--contenders", "loop,ddptrain,lightning,accelerate", "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    rows = _table(result.stdout)
    assert [r[1] for r in rows] == ["loop", "ddptrain", "lightning", "accelerate"]
    assert "tutorial: every contender ended at the same loss: yes" in result.stdout
    saved = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(saved) == 4 and all(r["wall_1_epoch_s"] > 0 and r["same_loss_as_all"] for r in saved)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_names_missing_peers_in_one_line(tmp_path):
    hide = "import sys; sys.modules['lightning'] = sys.modules['accelerate'] = None; from ddptrain.cli import main; "
    result = run([str(BIN / "python"), "-c", hide + "sys.exit(main(sys.argv[1:]))", "bench", "--smoke", "--peers",
                  "--reps", "1", "--jobs", "tutorial", "--contenders", "ddptrain-skip", "--out", str(tmp_path)],
                 timeout=300)
    assert_ok(result)
    missing = [line for line in result.stdout.splitlines() if "not installed" in line]
    assert missing == ["ddptrain bench: lightning and accelerate not installed (pip install 'ddptrain[bench]'): "
                       "their rows are left out"]
    assert [r[1] for r in _table(result.stdout)] == ["ddptrain-skip"]


@pytest.mark.slow
def test_bench_floor_prints_the_floor_and_ddptrains_1_epoch_command_side_by_side(tmp_path):
    result = run([str(BIN / "ddptrain"), "bench", "--floor", "--reps", "2", "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    rows = {line.split("  ")[0].strip(): line.split() for line in result.stdout.splitlines()
            if line.startswith(("floor ", "ddptrain 1 epoch"))}
    assert rows["floor"][-1] == "1.00" and float(rows["ddptrain 1 epoch"][-1]) > 1.0, result.stdout
    walls = json.loads((tmp_path / "floor.json").read_text())["walls_s"]
    assert len(walls["floor"]) == len(walls["ddptrain 1 epoch"]) == 2
