"""Two hosts with their own addresses: two network namespaces joined by a veth pair, one
torchrun agent in each, the rendezvous on the first host's address (not 127.0.0.1).

Catches code that binds to localhost or assumes one host. Traffic goes only to the two
namespaces' own addresses (198.18.0.1/30 and .2, from the benchmarking range) and loopback.
"""

import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from ddptrain.snapshots import files
from helpers.commands import BIN, assert_ok, assert_same_weights, clean_env, ddptrain_cli, load_model, read_metrics

HOSTS = {"a": "198.18.0.1", "b": "198.18.0.2"}
TRAIN = ["train", "--max-epochs", "2", "--batch-size", "16", "--momentum", "0.9"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.fail("the two-host test needs iproute2's `ip` (apt-get install iproute2)")
    tag = uuid.uuid4().hex[:6]
    names = {host: f"ddp{host}{tag}" for host in HOSTS}
    links = {host: f"veth{host}{tag}" for host in HOSTS}
    try:
        for name in names.values():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", links["a"], "type", "veth", "peer", "name", links["b"])
        for host, name in names.items():
            _ip("link", "set", links[host], "netns", name)
            _ip("-n", name, "addr", "add", f"{HOSTS[host]}/30", "dev", links[host])
            _ip("-n", name, "link", "set", links[host], "up")
        yield names, links
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.slow
def test_two_namespaces_train_like_one_host(tmp_path, two_hosts, start):
    names, links = two_hosts
    assert_ok(ddptrain_cli(*TRAIN, "--nproc", "2", "--run-dir", str(tmp_path / "single")))
    endpoint = f"{HOSTS['a']}:29400"
    agents = []
    for host, name in names.items():
        # gloo must use the namespace's own interface, not whatever the hostname resolves to
        env = clean_env(GLOO_SOCKET_IFNAME=links[host])
        agents.append(start(
            ["ip", "netns", "exec", name, str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=netns",
             # the hostname resolves to 127.0.0.1: say which agent hosts the rendezvous store
             f"--rdzv-conf=is_host={int(host == 'a')}",
             f"--local-addr={HOSTS[host]}", "-m", "ddptrain", *TRAIN, "--run-dir", str(tmp_path / "two")],
            env=env))
    outputs = [agent.communicate(timeout=120) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    config_master = outputs[0][0] + outputs[1][0]
    assert "training regression on 2 rank(s)" in config_master
    assert_same_weights(load_model(tmp_path / "two"), load_model(tmp_path / "single"), exact=True)


# What Kubeflow's training operator (v1 PyTorchJob) sets in each pod, and the kubelet in any pod.
def _pytorchjob_env(pod: int, link: str) -> dict[str, str]:
    return clean_env(RANK=str(pod), WORLD_SIZE="2", MASTER_ADDR=HOSTS["a"], MASTER_PORT="23456", PYTHONUNBUFFERED="1",
                     KUBERNETES_SERVICE_HOST="10.96.0.1", KUBERNETES_SERVICE_PORT="443",
                     GLOO_SOCKET_IFNAME=link)  # (the pods' hostnames resolve to 127.0.0.1 here, not in a cluster)


@pytest.mark.slow
def test_a_pytorchjob_of_two_pods_with_two_processes_each_trains_like_four_local_ranks(tmp_path, two_hosts, start):
    """The manifest's command, `ddptrain train --nproc 2`, in two pods: RANK and WORLD_SIZE count
    pods, so each pod starts 2 ranks as one node of 2; the weights are a local 4-rank run's."""
    names, links = two_hosts
    assert_ok(ddptrain_cli(*TRAIN, "--nproc", "4", "--run-dir", str(tmp_path / "local")))
    pods = [start(["ip", "netns", "exec", name, str(BIN / "ddptrain"), *TRAIN, "--nproc", "2",
                   "--run-dir", str(tmp_path / "job")], env=_pytorchjob_env(pod, links[host]))
            for pod, (host, name) in enumerate(names.items())]
    outputs = [p.communicate(timeout=120) for p in pods]
    assert [p.returncode for p in pods] == [0, 0], outputs
    for pod, (out, _) in enumerate(outputs):
        assert (f"ddptrain: a Kubeflow PyTorchJob pod (RANK={pod} of WORLD_SIZE=2 pods): node {pod}, 2 rank(s) "
                f"here, 4 in all, meeting at {HOSTS['a']}:23456") in out, out
    assert "training regression on 4 rank(s)" in outputs[0][0]
    assert_same_weights(load_model(tmp_path / "job"), load_model(tmp_path / "local"), exact=True)


@pytest.mark.slow
def test_a_trainjob_of_two_nodes_runs_torchrun_with_the_runtimes_pet_variables(tmp_path, two_hosts, start):
    """Kubeflow Trainer's torch runtime runs the manifest's `torchrun -m ddptrain train` in each
    node's pod with PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
    PET_MASTER_PORT, which torchrun reads as its flags: the weights are a local 4-rank run's."""
    names, links = two_hosts
    assert_ok(ddptrain_cli(*TRAIN, "--nproc", "4", "--run-dir", str(tmp_path / "local")))
    nodes = []
    for node, (host, name) in enumerate(names.items()):
        env = clean_env(PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_NODE_RANK=str(node), PET_MASTER_ADDR=HOSTS["a"],
                        PET_MASTER_PORT="23457", KUBERNETES_SERVICE_HOST="10.96.0.1", GLOO_SOCKET_IFNAME=links[host])
        nodes.append(start(["ip", "netns", "exec", name, str(BIN / "torchrun"), "-m", "ddptrain", *TRAIN,
                            "--run-dir", str(tmp_path / "job")], env=env))
    outputs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert "training regression on 4 rank(s)" in outputs[0][0] + outputs[1][0]
    assert_same_weights(load_model(tmp_path / "job"), load_model(tmp_path / "local"), exact=True)


ELASTIC = ["train", "--task", "ddptrain_test_tasks:paced", "--max-epochs", "3", "--save-every", "4",
           "--momentum", "0.9"]


def _wait_for(what: str, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.2)


def _kill_host(namespace: str) -> None:
    """SIGKILL every process in the namespace, as a host that loses power."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:  # it ended between the listing and now
            pass


def _newest_step(run_dir) -> int:
    found = files.list_snapshots(run_dir / "snapshots")
    return files.snapshot_step(found[-1]) if found else 0


@pytest.mark.slow
def test_an_elastic_job_shrinks_when_a_node_dies_and_grows_back_when_it_returns(tmp_path, two_hosts, start):
    """torchrun --nnodes=1:2 on two hosts: host b's agent SIGKILLed mid-run, the job goes on on
    host a alone from the newest snapshot (same global batch); b started again, the job grows
    back at the next rendezvous; it ends with every epoch's record once and the weights of an
    uninterrupted 2-rank run (allclose: the sums are reduced in another order on 1 rank)."""
    names, links = two_hosts
    local = ddptrain_cli(*ELASTIC, "--nproc", "2", "--run-dir", str(tmp_path / "local"), env=clean_env(STEP_SLEEP="0"))
    assert_ok(local)
    run_dir, logs = tmp_path / "elastic", {}

    def agent(host: str, log: str):
        logs[log] = tmp_path / f"{log}.log"
        # A node that comes back waits for rank 0's address under torch's shared rendezvous store, which the
        # surviving rank 0 never publishes again (pytorch/pytorch#135712): the documented opt-out
        env = clean_env(GLOO_SOCKET_IFNAME=links[host], STEP_SLEEP="0.1", PYTHONUNBUFFERED="1",
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        return start(["ip", "netns", "exec", names[host], str(BIN / "torchrun"), "--nnodes=1:2", "--nproc-per-node=1",
                      "--max-restarts=3", "--monitor-interval=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint={HOSTS['a']}:29400", "--rdzv-id=elastic",
                      f"--rdzv-conf=is_host={int(host == 'a')},last_call_timeout=2", f"--local-addr={HOSTS[host]}",
                      "-m", "ddptrain", *ELASTIC, "--run-dir", str(run_dir)],
                     env=env, stdout=open(logs[log], "w"), stderr=subprocess.STDOUT)

    def said(text: str) -> bool:
        return any(text in path.read_text() for path in logs.values())

    a = agent("a", "a")
    agent("b", "b")
    _wait_for("a snapshot of the 2-node job", lambda: _newest_step(run_dir) >= 8)
    _kill_host(names["b"])  # host b is gone: its agent and its rank (in a session of its own)
    _wait_for("the job to go on alone", lambda: said("world size 2 → 1"))
    shrunk_at = _newest_step(run_dir)
    _wait_for("progress on one node", lambda: _newest_step(run_dir) >= shrunk_at + 8)
    back = agent("b", "b-again")
    assert a.wait(timeout=180) == 0 and back.wait(timeout=60) == 0, {k: p.read_text()[-3000:] for k, p in logs.items()}

    text = "".join(path.read_text() for path in logs.values())
    assert len(re.findall(r"world size 2 → 1 at step \d+", text)) == 1, text[-3000:]
    assert len(re.findall(r"world size 1 → 2 at step \d+", text)) == 1, text[-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir) if r["kind"] == "epoch"] == [0, 1, 2]
    assert_same_weights(load_model(run_dir), load_model(tmp_path / "local"))
