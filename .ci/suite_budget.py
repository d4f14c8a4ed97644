"""Fail CI when the test suite's own time passes half of CI's limit, naming the slowest tests.

Reads the output of `make test` (pytest's closing line "N passed ... in S s" and its
--durations table). A guard with wide headroom against a noisy machine, not a timed test:
growth shows here long before a landing would time out at CI's 90 minutes.
Usage: python3 .ci/suite_budget.py LOG [--budget-s 2700]
"""

import argparse
import re
import sys

CI_LIMIT_S = 90 * 60


def pytest_seconds(log: str) -> float | None:
    """The wall time pytest printed on its closing line (the last one, if several ran)."""
    found = re.findall(r"^(?:=+ )?\d+ (?:passed|failed|errors?)\b.* in ([\d.]+)s(?: \([\d:]+\))?(?: =+)?$", log, re.M)
    return float(found[-1]) if found else None


def slowest(log: str, count: int = 10) -> list[str]:
    """The --durations table's first rows: 'SECONDS s  call  tests/...::name'."""
    rows = re.findall(r"^([\d.]+)s (call|setup|teardown) +(\S.*)$", log, re.M)
    rows.sort(key=lambda row: -float(row[0]))
    return [f"{float(s):8.1f} s  {phase:8}  {name}" for s, phase, name in rows[:count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--budget-s", type=float, default=CI_LIMIT_S / 2)
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as handle:
        log = handle.read()
    seconds = pytest_seconds(log)
    if seconds is None:
        print("suite budget: no pytest closing line in the log; did pytest run?", file=sys.stderr)
        return 1
    print(f"suite budget: pytest took {seconds:,.0f} s of its {args.budget_s:,.0f} s budget "
          f"({seconds / args.budget_s:.0%}; half of CI's {CI_LIMIT_S // 60} minutes)")
    if seconds <= args.budget_s:
        return 0
    print(f"suite budget: over by {seconds - args.budget_s:,.0f} s. The slowest tests:", file=sys.stderr)
    for row in slowest(log):
        print(f"  {row}", file=sys.stderr)
    print("Make them cheaper (one launch serving several assertions, events instead of sleeps, fit() "
          "instead of a new interpreter) before adding more: docs/development.md.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
