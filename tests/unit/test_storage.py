"""Where a run dir lives: a local folder, or a store's URL with a local mirror (no server needed;
the store itself: tests/integration/test_remote_run_dir.py)."""

from pathlib import Path

from ddptrain.storage import is_remote, local_dir, remote_of


def test_a_url_is_a_store_and_a_path_is_a_folder():
    assert is_remote("s3://bucket/run") and is_remote("gs://b/r") and is_remote("az://c/r")
    assert not is_remote("runs/a") and not is_remote("/abs/runs") and not is_remote("file:///tmp/x")
    assert not is_remote(None) and remote_of("runs/a") is None
    assert remote_of("s3://bucket/team/run/").path("model.pt") == "bucket/team/run/model.pt"


def test_each_store_run_dir_has_its_own_mirror_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DDPTRAIN_CACHE", str(tmp_path))
    assert local_dir("runs/a") == Path("runs/a")
    mirror = local_dir("s3://bucket/team/run-1")
    assert mirror.parent == tmp_path / "runs" / "s3" and mirror.name.startswith("bucket-team-run-1-")
    assert local_dir("s3://bucket/team/run-1") == mirror != local_dir("s3://bucket/team/run-2")
    assert local_dir("gs://bucket/team/run-1") != mirror
