"""Every launch mode trains the same weights: ddptrain's own launch, torchrun,
torch.distributed.launch --use-env, and two torchrun agents forming a two-node job."""

import pytest

from ddptrain import free_port

from conftest import BIN, assert_ok, assert_same_weights, fit, load_model, run

TRAIN = ["train", "--max-epochs", "2", "--batch-size", "16", "--momentum", "0.9"]
PY = str(BIN / "python")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    fit("regression", run_dir, max_epochs=2, batch_size=16, momentum=0.9)
    return load_model(run_dir)


@pytest.mark.slow
def test_torchrun(tmp_path, reference):
    result = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddptrain",
                  *TRAIN, "--run-dir", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), reference, exact=True)


@pytest.mark.slow
def test_torch_distributed_launch_use_env(tmp_path, reference):
    result = run([PY, "-m", "torch.distributed.launch", "--use-env", "--nproc-per-node=2",
                  f"--master-port={free_port()}", "-m", "ddptrain", *TRAIN, "--run-dir", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), reference, exact=True)


@pytest.mark.slow
def test_two_torchrun_agents_form_a_two_node_job(tmp_path, reference, start):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-node-test", "-m", "ddptrain", *TRAIN,
                     "--run-dir", str(tmp_path)]) for _ in range(2)]
    outputs = [agent.communicate(timeout=180) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert_same_weights(load_model(tmp_path), reference, exact=True)


@pytest.mark.slow
def test_two_jobs_started_together_both_succeed(tmp_path, start, reference):
    """No fixed port: two jobs on one machine at the same moment do not clash."""
    jobs = [start([str(BIN / "ddptrain"), *TRAIN, "--nproc", "2", "--run-dir", str(tmp_path / str(i))])
            for i in range(2)]
    outputs = [job.communicate(timeout=180) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    for i in range(2):
        assert_same_weights(load_model(tmp_path / str(i)), reference, exact=True)
