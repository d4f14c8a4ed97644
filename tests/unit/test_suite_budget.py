""".ci/suite_budget.py: CI fails when pytest's own time passes half of CI's limit, naming the slowest tests."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / ".ci" / "suite_budget.py"
spec = importlib.util.spec_from_file_location("suite_budget", SCRIPT)
budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(budget)

LOG = """\
============================= slowest 25 durations =============================
167.02s call     tests/integration/test_bench.py::test_peers_smoke
3.10s setup    tests/integration/test_docs.py::test_runnable_block[README.md-x]
80.50s call     tests/integration/test_launch_ray.py::test_ray_job
{closing}
"""


def test_a_suite_within_its_budget_passes_and_says_how_much_it_used(tmp_path, capsys):
    log = tmp_path / "log"
    log.write_text(LOG.format(closing="510 passed, 2 skipped in 1234.56s (0:20:34)"))
    assert budget.main([str(log)]) == 0
    assert "pytest took 1,235 s of its 2,700 s budget (46%" in capsys.readouterr().out


def test_a_suite_over_its_budget_fails_naming_the_slowest_tests_first(tmp_path, capsys):
    log = tmp_path / "log"
    log.write_text(LOG.format(closing="==== 3 failed, 507 passed in 2800.00s (0:46:40) ===="))
    assert budget.main([str(log)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "over by 100 s" in err[0]
    assert "test_peers_smoke" in err[1] and "test_ray_job" in err[2] and "test_runnable_block" in err[3]


def test_a_log_without_pytests_closing_line_fails(tmp_path):
    log = tmp_path / "log"
    log.write_text("make: *** [Makefile:30: lint] Error 1\n")
    assert budget.main([str(log)]) == 1
