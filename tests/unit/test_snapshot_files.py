"""Snapshot files and the checkpointer's pure parts (no process group needed)."""

import os
import pickle
import time
import warnings
from pathlib import Path

import pytest
import torch

from ddptrain import ConfigError
from ddptrain.errors import SnapshotError
from ddptrain.run_dir import RunDir
from ddptrain.snapshots import files
from ddptrain.snapshots.dcp import remove_partials
from ddptrain.snapshots.restore import adapt_batch, check_resume_path


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddptrain-pwned",))


def _good_state(step):
    return {"format_version": files.FORMAT_VERSION, "model": {"w": torch.zeros(2)}, "optimizer": {},
            "progress": {"epoch": 0, "step_in_epoch": step, "global_step": step}, "world_size": 1,
            "batch_size": 1, "global_batch": 1, "fingerprint": {}}


def test_newest_good_snapshot_wins_over_broken_ones(tmp_path):
    folder = tmp_path / "snapshots"
    folder.mkdir()
    files.atomic_save(_good_state(5), folder / "step-000000005.pt")
    (folder / "step-000000006.pt").write_bytes(b"")                           # empty
    with open(folder / "step-000000007.pt", "wb") as handle:                  # malicious pickle
        pickle.dump({"model": _Exploit()}, handle)
    torch.save({"format_version": files.FORMAT_VERSION}, folder / "step-000000008.pt")  # wrong schema
    torch.save({**_good_state(9), "format_version": 1}, folder / "step-000000009.pt")   # an older format
    (folder / ".step-000000010.pt.123.tmp").write_bytes(b"half a file")       # never a candidate
    (folder / ".step-000000011.partial").mkdir()                              # an unfinished DCP folder
    if os.path.exists("/tmp/ddptrain-pwned"):
        os.remove("/tmp/ddptrain-pwned")
    with pytest.warns(UserWarning) as warned:
        path, state = files.load_newest(folder)
    assert path.name == "step-000000005.pt" and state["progress"]["global_step"] == 5
    messages = [str(w.message) for w in warned]
    assert any("step-000000009.pt has format version 1" in m for m in messages)
    assert any("step-000000008.pt is not a ddptrain snapshot" in m for m in messages)
    assert any("step-000000007.pt cannot be read" in m for m in messages)
    assert any("step-000000006.pt cannot be read" in m for m in messages)
    assert not os.path.exists("/tmp/ddptrain-pwned"), "the malicious pickle ran code"


def test_init_optimizer_takes_a_run_dirs_newest_snapshot_that_loads(tmp_path):
    """--init-optimizer from a run dir reads its snapshots once, as a resume does: a damaged
    newest one is named and the one before it taken; a snapshot named by its path is that one."""
    from ddptrain.snapshots.init_from import snapshot_at

    folder = tmp_path / "run" / "snapshots"
    folder.mkdir(parents=True)
    files.atomic_save(_good_state(5), folder / "step-000000005.pt")
    (folder / "step-000000010.pt").write_bytes(b"PK cut")
    with pytest.warns(UserWarning, match=r"step-000000010\.pt cannot be read .*; trying the previous snapshot"):
        path, state = snapshot_at(str(tmp_path / "run"))
    assert path.name == "step-000000005.pt" and state["progress"]["global_step"] == 5
    path, state = snapshot_at(str(folder / "step-000000005.pt"))
    assert path == folder / "step-000000005.pt" and state["progress"]["global_step"] == 5
    with pytest.raises(ConfigError, match=r"^--init-optimizer: --init-from .* holds no snapshot"):
        snapshot_at(str(tmp_path / "elsewhere"))


def test_an_unfinished_dcp_folder_is_named_and_removed(tmp_path):
    partial = tmp_path / ".step-000000040.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"shard")
    with pytest.warns(UserWarning, match=r"\.step-000000040\.partial was never completed"):
        remove_partials(tmp_path)
    assert not partial.exists() and files.list_snapshots(tmp_path) == []


