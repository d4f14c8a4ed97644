"""Going on from a finished run: a warmup-stable-decay run trained longer from the snapshot before
its decay ends as the longer run started afresh would, bit for bit; a new run takes a finished
one's weights and optimizer state under a schedule of its own."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddptrain.errors import ConfigError
from helpers.commands import assert_same_weights, fit, load_model

TASKS = "ddptrain_test_tasks:"

WSD = {"lr_schedule": "linear", "warmup_steps": 2, "decay_fraction": 0.25, "lr": 0.05, "keep": 1}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_warmup_stable_decay_run_goes_on_from_before_its_decay_bitwise(tmp_path, capfd, strategy):
    """12 steps under --keep 1 keep the snapshot before the decay (step 9: 20 steps' decay begins
    at 15) beside the last, a file or a DCP folder; the same command says how to go on; a larger
    --max-steps from the last snapshot is refused in one line naming that snapshot; resumed from
    it, 20 steps equal 20 steps trained in one go."""
    short, longer = tmp_path / "short", tmp_path / "longer"
    suffix = ".pt" if strategy == "ddp" else ""
    fit("regression", short, max_steps=12, strategy=strategy, **WSD)
    snapshots = sorted(p.name for p in (short / "snapshots").iterdir() if not p.name.endswith(".ranks"))
    assert snapshots == [f"step-000000009{suffix}", f"step-000000012{suffix}"]
    capfd.readouterr()
    fit("regression", short, max_steps=12, strategy=strategy, **WSD)
    kept = short / "snapshots" / snapshots[0]
    assert f"began after {kept}, which goes on exactly: to train it longer, pass --resume {kept} and a larger " \
           "--max-steps" in capfd.readouterr().out
    with pytest.raises(ConfigError, match=f"cannot go on exactly; resume its snapshot from before the decay with "
                                          f"--resume {kept}"):
        fit("regression", short, max_steps=20, strategy=strategy, **WSD)
    fit("regression", short, max_steps=20, resume=str(kept), strategy=strategy, **WSD)
    assert "at step 9: every step so far had the rate a run of 20 steps gives it" in capfd.readouterr().out
    fit("regression", longer, max_steps=20, strategy=strategy, **WSD)
    assert_same_weights(load_model(short), load_model(longer), exact=True)


def _optimizer_state(snapshot: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A snapshot's optimizer state by parameter name, whole tensors: a file's, or a DCP folder's read here."""
    if snapshot.is_file():
        return torch.load(snapshot, weights_only=False)["optimizer"]["state"]
    metadata = dcp.FileSystemReader(snapshot).read_metadata().state_dict_metadata
    flat = {key: torch.empty(tuple(value.size), dtype=value.properties.dtype) for key, value in metadata.items()
            if key.startswith("optimizer.state.") and hasattr(value, "size")}
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, checkpoint_id=snapshot, no_dist=True)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, moment = key.removeprefix("optimizer.state.").rsplit(".", 1)
        state.setdefault(name, {})[moment] = value
    return state


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_new_run_takes_a_finished_run_s_optimizer_state_under_its_own_rates(tmp_path, capfd, strategy):
    """--init-from RUN_DIR --init-optimizer: before its first step the new run's AdamW holds the
    finished run's newest snapshot's moments and step counts, bit for bit (a ddp file or an fsdp DCP
    folder, into a ddp run), at its own rate, not the decayed one; config.json says where it came
    from; a weights-only --init-from is refused in one line."""
    finished, carried, probe = tmp_path / "finished", tmp_path / "carried", tmp_path / "probe.pt"
    fit(TASKS + "optimizer_probe", finished, max_steps=6, lr=0.05, lr_schedule="cosine", strategy=strategy)
    (snapshot,) = [p for p in (finished / "snapshots").iterdir() if not p.name.endswith(".ranks")]
    capfd.readouterr()
    fit(TASKS + "optimizer_probe", carried, env={"OPTIMIZER_PROBE": str(probe)}, max_steps=2, lr=0.02,
        init_from=str(finished), init_optimizer=True)
    assert f"initialised from {snapshot} (step 6): its weights and its optimizer's state (AdamW's)" in \
        capfd.readouterr().out
    loaded, saved = torch.load(probe, weights_only=True), _optimizer_state(snapshot)
    assert loaded["lr"] == [0.02] and set(loaded["state"]) == set(saved) == {"weight", "bias"}
    for name, moments in saved.items():
        assert set(moments) == set(loaded["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
        for moment, value in moments.items():
            assert torch.equal(loaded["state"][name][moment], value), f"{name}.{moment} differs"
    settings = json.loads((carried / "config.json").read_text())
    assert (settings["init_from"], settings["init_optimizer"]) == (str(finished), True)
    with pytest.raises(ConfigError, match="holds no snapshot, so no optimizer state"):
        fit(TASKS + "optimizer_probe", tmp_path / "refused", max_steps=2, init_from=str(finished / "model.pt"),
            init_optimizer=True)
    with pytest.raises(ConfigError, match=r"^snapshot .* holds another model: missing keys"):  # one line, not torch's
        fit(TASKS + "mlp_regression", tmp_path / "other", max_steps=2, init_from=str(finished), init_optimizer=True)


@pytest.mark.slow
def test_a_run_under_the_task_s_own_schedule_goes_on_longer_where_the_schedule_agrees(tmp_path, capfd):
    """nanogpt_schedule decays to its own lr_decay_iters whatever the run's length: 6 steps, then
    the same command with --max-steps 12, end as 12 steps in one go, bit for bit."""
    short, longer = tmp_path / "short", tmp_path / "longer"
    fit(TASKS + "nanogpt_scheduled", short, max_steps=6, lr=0.05)
    fit(TASKS + "nanogpt_scheduled", short, max_steps=12, lr=0.05)
    assert "at step 6: the task's schedule gave every step so far the rate a run of 12 steps gives it" in \
        capfd.readouterr().out
    fit(TASKS + "nanogpt_scheduled", longer, max_steps=12, lr=0.05)
    assert_same_weights(load_model(short), load_model(longer), exact=True)
