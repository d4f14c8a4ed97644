"""A task's own step figures (Task.step_figures): step_fn returns them beside its loss, and each
step record holds them combined over the ranks and the record's steps as declared, computed here
from the samples the sampler gives each rank; a resume inside a window writes the same records;
and they cost no collective of their own (test_costs.py counts the step's)."""

import csv

import pytest

from ddptrain.data.sampling import StepSampler
from ddptrain.observe.summary import read_metrics
from helpers.commands import fit

from figure_tasks import SAMPLES

WORLD, BATCH, ACCUM, EVERY, EPOCHS = 2, 4, 2, 2, 2


def expected_records() -> dict[int, dict[str, float]]:
    """Each step record's figures, by its step: index_mean the mean over ranks and steps of each
    rank's mean over its micro-batches (of those with samples) of their mean index; index_max the
    largest index and the rank that trained it; samples_seen every sample of the window's steps."""
    steps: list[list[list[list[int]]]] = []  # [step][rank][micro-batch] -> indices
    for epoch in range(EPOCHS):
        by_rank = []
        for rank in range(WORLD):
            sampler = StepSampler(SAMPLES, WORLD, rank, BATCH, ACCUM, seed=0)
            sampler.set_epoch(epoch)
            micro = [m.indices.tolist() if m.samples else None for m in sampler.micro_batches(sampler.order())]
            by_rank.append([micro[i:i + ACCUM] for i in range(0, len(micro), ACCUM)])
        steps += [list(ranks) for ranks in zip(*by_rank)]
    records = {}
    for end in range(EVERY, len(steps) + 1, EVERY):
        means, largest, seen = [], (-1, -1), 0
        for ranks in steps[end - EVERY:end]:
            for rank, micro_batches in enumerate(ranks):
                real = [indices for indices in micro_batches if indices is not None]
                means.append(sum(sum(i) / len(i) for i in real) / len(real))
                largest = max(largest, max((max(i), rank) for i in real))
                seen += sum(len(i) for i in real)
        records[end] = {"index_mean": sum(means) / len(means), "index_max": largest[0],
                        "index_max_rank": largest[1], "samples_seen": seen}
    return records


def step_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r.get("kind") == "step"}


@pytest.mark.slow
def test_a_tasks_figures_are_its_samples_combined_as_declared_and_resume_inside_a_window(tmp_path):
    options = {"batch_size": BATCH, "grad_accum": ACCUM, "log_every": EVERY, "seed": 0}
    fit("figure_tasks:indexed", tmp_path / "straight", max_epochs=EPOCHS, tracker="csv", **options)
    records, expected = step_records(tmp_path / "straight"), expected_records()
    with open(tmp_path / "straight" / "metrics.csv") as table:  # a tracker's too (each tracker gets what csv gets)
        rows = {int(row["step"]): row for row in csv.DictReader(table)}
    assert float(rows[6]["step/index_max"]) == expected[6]["index_max"]
    assert float(rows[6]["step/samples_seen"]) == expected[6]["samples_seen"]
    assert sorted(records) == sorted(expected) == [2, 4, 6]
    for step, figures in expected.items():
        got = {name: records[step][name] for name in figures}
        assert got == pytest.approx(figures, rel=1e-12, abs=0), (step, got, figures)
    assert expected[4]["samples_seen"] == 16 + 3  # (steps 3 and 4: the first epoch's short last step, then a full one)

    fit("figure_tasks:indexed", tmp_path / "resumed", max_steps=3, **options)  # stops inside the window of 3-4
    fit("figure_tasks:indexed", tmp_path / "resumed", max_epochs=EPOCHS, **options)
    resumed = step_records(tmp_path / "resumed")
    for step in (4, 6):  # the window the snapshot cut, and the next
        keys = ("train_loss", "grad_norm", *expected[step])
        assert {k: resumed[step][k] for k in keys} == {k: records[step][k] for k in keys}, step