class SlowWriter(files.SnapshotWriter):
    """A disk that takes ``seconds`` to write a snapshot."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def _write(self, state, directory, keep):
        time.sleep(self.seconds)
        return super()._write(state, directory, keep)


def test_after_a_failure_the_write_in_flight_is_finished_within_its_bound(tmp_path, monkeypatch):
    """The failure path (close(wait=False)) keeps the snapshot being written: the error names it
    as the last good one. A write slower than FAILED_WRITE_WAIT_S is left behind."""
    writer = SlowWriter(0.3)
    writer.submit(_good_state(20), tmp_path, keep=2)
    writer.close(wait=False)
    assert [files.snapshot_step(p) for p in files.list_snapshots(tmp_path)] == [20]
    monkeypatch.setattr(files, "FAILED_WRITE_WAIT_S", 0.05)
    writer = SlowWriter(1.0)
    writer.submit(_good_state(25), tmp_path / "slow", keep=2)
    started = time.monotonic()
    writer.close(wait=False)
    assert time.monotonic() - started < 0.5 and not files.list_snapshots(tmp_path / "slow")


def test_rotation_keeps_the_newest_k_files_and_folders(tmp_path):
    folder = tmp_path / "snapshots"
    for step in range(1, 6):
        files.write_snapshot(_good_state(step), folder, keep=2)
    (folder / "step-000000006").mkdir()
    files.rotate(folder, keep=2)
    assert [p.name for p in files.list_snapshots(folder)] == ["step-000000005.pt", "step-000000006"]


def test_adapt_batch_keeps_the_global_batch_or_names_the_world_sizes_that_do():
    assert adapt_batch(64, 1, 1) == 64 and adapt_batch(64, 4, 2) == 8
    with pytest.raises(ConfigError, match=r"use a world size in \[1, 2, 4, 8, 16, 32, 64\]"):
        adapt_batch(64, 3, 1)


def test_a_fresh_start_moves_an_earlier_runs_files_aside(tmp_path):
    for name in ("metrics.jsonl", "model.pt", "config.json"):
        (tmp_path / name).write_text(name)
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "logs").mkdir()
    moved = RunDir(tmp_path).move_aside("20261202-000000")
    assert moved is not None and Path(moved).parent == tmp_path and Path(moved).name.startswith("previous-")
    assert sorted(p.name for p in Path(moved).iterdir()) == ["config.json", "metrics.jsonl", "model.pt", "snapshots"]
    assert (tmp_path / "logs").is_dir() and not (tmp_path / "model.pt").exists()
    assert RunDir(tmp_path).move_aside("20261202-000001") is None  # nothing left to move


def test_resume_path_is_checked_before_any_rank_starts(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        check_resume_path(str(tmp_path))  # a folder without meta.pt
    files.atomic_save(_good_state(3), tmp_path / "step-000000003.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resume_path(str(tmp_path / "step-000000003.pt"))


@pytest.mark.slow  # ~1 s
def test_a_snapshots_size_is_estimated_from_the_model_and_the_optimizer():
    model = torch.nn.Linear(100, 10)  # 1,010 floats: 4,040 bytes
    assert files.snapshot_estimate(model, torch.optim.AdamW(model.parameters())) == 3 * 4040
    assert files.snapshot_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 2 * 4040
    assert files.snapshot_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1)) == 4040


def test_a_disk_too_small_for_keep_plus_one_snapshots_is_warned_of(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert files.space_warning(tmp_path, snapshot=1 << 20, keep=2) is None
    warning = files.space_warning(tmp_path, snapshot=free // 2, keep=2)
    assert warning is not None and warning.startswith(f"warning: {tmp_path} has ")
    assert "--keep 2 snapshots and the one being written need about" in warning


def test_a_write_that_finds_the_disk_full_is_one_line_naming_the_intact_snapshot(tmp_path):
    import errno

    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    files.atomic_save({"x": torch.zeros(3)}, snapshots / files.snapshot_name(10))
    assert files.out_of_space(OSError(errno.ENOSPC, "No space left on device"), snapshots)
    assert not files.out_of_space(ValueError("not a write"), snapshots)
    error = files.disk_full(snapshots / files.snapshot_name(15), 3 << 20)
    assert str(error).startswith(f"no space left in {tmp_path} writing step-000000015.pt (")
    assert "it takes about 3.0 MB); the newest complete snapshot, step-000000010.pt, is intact" in str(error)


def test_init_from_counts_a_tied_weight_as_present_when_its_twin_is():
    """A Hugging Face folder leaves a tied head out (save_pretrained): strict loading takes it."""
    import torch

    from ddptrain.snapshots.init_from import load_into

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model, source = Tied(), torch.arange(15.0).reshape(5, 3)
    assert load_into(model, {"embed.weight": source}, "hf", partial=False) == "initialised from hf: 1 tensor(s)"
    assert torch.equal(model.head.weight, source)


def test_a_resume_keeps_the_average_and_the_best_metric_but_older_snapshots_are_not_asked():
    from ddptrain import RunConfig

    taken = RunConfig(ema=0.99, keep_best="loss").math_fingerprint(2)
    files.check_fingerprint(taken, RunConfig(ema=0.99, keep_best="eval_loss:min").math_fingerprint(2), Path("s"))
    for other in (RunConfig(ema=0.9, keep_best="loss"), RunConfig(keep_best="loss"),
                  RunConfig(ema=0.99, ema_every=4, keep_best="loss"), RunConfig(ema=0.99, keep_best="eval_accuracy")):
        with pytest.raises(SnapshotError, match="taken with other settings"):
            files.check_fingerprint(taken, other.math_fingerprint(2), Path("s"))
    before_05 = {k: v for k, v in taken.items() if k not in ("ema", "ema_every", "keep_best")}
    files.check_fingerprint(before_05, RunConfig(ema=0.5).math_fingerprint(2), Path("s"))


def test_a_resume_keeps_the_sync_mode_and_its_settings():
    from ddptrain import RunConfig

    diloco = RunConfig(sync="diloco", sync_every=4, replicas=2)
    taken = diloco.math_fingerprint(2)
    files.check_fingerprint(taken, RunConfig(sync="diloco", sync_every=4, replicas=2).math_fingerprint(2), Path("s"))
    files.check_fingerprint(RunConfig().math_fingerprint(2), RunConfig(seed=0).math_fingerprint(2), Path("s"))
    for other, words in ((RunConfig(), "sync: 'diloco' -> 'every-step'"),
                         (RunConfig(sync="local-sgd", sync_every=4, replicas=2), "sync: 'diloco' -> 'local-sgd'"),
                         (RunConfig(sync="diloco", sync_every=8, replicas=2), "sync_every: 4 -> 8"),
                         (RunConfig(sync="diloco", sync_every=4, outer_lr=0.5, replicas=2), "outer_lr: 0.7 -> 0.5"),
                         (RunConfig(sync="diloco", sync_every=4, outer_momentum=0.0, replicas=2),
                          "outer_momentum: 0.9 -> 0.0"),
                         (RunConfig(sync="diloco", sync_every=4, replicas=1), "replicas: 2 -> 1"),
                         (RunConfig(sync="diloco", sync_every=4), "replicas: 2 -> None")):
        with pytest.raises(SnapshotError, match=words):
            files.check_fingerprint(taken, other.math_fingerprint(2), Path("s"))
    with pytest.raises(SnapshotError, match="sync: 'every-step' -> 'diloco'"):  # every-step, resumed by diloco
        files.check_fingerprint(RunConfig().math_fingerprint(2), taken, Path("s"))
    before_replicas = {k: v for k, v in taken.items() if k != "replicas"}  # (0.4's snapshots are not asked)
    files.check_fingerprint(before_replicas, RunConfig(sync="diloco", sync_every=4, replicas=4).math_fingerprint(2),
                            Path("s"))
    hsdp = RunConfig(strategy="hsdp", replicas=2).math_fingerprint(4)  # every step: the groups' count is layout only
    files.check_fingerprint(hsdp, RunConfig(strategy="hsdp", replicas=4).math_fingerprint(4), Path("s"))


def test_each_rank_s_part_is_read_from_its_own_file_or_from_a_format_2_snapshot_s_lists(tmp_path):
    """snapshots/rank_parts.py: a part beside a file snapshot, inside a DCP folder, and (0.1-0.6)
    the lists by rank in a snapshot's metadata, which still load."""
    from ddptrain.snapshots import rank_parts

    folder = tmp_path / "snapshots"
    state = {**_good_state(5), "world_size": 2}
    for rank in (0, 1):
        written = rank_parts.write_part(folder, 5, False, rank, 2, {"rng": {"rank": rank}, "data": {"at": rank}})
        assert written == folder / "step-000000005.ranks" / f"rank-0000{rank}-of-00002.pt"
    files.atomic_save(state, folder / "step-000000005.pt")
    path, loaded = files.load_newest(folder)
    assert [rank_parts.read_part(path, loaded, rank) for rank in (0, 1, 2)] == [
        {"rng": {"rank": 0}, "data": {"at": 0}}, {"rng": {"rank": 1}, "data": {"at": 1}}, None]
    rank_parts.write_part(folder, 7, True, 1, 2, {"rng": {"rank": 1}})  # a DCP folder's, before its rename
    assert (folder / ".step-000000007.partial" / "ranks" / "rank-00001-of-00002.pt").is_file()
    (folder / ".step-000000007.partial").rename(folder / "step-000000007")
    assert rank_parts.read_part(folder / "step-000000007", state, 1) == {"rng": {"rank": 1}}
    assert rank_parts.read_part(folder / "step-000000007", state, 0) is None  # (not written: as absent)
    old = {**state, "format_version": 2, "rng": [{"r": 0}, {"r": 1}], "data": [{"at": 0}, {"at": 1}]}
    files.atomic_save(old, folder / "step-000000009.pt")
    assert files.load_snapshot(folder / "step-000000009.pt")["rng"] == [{"r": 0}, {"r": 1}]
    assert rank_parts.read_part(folder / "step-000000009.pt", old, 1) == {"rng": {"r": 1}, "data": {"at": 1}}
    files.atomic_save({**old, "rng": None}, folder / "step-000000010.pt")
    with pytest.raises(SnapshotError, match="field 'rng' missing"):  # version 2 still needs its lists
        files.load_snapshot(folder / "step-000000010.pt")
    assert rank_parts.expected_parts(["x/rank-00001-of-00003.pt"]) == [
        "rank-00000-of-00003.pt", "rank-00001-of-00003.pt", "rank-00002-of-00003.pt"]


