"""Where a run lives: a local folder, or a store's URL with a local mirror (no server needed;
the store itself: tests/integration/test_remote_run_dir.py)."""

import os
import re
from pathlib import Path

import pytest

from ddptrain.errors import ConfigError, StorageNotShared
from ddptrain.run_dir import LEFTOVERS, RunDir, StoreRunDir, default_name, snapshot_name, snapshot_number

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddptrain"


def test_a_url_is_a_store_and_a_path_is_a_folder():
    for url in ("s3://bucket/run", "gs://b/r", "az://c/r"):
        assert isinstance(RunDir.of(url), StoreRunDir)
    for path in ("runs/a", "/abs/runs", "file:///tmp/x"):
        assert type(RunDir.of(path)) is RunDir
    home = RunDir.of("s3://bucket/team/run/")
    assert str(home) == "s3://bucket/team/run" and home.url_of("model.pt") == "s3://bucket/team/run/model.pt"
    assert RunDir.of("runs/a").url_of("model.pt") == os.path.join("runs", "a", "model.pt")


def test_each_store_run_dir_has_its_own_mirror_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))
    assert RunDir.of("runs/a").local == Path("runs/a")
    mirror = RunDir.of("s3://bucket/team/run-1").local
    assert mirror.parent == tmp_path / "runs" / "s3" and mirror.name.startswith("bucket-team-run-1-")
    assert RunDir.of("s3://bucket/team/run-1").local == mirror != RunDir.of("s3://bucket/team/run-2").local
    assert RunDir.of("gs://bucket/team/run-1").local != mirror


def test_a_store_url_of_the_wrong_shape_is_one_line_before_any_request(monkeypatch, tmp_path):
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--run-dir ftp://x/run: unknown storage scheme 'ftp'; use a local"):
        RunDir.of("ftp://x/run").check()
    with pytest.raises(ConfigError, match=r"^run dir s3:///run: no bucket; write s3://BUCKET/PREFIX$"):
        RunDir.of("s3:///run").check(flag="run dir")


def test_snapshot_names_and_their_steps_are_one_pattern():
    assert snapshot_name(42) == "step-000000042.pt" and snapshot_name(42, folder=True) == "step-000000042"
    assert snapshot_number("step-000000042.pt") == snapshot_number("step-000000042") == 42
    with pytest.raises(AttributeError):
        snapshot_number("step-42.pt")  # never a snapshot's name


def test_the_default_name_is_the_task_and_a_digest_of_the_settings():
    assert default_name("my_tasks:make", {"lr": 0.1}) == default_name("my_tasks:make", {"lr": 0.1})
    assert default_name("my_tasks:make", {"lr": 0.1}).startswith(os.path.join("runs", "my_tasks.make-"))
    assert default_name("t", {"lr": 0.1}) != default_name("t", {"lr": 0.2})


def test_a_fresh_start_moves_every_leftover_aside_and_nothing_else(tmp_path):
    home = RunDir(tmp_path / "run")
    home.create()
    for name in LEFTOVERS:
        (home.local / name).write_text(name)
    (home.local / ".hold").write_text("{}")
    (home.local / "rank-0.log").write_text("")
    first = home.move_aside("20260101-000000")
    assert first is not None and sorted(os.listdir(first)) == sorted(LEFTOVERS)
    assert sorted(os.listdir(home.local)) == sorted([".hold", "rank-0.log", Path(first).name])
    (home.local / "model.pt").write_text("again")
    second = home.move_aside("20260101-000000")  # the same second: a folder of its own
    assert second is not None and second != first and os.listdir(second) == ["model.pt"]
    assert home.move_aside("20260101-000001") is None  # nothing left to move


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"is a file, not a folder; choose another --run-dir$"):
        RunDir(tmp_path / "file").create()
    with pytest.raises(ConfigError, match=r"cannot be created \(.*file is a file, not a folder\)"):
        RunDir(tmp_path / "file" / "run").create()


def test_a_folder_that_is_not_shared_fails_the_rank_a_store_mirror_does_not(tmp_path):
    with pytest.raises(StorageNotShared, match="rank 3 cannot see snapshot"):
        RunDir(tmp_path).check_visible(tmp_path / "snapshots" / snapshot_name(5), rank=3)
    StoreRunDir("s3://bucket/run").check_visible(tmp_path / "nowhere", rank=3)  # each mirror is its own


def test_no_module_but_the_run_dir_modules_know_urls_or_fsspec():
    """Every module takes one RunDir: none imports fsspec, parses a URL or keeps a (folder,
    store) pair; the store's variant is named only where a feature exists for a store alone."""
    store_only = {"run_dir.py", "snapshots/uploads.py", "snapshots/restore.py", "resilience/hold.py", "cli.py"}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in ("run_dir.py", "store_calls.py"):  # the store's own two modules
            continue
        text = path.read_text()
        assert not re.search(r"\bfsspec\b|RemoteDir|is_remote|remote_of|local_dir\(|remote is (not )?None|"
                             r"\._store\b|split\(\"://\"", text), name
        assert "StoreRunDir" not in text or name in store_only, name
