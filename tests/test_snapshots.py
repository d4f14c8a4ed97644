"""Snapshots: atomic, validated, and resume that is bitwise the uninterrupted run.

Processes are really killed (SIGKILL, SIGTERM); files are really corrupted.
"""

import os
import pickle
import shutil
import signal
import time

import pytest
import torch

from ddptrain import snapshot

from conftest import BIN, assert_ok, assert_same_weights, clean_env, ddptrain, load_model, run
from ports import free_port

ARGS = ["--max-epochs", "3", "--save-every", "5", "--momentum", "0.9"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(ddptrain("train", *ARGS, "--nproc", "2", "--run-dir", str(run_dir)))
    return load_model(run_dir)


def _kill_env(tmp_path, rank, step):
    return clean_env(KILL_RANK=str(rank), KILL_STEP=str(step), KILL_MARKER=str(tmp_path / "killed"))


@pytest.mark.slow
@pytest.mark.parametrize("rank,step", [
    (1, 1),    # the first step, before any snapshot
    (0, 21),   # mid-epoch, between snapshots
    (1, 32),   # the last step of epoch 0, before its epoch-end snapshot
    (0, 33),   # the first step after an epoch boundary
])
def test_sigkill_any_rank_then_elastic_restart_is_bitwise_exact(tmp_path, uninterrupted, rank, step):
    result = ddptrain("train", *ARGS, "--task", "ddptrain_test_tasks:kill_at_step", "--nproc", "2",
                      "--max-restarts", "3", "--run-dir", str(tmp_path / "run"),
                      env=_kill_env(tmp_path, rank, step))
    assert_ok(result)
    assert (tmp_path / "killed").exists(), "the rank was never killed"
    assert_same_weights(load_model(tmp_path / "run"), uninterrupted, exact=True)


@pytest.mark.slow
def test_sigkill_while_writing_a_snapshot(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    env = clean_env(KILL_SNAPSHOT="3", KILL_MARKER=str(tmp_path / "killed"))
    result = ddptrain("train", *ARGS, "--task", "ddptrain_test_tasks:kill_while_snapshotting",
                      "--nproc", "2", "--max-restarts", "3", "--run-dir", str(run_dir), env=env)
    assert_ok(result)
    assert (tmp_path / "killed").exists()
    assert "resumed from" in result.stdout and "step-000000010.pt" in result.stdout  # not the half file
    assert not list((run_dir / "snapshots").glob(".*.tmp")), "the half-written file was not cleaned up"
    assert_same_weights(load_model(run_dir), uninterrupted, exact=True)


@pytest.mark.slow
def test_torchrun_max_restarts_is_bitwise_exact(tmp_path, uninterrupted):
    result = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=3",
                  "-m", "ddptrain", "train", *ARGS, "--task", "ddptrain_test_tasks:kill_at_step",
                  "--run-dir", str(tmp_path / "run")],
                 # torchrun's agent must not share its store with restarted gloo ranks (README)
                 env=_kill_env(tmp_path, 1, 21) | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert_ok(result)
    assert (tmp_path / "killed").exists()
    assert_same_weights(load_model(tmp_path / "run"), uninterrupted, exact=True)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A 2-rank run SIGKILLed at step 21 without restarts: the job fails, snapshots remain."""
    base = tmp_path_factory.mktemp("killed")
    result = ddptrain("train", *ARGS, "--task", "ddptrain_test_tasks:kill_at_step", "--nproc", "2",
                      "--run-dir", str(base / "run"), env=_kill_env(base, 0, 21))
    assert result.returncode == 1
    kept = [p.name for p in snapshot.list_snapshots(base / "run" / "snapshots")]
    # --keep 2; step 20's write runs in the background and may not have finished at the kill
    assert kept in (["step-000000015.pt", "step-000000020.pt"], ["step-000000010.pt", "step-000000015.pt"])
    return base / "run"


def _copy(run_dir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def _resume(run_dir, *extra, nproc="2", task="ddptrain_test_tasks:kill_at_step"):
    """Resume the killed run with its own task name (without KILL_* variables it kills nothing)."""
    return ddptrain("train", *ARGS, "--task", task, "--nproc", nproc, "--run-dir", str(run_dir), *extra)


@pytest.mark.slow
def test_truncated_newest_snapshot_falls_back_to_previous(killed_run, tmp_path, uninterrupted):
    run_dir = _copy(killed_run, tmp_path)
    previous, newest = snapshot.list_snapshots(run_dir / "snapshots")
    newest.write_bytes(newest.read_bytes()[:1000])
    result = _resume(run_dir)
    assert_ok(result)
    assert f"ddptrain: rank 0: UserWarning: snapshot {newest} cannot be read" in result.stderr
    assert f"resumed from {previous}" in result.stdout
    assert_same_weights(load_model(run_dir), uninterrupted, exact=True)


@pytest.mark.slow
def test_resume_on_one_rank_with_double_batch(killed_run, tmp_path, uninterrupted):
    run_dir = _copy(killed_run, tmp_path)
    result = _resume(run_dir, nproc="1")
    assert_ok(result)
    assert "batch size per rank 64 keeps the global batch 64" in result.stdout
    assert_same_weights(load_model(run_dir), uninterrupted)


@pytest.mark.slow
def test_changed_math_settings_are_refused(killed_run, tmp_path):
    run_dir = _copy(killed_run, tmp_path)
    result = _resume(run_dir, "--momentum", "0.5")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "momentum: 0.9 -> 0.5" in result.stderr


@pytest.mark.slow
def test_snapshot_of_another_model_is_refused(killed_run, tmp_path):
    run_dir = _copy(killed_run, tmp_path)
    result = _resume(run_dir, task="ddptrain_test_tasks:mlp_regression")
    assert result.returncode == 2
    assert "holds another model" in result.stderr and "missing keys" in result.stderr


@pytest.mark.slow
def test_run_dir_not_shared_between_nodes_is_a_clear_error(tmp_path, start):
    """Two torchrun 'nodes' in different folders: rank 1 cannot see rank 0's snapshot."""
    port = free_port()
    agents = []
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        agents.append(start(
            [str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=unshared", "-m", "ddptrain", "train",
             "--max-epochs", "1", "--run-dir", "run"], cwd=tmp_path / node))
    outputs = [agent.communicate(timeout=120) for agent in agents]
    assert all(agent.returncode != 0 for agent in agents)
    assert "put --run-dir on storage every node shares" in "".join(o[1] for o in outputs)


# --- files that are not good snapshots (no process group needed) -------------------------------

class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddptrain-pwned",))


def _good_state(step):
    return {"format_version": 1, "model": {"w": torch.zeros(2)}, "optimizer": {}, "epoch": 0,
            "step_in_epoch": step, "global_step": step, "world_size": 1, "batch_size": 1,
            "global_batch": 1, "fingerprint": {}, "rng": []}


def test_newest_good_snapshot_wins_over_broken_ones(tmp_path):
    folder = tmp_path / "snapshots"
    folder.mkdir()
    snapshot.atomic_save(_good_state(5), folder / "step-000000005.pt")
    (folder / "step-000000006.pt").write_bytes(b"")                           # empty
    with open(folder / "step-000000007.pt", "wb") as handle:                  # malicious pickle
        pickle.dump({"model": _Exploit()}, handle)
    torch.save({"format_version": 1}, folder / "step-000000008.pt")            # wrong schema
    (folder / ".step-000000009.pt.123.tmp").write_bytes(b"half a file")       # never a candidate
    if os.path.exists("/tmp/ddptrain-pwned"):
        os.remove("/tmp/ddptrain-pwned")
    with pytest.warns(UserWarning) as warned:
        path, state = snapshot.load_newest(folder)
    assert path.name == "step-000000005.pt" and state["global_step"] == 5
    messages = [str(w.message) for w in warned]
    assert any("step-000000008.pt is not a ddptrain snapshot" in m for m in messages)
    assert any("step-000000007.pt cannot be read" in m for m in messages)
    assert any("step-000000006.pt cannot be read" in m for m in messages)
    assert not os.path.exists("/tmp/ddptrain-pwned"), "the malicious pickle ran code"


def test_no_usable_snapshot_is_one_line_exit_2(tmp_path):
    folder = tmp_path / "run" / "snapshots"
    folder.mkdir(parents=True)
    (folder / "step-000000003.pt").write_bytes(b"\x00" * 10)
    result = ddptrain("train", "--nproc", "1", "--max-epochs", "1", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error:")]
    assert len(error_lines) == 1 and "no usable snapshot" in error_lines[0]
    assert "Traceback" not in result.stderr


def test_rotation_keeps_the_newest_k(tmp_path):
    folder = tmp_path / "snapshots"
    for step in range(1, 6):
        snapshot.write_snapshot(_good_state(step), folder, keep=2)
    assert [p.name for p in snapshot.list_snapshots(folder)] == ["step-000000004.pt", "step-000000005.pt"]


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_and_exits_cleanly_then_resumes_exactly(tmp_path, start):
    args = ["--max-epochs", "60", "--momentum", "0.9"]
    reference = tmp_path / "reference"
    assert_ok(ddptrain("train", *args, "--nproc", "2", "--run-dir", str(reference)))
    run_dir = tmp_path / "run"
    job = start([str(BIN / "ddptrain"), "train", *args, "--nproc", "2", "--run-dir", str(run_dir)])
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    rank1 = int((run_dir / "pids" / "rank-1.pid").read_text())
    os.kill(rank1, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 143, err
    assert "snapshot saved" in err and "Traceback" not in err
    saved = snapshot.list_snapshots(run_dir / "snapshots")
    assert saved and "model.pt" not in os.listdir(run_dir)
    step = snapshot.load_snapshot(saved[-1])["global_step"]
    assert 0 < step < 60 * 32
    result = ddptrain("train", *args, "--nproc", "2", "--run-dir", str(run_dir))
    assert_ok(result)
    assert f"step {step}" in result.stdout
    assert_same_weights(load_model(run_dir), load_model(reference), exact=True)
