"""Launcher detection from environment dicts (no process needed)."""

import re

import pytest

from ddptrain import ConfigError
from ddptrain.launch.environments import (
    LocalEnvironment,
    PyTorchJobPod,
    SlurmEnvironment,
    TorchrunEnvironment,
    detect,
)
from ddptrain.launch.slurm_lists import expand_hostlist, expand_tasks_per_node

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08,10]", "SLURM_JOB_ID": "4242",
         "SLURM_TASKS_PER_NODE": "4(x2)"}


def test_no_launcher_is_local():
    env = detect({})
    assert isinstance(env, LocalEnvironment)
    assert (env.rank, env.world_size) == (0, 1)


def test_torchrun_variables():
    env = detect(TORCHRUN)
    assert isinstance(env, TorchrunEnvironment)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("node0", 29500)


def test_legacy_local_rank_argument_when_variable_missing():
    values = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}
    assert detect(values, local_rank_arg=1).local_rank == 1


def test_slurm_variables():
    env = detect(SLURM)
    assert isinstance(env, SlurmEnvironment)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu07"
    assert env.master_port == 15000 + 4242 % 20000


def test_slurm_batch_script_without_srun_is_not_a_rank():
    batch_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert isinstance(detect(batch_step), LocalEnvironment)


def test_torchrun_inside_slurm_wins():
    assert isinstance(detect({**SLURM, **TORCHRUN}), TorchrunEnvironment)


def test_slurm_master_from_environment_when_set():
    env = SlurmEnvironment({**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b3,c[09-11]", ["a1", "a2", "b3", "c09", "c10", "c11"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x-[8-9]y", ["x-8y", "x-9y"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


@pytest.mark.parametrize("read,text", [(expand_hostlist, "gpu[01-"), (expand_hostlist, "gpu[a-b]"),
                                       (expand_hostlist, "gpu]1"), (expand_tasks_per_node, "2(x)")])
def test_an_unreadable_slurm_list_is_a_value_error_naming_it(read, text):
    with pytest.raises(ValueError, match=f"cannot read Slurm .*{re.escape(text)}"):
        read(text)


@pytest.mark.parametrize("spelling", [["--local-rank=1"], ["--local_rank", "1"]])
def test_legacy_launcher_local_rank_argument_is_accepted(spelling):
    from ddptrain.cli import build_parser

    args = build_parser().parse_args(["train", *spelling])
    assert args.local_rank == 1


POD = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456",
       "KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "1"}


def test_a_pytorchjob_pods_rank_and_world_size_count_pods():
    env = detect(POD)
    assert isinstance(env, PyTorchJobPod) and env.starts_ranks
    assert (env.node_rank, env.nodes, env.master_addr, env.master_port) == (1, 3, "127.0.0.1", 23456)
    env.validate()


def test_torchrun_inside_a_pod_and_a_hand_set_rank_outside_kubernetes_stay_one_rank():
    assert isinstance(detect({**POD, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}), TorchrunEnvironment)
    assert isinstance(detect({**POD, "TORCHELASTIC_RUN_ID": "job"}), TorchrunEnvironment)
    assert isinstance(detect({k: v for k, v in POD.items() if k != "KUBERNETES_SERVICE_HOST"}), TorchrunEnvironment)


def test_a_pod_index_outside_the_job_is_one_line():
    with pytest.raises(ConfigError, match=r"^RANK=3 is outside the PyTorchJob's 3 pod\(s\) \(WORLD_SIZE\)"):
        detect({**POD, "RANK": "3"}).validate()


TORCHRUN_WORKER = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("args,named", [
    (["torchrun", "--nnodes=1:2", "-m", "ddptrain", "train"], "--nnodes 1:2"),
    (["torchrun", "--nnodes", "2:4", "--nproc-per-node=8", "x.py"], "--nnodes 2:4"),
    (["torchrun", "--nnodes=2", "x.py"], None),  # a fixed size: nobody rejoins
    (["torchrun", "--nnodes=2:2", "x.py"], None),
    ([], None),  # the parent's command line could not be read
])
def test_an_elastic_range_under_the_shared_store_is_one_warning(args, named):
    line = TorchrunEnvironment(TORCHRUN_WORKER).shared_store_warning(args)
    assert (line is None) == (named is None)
    if named:
        assert f"torchrun {named} without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and "\n" not in line
    # with the variable set, torch's agent tells its workers it shares no store: nothing to say
    own_store = {**TORCHRUN_WORKER, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert TorchrunEnvironment(own_store).shared_store_warning(args) is None