def test_rotation_removes_a_file_s_parts_with_it_and_parts_whose_file_never_came(tmp_path):
    from ddptrain.snapshots import rank_parts

    for step in (3, 5, 7, 9):
        rank_parts.write_part(tmp_path, step, False, 0, 1, {"rng": {}})
        if step != 3:  # step 3's file never written (a run stopped in between)
            files.atomic_save(_good_state(step), tmp_path / f"step-00000000{step}.pt")
    files.rotate(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000007.pt", "step-000000007.ranks", "step-000000009.pt", "step-000000009.ranks"]
    rank_parts.write_part(tmp_path, 11, False, 0, 1, {"rng": {}})  # the next snapshot's, its file not yet written
    files.rotate(tmp_path, keep=2, spare={"step-000000007.pt"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000007.pt", "step-000000007.ranks", "step-000000009.pt", "step-000000009.ranks",
        "step-000000011.ranks"]


def test_a_snapshot_larger_than_the_free_space_is_refused_before_a_byte_is_written(tmp_path):
    """A snapshot that cannot fit is DiskFull (the one line) before its write fills the disk: a
    write into the last free bytes failed the run's other writers meanwhile (its step records, the
    ranks' error reports). 40 TB of state (a view of one number: no memory) on this disk."""
    from ddptrain.errors import DiskFull

    (tmp_path / "snapshots").mkdir()
    huge = {"model": {"w": torch.zeros(1).expand(10**13)}}
    with pytest.raises(DiskFull, match=r"no space left in .* writing step-000000003\.pt \(.* MB free; it takes "
                                       r"about 38146972\.7 MB\); no snapshot was written yet"):
        files.atomic_save(huge, tmp_path / "snapshots" / "step-000000003.pt")
    assert list((tmp_path / "snapshots").iterdir()) == []  # nothing begun, nothing left
    assert files.room_for(10, tmp_path) and not files.room_for(4 * 10**13, tmp_path)
