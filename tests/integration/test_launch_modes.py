"""Every launch mode trains the same weights: two torchrun agents forming a two-node job, and
two of ddptrain's own launches at the same moment. (torchrun and torch.distributed.launch
--use-env on one node: docs/guide.md's launcher block runs them and compares the weights with
ddptrain's own launch, bit for bit; tests/integration/test_docs.py runs it.)"""

import pytest

from ddptrain import free_port
from helpers.commands import BIN, assert_same_weights, fit, load_model

TRAIN = ["train", "--max-epochs", "2", "--batch-size", "16", "--momentum", "0.9"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    fit("regression", run_dir, max_epochs=2, batch_size=16, momentum=0.9)
    return load_model(run_dir)


@pytest.mark.slow
def test_two_torchrun_agents_form_a_two_node_job(tmp_path, reference, start):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-node-test", "-m", "ddptrain", *TRAIN,
                     "--run-dir", str(tmp_path)]) for _ in range(2)]
    outputs = [agent.communicate(timeout=180) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert_same_weights(load_model(tmp_path), reference, exact=True)
    assert not any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in err for _, err in outputs)  # not an elastic range


@pytest.mark.slow
def test_an_elastic_range_under_the_shared_store_is_named_on_every_node(tmp_path, reference, start):
    """--nnodes=1:2 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: it trains (both nodes joined),
    and each node says once, at start, that a node which leaves could not come back."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([str(BIN / "torchrun"), "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic-warning", f"--rdzv-conf=is_host={i == 0}",
                     "-m", "ddptrain", *TRAIN, "--run-dir", str(tmp_path)]) for i in range(2)]
    outputs = [agent.communicate(timeout=180) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert_same_weights(load_model(tmp_path), reference, exact=True)
    for _, err in outputs:
        lines = [line for line in err.splitlines() if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in line]
        assert lines == ["ddptrain: warning: torchrun --nnodes 1:2 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
                         "a node that leaves can never rejoin (torch's shared rendezvous store, "
                         "pytorch/pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on "
                         "every node (docs/multinode.md)"], err


@pytest.mark.slow
def test_two_jobs_started_together_both_succeed(tmp_path, start, reference):
    """No fixed port: two jobs on one machine at the same moment do not clash."""
    jobs = [start([str(BIN / "ddptrain"), *TRAIN, "--nproc", "2", "--run-dir", str(tmp_path / str(i))])
            for i in range(2)]
    outputs = [job.communicate(timeout=180) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    for i in range(2):
        assert_same_weights(load_model(tmp_path / str(i)), reference, exact=True)


@pytest.mark.slow
def test_an_elastic_node_replaced_within_the_rendezvous_grace_costs_one_restart(tmp_path, monkeypatch):
    """benchmarks/fault_tolerance.py's elastic path: two torchrun agents of one rank on loopback,
    node b's agent and rank SIGKILLed at step 40, a replacement started at once (as an
    orchestrator does). It joins the survivor's rendezvous within its grace (last_call_timeout):
    one restart, at world size 2 (no round alone in between), the run resumed from step 20's
    snapshot (step 40's is not taken: the kill comes in step 40); the failure's teardown
    (goodput's failure part) under a second."""
    from ddptrain.observe.goodput import attempts_of, read_timeline
    from helpers.commands import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import fault_tolerance

    monkeypatch.setenv("STARTUP_S", "0")
    found = fault_tolerance.elastic(tmp_path, [40, 10_000], save_every=20)  # (the second never comes: 192 steps)
    attempts = attempts_of(read_timeline(tmp_path / "run"))
    assert [(a.start["resumed_from"], a.start["world_size"]) for a in attempts] == [(0, 2), (20, 2)], found
    assert found["kills"] == 1 and found["steps_redone"] == 19 and 0 < found["failure_s"] < 1, found
