"""Where a suite's time and CPU went, by test file, from a run with DDPTRAIN_TEST_CPU=FILE
(tests/conftest.py writes a line per test: its id, wall seconds, CPU seconds).

    DDPTRAIN_TEST_CPU=/tmp/cpu.tsv make test && python tests/helpers/cpu_by_file.py /tmp/cpu.tsv
"""

from __future__ import annotations

import sys
from collections import defaultdict


def by_file(lines: list[str]) -> dict[str, tuple[float, float, int]]:
    """{test file: (wall s, CPU s, tests)}."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for line in lines:
        nodeid, wall, cpu = line.rstrip("\n").split("\t")[:3]
        total = totals[nodeid.split("::", 1)[0]]
        total[0] += float(wall)
        total[1] += float(cpu)
        total[2] += 1
    return {name: (wall, cpu, int(count)) for name, (wall, cpu, count) in totals.items()}


def main(path: str, top: int = 25) -> None:
    with open(path) as tsv:
        every = [line for line in tsv if line.strip()]
    lines = [line for line in every if not line.startswith("#")]
    files = sorted(by_file(lines).items(), key=lambda item: -item[1][1])
    wall_all, cpu_all = sum(f[1][0] for f in files), sum(f[1][1] for f in files)
    print(f"{'file':52} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'CPU/wall':>8}")
    for name, (wall, cpu, count) in files[:top]:
        print(f"{name:52} {count:5d} {wall:8.1f} {cpu:8.1f} {cpu / max(wall, 1e-9):8.2f}")
    print(f"{'all (' + str(len(lines)) + ' tests)':52} {'':5} {wall_all:8.1f} {cpu_all:8.1f} "
          f"{cpu_all / max(wall_all, 1e-9):8.2f}")
    for line in every:
        if line.startswith("#machine\t"):
            wall, cpu, cores = (float(x) for x in line.split("\t")[1:4])
            print(f"the machine over the session: {cpu:,.0f} CPU s in {wall:,.0f} s ({cpu / wall / cores:.0%} of "
                  f"{cores:.0f} cores); {cpu - cpu_all:,.0f} CPU s in no test's own (processes no test waited "
                  "for: Ray's actors, servers; pytest's workers between tests)")
    tests = sorted((line.rstrip("\n").split("\t")[:3] for line in lines), key=lambda t: -float(t[2]))
    print("\nthe CPU-heaviest tests:")
    for nodeid, wall, cpu in tests[:top]:
        print(f"{float(cpu):8.1f} CPU s {float(wall):8.1f} wall s  {nodeid}")
    print_workers(lines)


def print_workers(lines: list[str]) -> None:
    """When each worker ran its last test: a worker idle long before the last one ends is time a
    better order of the files would win (the files that run last are named)."""
    rows = [line.rstrip("\n").split("\t") for line in lines]
    rows = [(row[3], float(row[4]), float(row[1]), row[0].split("::", 1)[0]) for row in rows if len(row) >= 5]
    if not rows:
        return
    first = min(start for _, start, _, _ in rows)
    print("\nworker   ends at s  its last file")
    for worker in sorted({row[0] for row in rows}):
        *_, (_, start, wall, name) = sorted((row for row in rows if row[0] == worker), key=lambda row: row[1])
        print(f"{worker:8} {start + wall - first:9.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
