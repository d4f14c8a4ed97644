"""--strategy hsdp --replicas R (FSDP2 on a 2-D mesh): 4 ranks as 2 replica groups of 2, the
same training as ddp and fsdp, DCP snapshots that resume exactly and under the other strategies."""

import shutil

import pytest
import torch

from ddptrain.settings import RunConfig
from ddptrain.snapshots import files
from ddptrain.tasks import digits_task
from helpers.commands import assert_same_weights, ddptrain_cli, fit, load_model, read_metrics
from helpers.ranks import run_on_ranks

pytestmark = pytest.mark.slow
ARGS = {"max_epochs": 2, "save_every": 10, "nproc": 4}  # digits on 4 ranks x 32: 12 steps an epoch
HSDP = {"strategy": "hsdp", "replicas": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hsdp")
    for name, options in (("ddp", {}), ("fsdp", {"strategy": "fsdp"}), ("hsdp", HSDP)):
        fit("digits", base / name, **options, **ARGS)
    return base


def _placements(rank, world):
    from ddptrain.comm import DistContext
    from ddptrain.parallel import make_strategy

    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                      device=torch.device("cpu"), backend="gloo")
    cfg = RunConfig(task="digits", strategy="hsdp", replicas=2)
    task = digits_task(cfg)
    model = make_strategy(cfg.parallel, ctx).wrap(task.model, task)
    weight = next(model.parameters())
    placements = [(p.is_replicate(), p.is_shard(0)) for p in weight.placements]
    return tuple(weight.device_mesh.shape), placements, tuple(weight.to_local().shape)


def test_hsdp_shards_inside_each_replica_group_and_replicates_across_them():
    by_rank = run_on_ranks(4, _placements)
    mesh, placements, local = by_rank[0]
    assert mesh == (2, 2) and placements == [(True, False), (False, True)]  # replicated, then sharded
    whole = next(digits_task(RunConfig(task="digits")).model.parameters()).shape
    assert local[0] == whole[0] // 2 and all(r == by_rank[0] for r in by_rank)  # half a tensor per rank


def test_the_default_is_one_replica_group_per_node():
    from ddptrain.comm import DistContext
    from ddptrain.parallel.fsdp import HSDPStrategy

    def replicas(world, per_node, rank=0, **options):
        ctx = DistContext(rank=rank, world_size=world, local_rank=rank % per_node, local_world_size=per_node,
                          device=torch.device("cpu"), backend="gloo")
        strategy = HSDPStrategy(RunConfig(task="digits", strategy="hsdp", **options).parallel, ctx)
        return strategy.replicas, strategy.counts_gradients
    assert replicas(8, 4) == (2, True) and replicas(8, 4, rank=4) == (2, False)  # 2 nodes of 4
    assert replicas(4, 4) == (1, True) and replicas(8, 4, replicas=4, rank=3) == (4, False)


def test_hsdp_trains_like_ddp_and_fsdp_and_writes_dcp_snapshots(runs):
    hsdp = load_model(runs / "hsdp")
    for other in ("ddp", "fsdp"):
        assert_same_weights(hsdp, load_model(runs / other))  # allclose: another order of the sums
    norms = {name: [r["grad_norm"] for r in read_metrics(runs / name)] for name in ("ddp", "hsdp")}
    torch.testing.assert_close(torch.tensor(norms["hsdp"]), torch.tensor(norms["ddp"]), rtol=1e-4, atol=0)
    snapshots = files.list_snapshots(runs / "hsdp" / "snapshots")
    assert snapshots and all(path.is_dir() for path in snapshots)  # DCP folders, as fsdp's
    digits_task(RunConfig(task="digits")).model.load_state_dict(hsdp)  # whole tensors, plain names


def test_an_hsdp_run_killed_and_resumed_ends_bitwise(runs, tmp_path):
    run_dir = tmp_path / "run"
    env = {"KILL_RANK": "3", "KILL_STEP": "18", "KILL_MARKER": str(tmp_path / "killed"),  # step 15: epoch 1
           "KILL_ONCE_SAVED": str(run_dir / "snapshots")}
    fit("ddptrain_test_tasks:kill_digits", run_dir, env=env, max_restarts=1, **HSDP, **ARGS)
    assert (tmp_path / "killed").exists()
    assert_same_weights(load_model(run_dir), load_model(runs / "hsdp"), exact=True)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_an_hsdp_snapshot_resumes_under_another_strategy(runs, tmp_path, strategy):
    """The hsdp run's snapshot of step 20 (of 24), continued under fsdp or ddp: the run ends
    where theirs does (allclose: the sums' order differs), and a ddp snapshot resumes under hsdp."""
    for source, target, options in (("hsdp", strategy, {"strategy": strategy}), ("ddp", "hsdp", HSDP)):
        if source == "ddp" and strategy == "ddp":
            continue
        run_dir = tmp_path / f"{source}-as-{target}"
        shutil.copytree(runs / source, run_dir)
        for path in files.list_snapshots(run_dir / "snapshots")[1:]:  # (20 and 24 kept) resume from step 20
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        (run_dir / "model.pt").unlink()
        fit("digits", run_dir, **options, **ARGS)
        assert_same_weights(load_model(run_dir), load_model(runs / target))


def test_replicas_that_do_not_divide_the_ranks_are_one_line(tmp_path):
    result = ddptrain_cli("train", "--task", "digits", "--strategy", "hsdp", "--replicas", "3", "--nproc", "4",
                          "--max-epochs", "1", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "ddptrain: error: --replicas 3 does not divide the 4 ranks into equal groups; choose a divisor of the "
        "number of ranks")
