"""The combination matrix (tests/helpers/matrix.py): each case a combination of strategy, data
shape, workers, accumulation, precision, resume world size and interruption, checked against
its uninterrupted reference. ``make test`` runs the fixed sample below, which takes every
value of every axis at least once; ``make test-matrix N=200 SEED=7`` runs 200 seeded cases,
``make test-matrix CASE=<id>`` one case again (a failure prints its command)."""

from __future__ import annotations

import os

import pytest

from helpers.matrix import Case, Runs, cases, covers_every_value, reproduce, run_case

pytestmark = pytest.mark.slow

# The CI sample: the first cases of the seeded pairwise cover, enough for every axis value.
CI_CASES, CI_SEED = 14, 2026


def _chosen() -> list[Case]:
    if os.environ.get("MATRIX_CASE"):
        return [Case.parse(text) for text in os.environ["MATRIX_CASE"].split(",")]
    n, seed = int(os.environ.get("MATRIX_N", CI_CASES)), int(os.environ.get("MATRIX_SEED", CI_SEED))
    return cases(n, seed)


CHOSEN = _chosen()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from matrix_tasks import write_token_file

    base = tmp_path_factory.mktemp("matrix")
    write_token_file(base / "tokens.bin")
    return Runs(base, {"TOKEN_FILE": str(base / "tokens.bin")})


def test_the_ci_sample_takes_every_value_of_every_axis():
    missing = covers_every_value(cases(CI_CASES, CI_SEED))
    assert not any(missing.values()), missing
    assert all(Case.parse(c.id) == c for c in cases(200, 1))  # every id runs its case again


@pytest.mark.parametrize("case", CHOSEN, ids=[c.id for c in CHOSEN])
def test_a_combination_keeps_every_promise(case, runs, tmp_path):
    try:
        run_case(case, runs, tmp_path / "run")
    except AssertionError as failure:
        raise AssertionError(f"{case.id}: {failure}\n{reproduce(case)}") from None
