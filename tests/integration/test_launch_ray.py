"""Ray Train: ddptrain.fit() in a TorchTrainer's workers, on a real local Ray cluster (2 CPUs):
Ray's own process group, a worker SIGKILLed and the group restarted by Ray, storage that only
one worker sees."""

import json
import sys

import pytest

from helpers.commands import REPO, TESTS, assert_ok, assert_same_weights, clean_env, fit, load_model, read_metrics, run

pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install 'ddptrain[ray]'")
pytestmark = pytest.mark.slow


def test_ray_workers_train_on_rays_group_and_a_killed_worker_resumes_bitwise(tmp_path):
    fit("regression", tmp_path / "local", max_epochs=3, save_every=32, momentum=0.9)  # the job under ddptrain
    env = clean_env(KILL_RANK="1", KILL_STEP="40", KILL_MARKER=str(tmp_path / "killed"),
                    KILL_ONCE_SAVED=str(tmp_path / "resumed" / "snapshots"))  # step 32's, or a fresh start
    env["PYTHONPATH"] += f":{REPO / 'examples'}"  # Ray's workers import the example's worker function
    result = run([sys.executable, str(TESTS / "helpers" / "ray_jobs.py"), str(tmp_path), str(tmp_path / "ray-storage"),
                  "resumed", "unshared", "in-ray-storage"], env=env, timeout=600)
    assert_ok(result)
    outcomes = {o["job"]: o for o in (json.loads(line.removeprefix("RESULT ")) for line in result.stdout.splitlines()
                                      if line.startswith("RESULT "))}

    resumed = outcomes["resumed"]
    assert (tmp_path / "killed").exists(), "rank 1 was never killed"
    assert resumed["error"] is None, resumed
    assert_same_weights(load_model(tmp_path / "resumed"), load_model(tmp_path / "local"), exact=True)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [32, 64, 96]  # each epoch once
    assert resumed["ray_checkpoint"] == {"run_dir": str(tmp_path / "resumed"), "epoch": 3, "global_step": 96,
                                         "snapshot": str(tmp_path / "resumed" / "snapshots" / "step-000000096.pt")}
    assert "resumed from" in result.stdout + result.stderr  # under --resume never: Ray's restart of the job

    assert outcomes["unshared"]["error"]  # Ray ends the job; the rank's own error names the cause
    assert (f"rank 1 cannot see snapshot {tmp_path}/unshared/rank-1/snapshots/step-000000032.pt written by rank 0: "
            "put --run-dir on storage every node shares") in result.stdout + result.stderr

    # fit() without a run dir: the run lives in Ray's storage for the job, and says so once
    in_ray = tmp_path / "ray-storage" / "in-ray-storage" / "ddptrain"
    assert outcomes["in-ray-storage"]["error"] is None, outcomes["in-ray-storage"]
    assert_same_weights(load_model(in_ray), load_model(tmp_path / "local"), exact=True)
    assert outcomes["in-ray-storage"]["ray_checkpoint"]["run_dir"] == str(in_ray)
    assert (result.stdout + result.stderr).count(f"the run lives in Ray's storage, {in_ray}") == 1
